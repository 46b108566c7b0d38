"""TLS for the internal gRPC hops (router -> prefill / decode / colocated engines).

One frozen :class:`TLSFiles` per process, read from ``--tls-cert``, ``--tls-key`` and
``--tls-ca`` at the edge (PEM files, as a Kubernetes TLS secret mounts them), gives both
sides their ``grpc`` credentials:

* an engine service with a certificate and key serves TLS only; with a CA as well it
  requires and verifies a client certificate signed by it (mutual TLS);
* the router with a CA verifies the engines' certificates against it (their subject
  alternative names must match the address it dials, or ``--tls-server-name`` when given:
  one certificate for every engine pod, whose IPs no certificate can list ahead); with a
  certificate and key it also presents its own (mutual TLS).

The credentials are grpc's own (``grpc.ssl_server_credentials``,
``grpc.ssl_channel_credentials``); nothing here parses certificates.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    """PEM contents of the TLS flags (``None``: not given).

    Attributes:
        cert: this side's certificate chain.
        key: its private key.
        ca: the CA bundle that the other side's certificate must chain to.
        server_name: client side: the name the servers' certificates must carry, in place
            of the dialled host (grpc's ``grpc.ssl_target_name_override``); ``None``: the
            dialled host.

    Raises:
        ValueError: naming the flag: a certificate without its key or the reverse.
    """

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.server_name is not None and not (self.enabled and self.server_name):
            raise ValueError("--tls-server-name needs --tls-ca or --tls-cert (a TLS hop) "
                             "and a non-empty name")

    @property
    def enabled(self) -> bool:
        """Whether any TLS flag was given (then the hop is TLS, never plaintext)."""
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """An engine's server credentials; a client certificate is required when ``ca``
        is set.

        Raises:
            ValueError: naming ``--tls-cert`` when the server has no certificate.
        """
        if self.cert is None or self.key is None:
            raise ValueError("--tls-cert and --tls-key are needed to serve TLS")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's channel credentials (the system's roots when ``ca`` is not set)."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """A client's extra channel options: the name to check servers' certificates
        against, when ``server_name`` is set."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_tls_flags(parser: argparse.ArgumentParser, side: str, client: bool = False) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` on ``parser`` (and ``--tls-server-name``
    when ``client``); ``side`` says which hop they secure (for the help text)."""
    parser.add_argument("--tls-cert", default=None,
                        help=f"PEM certificate chain for {side} (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help=f"PEM private key for {side}")
    parser.add_argument("--tls-ca", default=None,
                        help=f"PEM CA bundle that the peer's certificate must chain to ({side}; "
                             "on a server it makes client certificates required)")
    if client:
        parser.add_argument("--tls-server-name", default=None,
                            help="the name every server certificate must carry (a DNS "
                                 "subject alternative name), checked instead of the dialled "
                                 "address: one certificate for all engine pods")


def tls_from_args(ns: argparse.Namespace) -> TLSFiles:
    """Read the files the TLS flags name.

    Raises:
        ValueError: naming the flag whose file cannot be read, or as :class:`TLSFiles`.
    """

    def read(flag: str, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None

    return TLSFiles(cert=read("--tls-cert", ns.tls_cert), key=read("--tls-key", ns.tls_key),
                    ca=read("--tls-ca", ns.tls_ca),
                    server_name=getattr(ns, "tls_server_name", None))

"""Who may talk to whom: mutual TLS on the internal gRPC hop, and Redis with a password
over TLS.

A colocated engine (tiny random-weight Llama, float32) serves TLS with ``--tls-ca`` (client
certificates required); certificates are made here with the ``openssl`` command line (a CA,
the engine's with an IP SAN for 127.0.0.1, the router's, and a stranger's signed by another
CA). The engine refuses plaintext, a client without a certificate and one signed by the
other CA; a router with the right certificate serves end to end, one without cannot reach
it. The engine and the router find each other through a redis-server that requires a
password and serves TLS only (``rediss://:PASS@host:port/0?ssl_ca_certs=CA``: the URL
carries both).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from ports import free_port
from redis_server import RedisServer

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "256"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
             str(crt), "-days", "2", "-subj", f"/CN={name}")
    return key, crt


def _signed(d: Path, name: str, ca: tuple[Path, Path], san: str | None = None
            ) -> tuple[Path, Path]:
    key, csr, crt = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", f"/CN={name}")
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
             "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext))
    return key, crt


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("certs")
    ca, other = _ca(d, "ca"), _ca(d, "other-ca")
    return {"ca": ca, "engine": _signed(d, "engine", ca, "IP:127.0.0.1,DNS:tandem-engine"),
            "router": _signed(d, "router", ca), "stranger": _signed(d, "stranger", other)}


def _creds(certs, who: str | None) -> grpc.ChannelCredentials:
    ca = certs["ca"][1].read_bytes()
    if who is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    key, crt = certs[who]
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key.read_bytes(),
                                        certificate_chain=crt.read_bytes())


@pytest.fixture(scope="module")
def stack(certs, tmp_path_factory):
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    # Redis with a password and TLS only (a rediss:// URL), its certificate from the test CA.
    redis = RedisServer(free_port(), password="s3cret-pass",
                        tls=(certs["engine"][1], certs["engine"][0], certs["ca"][1]))
    redis.start()
    launcher = Launcher(tmp_path_factory.mktemp("tls"))
    eng = f"127.0.0.1:{free_port()}"
    key, crt = certs["engine"]
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", eng, "--model", tiny, *ENGINE_ARGS,
            "--redis-url", redis.url, "--tls-cert", str(crt), "--tls-key", str(key),
            "--tls-ca", str(certs["ca"][1])),
            lambda: grpc_serving(eng, credentials=_creds(certs, "router")))], 300)

        def router(*tls: str) -> str:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            launcher.launch([Part(f"router-{port}", tandem_argv(
                "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
                "--model", tiny, "--redis-url", redis.url, "--max-model-len", "256", *tls),
                lambda: http_ok(f"{url}/health"))], 300)
            return url

        yield eng, router, tiny
    finally:
        launcher.close(timeout_s=10)
        redis.stop()


def test_the_engine_refuses_plaintext_and_foreign_or_missing_client_certificates(
        stack, certs) -> None:
    eng = stack[0]
    assert grpc_serving(eng, credentials=_creds(certs, "router"))
    assert not grpc_serving(eng)  # plaintext
    assert not grpc_serving(eng, credentials=_creds(certs, None))  # no client certificate
    assert not grpc_serving(eng, credentials=_creds(certs, "stranger"))  # another CA's


def test_a_router_with_its_certificate_serves_end_to_end_and_one_without_cannot(
        stack, certs) -> None:
    _eng, router, _tiny = stack
    key, crt = certs["router"]
    good = router("--tls-cert", str(crt), "--tls-key", str(key), "--tls-ca",
                  str(certs["ca"][1]))
    model = httpx.get(f"{good}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{good}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
    plain = router()  # finds the engine in Redis, but cannot speak to it
    resp = httpx.post(f"{plain}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 503, resp.text
    # --tls-server-name: the engine's certificate is checked against that name, not the
    # dialled address (one certificate for every engine pod)
    tls = ["--tls-cert", str(crt), "--tls-key", str(key), "--tls-ca", str(certs["ca"][1])]
    named = router(*tls, "--tls-server-name", "tandem-engine")
    assert httpx.post(f"{named}/v1/completions", json=body, timeout=60).status_code == 200
    misnamed = router(*tls, "--tls-server-name", "another-name")
    resp = httpx.post(f"{misnamed}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 503, resp.text


def test_tls_flags_are_checked_at_start(tmp_path, stack, certs) -> None:
    tiny, crt = stack[2], str(certs["router"][1])
    for args, flag in ((["--tls-cert", "/no/such.pem", "--tls-key", "/no/such.key"],
                        "--tls-cert: cannot read /no/such.pem"),
                       (["--tls-cert", crt], "--tls-cert and --tls-key go together"),
                       (["--tls-ca", str(tmp_path / "x")], "--tls-ca"),
                       (["--tls-server-name", "x"], "--tls-server-name needs")):
        for cmd in (["router", "--colocated", "h:1", "--model", tiny],
                    ["serve", "--role", "both", "--model", tiny]):
            if args[0] == "--tls-server-name" and cmd[0] == "serve":
                continue  # a client-side flag: only the router has it
            out = subprocess.run(tandem_argv(*cmd, *args), capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 2, (cmd, out.stderr)
            assert flag in out.stderr, out.stderr

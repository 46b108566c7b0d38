"""Store settings, each read once at the edge: a node's (:class:`NodeConfig`, from
`tandem kvstore`'s flags), a client's (:class:`ClientOptions`), UCX's (:class:`UcxOptions`)
and the store connector's (:class:`StoreConnectorConfig`); and the byte-size parser of the
flags. Torch-free: entry points build these before loading an engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.contracts.config_args import flag
from tandem.engine.config import KVConnectorConfig

_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512MiB"``, ``"1G"``, ``"64KB"`` -> bytes (binary units).

    Raises:
        ValueError: not a size.
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = t[-1:] if t[-1:] in _SIZE_SUFFIX and not t[-1:].isdigit() else ""
    try:
        value = float(t[: len(t) - len(suffix)] if suffix else t)
    except ValueError as exc:
        raise ValueError(f"not a byte size: {text!r}") from exc
    return int(value * _SIZE_SUFFIX[suffix])


@dataclass(frozen=True)
class UcxOptions:
    """How this process drives ucxx (fixed when UCX initialises, once per process).

    Attributes:
        progress_mode: ucxx progress mode (``thread``, ``thread-polling``, ``polling``,
            ``blocking``). A progress thread that sleeps in epoll while idle is the
            default: polling modes spin a core per process (see kvstore/ucx.py).
        python_future: completions handed to asyncio futures by ucxx's notifier
            thread; only with a ``thread*`` mode (forced off otherwise).
    """

    progress_mode: str = "thread"
    python_future: bool = True

    def __post_init__(self) -> None:
        if self.progress_mode not in ("thread", "thread-polling", "polling", "blocking"):
            raise ValueError(f"progress_mode must be thread, thread-polling, polling or "
                             f"blocking, got {self.progress_mode!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> UcxOptions:
        """From ucxx's own variables ``UCXPY_PROGRESS_MODE`` and
        ``UCXPY_ENABLE_PYTHON_FUTURE`` (``0``: off), defaults where unset.

        Raises:
            ValueError: an unknown progress mode.
        """
        mode = environ.get("UCXPY_PROGRESS_MODE", "thread")
        future = environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0"
        return cls(mode, future and mode.startswith("thread"))


@dataclass(frozen=True)
class NodeConfig:
    """A store node's settings (from the command line).

    Attributes:
        host, port: the ``--listen`` address, advertised in the registry.
        capacity_bytes: pool size.
        redis_url: the index.
        node_id: registry id (default: hostname-port-random).
        metrics_port: HTTP /health and /metrics port (0: pick a free one).
        heartbeat_ttl_s: registry TTL; refreshed every third of it.
        block_ttl_s: drop blocks this long after their put (``None``: never).
        slot_bytes: fix the slot size up front (default: the first block's size).
        transfer_timeout_s: a payload transfer that takes longer fails and its
            connection is dropped (dead or stuck client).
        prefault: touch every page of the pool at start, so that no transfer pays
            for page faults (the pool's memory is committed up front).
        shm: keep the pool in a shared-memory segment that clients on this host
            read directly (kvstore/shm.py); off: private memory, UCX reads only.
        shm_lease_s: a shared-memory read pins its blocks until the client's
            ``release``, or this long if none comes (client crashed).
        ucx: how the node drives ucxx.
        disk_path: directory of the node's disk tier (blocks evicted from RAM kept as
            files, read back on a hit, registered again after a restart:
            kvstore/node_disk.py); ``None``: RAM only.
        disk_capacity_bytes: the most bytes the disk tier's files take.
        disk_write_queue_bytes: the most evicted bytes waiting for their disk write;
            evictions beyond it are not kept (counted).
    """

    host: str
    port: int
    capacity_bytes: int
    redis_url: str
    node_id: str
    metrics_port: int
    heartbeat_ttl_s: float = 10.0
    block_ttl_s: float | None = None
    slot_bytes: int | None = None
    transfer_timeout_s: float = 30.0
    prefault: bool = True
    shm: bool = True
    shm_lease_s: float = 30.0
    ucx: UcxOptions = UcxOptions()
    disk_path: str | None = None
    disk_capacity_bytes: int = 0
    disk_write_queue_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        # the id is the first "|"-separated field of index entries, and lookups join
        # entries with newlines (kvstore/index.py): either character would turn every
        # block of this node into a silent miss
        if not self.node_id or any(c == "|" or c.isspace() or not c.isprintable()
                                   for c in self.node_id):
            raise ValueError(f"node_id must be non-empty, printable, without '|' or "
                             f"whitespace, got {self.node_id!r}")
        if self.capacity_bytes < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {self.capacity_bytes}")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        if self.block_ttl_s is not None and self.block_ttl_s <= 0:
            raise ValueError(f"block_ttl_s must be > 0, got {self.block_ttl_s}")
        if self.shm_lease_s <= 0:
            raise ValueError(f"shm_lease_s must be > 0, got {self.shm_lease_s}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        self._check_disk()

    def _check_disk(self) -> None:
        if self.disk_write_queue_bytes < 1:
            raise ValueError(f"disk_write_queue_bytes must be >= 1, got "
                             f"{self.disk_write_queue_bytes}")
        if self.disk_path is None:
            if self.disk_capacity_bytes:
                raise ValueError("disk_capacity_bytes needs disk_path (--disk-path)")
            return
        if not self.disk_path:
            raise ValueError("disk_path must be a directory path, got ''")
        if self.disk_capacity_bytes < 1:
            raise ValueError(f"disk_capacity_bytes must be >= 1 with disk_path "
                             f"(--disk-capacity), got {self.disk_capacity_bytes}")
        if self.block_ttl_s is not None:
            # NOTE: block files carry no deadline, so a TTL would end at a restart
            raise ValueError("block_ttl_s (--block-ttl-s) is not supported with disk_path "
                             "(--disk-path)")


_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ClientOptions:
    """How a store client reads (kvstore/client.py), beyond where the store is.

    Attributes:
        shm: read blocks of nodes on this host straight from their shared-memory
            pool (kvstore/shm_read.py); off: every read goes over UCX.
        copy_threads: threads that copy and checksum one large shared-memory read.
        ucx: this process's UCX settings (the first client of a process fixes them).
        down_node_retry_s: seconds a node found gone (connection refused or reset, or
            its process on this host exited) is left alone, its blocks misses, before
            it is tried again; a node the registry shows restarted is tried at once.
    """

    shm: bool = True
    copy_threads: int = 2
    ucx: UcxOptions = UcxOptions()
    down_node_retry_s: float = 2.0

    def __post_init__(self) -> None:
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {self.copy_threads}")
        if self.down_node_retry_s <= 0:
            raise ValueError(f"down_node_retry_s must be > 0, got {self.down_node_retry_s}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ClientOptions:
        """From ``TANDEM_KV_SHM`` (``0``/``false``/``no``/``off``: off),
        ``TANDEM_KV_COPY_THREADS`` (default 2) and :meth:`UcxOptions.from_environ`.
        Called once by each entry point (services, benchmarks), never deeper.

        Raises:
            ValueError: a variable that does not parse (named).
        """
        shm = environ.get("TANDEM_KV_SHM", "1").strip().lower() not in _OFF
        raw = environ.get("TANDEM_KV_COPY_THREADS", "2")
        try:
            threads = int(raw)
        except ValueError as exc:
            raise ValueError(f"TANDEM_KV_COPY_THREADS must be an integer, got {raw!r}") from exc
        return cls(shm=shm, copy_threads=threads, ucx=UcxOptions.from_environ(environ))


@dataclass(frozen=True)
class StoreConnectorConfig(KVConnectorConfig):
    """Settings of the ``"store"`` connector (``KVTransferConfig.connector_config``).

    Attributes:
        redis_url: the store's index (and node registry), e.g. ``redis://host:6379``.
        kvstore_address: ``HOST:PORT`` of the store node on this host, read through
            shared memory when it can be; ``None``: only nodes found in Redis.
        kvstore_timeout_s: a store call that takes longer fails (a miss on load).
        num_transfer_threads: threads that run transfers off the engine's step loop.
        client_options: how the store client reads (shared memory, copy threads, UCX).
        load_from_store: a request that comes without block hashes (a prefill, or a
            decode instance's local prefill) looks up the blocks beyond its local
            prefix-cache hit in the store index and loads those present.
        publish_output: the consumer (decode) side publishes the full blocks of prompt
            + output when a request finishes, so a later turn of the conversation finds
            them (``--kv-publish-output``).
        lookup_timeout_s: deadline of one index lookup made for ``load_from_store``
            (a lookup that takes longer is a miss; the request waits for it, the engine
            does not), and of one poll of a load waiting for blocks (below).
        kv_load_wait_s: the prefill answers before its publish ends, so a decode's load
            may miss blocks still in flight; it then waits (in ``WAITING_FOR_REMOTE_KV``,
            other requests keep running) up to this many seconds for them to reach the
            store index, or until the prefill marks its publish ended, and recomputes
            what did not come (``--kv-load-wait-s``; 0: never wait, recompute at once).
            A store lookup with a ``PublishInFlight`` hint (a chat's next turn while a
            decode still publishes the previous answer) waits as long at most.

    Raises:
        ValueError: a field out of range (named in the message).
    """

    redis_url: str
    kvstore_address: str | None = field(default=None, metadata=flag(
        "HOST:PORT of a KV store node (default: nodes found in Redis)", name="--kvstore"))
    kvstore_timeout_s: float = field(default=10.0, metadata=flag(
        "deadline of one KV store node request (put or get); a node that stops answering "
        "costs this long before the blocks count as a miss (default 10)", metavar="S"))
    num_transfer_threads: int = 2
    client_options: ClientOptions = ClientOptions()
    load_from_store: bool = field(default=True, metadata=flag(
        "load a prompt's blocks beyond the local prefix-cache hit from the KV store when the "
        "store index holds them (default true)", name="--kv-load-from-store",
        bool_style="value"))
    publish_output: bool = field(default=True, metadata=flag(
        "decode: publish the blocks of prompt + output of finished requests to the KV "
        "store, for the conversation's next turn (default true)", name="--kv-publish-output",
        bool_style="value"))
    lookup_timeout_s: float = 2.0
    kv_load_wait_s: float = field(default=5.0, metadata=flag(
        "how long a load waits for blocks still being published before it recomputes "
        "them: a decode's load of blocks the prefill is still publishing (it answers "
        "before its publish ends), and any engine's store lookup of a chat's next turn "
        "whose previous answer a decode is still publishing (the router's "
        "kv_publish_in_flight hint) (default 5; 0: recompute at once)", metavar="S"))

    def __post_init__(self) -> None:
        if self.kv_load_wait_s < 0:
            raise ValueError(f"kv_load_wait_s must be >= 0, got {self.kv_load_wait_s}")
        if self.lookup_timeout_s <= 0:
            raise ValueError(f"lookup_timeout_s must be > 0, got {self.lookup_timeout_s}")
        if not self.redis_url:
            raise ValueError("redis_url must be a non-empty Redis URL (the KV store index)")
        if self.kvstore_address is not None and ":" not in self.kvstore_address:
            raise ValueError(f"kvstore_address must be HOST:PORT, got {self.kvstore_address!r}")
        if self.kvstore_timeout_s <= 0:
            raise ValueError(f"kvstore_timeout_s must be > 0, got {self.kvstore_timeout_s}")
        if self.num_transfer_threads < 1:
            raise ValueError(
                f"num_transfer_threads must be >= 1, got {self.num_transfer_threads}"
            )

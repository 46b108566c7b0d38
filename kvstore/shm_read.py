"""The same-host reader: blocks of a node on this host copied out of its shared pool.

A node keeps its slot pool in a shared-memory segment (kvstore/shm.py) and
answers ``get_shm`` on a Unix socket of its host (kvstore/shm_ctl.py). To read
blocks of such a node, :class:`ShmReader` on the calling thread

1. sends ``get_shm`` for the keys: the node pins the present blocks and answers
   with their offsets in the segment;
2. copies the pinned blocks straight from its read-only mapping of the segment
   into the caller's buffers, checksumming each one (:func:`copy_blocks`);
3. sends ``release`` (no reply): the node unpins them.

No payload crosses a socket, and nothing hops to the client's event loop: one
wake-up of the node's loop each way. Whether the copied bytes count is the
caller's decision (the index's checksum, kvstore/aio_client.py); this module
never reads the index. A node it cannot read this way (another host, no shared
segment, no socket) is read over UCX instead (kvstore/ucx_read.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tandem.kvstore.index import IndexEntry
from tandem.kvstore.index_entries import checksum_verdicts
from tandem.kvstore.shm import Mapping, host_id
from tandem.kvstore.shm_ctl import CtlChannel, ctl_address
from tandem.kvstore.store import KVStoreError, KVStoreTimeoutError
from tandem.kvstore.transport import NodeInfo, checksum, runs_of, span_of

logger = logging.getLogger("tandem.kvstore.client")

#: reads smaller than this are copied by one thread (a hand-off to the pool costs
#: tens of microseconds)
PARALLEL_COPY_MIN_BYTES = 2 << 20


class ShmReader:
    """Reads blocks of nodes on this host from their shared-memory pools.

    Args:
        timeout_s: deadline of each control-socket send and receive, seconds.
        copy_threads: threads that copy and checksum one read of at least
            :data:`PARALLEL_COPY_MIN_BYTES` (the calling thread is one of them).

    Thread-safe: each thread has its own channel to each node; mappings are shared.

    Raises:
        ValueError: ``timeout_s`` <= 0 or ``copy_threads`` < 1.
    """

    def __init__(self, timeout_s: float, copy_threads: int) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self.timeout_s = timeout_s
        self.copy_threads = copy_threads
        self._lock = threading.Lock()
        # node id -> (path|segment id, its mapping or None when it cannot be mapped)
        self._maps: dict[str, tuple[str, Mapping | None]] = {}
        self._local = threading.local()
        # every live thread's channels, closed by close(); weak, so that a channel of
        # a thread that has exited is collected (and its socket closed) with it
        self._all: weakref.WeakSet[CtlChannel] = weakref.WeakSet()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        #: node reads served from a shared segment
        self.num_reads = 0

    # -- mappings ---------------------------------------------------------------------------

    def mapping(self, node: NodeInfo) -> Mapping | None:
        """``node``'s segment mapped read-only; ``None`` when it must be read over UCX
        (another host or pid namespace, no shared pool, not the advertised file)."""
        if not (node.shm_path and node.shm_id and node.host_id == host_id()):
            return None
        ident = f"{node.shm_path}|{node.shm_id}"
        with self._lock:
            cached = self._maps.get(node.node_id)
        if cached is not None and cached[0] == ident:
            return cached[1]
        try:
            mapping: Mapping | None = Mapping(node.shm_path, node.shm_id)
        except (OSError, ValueError) as exc:
            logger.info("store node %s: cannot map its shared pool (%s); reading over UCX",
                        node.node_id, exc)
            mapping = None
        with self._lock:
            if not self._closed:  # NOTE: a mapping kept after close() would pin the segment
                self._maps[node.node_id] = (ident, mapping)
        return mapping

    def mapped_node_ids(self) -> set[str]:
        """Nodes whose segment this reader holds (mapped or found unmappable)."""
        with self._lock:
            return set(self._maps)

    def forget(self, node_id: str) -> None:
        """Let go of a node's mapping (the node is dead, or restarted): a dead node's
        segment lives as long as some process maps it."""
        with self._lock:
            self._maps.pop(node_id, None)

    def retain(self, live: set[str]) -> None:
        """:meth:`forget` every node not in ``live``."""
        with self._lock:
            for gone in self._maps.keys() - live:
                del self._maps[gone]

    # -- reads ------------------------------------------------------------------------------

    def serves(self, node: NodeInfo) -> bool:
        """:meth:`BlockReader.serves <tandem.kvstore.readers.BlockReader.serves>`: the
        node's segment can be mapped from this process."""
        return self.mapping(node) is not None

    async def fetch(self, node: NodeInfo, names: list[str], views: list[np.ndarray],
                    entries: list[IndexEntry]) -> dict[int, bool | None] | None:
        """:meth:`BlockReader.fetch <tandem.kvstore.readers.BlockReader.fetch>`:
        :meth:`read` on a worker thread (it blocks its thread, never the client loop),
        each block's checksum compared with its index entry's."""
        sums = await asyncio.to_thread(self.read, node, names, views)
        return None if sums is None else checksum_verdicts(sums, entries)

    def read(self, node: NodeInfo, names: list[str],
             views: list[np.ndarray]) -> dict[int, str] | None:
        """Pin the blocks ``names`` (index keys) on ``node``, copy the present ones into
        ``views[i]`` (one uint8 buffer per name, of the block's size), release them.

        Blocks consecutive both in ``views`` and in the segment move in one copy.

        Returns:
            index -> xxh3-64 hex of the bytes that landed in ``views[index]``, for each
            block the node holds with the expected size (absent ones are left out);
            ``None`` when ``node`` cannot be read this way (read it over UCX).

        Raises:
            KVStoreTimeoutError: the node did not answer within ``timeout_s``.
            KVStoreError: this reader was closed.
        """
        if self._closed:
            raise KVStoreError("client is closed")
        mapping = self.mapping(node)
        ch = self._channel(node) if mapping is not None else None
        if mapping is None or ch is None:
            return None
        try:
            req = ch.send_get(names)
        except ValueError:
            return None  # too many keys for one control message: nothing was sent
        except OSError as exc:
            self._fail(node, exc)
            return None
        try:
            reply = ch.recv_reply(req)
        except (OSError, ValueError) as exc:
            self._fail(node, exc)
            return None
        lease, offsets, sizes = reply.get("lease"), reply.get("offsets"), reply.get("sizes")
        try:
            if reply.get("op") != "shm" or not (isinstance(offsets, list)
                                                and isinstance(sizes, list)
                                                and len(offsets) == len(sizes) == len(views)):
                logger.warning("store node %s answered a malformed get_shm: %s", node.node_id,
                               reply.get("error", reply.get("op")))
                return None
            sums = copy_blocks(mapping, offsets, sizes, views, self._copy_pool)
        finally:
            if isinstance(lease, int) and lease:
                try:
                    ch.release(lease)
                except OSError:
                    self._drop(node.node_id)  # closing the channel releases it too
        with self._lock:
            self.num_reads += 1
        return sums

    def _copy_pool(self, nbytes: int) -> tuple[ThreadPoolExecutor | None, int]:
        """The pool that helps copy ``nbytes``, and how many shares to cut."""
        if self.copy_threads <= 1 or nbytes < PARALLEL_COPY_MIN_BYTES:
            return None, 1
        with self._lock:
            if self._closed:
                return None, 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.copy_threads - 1,
                                                thread_name_prefix="tandem-kv-copy")
            return self._pool, self.copy_threads

    # -- channels ---------------------------------------------------------------------------

    def _channel(self, node: NodeInfo) -> CtlChannel | None:
        """This thread's channel to ``node`` (``None``: cannot connect).

        Raises:
            KVStoreError: this reader was closed.
        """
        chans: dict[str, CtlChannel] = self._local.__dict__.setdefault("chans", {})
        address = ctl_address(node.node_id, node.shm_id)
        ch = chans.get(node.node_id)
        if ch is not None and ch.address == address and not self._closed:
            return ch
        if ch is not None:
            self._drop(node.node_id)  # the node restarted with another segment
        try:
            ch = CtlChannel(address, self.timeout_s)
        except OSError as exc:
            logger.debug("no shared-memory channel to %s: %s", node.node_id, exc)
            return None
        with self._lock:
            if self._closed:
                ch.close()
                raise KVStoreError("client is closed")
            self._all.add(ch)
        chans[node.node_id] = ch
        return ch

    def _fail(self, node: NodeInfo, exc: BaseException) -> None:
        """This thread's channel to ``node`` failed with ``exc``: close it (which
        releases whatever it pinned).

        Raises:
            KVStoreTimeoutError: ``exc`` is a timeout (the node is hung).
            KVStoreError: the reader was closed meanwhile.
        """
        self._drop(node.node_id)
        if isinstance(exc, TimeoutError):
            raise KVStoreTimeoutError(
                f"get from store node {node.node_id} ({node.address}) timed out after "
                f"{self.timeout_s}s (node hung or overloaded)") from exc
        if self._closed:
            raise KVStoreError("client is closed") from exc

    def _drop(self, node_id: str) -> None:
        ch = self._local.__dict__.get("chans", {}).pop(node_id, None)
        if ch is not None:
            with self._lock:
                self._all.discard(ch)
            ch.close()  # the node releases the connection's leases

    def num_channels(self) -> int:
        """Open channels of live threads (each thread has its own per node)."""
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        """Close every thread's channels and the copy pool; later reads raise
        :class:`KVStoreError`."""
        with self._lock:
            self._closed = True
            chans, self._all = list(self._all), weakref.WeakSet()
            pool, self._pool = self._pool, None
            self._maps.clear()
        for ch in chans:
            ch.close()
        if pool is not None:
            pool.shutdown(wait=True)


def copy_blocks(mapping: Mapping, offsets: list[int], sizes: list[int],
                views: list[np.ndarray],
                pool_for: Callable[[int], tuple[ThreadPoolExecutor | None, int]]
                ) -> dict[int, str]:
    """Copy block ``j`` (``sizes[j]`` bytes at ``offsets[j]`` in the segment; -1:
    absent) into ``views[j]``; returns each copied index with the checksum
    (:func:`~tandem.kvstore.transport.checksum`) of the bytes that landed.

    A block is copied only where the node has it, with the size of its view,
    inside the segment. Blocks adjacent on both sides (a run of consecutive
    cache blocks in consecutive slots) move in one copy; then each block's
    checksum is taken on the bytes in ``views``. ``pool_for(nbytes)`` gives the
    thread pool and the number of shares for a read of ``nbytes``.

    NOTE: one copy per run, not per block: glibc copies of up to the L2 size use
    ``rep movsb`` on AMD Zen, which is much slower when the destination is not
    64-byte aligned relative to the (page-aligned) slot, as numpy's 16-byte-aligned
    arrays are (torch's are 64-byte aligned); larger copies use vector loops that
    do not care. Large reads are split into shares of about equal bytes (at block
    boundaries), each copied then checksummed by its own thread: one core's memory
    bandwidth was the limit. Figures: docs/benchmarks.md.
    """
    ok = [isinstance(o, int) and isinstance(n, int) and 0 <= o and n == v.nbytes
          and o + n <= mapping.nbytes for o, n, v in zip(offsets, sizes, views, strict=True)]
    pieces: list[list[int]] = []  # each: blocks adjacent on both sides, one copy
    for start, count in runs_of(views):
        j, end = start, start + count
        while j < end:
            if not ok[j]:
                j += 1
                continue
            k, stop = j, offsets[j] + sizes[j]
            while k + 1 < end and ok[k + 1] and offsets[k + 1] == stop:
                k += 1
                stop += sizes[k]
            pieces.append(list(range(j, k + 1)))
            j = k + 1
    src = mapping.array

    def work(share: list[list[int]]) -> dict[int, str]:
        for piece in share:
            first, last = piece[0], piece[-1]
            np.copyto(span_of(views, first, len(piece)),
                      src[offsets[first]:offsets[last] + sizes[last]])
        return {j: checksum(views[j]) for piece in share for j in piece}

    pool, n = pool_for(sum(sizes[j] for p in pieces for j in p))
    shares = split_shares(pieces, sizes, n)
    # NOTE: numpy's copy and xxhash both release the GIL, so the shares run in
    # parallel; this thread does the first, the pool the others.
    futures: list[Future[dict[int, str]]] = []
    for sh in shares[1:]:
        if pool is not None:
            try:
                futures.append(pool.submit(work, sh))
                continue
            except RuntimeError:  # shut down meanwhile (close): copy it here
                pass
        done: Future[dict[int, str]] = Future()
        done.set_result(work(sh))
        futures.append(done)
    sums = work(shares[0]) if shares else {}
    for fut in futures:
        sums.update(fut.result())
    return sums



def split_shares(pieces: list[list[int]], sizes: list[int], n: int) -> list[list[list[int]]]:
    """Cut copy ``pieces`` (lists of adjacent block indices, ``sizes[j]`` bytes each)
    into at most ``n`` shares of about equal bytes, splitting a piece only
    between blocks. Every block lands in exactly one share, order kept."""
    total = sum(sizes[j] for p in pieces for j in p)
    shares: list[list[list[int]]] = []
    done, at = 0, -1
    for piece in pieces:
        cur: list[int] = []
        for j in piece:
            share = min(n - 1, done * n // total) if n > 1 else 0
            if share != at:  # a new share starts at this block
                if cur:
                    shares[-1].append(cur)
                    cur = []
                shares.append([])
                at = share
            cur.append(j)
            done += sizes[j]
        if cur:
            shares[-1].append(cur)
    return shares

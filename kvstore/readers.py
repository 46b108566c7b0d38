"""The transport seam of the store client's reads: one :class:`BlockReader` per transport,
picked by a registry.

A transport is one module holding a class that satisfies :class:`BlockReader`, and one
:func:`register_reader` line here naming its factory. The client
(:class:`~tandem.kvstore.aio_client.AsyncKVStoreClient`) builds every registered reader
the options allow, in registration order, and reads each node's blocks through the first
that serves the node: ``shm`` (kvstore/shm_read.py: nodes on this host, copied out of
their shared pool) before ``ucx`` (kvstore/ucx_read.py: any node, UCX tag messages).
The factories import their modules only when called, so this registry loads no
transport by itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tandem.kvstore.config import ClientOptions
from tandem.kvstore.index import IndexEntry
from tandem.kvstore.transport import NodeConnection, NodeInfo


class BlockReader(Protocol):
    """How one transport reads blocks from store nodes into the caller's buffers.

    The client calls :meth:`fetch` on its event loop, the others from any thread.
    """

    def serves(self, node: NodeInfo) -> bool:
        """Whether this reader can read ``node`` (no node request: what the registry
        entry and this process's state say)."""

    async def fetch(
        self, node: NodeInfo, names: list[str], views: list[np.ndarray], entries: list[IndexEntry]
    ) -> dict[int, bool | None] | None:
        """Read blocks ``names`` (index keys, ``entries[i]`` their index entries) of
        ``node`` into ``views[i]`` (one writable uint8 buffer per name, of the block's
        size).

        Returns:
            index -> checksum verdict (``None``: not checked, the caller checks) of
            each block that arrived (absent ones left out); ``None`` when this reader
            could not read the node after all (the next reader is tried).

        Raises:
            KVStoreNodeDownError: the node is gone (the client marks it down).
            KVStoreTimeoutError / KVStoreError: the read failed.
        """

    def retain(self, live: set[str]) -> None:
        """Let go of what this reader holds for nodes not in ``live`` (node ids)."""

    def forget(self, node_id: str) -> None:
        """Let go of what this reader holds for ``node_id`` (dead or restarted)."""

    def close(self) -> None:
        """Release what this reader holds (blocks: joins its threads)."""


@dataclass(frozen=True)
class ReaderContext:
    """What a reader factory may build its reader from.

    Attributes:
        timeout_s: deadline of each node request, seconds.
        options: the client's options (kvstore/config.py).
        connect: the client's (cached) UCX connection to a node; raises KVStoreError.
        drop: forget a connection that failed (cancels what is posted on it).
    """

    timeout_s: float
    options: ClientOptions
    connect: Callable[[NodeInfo], Awaitable[NodeConnection]]
    drop: Callable[[NodeConnection], None]


#: A reader factory: the reader, or ``None`` when the options turn its transport off.
ReaderFactory = Callable[[ReaderContext], BlockReader | None]

_READERS: dict[str, ReaderFactory] = {}


def register_reader(name: str, factory: ReaderFactory) -> None:
    """Register a transport's reader under ``name``; tried after those registered before.

    Raises:
        ValueError: ``name`` already registered.
    """
    if name in _READERS:
        raise ValueError(f"block reader {name!r} is already registered")
    _READERS[name] = factory


def make_readers(ctx: ReaderContext) -> dict[str, BlockReader]:
    """Every registered reader the options allow, by name, in the order they are tried."""
    out: dict[str, BlockReader] = {}
    for name, factory in _READERS.items():
        reader = factory(ctx)
        if reader is not None:
            out[name] = reader
    return out


def _shm_reader(ctx: ReaderContext) -> BlockReader | None:
    from tandem.kvstore.shm_read import ShmReader

    return ShmReader(ctx.timeout_s, ctx.options.copy_threads) if ctx.options.shm else None


def _ucx_reader(ctx: ReaderContext) -> BlockReader:
    from tandem.kvstore.ucx_read import UcxReader

    return UcxReader(ctx.connect, ctx.drop, ctx.timeout_s)


register_reader("shm", _shm_reader)
register_reader("ucx", _ucx_reader)

"""Pure functions over a lookup's index entries (one per block key, ``None`` for a miss):
the leading run of hits, its blocks grouped by node, the entries of nodes that are down
turned into misses, and the checksum verdicts of copied blocks. Shared by the asynchronous
client (``aio_client.py``) and its synchronous facade (``client.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.kvstore.index import IndexEntry
from tandem.kvstore.transport import DownNodes, NodeInfo


def checksum_verdicts(sums: dict[int, str],
                      entries: Sequence[IndexEntry | None]) -> dict[int, bool | None]:
    """Block index -> whether the checksum of its copied bytes (``sums``) is the one
    its index entry (``entries[index]``, present) names."""
    out: dict[int, bool | None] = {}
    for i, h in sums.items():
        e = entries[i]
        assert e is not None, "only present blocks are copied"
        out[i] = h == e.checksum
    return out


def without_down(entries: list[IndexEntry | None], nodes: dict[str, NodeInfo],
                 down: DownNodes) -> list[IndexEntry | None]:
    """``entries`` with those of nodes that are down turned into misses (kept in the
    index: the node may come back with them)."""
    gone = {nid for nid, node in nodes.items() if down.is_down(node)}
    if not gone:
        return entries
    return [None if e is None or e.node_id in gone else e for e in entries]


def leading_by_node(entries: Sequence[IndexEntry | None],
                    views: Sequence[np.ndarray]) -> tuple[int, dict[str, list[int]]]:
    """The number of leading present blocks, and their indices grouped by node id.

    Raises:
        ValueError: a buffer's size is not its stored block's.
    """
    n = leading_count(entries)
    by_node: dict[str, list[int]] = {}
    for i in range(n):
        e = entries[i]
        assert e is not None
        if e.size_bytes != views[i].nbytes:
            raise ValueError(f"into[{i}] has {views[i].nbytes} bytes, the stored block has "
                             f"{e.size_bytes}")
        by_node.setdefault(e.node_id, []).append(i)
    return n, by_node


def leading_count(entries: Sequence[IndexEntry | None]) -> int:
    """Entries before the first miss."""
    n = 0
    for e in entries:
        if e is None:
            break
        n += 1
    return n

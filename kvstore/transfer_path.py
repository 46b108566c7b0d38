"""How the store connector moves an engine's KV blocks: in place or through host staging.

The store client (kvstore/aio_client.py) sends and receives host memory only: it
checks each block's xxh3 checksum on the host on both sides, and a node keeps its
blocks in a host memory pool (kvstore/pool.py). A cache in GPU memory therefore moves
through a pinned host buffer: a save copies the blocks device -> host, then the client
sends the buffer; a load receives into it, then copies host -> device. This is the copy
UCX's own CUDA transport (``cuda_copy``) would make for a host-bound message; doing it
ourselves keeps the checksum on the bytes actually sent and works whether or not the
UCX build has CUDA transports (``cuda_copy``, ``cuda_ipc``, ``gdr_copy``). Sending
device memory without staging would need the checksum computed on the GPU and a
node that keeps GPU blocks, neither of which exists.

``plan_kv_transfer`` is the decision as a pure function of the cache's facts, tested
on the CPU; the staging copies themselves (``ShardedKVCache.read_blocks`` /
``write_blocks``) are device-agnostic torch copies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVTransferPath(enum.Enum):
    """Where the store client reads and writes a cache's blocks."""

    #: the client reads and writes the cache's own host memory (no copy)
    IN_PLACE = "in_place"
    #: through a host staging buffer, assembled from / scattered into the cache's shards
    HOST_STAGING = "host_staging"


@dataclass(frozen=True)
class KVTransferPlan:
    """The outcome of ``plan_kv_transfer``.

    Attributes:
        path: in place or staged.
        pinned: the staging buffer is page-locked (faster DMA to and from a GPU).
        reason: why, in words.
    """

    path: KVTransferPath
    pinned: bool
    reason: str


def plan_kv_transfer(device_types: set[str], one_contiguous_tensor: bool) -> KVTransferPlan:
    """How to move the blocks of a cache whose shards live on ``device_types``
    (``torch.device.type`` of each shard: "cpu", "cuda"...).

    Rules: a cache that is one contiguous CPU tensor holding the whole block is read
    and written in place; any other cache is staged through a host buffer, pinned when
    a shard is on CUDA (see the module docstring for why GPU memory is never sent
    directly).

    Raises:
        ValueError: no device type.
    """
    if not device_types:
        raise ValueError("device_types: a cache has at least one shard")
    if device_types == {"cpu"} and one_contiguous_tensor:
        return KVTransferPlan(KVTransferPath.IN_PLACE, False, "one contiguous CPU tensor")
    if "cuda" in device_types:
        return KVTransferPlan(
            KVTransferPath.HOST_STAGING, True,
            "GPU memory: the store client sends and checksums host memory",
        )
    why = ("not one contiguous tensor (shards of several ranks)" if device_types == {"cpu"}
           else f"devices {sorted(device_types)}")
    return KVTransferPlan(KVTransferPath.HOST_STAGING, False, why)

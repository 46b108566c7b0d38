"""The store's metadata in Redis: block index entries and the node registry.

Schema (all keys under ``tandem:``):

- ``tandem:kv:blk:<fingerprint hex>:<hash hex>`` -> string
  ``"<node_id>|<slot>|<size_bytes>|<xxh3-64 hex>"``: where a block lives. Written
  only by the node that holds the bytes, after the bytes are complete (the
  entry is the commit marker); optional Redis TTL for block expiry. The slot is
  :data:`DISK_SLOT` (``-1``) for a block in the node's disk tier (kvstore/node_disk.py):
  the node reads it back into a RAM slot when a get asks for it.
- ``tandem:kvnode:<node_id>`` -> hash (``address``, ``ucx_address`` hex,
  ``capacity_bytes``, ``used_bytes``, ``num_blocks``, ``slot_bytes``, ``hostname``,
  ``host_id``, ``shm_path``, ``shm_id`` (kvstore/shm.py; empty without a shared
  pool), ``pid``, ``updated_at``) with a heartbeat TTL: a node whose key expired is dead
  and its blocks are misses.
- ``tandem:kvnodes`` -> set of node ids ever registered (dead ones are pruned by readers).
- ``tandem:kv:pubdone:<fingerprint hex>:<last block hash hex>:<request id>`` -> ``"ok"``
  or ``"failed"``: a prefill's publish of a prompt (named by its last block's key) for
  one request ended, written by the prefill after the put (kvstore/arrival.py), with a
  short TTL; a decode waiting for those blocks stops waiting when it sees it.
- ``tandem:kv:outdone:<fingerprint hex>:<request id>`` -> ``"ok"`` or ``"failed"``: a
  decode's publish of one finished request's prompt + output blocks ended (the same
  short TTL); a store lookup of the next turn that the router told about that publish
  (``contracts.block_key.PublishInFlight``) stops waiting when it sees it.

A batch's index update (new entries plus removal of the blocks evicted to make
room) is one Lua script, so it is atomic.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.contracts.block_key import BlockKey

NODE_PREFIX = "tandem:kvnode:"
#: the slot of an index entry whose block is in its node's disk tier, not in RAM
DISK_SLOT = -1
NODES_SET = "tandem:kvnodes"

# KEYS: ndel keys to delete-if-owned, then keys to set.
# ARGV: ndel, then per deleted key the expected value prefix "<node>|<slot>|",
# then per set key its value and TTL in ms (0: none).
COMMIT_LUA = """
local ndel = tonumber(ARGV[1])
local i = 2
for k = 1, ndel do
  local v = redis.call('GET', KEYS[k])
  if v and string.sub(v, 1, string.len(ARGV[i])) == ARGV[i] then
    redis.call('DEL', KEYS[k])
  end
  i = i + 1
end
for k = ndel + 1, #KEYS do
  local ttl = tonumber(ARGV[i + 1])
  if ttl > 0 then
    redis.call('SET', KEYS[k], ARGV[i], 'PX', ttl)
  else
    redis.call('SET', KEYS[k], ARGV[i])
  end
  i = i + 2
end
return #KEYS - ndel
"""


# KEYS: index keys; ARGV[1]: NODE_PREFIX. One round trip for a lookup: the
# entries, plus (node id, address, ucx address, capacity, used, slot bytes, host id,
# shm path, shm id) of every live node they name.
# Returns two strings: the entries joined by "\n" ("" for a missing key, so
# there are exactly #KEYS fields) and the live nodes' nine fields each, all
# joined by "\n" (see parse_lookup). NOTE: one string instead of an array of
# #KEYS bulk strings, because redis-py's Python parser pays per reply element, a
# visible share of a get's fixed cost (docs/benchmarks.md, "Kernel measurements").
# NOTE: reads node keys not passed in KEYS; fine on a single Redis, not on a cluster.
LOOKUP_LUA = """
local vals = {}
for s = 1, #KEYS, 1000 do
  local part = redis.call('MGET', unpack(KEYS, s, math.min(s + 999, #KEYS)))
  for i = 1, #part do vals[#vals + 1] = part[i] or '' end
end
local nodes = {}
local seen = {}
for i = 1, #vals do
  local nid = string.match(vals[i], '^([^|]+)|')
  if nid and not seen[nid] then
    seen[nid] = true
    local h = redis.call('HMGET', ARGV[1] .. nid, 'address', 'ucx_address',
                         'capacity_bytes', 'used_bytes', 'slot_bytes', 'host_id',
                         'shm_path', 'shm_id')
    if h[2] then
      nodes[#nodes + 1] = table.concat({nid, h[1] or '', h[2], h[3] or '0', h[4] or '0',
                                        h[5] or '0', h[6] or '', h[7] or '', h[8] or ''},
                                       '\\n')
    end
  end
end
return {table.concat(vals, '\\n'), table.concat(nodes, '\\n')}
"""


PUBLISH_MARKER_PREFIX = "tandem:kv:pubdone:"


def publish_marker_key(last_block: BlockKey, request_id: str) -> str:
    """Redis key of the marker saying that ``request_id``'s publish of the prompt whose
    last block is ``last_block`` ended."""
    return f"{PUBLISH_MARKER_PREFIX}{last_block}:{request_id}"


OUTPUT_MARKER_PREFIX = "tandem:kv:outdone:"


def output_marker_key(layout_fingerprint: bytes, request_id: str) -> str:
    """Redis key of the marker saying that the output publish of ``request_id`` (a
    decode's publish of its prompt + output blocks, of that layout) ended."""
    return f"{OUTPUT_MARKER_PREFIX}{layout_fingerprint.hex()}:{request_id}"


def node_key(node_id: str) -> str:
    """Redis key of a node's registry hash."""
    return NODE_PREFIX + node_id


@dataclass(frozen=True)
class IndexEntry:
    """Where one block lives (the value of its index key)."""

    node_id: str
    slot: int
    size_bytes: int
    checksum: str

    def encode(self) -> str:
        return f"{self.node_id}|{self.slot}|{self.size_bytes}|{self.checksum}"

    @property
    def tier(self) -> str:
        """``"disk"`` for a block in its node's disk tier, else ``"ram"``."""
        return "disk" if self.slot == DISK_SLOT else "ram"

    @property
    def owner_prefix(self) -> str:
        """Prefix that identifies this node's slot (compare-and-delete)."""
        return f"{self.node_id}|{self.slot}|"

    @classmethod
    def decode(cls, raw: bytes | str | None) -> IndexEntry | None:
        """Parse an index value; ``None`` (a miss) for absent or malformed values."""
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split("|")
        if len(parts) != 4 or not parts[0]:
            return None
        try:
            return cls(parts[0], int(parts[1]), int(parts[2]), parts[3])
        except ValueError:
            return None


def commit_args(
    evicted: list[tuple[str, str]], new: list[tuple[str, str, int]]
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of :data:`COMMIT_LUA`.

    Args:
        evicted: ``(redis key, owner prefix)`` of index entries to remove if still owned.
        new: ``(redis key, encoded entry, ttl_ms)`` to write.
    """
    keys = [k for k, _ in evicted] + [k for k, _, _ in new]
    argv: list[str | int] = [len(evicted)]
    argv += [prefix for _, prefix in evicted]
    for _, value, ttl_ms in new:
        argv += [value, ttl_ms]
    return keys, argv


#: Fields per node in :data:`LOOKUP_LUA`'s second string.
LOOKUP_NODE_FIELDS = 9


def parse_lookup(num_keys: int, reply: list[bytes | str]
                 ) -> tuple[list[IndexEntry | None], list[list[str]]]:
    """Split :data:`LOOKUP_LUA`'s reply into per-key entries and per-node field lists.

    Returns ``(entries, nodes)``: ``entries[i]`` is key ``i``'s entry (``None`` when
    absent or malformed); each of ``nodes`` is ``[node id, address, ucx address hex,
    capacity bytes, used bytes, slot bytes, host id, shm path, shm id]`` of a live
    node the entries name.

    Raises:
        ValueError: the reply does not have one field per key or whole node records
            (an index value containing a newline; never written by a store node).
    """
    vals_raw, nodes_raw = (x.decode() if isinstance(x, bytes) else str(x) for x in reply)
    vals = vals_raw.split("\n") if num_keys else []
    if len(vals) != num_keys:
        raise ValueError(f"index lookup returned {len(vals)} fields for {num_keys} keys")
    flat = nodes_raw.split("\n") if nodes_raw else []
    if len(flat) % LOOKUP_NODE_FIELDS:
        raise ValueError(f"index lookup returned {len(flat)} node fields, not whole records")
    nodes = [flat[j : j + LOOKUP_NODE_FIELDS] for j in range(0, len(flat), LOOKUP_NODE_FIELDS)]
    return [IndexEntry.decode(v) if v else None for v in vals], nodes

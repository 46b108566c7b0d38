"""Output publishes that may still be running: the router's hint for a chat's next turn.

A decode instance with ``--kv-publish-output`` publishes a finished request's prompt +
output blocks after the last token went out (publishing never holds the stream). A
client that sends its next turn at once (the turn's prompt is the previous prompt, the
answer and a new message) can reach a prefill's store lookup before that publish has
committed the answer's blocks, and the answer is then recomputed. The router sees both
ends: it passes the answer on, so it learns that the request finished before the client
does, and it routes the next turn. :class:`PublishTracker` remembers each such finish
(the hash chain of the blocks the decode publishes) for :data:`HINT_TTL_S`, and a prompt
that continues one of those chains gets a ``PublishInFlight`` naming the blocks: the
engine's lookup then waits for them or for the publish's end marker
(kvstore/connector.py) instead of recomputing them.

Cost on the router: hashing the answer's full blocks at each finish (the prompt's hashes
are the route's, already computed) and one dict probe per block of each prompt routed
while any record is live. The event loop is the only caller: no locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.contracts.block_hash import BlockHash, hash_block
from tandem.contracts.block_key import PublishInFlight

#: How long a finish is remembered, seconds: past it the hint is not sent, and a lookup
#: that misses the answer's blocks recomputes them.
HINT_TTL_S = 30.0
#: Finishes remembered at most (the oldest are forgotten first).
MAX_RECORDS = 4096

#: ``block size -> the prompt's full-block hash chain`` in blocks of that size.
_HashesOf = Callable[[int], Sequence[BlockHash]]
#: ``(block size, hash of a publish's first block, request id)``: a record's key.
_Key = tuple[int, BlockHash, str]


@dataclass(frozen=True)
class _Record:
    request_id: str
    instance: str  # the publishing decode's address
    layout_fingerprint: bytes
    block_size: int
    first_block: int
    chain: tuple[BlockHash, ...]  # hashes of blocks [first_block, first_block + len)
    expires_at: float  # time.monotonic() seconds


class PublishTracker:
    """Finished requests whose output publish may still run, found by the hash of the
    first block each publish brings (several may share it: a finish never replaces
    another request's).

    Args:
        ttl_s: how long a finish is remembered, seconds (> 0).
        max_records: finishes remembered at most (>= 1).

    Raises:
        ValueError: ``ttl_s <= 0`` or ``max_records < 1``.
    """

    def __init__(self, ttl_s: float = HINT_TTL_S, max_records: int = MAX_RECORDS) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self._ttl_s = ttl_s
        self._max = max_records
        # (block size, hash of the publish's first block, request id) -> record, oldest
        # first; several publishes can start at the same block (chats sharing a system
        # prompt whose turns were prefilled on the decode instance all start at block 0)
        self._records: OrderedDict[_Key, _Record] = OrderedDict()
        # (block size, hash of the publish's first block) -> the keys of those records
        self._by_start: dict[tuple[int, BlockHash], dict[_Key, None]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def record(self, request_id: str, instance: str, layout_fingerprint: bytes,
               block_size: int, prompt_hashes: Sequence[BlockHash],
               token_ids: Sequence[int], first_block: int) -> None:
        """Remember that ``request_id`` finished on a decode instance that publishes its
        output, so blocks ``first_block`` on of ``token_ids`` may still be on their way.

        Args:
            request_id: the finished request (its publish's end marker carries it).
            instance: the decode instance's address (its records are skipped while it is
                down: see :meth:`find`).
            layout_fingerprint: the decode instance's KV layout fingerprint.
            block_size: its tokens per block (> 0).
            prompt_hashes: the full-block hash chain of the request's prompt (in blocks
                of ``block_size``): reused, not recomputed.
            token_ids: prompt + output tokens whose KV the decode computed (every output
                token but the last sampled one).
            first_block: first block the publish brings (the prefill published the
                prompt's full blocks before it; 0 when the decode computed the prompt).
        """
        end = len(token_ids) // block_size
        if block_size <= 0 or not layout_fingerprint or end <= first_block:
            return
        chain: list[BlockHash] = []
        parent = None
        for i in range(end):
            if i < len(prompt_hashes):
                parent = prompt_hashes[i]
            else:
                parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
            if i >= first_block:
                chain.append(parent)
        self._prune(time.monotonic())
        key = (block_size, chain[0], request_id)
        self._forget(key)
        self._records[key] = _Record(request_id, instance, layout_fingerprint, block_size,
                                     first_block, tuple(chain),
                                     time.monotonic() + self._ttl_s)
        self._by_start.setdefault((block_size, chain[0]), {})[key] = None
        while len(self._records) > self._max:
            self._forget(next(iter(self._records)))

    def find(self, prompt_hashes_of: _HashesOf,
             is_down: Callable[[str], bool] = lambda instance: False
             ) -> PublishInFlight | None:
        """The hint for a prompt: of the remembered publishes that bring blocks of its
        chain, the one reaching furthest into it (the latest turn; an earlier turn's
        publish has most likely ended), or ``None``. ``prompt_hashes_of(block_size)`` is
        the prompt's full-block hash chain in blocks of that size. Publishes of instances
        for which ``is_down(address)`` holds are skipped: a dead decode never writes its
        end marker, and a hint of it would hold the lookup for the whole
        ``--kv-load-wait-s`` where recomputing is far cheaper."""
        self._prune(time.monotonic())
        if not self._records:
            return None
        best: tuple[int, _Record] | None = None
        for size in {key[0] for key in self._records}:
            hashes = prompt_hashes_of(size)
            for j, h in enumerate(hashes):
                for key in self._by_start.get((size, h), ()):
                    rec = self._records[key]
                    if rec.first_block != j or is_down(rec.instance):
                        continue
                    n = 0
                    for mine, theirs in zip(hashes[j:], rec.chain, strict=False):
                        if mine != theirs:
                            break
                        n += 1
                    if n and (best is None or j + n >= best[0]):
                        best = (j + n, rec)  # a tie: the later finish
        if best is None:
            return None
        end, rec = best
        return PublishInFlight(rec.request_id, rec.layout_fingerprint, rec.block_size,
                               rec.first_block, end)

    def _prune(self, now: float) -> None:
        while self._records:
            key, rec = next(iter(self._records.items()))
            if rec.expires_at > now:
                return
            self._forget(key)

    def _forget(self, key: _Key) -> None:
        if self._records.pop(key, None) is None:
            return
        start = (key[0], key[1])
        keys = self._by_start[start]
        del keys[key]
        if not keys:
            del self._by_start[start]

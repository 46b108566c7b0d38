"""Routing policies: small strategies behind one async interface, chosen by name.

- ``round_robin``: rotate over the healthy instances of the role (one rotation per stage).
- ``least_loaded``: fewest requests (running + waiting, or our own in-flight count if
  larger), then lowest KV usage, then round robin.
- ``kv_aware`` (default): for prefill, the instance that most likely holds the longest
  prefix of this prompt in its prefix cache; for decode (and colocated), least loaded.
  The router cannot see an engine's cache, so it keeps, per prefill instance, the block
  hashes (``contracts.block_hash.hash_token_blocks``) of the prompts it sent there recently,
  bounded LRU -- the approach of SGLang's cache-aware router and vLLM production-stack's
  prefix-aware routing. To avoid piling every request that shares a system prompt onto one
  instance, a prefix match only wins while that instance's load is within
  ``balance_slack`` requests of the least loaded one.

NOTE: the KV store's index is not consulted for the prefill choice: a prefill instance
only publishes to the store (it never loads from it), so blocks in the store shorten no
prefill; they shorten the decode side's load, which any decode instance does equally.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tandem.contracts.block_hash import BlockHash, hash_token_blocks
from tandem.contracts.role import Role
from tandem.services.router.discovery import InstanceInfo


class RoutingPolicy(str, enum.Enum):
    """Names accepted by ``--routing-policy``."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    KV_AWARE = "kv_aware"


@dataclass
class RouteContext:
    """What a policy may look at to place one request.

    Attributes:
        stage: the role of the instances being chosen (``Role.BOTH``: colocated).
        prompt_token_ids: the templated prompt's token ids.
        request_id: for logs.
    """

    stage: Role
    prompt_token_ids: Sequence[int]
    request_id: str = ""
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, repr=False)

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hash chain of the prompt's full blocks (computed once per block size)."""
        if block_size not in self._hashes:
            self._hashes[block_size] = hash_token_blocks(self.prompt_token_ids, block_size)
        return self._hashes[block_size]


class Router(ABC):
    """A routing strategy. ``choose`` never blocks on I/O and never mutates instances."""

    @abstractmethod
    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext
                     ) -> InstanceInfo:
        """Pick one of ``candidates`` (non-empty; the caller checks) for ``ctx``."""

    def on_routed(self, info: InstanceInfo, ctx: RouteContext) -> None:  # noqa: B027
        """Called once the chosen instance accepted the request (default: nothing)."""


class _Rotation:
    """One rotation per stage: a disaggregated request advances the prefill rotation with
    its prefill choice and the decode rotation with its decode choice.

    Why: with one counter for both choices, each request advanced it twice, so with two
    prefill instances every prefill choice landed on the same one.
    """

    def __init__(self) -> None:
        self._counters: dict[Role, Iterator[int]] = {}

    def next(self, stage: Role) -> int:
        """The next turn of ``stage``'s rotation (0, 1, 2, ...)."""
        return next(self._counters.setdefault(Role(stage), itertools.count()))


class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._rotation = _Rotation()

    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext
                     ) -> InstanceInfo:
        ordered = sorted(candidates, key=lambda i: i.address)
        return ordered[self._rotation.next(ctx.stage) % len(ordered)]


class LeastLoadedRouter(Router):
    def __init__(self) -> None:
        self._rotation = _Rotation()

    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext
                     ) -> InstanceInfo:
        return least_loaded(candidates, self._rotation.next(ctx.stage))


def least_loaded(candidates: Sequence[InstanceInfo], tiebreak: int = 0) -> InstanceInfo:
    """Fewest requests, then lowest KV usage; ties rotate by ``tiebreak``."""
    best = min((i.load, round(i.kv_usage, 2)) for i in candidates)
    ties = sorted((i for i in candidates if (i.load, round(i.kv_usage, 2)) == best),
                  key=lambda i: i.address)
    return ties[tiebreak % len(ties)]


class _PrefixHints:
    """Bounded LRU set of block hashes one instance was recently sent."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()

    def matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` held (hash chains: prefix = prefix)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)


class KVAwareRouter(Router):
    """Longest cached prefix for prefill; least loaded otherwise.

    Args:
        capacity_blocks: remembered blocks per instance (about its cache size).
        balance_slack: a prefix match wins only if its instance has at most this many
            requests more than the least loaded candidate.
    """

    def __init__(self, capacity_blocks: int = 65536, balance_slack: int = 8) -> None:
        self._hints: dict[str, _PrefixHints] = {}
        self._capacity_blocks = capacity_blocks
        self._balance_slack = balance_slack
        self._rotation = _Rotation()

    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext
                     ) -> InstanceInfo:
        fallback = least_loaded(candidates, self._rotation.next(ctx.stage))
        if ctx.stage == Role.DECODE:
            return fallback
        best, best_blocks = fallback, 0
        for info in sorted(candidates, key=lambda i: i.address):
            hints = self._hints.get(info.address)
            if hints is None or info.load > fallback.load + self._balance_slack:
                continue
            n = hints.matched_blocks(ctx.block_hashes(info.block_size))
            if n > best_blocks or (n == best_blocks and n > 0 and info.load < best.load):
                best, best_blocks = info, n
        return best

    def on_routed(self, info: InstanceInfo, ctx: RouteContext) -> None:
        if ctx.stage == Role.DECODE:
            return
        hints = self._hints.setdefault(info.address, _PrefixHints(self._capacity_blocks))
        hints.add(ctx.block_hashes(info.block_size))

    def matched_blocks(self, address: str, ctx: RouteContext, block_size: int = 16) -> int:
        """Blocks of ``ctx``'s prompt believed cached on ``address`` (for tests/metrics)."""
        hints = self._hints.get(address)
        return hints.matched_blocks(ctx.block_hashes(block_size)) if hints else 0


def make_router(policy: RoutingPolicy | str) -> Router:
    """Construct the strategy named ``policy``.

    Raises:
        ValueError: unknown policy name.
    """
    try:
        policy = RoutingPolicy(policy)
    except ValueError as exc:
        names = ", ".join(p.value for p in RoutingPolicy)
        raise ValueError(f"routing_policy must be one of {names}, got {policy!r}") from exc
    return {
        RoutingPolicy.ROUND_ROBIN: RoundRobinRouter,
        RoutingPolicy.LEAST_LOADED: LeastLoadedRouter,
        RoutingPolicy.KV_AWARE: KVAwareRouter,
    }[policy]()

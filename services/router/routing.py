"""Routing policies: small strategies behind one async interface, chosen by name.

- ``round_robin``: rotate over the healthy instances of the role (one rotation per stage).
- ``least_loaded``: fewest requests (running + waiting, or our own in-flight count if
  larger), then lowest KV usage, then round robin.
- ``kv_aware`` (default): for prefill (and colocated), the instance where this prompt
  costs the least to prefill, judged by two tiers of reuse (:class:`CacheView`): tokens
  the instance most likely holds in its own prefix cache (no transfer) and tokens in the
  KV store (a transfer, cheaper than compute; every instance loads them alike); for
  decode, least loaded. An engine started with ``--kv-events`` publishes its prefix
  cache's changes, and the view of its cache is built from them (``kv_events.py``: what
  the engine really holds, the same on every router replica); for an engine that does not
  publish (or whose view is resyncing) the router guesses: it keeps, per
  instance, the block hashes (``contracts.block_hash.hash_token_blocks``) of the prompts
  it sent there recently, bounded LRU -- the approach of SGLang's cache-aware router and
  vLLM production-stack's prefix-aware routing; the store's part is one batched lookup of
  the store index in Redis per request (``tandem.kvstore.lookup``), so every router
  replica sees the same store. To avoid piling every request that shares a system prompt
  onto one instance, a cheaper instance only wins while its load is within
  ``balance_slack`` requests of the least loaded one.
"""

from __future__ import annotations

import enum
import itertools
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.contracts.block_hash import BlockHash, hash_token_blocks
from tandem.contracts.block_key import BlockKey
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
        cache_salt: the request's ``cache_salt`` (in block 0's hash, as the engines hash).
    """

    stage: Role
    prompt_token_ids: Sequence[int]
    request_id: str = ""
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, repr=False)
    #: (block size, layout fingerprint) -> prompt tokens in the store (one lookup each)
    store_tokens: dict[tuple[int, bytes], int] = field(default_factory=dict, repr=False)
    cache_salt: str | None = None

    def for_stage(self, stage: Role) -> RouteContext:
        """The same prompt for another stage (hashes and store lookups are shared)."""
        return RouteContext(
            stage,
            self.prompt_token_ids,
            self.request_id,
            self._hashes,
            self.store_tokens,
            self.cache_salt,
        )

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hash chain of the prompt's full blocks, salted as the engines salt them
        (computed once per block size)."""
        if block_size not in self._hashes:
            self._hashes[block_size] = hash_token_blocks(
                self.prompt_token_ids, block_size, cache_salt=self.cache_salt
            )
        return self._hashes[block_size]


class Router(ABC):
    """A routing strategy. ``choose`` never blocks on I/O and never mutates instances."""

    @abstractmethod
    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext) -> InstanceInfo:
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

    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext) -> InstanceInfo:
        ordered = sorted(candidates, key=lambda i: i.address)
        return ordered[self._rotation.next(ctx.stage) % len(ordered)]


class LeastLoadedRouter(Router):
    def __init__(self) -> None:
        self._rotation = _Rotation()

    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext) -> InstanceInfo:
        return least_loaded(candidates, self._rotation.next(ctx.stage))


def least_loaded(candidates: Sequence[InstanceInfo], tiebreak: int = 0) -> InstanceInfo:
    """Fewest requests, then lowest KV usage; ties rotate by ``tiebreak``."""
    best = min((i.load, round(i.kv_usage, 2)) for i in candidates)
    ties = sorted(
        (i for i in candidates if (i.load, round(i.kv_usage, 2)) == best), key=lambda i: i.address
    )
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


class EngineCaches(Protocol):
    """The engines' own prefix caches as their KV events tell them:
    ``services.router.kv_events.KVEventsReader``."""

    def matched_blocks(self, topic: str, hashes: Sequence[BlockHash]) -> int | None:
        """Leading ``hashes`` in the cache of the engine publishing on ``topic``; ``None``
        when its view is not synced (the caller then guesses)."""


class StoreIndex(Protocol):
    """The store index as the router reads it: ``tandem.kvstore.lookup.AsyncIndexProbe``."""

    async def leading(self, keys: Sequence[BlockKey]) -> int:
        """Leading ``keys`` held by live store nodes (0 when the index is unreachable)."""


@dataclass(frozen=True)
class CacheEstimate:
    """Where a prompt's KV already is, for one instance, in tokens (full blocks only).

    Attributes:
        local_tokens: believed in the instance's own prefix cache (no transfer).
        store_tokens: in the KV store (loaded by any instance: a transfer).
    """

    local_tokens: int
    store_tokens: int

    @property
    def reused_tokens(self) -> int:
        """Tokens the instance does not compute: the larger of the two tiers (an engine
        loads from the store only beyond its local hit)."""
        return max(self.local_tokens, self.store_tokens)


class CacheView:
    """What the router knows of where prompts' KV lies: each engine's own prefix cache
    (from its KV events where it publishes them, else guessed from what was sent where,
    bounded LRU per instance) and the KV store's index.

    Args:
        store: the store index, ``None`` without one (static discovery, no Redis).
        capacity_blocks: remembered blocks per instance (about its cache size).
        on_lookup: called with each store lookup's duration in seconds (a metric).
        events: the engines' KV-event views (``None``: guess for every instance).

    The store is asked at most once per request and layout (``RouteContext.store_tokens``).
    """

    def __init__(
        self,
        store: StoreIndex | None = None,
        capacity_blocks: int = 65536,
        on_lookup: Callable[[float], None] = lambda seconds: None,
        events: EngineCaches | None = None,
    ) -> None:
        self.store = store
        self.events = events
        self._capacity_blocks = capacity_blocks
        self._hints: dict[str, _PrefixHints] = {}
        self._on_lookup = on_lookup

    def local_tokens(self, info: InstanceInfo, ctx: RouteContext) -> int:
        """Prompt tokens in ``info``'s prefix cache (full blocks): as its KV events say
        where it publishes them and its view is synced, else as guessed."""
        if self.events is not None and info.kv_events_topic:
            n = self.events.matched_blocks(info.kv_events_topic, ctx.block_hashes(info.block_size))
            if n is not None:
                return n * info.block_size
        hints = self._hints.get(info.address)
        if hints is None:
            return 0
        return hints.matched_blocks(ctx.block_hashes(info.block_size)) * info.block_size

    async def store_tokens(self, info: InstanceInfo, ctx: RouteContext) -> int:
        """Prompt tokens whose blocks (of ``info``'s layout) the store holds; 0 without a
        store or before the instance reported its layout."""
        if self.store is None or not info.kv_layout_fingerprint:
            return 0
        key = (info.block_size, info.kv_layout_fingerprint)
        if key not in ctx.store_tokens:
            hashes = ctx.block_hashes(info.block_size)
            start = time.perf_counter()
            n = await self.store.leading([BlockKey(h, info.kv_layout_fingerprint) for h in hashes])
            self._on_lookup(time.perf_counter() - start)
            ctx.store_tokens[key] = n * info.block_size
        return ctx.store_tokens[key]

    async def estimate(self, info: InstanceInfo, ctx: RouteContext) -> CacheEstimate:
        """Both tiers for ``info``; a colocated (``both``) instance has no store."""
        if info.role == Role.BOTH:
            return CacheEstimate(self.local_tokens(info, ctx), 0)
        return CacheEstimate(self.local_tokens(info, ctx), await self.store_tokens(info, ctx))

    def record(self, info: InstanceInfo, ctx: RouteContext) -> None:
        """``info`` now holds the prompt's full blocks in its prefix cache."""
        hints = self._hints.setdefault(info.address, _PrefixHints(self._capacity_blocks))
        hints.add(ctx.block_hashes(info.block_size))


class KVAwareRouter(Router):
    """Cheapest prefill for prefill and colocated; least loaded for decode.

    The cost of a prompt on an instance, in compute-token units:
    ``uncached + store_load_cost * loaded``, where ``loaded`` are the tokens it would load
    from the store beyond its local hit and ``uncached`` the rest of the prompt (the local
    hit is free). Lowest cost wins among the instances within ``balance_slack`` requests of
    the least loaded one; on equal cost, the least loaded (rotating) one.

    Args:
        view: the cache view (shared with the pipeline's disaggregation decision); a
            fresh one without a store when ``None``.
        balance_slack: most extra requests a cheaper instance may have and still win.
        store_load_cost: cost of loading a token relative to computing it (0..1).
    """

    def __init__(
        self, view: CacheView | None = None, balance_slack: int = 8, store_load_cost: float = 0.1
    ) -> None:
        if not 0 <= store_load_cost <= 1:
            raise ValueError(f"store_load_cost must be in [0, 1], got {store_load_cost}")
        self.view = view if view is not None else CacheView()
        self._balance_slack = balance_slack
        self._store_load_cost = store_load_cost
        self._rotation = _Rotation()

    async def _cost(self, info: InstanceInfo, ctx: RouteContext) -> float:
        est = await self.view.estimate(info, ctx)
        num_full = len(ctx.block_hashes(info.block_size)) * info.block_size
        loaded = max(0, est.store_tokens - est.local_tokens)
        return (num_full - est.reused_tokens) + self._store_load_cost * loaded

    async def choose(self, candidates: Sequence[InstanceInfo], ctx: RouteContext) -> InstanceInfo:
        fallback = least_loaded(candidates, self._rotation.next(ctx.stage))
        if ctx.stage == Role.DECODE:
            return fallback
        fallback_cost = await self._cost(fallback, ctx)
        best, best_cost = fallback, fallback_cost
        for info in sorted(candidates, key=lambda i: i.address):
            if info is fallback or info.load > fallback.load + self._balance_slack:
                continue
            cost = await self._cost(info, ctx)
            # among equally cheap instances that beat the fallback, the less loaded one
            if cost < best_cost or (cost == best_cost < fallback_cost and info.load < best.load):
                best, best_cost = info, cost
        return best

    def on_routed(self, info: InstanceInfo, ctx: RouteContext) -> None:
        # A decode instance holds the prompt's blocks afterwards too (loaded or computed):
        # what a local prefill there would reuse.
        self.view.record(info, ctx)

    def matched_blocks(self, address: str, ctx: RouteContext, block_size: int = 16) -> int:
        """Blocks of ``ctx``'s prompt believed cached on ``address`` (for tests/metrics)."""
        info = InstanceInfo(role=ctx.stage, address=address, block_size=block_size)
        return self.view.local_tokens(info, ctx) // block_size


def make_router(policy: RoutingPolicy | str, view: CacheView | None = None) -> Router:
    """Construct the strategy named ``policy`` (``view``: the kv_aware policy's cache view).

    Raises:
        ValueError: unknown policy name.
    """
    try:
        policy = RoutingPolicy(policy)
    except ValueError as exc:
        names = ", ".join(p.value for p in RoutingPolicy)
        raise ValueError(f"routing_policy must be one of {names}, got {policy!r}") from exc
    if policy == RoutingPolicy.KV_AWARE:
        return KVAwareRouter(view)
    return {
        RoutingPolicy.ROUND_ROBIN: RoundRobinRouter,
        RoutingPolicy.LEAST_LOADED: LeastLoadedRouter,
    }[policy]()

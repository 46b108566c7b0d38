"""Where the engine instances are: the Redis registry (heartbeats) or static address lists.

The registry contract (written by the prefill/decode/colocated services): one hash per
instance at ``tandem:instance:<role>:<instance_id>`` with fields ``role`` (prefill | decode |
both), ``address`` (gRPC host:port), ``model``, ``running``, ``waiting``, ``kv_usage``,
``num_free_blocks``, ``updated_at`` and the model's facts (``max_model_len_tokens``,
``vocab_size_tokens``, ``architecture``, ``model_impl``, as GetLoad reports them); TTL 10 s,
refreshed every 2 s. A dead instance's key
expires, so it drops out of routing within 10 s; the router also benches an instance for
:data:`FAILURE_COOLDOWN_S` as soon as a call to it fails, so new requests go to the
survivors at once. When Redis itself restarts empty (its ``run_id`` changes), the instances
that answered their last load poll stay in the view until they register again, for at most
one registry TTL: the registry's loss is not theirs.

:class:`Discovery` refreshes in a background task (never blocking I/O on the request
path); :meth:`Discovery.instances` is a cheap in-memory read.

What the model is (its context length, vocabulary, architecture, implementation) comes
from the instances too (:attr:`Discovery.facts`, :class:`ServedFacts`): the router reads no
limit from the model's files. An instance whose vocabulary differs from its peers' serves
another model under this name and is never routed to (logged as an error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.contracts.role import ROLES, Role
from tandem.services.common.periodic import start_periodic, stop_periodic

logger = logging.getLogger(__name__)

REGISTRY_PREFIX = "tandem:instance:"
#: Seconds an instance is skipped after a failed call (unless it is the only one left).
FAILURE_COOLDOWN_S = 5.0


@dataclass
class InstanceInfo:
    """One engine instance as the router sees it.

    Attributes:
        role: what the instance does (``Role.BOTH``: colocated).
        address: gRPC ``host:port``.
        model: model id the instance serves ("" when unknown).
        running / waiting: requests in its batch / queue (last report).
        kv_usage: fraction of its KV blocks in use, 0..1 (last report).
        num_free_blocks: free KV blocks (last report; -1 unknown).
        prefix_cache_hit_rate: 0..1, from GetLoad; ``None`` unknown.
        block_size: tokens per KV block (from GetLoad; 16 until known).
        kv_layout_fingerprint: the engine's KV layout fingerprint (from GetLoad; empty
            until known): the store keys of its blocks carry it.
        kv_publish_output: it publishes finished requests' prompt + output blocks and
            marks each publish's end (from GetLoad; False until known).
        max_model_len: context length in tokens it serves (GetLoad or registry; 0 unknown).
        vocab_size: token ids of its model (GetLoad or registry; 0 unknown).
        architecture: its model's architecture, e.g. "LlamaForCausalLM" ("" unknown).
        model_impl: the implementation running it, "tandem" or "transformers" ("" unknown).
        kv_events_topic: the topic (instance id) its KV events are published on (registry
            field ``kv_events_topic``; "" when it publishes none).
        updated_at: wall-clock seconds of the last report.
        alive: the last GetLoad answered (``None``: not polled yet).
        inflight: requests this router has in flight on it (fresher than reports).
    """

    role: Role
    address: str
    model: str = ""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = -1
    prefix_cache_hit_rate: float | None = None
    block_size: int = 16
    kv_layout_fingerprint: bytes = b""
    kv_publish_output: bool = False
    max_model_len: int = 0
    vocab_size: int = 0
    architecture: str = ""
    model_impl: str = ""
    kv_events_topic: str = ""
    updated_at: float = 0.0
    alive: bool | None = None
    inflight: int = 0

    @property
    def load(self) -> int:
        """Requests on the instance: the larger of its report and our own count."""
        return max(self.running + self.waiting, self.inflight)


#: The fields an instance reports about its model, copied from GetLoad and the registry.
MODEL_FACT_FIELDS = ("max_model_len", "vocab_size", "architecture", "model_impl")


@dataclass(frozen=True)
class ServedFacts:
    """What the instances serving the model report about it (:meth:`Discovery.reconcile`).

    Attributes:
        max_model_len: the smallest context length in tokens among the live instances
            routed to, ``None`` while none has reported one.
        vocab_size: the vocabulary size (token ids) most instances report; an instance
            reporting another is not routed to. ``None`` while none has reported one.
        architecture: the architectures the instances report, sorted, comma-separated
            ("" while none has reported).
        model_impl: the implementations running them ("tandem", "transformers"), sorted,
            comma-separated: a prefill and a decode instance may run different ones.
    """

    max_model_len: int | None = None
    vocab_size: int | None = None
    architecture: str = ""
    model_impl: str = ""


class Discovery(ABC):
    """Source of instances. Subclasses fill ``self._by_address`` in :meth:`refresh`."""

    def __init__(self) -> None:
        self._by_address: dict[str, InstanceInfo] = {}
        #: what the instances report about the model (:meth:`reconcile`)
        self.facts = ServedFacts()
        # address -> why it is not routed to (another vocabulary than its peers')
        self._refused: dict[str, str] = {}
        self._failed_until: dict[str, float] = {}
        # Requests this router has in flight per address; kept apart from InstanceInfo
        # because a Redis refresh replaces those objects.
        self._inflight: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    @abstractmethod
    async def refresh(self) -> None:
        """Re-read the source (may do I/O). Errors are logged by the caller's loop."""

    def instances(
        self, role: Role, *, exclude: set[str] | frozenset[str] = frozenset()
    ) -> list[InstanceInfo]:
        """Healthy instances of ``role``, without ``exclude`` (addresses already tried).

        Instances benched after a failure are left out unless nothing else is left.
        Never blocks; never raises.
        """
        now = time.monotonic()
        # NOTE: a refused instance is left out even when nothing else is left: it serves
        # another model, so a 503 is the right answer, not its tokens.
        cands = [
            i
            for i in self._by_address.values()
            if i.role == role and i.address not in exclude and i.address not in self._refused
        ]
        for i in cands:
            i.inflight = self._inflight.get(i.address, 0)
        healthy = [
            i
            for i in cands
            if self._failed_until.get(i.address, 0.0) <= now and i.alive is not False
        ]
        return healthy or cands

    def has_live(self, role: Role) -> bool:
        """Some instance of ``role`` answered its last load poll (readiness)."""
        return any(
            i.alive
            for i in self._by_address.values()
            if i.role == role and i.address not in self._refused
        )

    def refused(self, address: str) -> str | None:
        """Why ``address`` is not routed to, ``None`` when it is."""
        return self._refused.get(address)

    def reconcile(self) -> None:
        """Recompute :attr:`facts` from the instances' reports and refuse those whose
        vocabulary differs from the one most report (ties: the one accepted so far, else
        the smallest). Called after every load poll and registry refresh; never raises.

        A refused instance is logged as an error once (and again, at INFO, when it reports
        the accepted vocabulary and is routed to again).
        """
        infos = list(self._by_address.values())
        # NOTE: an instance whose last poll failed does not vote: a dead engine's report
        # must not decide which live one is refused.
        counts = Counter(i.vocab_size for i in infos if i.alive is not False and i.vocab_size)
        accepted = self.facts.vocab_size
        if counts:
            top = max(counts.values())
            tied = sorted(v for v, c in counts.items() if c == top)
            if accepted not in tied:
                accepted = tied[0]
        refused: dict[str, str] = {}
        for i in infos:
            if accepted is not None and i.vocab_size and i.vocab_size != accepted:
                refused[i.address] = (
                    f"its vocabulary has {i.vocab_size} tokens, the other "
                    f"instances' {accepted}: another model"
                )
        for address, why in refused.items():
            if self._refused.get(address) != why:
                logger.error(
                    "not routing to %s: %s (check the model it was started with)", address, why
                )
        for address in self._refused.keys() - refused.keys():
            if address in self._by_address:
                logger.info("%s reports the accepted vocabulary again: routing to it", address)
        self._refused = refused
        serving = [i for i in infos if i.alive is not False and i.address not in refused]
        lens = [i.max_model_len for i in serving if i.max_model_len > 0]
        self.facts = ServedFacts(
            max_model_len=min(lens) if lens else None,
            vocab_size=accepted,
            architecture=",".join(sorted({i.architecture for i in serving if i.architecture})),
            model_impl=",".join(sorted({i.model_impl for i in serving if i.model_impl})),
        )

    def acquire(self, address: str) -> None:
        """Count one more request of ours in flight on ``address``."""
        self._inflight[address] = self._inflight.get(address, 0) + 1

    def release(self, address: str) -> None:
        """Undo :meth:`acquire`."""
        n = self._inflight.get(address, 0) - 1
        if n > 0:
            self._inflight[address] = n
        else:
            self._inflight.pop(address, None)

    def all_instances(self) -> list[InstanceInfo]:
        return list(self._by_address.values())

    def get(self, address: str) -> InstanceInfo | None:
        return self._by_address.get(address)

    def is_down(self, address: str) -> bool:
        """``address`` left the view, failed its last load poll, or is benched after a
        failed call."""
        info = self._by_address.get(address)
        return (
            info is None
            or info.alive is False
            or self._failed_until.get(address, 0.0) > time.monotonic()
        )

    def mark_failed(self, address: str) -> None:
        """Bench ``address`` for :data:`FAILURE_COOLDOWN_S` after a failed call."""
        self._failed_until[address] = time.monotonic() + FAILURE_COOLDOWN_S

    def mark_ok(self, address: str) -> None:
        self._failed_until.pop(address, None)

    async def start(self, interval_s: float = 1.0) -> None:
        """First refresh now, then every ``interval_s`` in a background task (a failed
        refresh keeps the last view: logged, retried next tick)."""
        self._task = await start_periodic(
            self.refresh, interval_s, what="instance discovery refresh", log=logger
        )

    async def stop(self) -> None:
        await stop_periodic(self._task)
        self._task = None


class StaticDiscovery(Discovery):
    """Fixed address lists (``--prefill``, ``--decode``, ``--colocated``).

    Load fields are filled by the router's load poller (GetLoad), not here.
    """

    def __init__(
        self, *, prefill: Sequence[str] = (), decode: Sequence[str] = (), both: Sequence[str] = ()
    ) -> None:
        super().__init__()
        for role, addrs in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.BOTH, both)):
            for addr in addrs:
                if addr in self._by_address:
                    raise ValueError(f"--{role}: address {addr} listed twice")
                self._by_address[addr] = InstanceInfo(role=role, address=addr)

    async def refresh(self) -> None:
        return None


class RedisDiscovery(Discovery):
    """Instances from the Redis registry (``tandem:instance:<role>:<id>`` hashes).

    A registry that restarts empty (or fails over to a server without the keys) is told
    apart from deregistrations by Redis's ``run_id``: when it changes between refreshes,
    the instances that left the view with it but answered their last load poll
    (``alive is True``) are kept until they register again, their poll fails, or one
    registry TTL (``services.common.registry.TTL_S``) passes from the refresh that saw the
    change. A key deleted while Redis stays up drops its instance at once, alive or not
    (a draining engine still answers GetLoad). Where Redis does not report a ``run_id``,
    nothing is kept.

    Args:
        redis_url: ``redis://host:port/db``.
        model: when set, instances registered for another model are ignored (an
            instance with an empty ``model`` field is accepted).
        clock: monotonic seconds, for the restart grace (tests pass a fake one).
    """

    def __init__(
        self,
        redis_url: str,
        model: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        # imported here: static mode needs no Redis client
        import redis.asyncio as aioredis

        from tandem.services.common.registry import TTL_S

        self._redis = aioredis.from_url(redis_url, decode_responses=True)
        self._model = model
        self._clock = clock
        # An instance alive through the restart re-registers within one heartbeat; one
        # whose entry would have expired by now without a heartbeat is kept no longer.
        self._restart_grace_s = float(TTL_S)
        self._run_id: str | None = None
        self._run_id_unknown_logged = False
        # address -> clock time until which an instance missing after a restart is kept
        self._kept_until: dict[str, float] = {}

    async def refresh(self) -> None:
        """Re-read the registry and replace the view; keeps instances across a registry
        restart as the class docstring says.

        Raises:
            redis.RedisError: Redis unreachable or a registry key of the wrong type (the
                view is left as it was).
        """
        keys = [k async for k in self._redis.scan_iter(match=REGISTRY_PREFIX + "*", count=500)]
        seen: dict[str, InstanceInfo] = {}
        if keys:
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            for key, fields in zip(keys, await pipe.execute(), strict=True):
                info = _parse_entry(key, fields)
                if info is None:
                    continue
                if self._model and info.model and info.model != self._model:
                    continue
                old = self._by_address.get(info.address)
                if old is not None:  # keep the fields only GetLoad reports
                    info.alive = old.alive
                    info.prefix_cache_hit_rate = old.prefix_cache_hit_rate
                    info.block_size = old.block_size
                    info.kv_layout_fingerprint = old.kv_layout_fingerprint
                    info.kv_publish_output = old.kv_publish_output
                    # an entry without the facts (an older engine, or a first heartbeat
                    # whose load report was late) keeps what GetLoad said
                    for name in MODEL_FACT_FIELDS:
                        if not getattr(info, name):
                            setattr(info, name, getattr(old, name))
                seen[info.address] = info
        # NOTE: asked after the reads: a restart before or during them shows here, in this
        # refresh, rather than in the next one (whose reads would look like deregistrations).
        run_id = await self._read_run_id()
        if run_id is not None and self._run_id is not None and run_id != self._run_id:
            self._keep_through_restart(seen)
        self._run_id = run_id
        now = self._clock()
        for address, until in list(self._kept_until.items()):
            kept = self._by_address.get(address)
            if address in seen or kept is None or kept.alive is not True or until <= now:
                del self._kept_until[address]
            else:
                seen[address] = kept
        # NOTE: replace the dict wholesale (not in place) so readers never see a half update.
        self._by_address = seen
        self.reconcile()

    def _keep_through_restart(self, seen: dict[str, InstanceInfo]) -> None:
        """Start the grace of the live instances missing from ``seen`` after a restart
        (one already kept keeps its first deadline)."""
        until = self._clock() + self._restart_grace_s
        num_kept = 0
        for address, info in self._by_address.items():
            if address not in seen and info.alive is True:
                self._kept_until.setdefault(address, until)
                num_kept += 1
        logger.warning(
            "the instance registry restarted (Redis run_id changed, its entries "
            "lost): keeping %d live instance(s) for up to %.0f s until they "
            "register again",
            num_kept,
            self._restart_grace_s,
        )

    async def _read_run_id(self) -> str | None:
        """Redis's ``run_id`` (new on every server start), or ``None`` where the server
        does not report one (INFO refused, or a Redis-like server without the field)."""
        from redis.exceptions import ResponseError

        try:
            server = await self._redis.info("server")
        except ResponseError as exc:
            # NOTE: not fatal: without it a registry restart empties the view until the
            # engines' next heartbeats, as it did before restarts were detected.
            if not self._run_id_unknown_logged:
                logger.warning(
                    "Redis refuses INFO server (%s): a registry restart will "
                    "drop every instance until it registers again",
                    exc,
                )
                self._run_id_unknown_logged = True
            return None
        run_id = server.get("run_id")
        return str(run_id) if run_id else None

    async def stop(self) -> None:
        await super().stop()
        await self._redis.aclose()


def _parse_entry(key: str, fields: dict[str, str]) -> InstanceInfo | None:
    role = fields.get("role") or key[len(REGISTRY_PREFIX) :].split(":", 1)[0]
    address = fields.get("address")
    if role not in ROLES or not address:
        logger.warning("ignoring malformed registry entry %s", key)
        return None
    try:
        return InstanceInfo(
            role=Role(role),
            address=address,
            model=fields.get("model", ""),
            running=int(float(fields.get("running", 0))),
            waiting=int(float(fields.get("waiting", 0))),
            kv_usage=float(fields.get("kv_usage", 0.0)),
            num_free_blocks=int(float(fields.get("num_free_blocks", -1))),
            max_model_len=int(float(fields.get("max_model_len_tokens", 0))),
            vocab_size=int(float(fields.get("vocab_size_tokens", 0))),
            architecture=fields.get("architecture", ""),
            model_impl=fields.get("model_impl", ""),
            kv_events_topic=fields.get("kv_events_topic", ""),
            updated_at=float(fields.get("updated_at", 0.0)),
        )
    except ValueError:
        logger.warning("ignoring registry entry %s with non-numeric fields", key)
        return None

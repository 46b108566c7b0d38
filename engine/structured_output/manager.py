"""The structured-output manager: compile off the step loop, fill one bitmask per step.

vLLM v1's shape: the engine core owns one ``StructuredOutputManager``; the scheduler
hands it each constrained request when it arrives (the request waits in
``WAITING_FOR_GRAMMAR`` while its grammar compiles on the manager's thread pool, and other
requests keep running), asks it every step whether the grammar is ready, and asks it for
the step's token bitmask; after each sampled token it advances the request's matcher.

A request whose ``StructuredOutputsParams.after_token_id`` is set (a reasoning model's
end-of-thinking token) is free until that token is generated: no bitmask row and no
matcher advance up to and including it, the grammar from the token after it (vLLM's
structured output manager gates the grammar on ``reasoning_parser.is_reasoning_end``).
Whether it was generated is derived from the output tokens whenever the matcher is made
(:meth:`StructuredOutputManager.poll`), so a decode instance continuing a request
reaches the same state; a preempted request keeps its output tokens and its matcher.

Compiled grammars are cached by ``StructuredOutputsParams.cache_key()`` (kind, spec,
whitespace flag) in a bounded LRU, and concurrent compiles of one key share one future,
so in steady state (the decode instance compiling what the prefill instance compiled
for the same request, or many requests with one schema) a compile is a dictionary hit.

Thread-safety: :meth:`compile_async` and :meth:`validate` may be called from any thread
(the services validate a request off the engine thread); the per-request methods
(:meth:`add_request`, :meth:`poll`, :meth:`grammar_bitmask`, :meth:`accept`,
:meth:`free`) belong to the engine thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.request import Request
from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.engine.validation import GrammarCompilerBusyError, RequestError

if TYPE_CHECKING:
    import torch

    # NOTE: only for types: the backend imports xgrammar, which an engine that never
    # sees a constrained request need not load (the factory imports it on first use).
    from tandem.engine.structured_output.backend import (
        CompiledGrammar,
        GrammarMatcher,
        XgrammarBackend,
    )

logger = logging.getLogger(__name__)

CacheKey = tuple[str, str, bool]


@dataclass
class GrammarState:
    """One constrained request's grammar (``Request.structured_output``).

    Attributes:
        params: the request's constraint.
        future: the compile in flight or done (``None`` once the matcher exists); it
            always resolves: a compile is killed past the manager's time limit.
        matcher: the request's matcher once the grammar is ready; it has accepted every
            output token of the request after the grammar began (``started``).
        started: the grammar applies: ``params.after_token_id`` is unset or was generated.
    """

    params: StructuredOutputsParams
    future: concurrent.futures.Future[CompiledGrammar] | None
    matcher: GrammarMatcher | None = None
    started: bool = True


@dataclass
class ManagerStats:
    """Cumulative counters (tests and logs).

    Attributes:
        num_compiles: grammars compiled (cache misses that ran the compiler).
        num_cache_hits: lookups served from the cache or from a compile in flight.
        num_busy: compiles refused because too many were queued or they waited too long.
        compile_s: seconds spent compiling, summed over compiles.
    """

    num_compiles: int = 0
    num_cache_hits: int = 0
    num_busy: int = 0
    compile_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class StepBitmask:
    """The token bitmask of one step.

    Attributes:
        bitmask: ``int32 [num_rows, ceil(vocab / 32)]`` (xgrammar's layout: bit ``j % 32``
            of word ``j // 32`` is 1 when token ``j`` is allowed).
        rows: request id -> its row, for the constrained requests sampled this step.
        spec_rows: request id -> its row at each verified position (``k + 1`` rows for
            ``k`` draft tokens), for the constrained requests with draft tokens this
            step (speculative decoding); such a request is not in ``rows``.
    """

    bitmask: torch.Tensor
    rows: dict[str, int]
    spec_rows: dict[str, list[int]] = field(default_factory=dict)


class StructuredOutputManager:
    """Compiles, caches and matches the grammars of constrained requests.

    Args:
        backend_factory: builds the compiler backend on first use (the tokenizer's
            vocabulary is read then, not at engine start).
        max_workers: compiles that run at once (as many as the backend's worker
            processes, ``backend.DEFAULT_COMPILE_WORKERS``).
        max_cache_entries: compiled grammars kept (least recently used evicted).
        compile_timeout_s: a compile that runs longer fails its requests with a
            ``RequestError`` (a 400) and is killed (``XgrammarBackend.compile``), so a
            pathological schema or regex costs this much compile time and no more.
        max_queue_wait_s: a compile that waited longer than this for a free worker fails
            with ``GrammarCompilerBusyError`` (a 503 through the services), as does one
            submitted while ``max_pending`` distinct compiles are queued or running.
            Defaults to ``compile_timeout_s``.
        max_pending: bound on distinct compiles queued or running.
        clock: ``time.monotonic`` (tests pass their own to age a queued compile).
    """

    def __init__(
        self,
        backend_factory: Callable[[], XgrammarBackend],
        *,
        max_workers: int = 4,
        max_cache_entries: int = 256,
        compile_timeout_s: float = 10.0,
        max_queue_wait_s: float | None = None,
        max_pending: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_cache_entries < 1:
            raise ValueError(f"max_cache_entries must be >= 1, got {max_cache_entries}")
        if not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self._backend_factory = backend_factory
        self._backend: XgrammarBackend | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="grammar-compile"
        )
        self.max_cache_entries = max_cache_entries
        self.compile_timeout_s = compile_timeout_s
        self.max_queue_wait_s = compile_timeout_s if max_queue_wait_s is None else max_queue_wait_s
        self.max_pending = max_pending
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[CacheKey, CompiledGrammar] = collections.OrderedDict()
        self._inflight: dict[CacheKey, concurrent.futures.Future[CompiledGrammar]] = {}
        self.stats = ManagerStats()

    # -- compiling (any thread) ----------------------------------------------------------------

    @property
    def backend(self) -> XgrammarBackend:
        """The compiler backend (built on first use; thread-safe)."""
        with self._lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def compile_async(
        self, params: StructuredOutputsParams
    ) -> concurrent.futures.Future[CompiledGrammar]:
        """The compiled grammar of ``params``, as a future: already resolved on a cache hit,
        shared with a compile of the same key in flight, else a new job on the pool.
        The future's exception is a ``RequestError`` naming the field."""
        key = params.cache_key()
        backend = self.backend
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                done: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
                done.set_result(hit)
                return done
            running = self._inflight.get(key)
            if running is not None:
                self.stats.num_cache_hits += 1
                return running
            if len(self._inflight) >= self.max_pending:
                self.stats.num_busy += 1
                busy: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
                busy.set_exception(_busy_error(params, f"{self.max_pending} compiles are queued"))
                return busy
            future = self._pool.submit(self._compile, backend, params, key, self._clock())
            self._inflight[key] = future
            return future

    def _compile(
        self,
        backend: XgrammarBackend,
        params: StructuredOutputsParams,
        key: CacheKey,
        submitted: float,
    ) -> CompiledGrammar:
        start = self._clock()
        try:
            if start - submitted > self.max_queue_wait_s:
                with self._lock:
                    self.stats.num_busy += 1
                raise _busy_error(params, f"it waited {start - submitted:.1f} s for a worker")
            compiled = backend.compile(params, self.compile_timeout_s)
        finally:
            with self._lock:
                self._inflight.pop(key, None)
        elapsed = self._clock() - start
        with self._lock:
            self.stats.num_compiles += 1
            self.stats.compile_s.append(elapsed)
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        logger.debug("compiled %s grammar in %.1f ms", params.kind, elapsed * 1e3)
        return compiled

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` (or find it cached) and wait; blocks the caller only, for at
        most about ``max_queue_wait_s + compile_timeout_s``.

        Raises:
            RequestError: naming ``params.field``: the library rejected the constraint,
                or compiling took longer than ``compile_timeout_s``.
            GrammarCompilerBusyError: too many compiles queued.
        """
        self.compile_async(params).result()

    def cached(self, params: StructuredOutputsParams) -> bool:
        """Whether the grammar of ``params`` is in the cache."""
        with self._lock:
            return params.cache_key() in self._cache

    # -- requests (engine thread) --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar; sets ``request.structured_output``."""
        params = request.sampling_params.structured_outputs
        assert params is not None, f"{request.request_id} has no structured_outputs"
        request.structured_output = GrammarState(
            params=params,
            future=self.compile_async(params),
            started=params.after_token_id is None,
        )

    def poll(self, request: Request) -> bool | RequestError:
        """Whether the request's grammar is ready; makes its matcher when it just became so.

        A new matcher first accepts the request's output tokens so far (on a decode
        instance: the first token that the prefill instance sampled under the same
        grammar), so it continues where the request is; with ``after_token_id``, only
        those after that token's first occurrence.

        Returns:
            ``True`` ready, ``False`` still compiling, or the ``RequestError`` that fails
            the request: the grammar did not compile (xgrammar's message), the compile
            timed out or found the compiler busy, or an output token so far is not
            allowed by the grammar.
        """
        state = request.structured_output
        assert state is not None, f"{request.request_id} is not constrained"
        if state.matcher is not None:
            return True
        future = state.future
        assert future is not None, "a state without matcher has a compile future"
        if not future.done():
            return False
        exc = future.exception()
        if exc is not None:
            if isinstance(exc, RequestError):
                return exc
            return RequestError(state.params.field, f"{state.params.field}: {exc}")
        matcher = future.result().new_matcher()
        after = state.params.after_token_id
        started = after is None
        for i, token in enumerate(request.output_token_ids):
            if not started:
                started = token == after
                continue
            if not matcher.accept_token(token):
                name = "first_token_id" if i == 0 else "output_token_ids"
                return RequestError(
                    name,
                    f"{name}: token {token} (output position {i}) is not allowed by the "
                    f"request's {state.params.kind} grammar",
                )
        state.matcher = matcher
        state.started = started
        state.future = None
        return True

    def grammar_bitmask(
        self,
        requests: Sequence[Request],
        spec_token_ids: Mapping[str, list[int]] | None = None,
    ) -> StepBitmask | None:
        """The bitmask for the constrained ones among ``requests`` (those sampled this
        step, in any order), or ``None`` when none is constrained.

        A request with draft tokens (``spec_token_ids``) gets one row per verified
        position: its matcher advances through the drafts to fill each row, then rolls
        back (the scheduler advances it by the tokens really emitted). After a draft
        token the grammar rejects, the rows are all-allowed: that token's own row
        forbids it, so no later position is ever accepted.

        A matcher that is already terminated gets an all-allowed row; the request
        finishes after this step anyway (it cannot be sampled again).

        A request whose grammar has not started (``after_token_id`` not yet generated)
        gets no row, unless a draft is that token: its positions up to the draft are
        all-allowed rows, the grammar's from the position after it.
        """
        spec = spec_token_ids or {}
        first: dict[str, int] = {}  # request id -> its first position under the grammar
        constrained = []
        for r in requests:
            state = r.structured_output
            if state is None or state.matcher is None:
                continue
            start = _grammar_start(state, spec.get(r.request_id) or [])
            if start is not None:
                first[r.request_id] = start
                constrained.append(r)
        if not constrained:
            return None
        num_rows = sum(len(spec.get(r.request_id, ())) + 1 for r in constrained)
        bitmask = self.backend.allocate_bitmask(num_rows)
        rows: dict[str, int] = {}
        spec_rows: dict[str, list[int]] = {}
        row = 0
        for req in constrained:
            state = req.structured_output
            assert state is not None and state.matcher is not None
            drafts = spec.get(req.request_id)
            if not drafts:
                # (no drafts: ``first`` is 0, the grammar has started)
                if not state.matcher.is_terminated():
                    state.matcher.fill_bitmask(bitmask, row)
                rows[req.request_id] = row
                row += 1
                continue
            own = list(range(row, row + len(drafts) + 1))
            row += len(drafts) + 1
            spec_rows[req.request_id] = own
            num_advanced = 0
            for j in range(first[req.request_id], len(own)):
                if state.matcher.is_terminated():
                    break
                state.matcher.fill_bitmask(bitmask, own[j])
                if j == len(drafts) or not state.matcher.accept_token(drafts[j]):
                    break
                num_advanced += 1
            state.matcher.rollback(num_advanced)
        return StepBitmask(bitmask, rows, spec_rows)

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance the request's matcher by its newly sampled token; before the grammar
        starts, only note whether ``token_id`` is ``after_token_id`` (which starts it).

        Returns:
            ``False`` when the grammar rejects the token (the caller fails the request).
        """
        state = request.structured_output
        assert state is not None and state.matcher is not None, (
            f"{request.request_id}: a token was sampled before its grammar was ready"
        )
        if not state.started:
            state.started = token_id == state.params.after_token_id
            return True
        return state.matcher.accept_token(token_id)

    @staticmethod
    def is_terminated(request: Request) -> bool:
        """Whether the request's grammar is complete (its stop token accepted)."""
        state = request.structured_output
        return (state is not None and state.started and state.matcher is not None
                and state.matcher.is_terminated())

    def free(self, request: Request) -> None:
        """Drop the request's grammar state (finished or aborted, in any status).

        NOTE: a compile still running is not cancelled: its future may be shared with
        other requests of the same key, and its result is worth caching anyway.
        """
        request.structured_output = None

    def shutdown(self) -> None:
        """Stop the compile threads (queued compiles are cancelled) and the backend's
        compile processes."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            backend = self._backend
        if backend is not None:
            backend.shutdown()


def _grammar_start(state: GrammarState, drafts: list[int]) -> int | None:
    """The first of a step's positions (0: the token after the output so far; ``j``: the
    one after draft ``j - 1``) that the grammar constrains, ``None`` when none does."""
    if state.started:
        return 0
    after = state.params.after_token_id
    if after in drafts:
        return drafts.index(after) + 1
    return None


def _busy_error(params: StructuredOutputsParams, why: str) -> GrammarCompilerBusyError:
    return GrammarCompilerBusyError(
        params.field,
        f"{params.field}: the grammar compiler is busy ({why}); retry later",
    )

"""One completion's state at the router: the request, its deltas, text, counts, timings.

``SeqState`` feeds engine tokens through ``engine.detokenizer.IncrementalDetokenizer``
(incremental, UTF-8 safe, stop strings with holdback), enforces ``max_tokens``, and
observes the per-token metrics (TTFT, inter-token latency, end-to-end latency).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context

from tandem.contracts.proto import finish_reason_from_proto
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import SamplingParams
from tandem.services.router.metrics import RouterMetrics
from tandem.v1 import common_pb2


@dataclass
class GenerationRequest:
    """A tokenized request as the pipeline takes it.

    Attributes:
        request_id: id used for every RPC (``-<i>`` appended per completion when n > 1).
        prompt_token_ids: templated prompt, token ids.
        sampling_params: validated; ``stop`` strings are handled here, not by engines.
        priority: engine scheduling priority (lower first).
        cache_salt: the client's ``cache_salt``, sent to the engines (mixed into the
            first block's hash); ``None``: unsalted.
        arrival_ns: ``time.monotonic_ns()`` when the router received it.
        param_of_field: engine field -> the API field the client used for it (e.g.
            ``"structured_outputs.json"`` -> ``"response_format.json_schema.schema"``),
            to name it in the errors engines report.
        trace_parent: the client's trace context (its W3C ``traceparent``) when the
            router traces (``contracts/tracing.py``), else ``None``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    param_of_field: dict[str, str] = field(default_factory=dict)
    cache_salt: str | None = None
    trace_parent: Context | None = None


@dataclass
class Timings:
    """Where one completion's time went, in ns (``None``: not on this path).

    ``ttft_ns`` = router_queue + prefill (queue + compute) + RPC overhead in the
    disaggregated path: the first token comes from prefill, which answers before its KV
    publish ends (``kv_publish_ns`` is then 0; it counts only a publish that ended before
    the answer). ``kv_pull_ns`` (any wait for blocks still being published included) and
    ``first_decode_ns`` (Decode call to its first token, KV pull included) follow it.
    """

    router_queue_ns: int | None = None
    prefill_queue_ns: int | None = None
    prefill_compute_ns: int | None = None
    kv_publish_ns: int | None = None
    kv_pull_ns: int | None = None
    decode_queue_ns: int | None = None
    first_decode_ns: int | None = None
    ttft_ns: int | None = None
    e2e_ns: int | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    #: disaggregated mode: "remote_prefill" (a prefill instance) or "local_prefill" (the
    #: decode instance prefills itself), and why
    disagg_decision: str | None = None
    disagg_reason: str | None = None
    #: prompt tokens the engine that prefilled did not compute (its prefix cache, the store)
    cached_tokens: int | None = None
    #: times the completion moved to another instance mid-stream (``decode_instance`` is
    #: the last one)
    num_migrations: int | None = None
    #: tokens the decode streams delivered (colocated: the first one too). Where each
    #: token's time went (engine step, hand-off, gRPC hop, detokenization) is not
    #: measured here: the request's trace carries it (``--otlp-traces-endpoint``,
    #: ``request_trace.py``).
    decode_tokens: int | None = None
    #: first token -> last token at the router (vLLM's request decode time)
    decode_ns: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class SeqDelta:
    """New output of completion ``index``.

    Attributes:
        text: text since the previous delta (stop-string holdback applied).
        token_ids: tokens since the previous delta.
        logprobs: per token, its ``TopLogprobs`` (when requested), else ``None``.
        finish_reason: "stop" | "length" on the last delta, else ``None``.
        stop_reason: matched stop string or stop token id.
        num_cached_tokens: prompt tokens served from a cache (first delta).
        prompt_logprobs: first delta only, with ``SamplingParams.prompt_logprobs``: one
            ``TopLogprobs`` per prompt token from the second on (``sampled``: that token).
        timings: on the last delta.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TopLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[common_pb2.TopLogprobs] | None = None
    timings: Timings | None = None


class EngineAbort(Exception):
    """The engine aborted the request (e.g. it is shutting down)."""


class SeqState:
    """Text, counts and metrics of one completion.

    Args:
        tokenizer: HF tokenizer (detokenization).
        metrics: the router's series (TTFT, ITL, E2E, generation tokens, finish reasons).
        index: the completion's index among the request's ``n``.
        req: the request (arrival time, prompt ids).
        sp: this completion's sampling parameters (stop strings, ``max_tokens``).
        timings: filled in by the pipeline; attached to the last delta.
    """

    def __init__(self, tokenizer: Any, metrics: RouterMetrics, index: int,
                 req: GenerationRequest, sp: SamplingParams, timings: Timings) -> None:
        self._metrics = metrics
        self.index = index
        self.req = req
        self.sp = sp
        self.timings = timings
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, sp)
        self.finished = False
        #: every token passed on so far (what a migrated request resumes from)
        self.output_token_ids: list[int] = []
        self.num_cached_tokens = 0
        #: the prompt's logprobs, from the engine that computed the prompt (set by the
        #: pipeline before the first ``add``); they go out on the first delta
        self.prompt_logprobs: list[common_pb2.TopLogprobs] | None = None
        self._last_token_ns: int | None = None
        self._sent_first = False

    @property
    def num_tokens(self) -> int:
        """Output tokens passed on so far."""
        return len(self.output_token_ids)

    def add(self, token_ids: list[int], logprobs: list[common_pb2.TopLogprobs] | None,
            finish: int, stop_token_id: int | None) -> SeqDelta | None:
        """Feed engine tokens; returns the delta to send (``None``: nothing to send yet).

        Raises:
            EngineAbort: the engine aborted the request.
        """
        if finish == common_pb2.FINISH_REASON_ABORT:
            raise EngineAbort("the engine aborted the request")
        max_tokens = self.sp.max_tokens
        if max_tokens is not None and self.num_tokens + len(token_ids) > max_tokens:
            # NOTE: never pass more than max_tokens on, even if an engine overshoots.
            token_ids = token_ids[: max_tokens - self.num_tokens]
            logprobs = logprobs[: len(token_ids)] if logprobs else logprobs
            finish = common_pb2.FINISH_REASON_LENGTH
        now = time.monotonic_ns()
        self._observe_tokens(len(token_ids), now)
        self.output_token_ids.extend(token_ids)
        reason = finish_reason_from_proto(finish)
        stop_reason: int | str | None = stop_token_id
        matched = self.detok.update(token_ids, stop_terminated=reason == "stop")
        if matched is not None:
            reason, stop_reason = "stop", matched
        finished = reason is not None
        text = self.detok.get_next_output_text(finished=finished, delta=True)
        delta = SeqDelta(self.index, text, list(token_ids), logprobs,
                         num_cached_tokens=self.num_cached_tokens if not self._sent_first else 0,
                         prompt_logprobs=None if self._sent_first else self.prompt_logprobs)
        self._sent_first = True
        if finished:
            self.finished = True
            delta.finish_reason, delta.stop_reason = reason, stop_reason
            self.timings.e2e_ns = now - self.req.arrival_ns
            if self.timings.ttft_ns is not None:
                self.timings.decode_ns = self.timings.e2e_ns - self.timings.ttft_ns
            delta.timings = self.timings
            m = self._metrics
            m.labels(m.e2e).observe(self.timings.e2e_ns / 1e9)
            m.request_success.labels(model_name=m.model_name, finished_reason=reason).inc()
        return delta

    def _observe_tokens(self, num: int, now_ns: int) -> None:
        m = self._metrics
        if num == 0:
            return
        if self._last_token_ns is None:
            self.timings.ttft_ns = now_ns - self.req.arrival_ns
            m.observe_ttft(self.timings.ttft_ns / 1e9)
        else:
            m.observe_itl((now_ns - self._last_token_ns) / 1e9 / num)
        self._last_token_ns = now_ns
        m.labels(m.generation_tokens).inc(num)

"""Text-level engine: prompts in, incremental ``RequestOutput``s out.

Wraps an ``EngineCore`` (token ids only) with what a user of text needs:
tokenization, ``n > 1`` fan-out into child requests, incremental detokenization,
stop strings (the core knows only stop token ids; a matched string finishes the
child in the scheduler with ``FINISHED_STOPPED``), logprob token texts, abort.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.engine.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.fan_out import fan_out
from tandem.engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from tandem.engine.request import PositionLogprobs, Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.model_loader import LoadedModel

PromptType = str | Sequence[int]


class OutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything so far, at every step
    DELTA = "delta"  # only what is new since the previous output (streaming)
    FINAL_ONLY = "final"  # one output, when the request finished


class _Child:
    """One of a request's ``n`` completions."""

    __slots__ = (
        "index",
        "request",
        "detok",
        "logprobs",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
        "num_sent_tokens",
    )

    def __init__(self, index: int, request: Request, detok: IncrementalDetokenizer) -> None:
        self.index = index
        self.request = request
        self.detok = detok
        want = request.sampling_params.logprobs is not None
        self.logprobs: list[PositionLogprobs] | None = [] if want else None
        self.cumulative_logprob: float | None = 0.0 if want else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_sent_tokens = 0


class _Parent:
    """A user request and its children."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "children", "kind",
                 "prompt_logprobs")

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], kind: OutputKind
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children: list[_Child] = []
        self.kind = kind
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class LLMEngine:
    """Drives an ``EngineCore`` with text prompts.

    Args:
        config: engine configuration (used when ``engine_core`` is ``None``).
        loaded: an already loaded model (``model_loader.load_model``) for the executor to
            wrap instead of loading ``config.model`` (see ``executor.create_executor``).
        engine_core: an existing core to wrap instead of building one.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        engine_core: EngineCore | None = None,
    ) -> None:
        if engine_core is None:
            config = config or EngineConfig()
            engine_core = EngineCore(config, create_executor(config, loaded))
        self.engine_core = engine_core
        self.tokenizer = self.engine_core.tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        # Parents touched outside step() (aborts) whose output is due next step.
        self._pending: dict[str, _Parent] = {}
        self._ids = itertools.count()
        # first child id -> siblings waiting for its prompt to be cached (n > 1).
        self._deferred: dict[str, list[Request]] = {}

    # -- adding and aborting -------------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens); ids pass through.

        Raises:
            ValueError: ``prompt`` is neither a string nor a sequence of ints, or is
                text for a model without a tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt must be a string or a list of int token ids")
        return ids

    def make_requests(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> tuple[_Parent, list[Request]]:
        """Build (and validate) the child requests of one prompt; allocate nothing.

        Children come from ``engine.fan_out.fan_out``: seeds ``seed + i`` (their samples
        differ but stay reproducible), ids ``request_id`` for ``n == 1`` and
        ``f"{request_id}-{i}"`` otherwise.

        Raises:
            ValueError: naming the field (see ``EngineCore.validate_request``), or
                ``request_id`` already in use.
        """
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if params.structured_outputs is not None:
            self.engine_core.check_structured_outputs(params.structured_outputs)
        parent = _Parent(request_id, prompt if isinstance(prompt, str) else None, ids, kind)
        requests = []
        for child in fan_out(request_id, params):
            req = Request(
                request_id=child.request_id,
                prompt_token_ids=ids,
                sampling_params=child.sampling_params,
                eos_token_id=self.engine_core.eos_token_id,
                priority=priority,
            )
            self.engine_core.validate_request(req)
            detok = IncrementalDetokenizer(self.tokenizer, ids, child.sampling_params)
            parent.children.append(_Child(child.index, req, detok))
            requests.append(req)
        return parent, requests

    def add_parent(self, parent: _Parent, requests: list[Request]) -> None:
        """Queue requests built by ``make_requests``.

        With ``n > 1`` and prefix caching on, children 1..n-1 are queued once child 0
        has computed the prompt, so they find its full blocks in the prefix cache and
        share them instead of computing the prompt n times.
        """
        self._parents[parent.request_id] = parent
        for child, req in zip(parent.children, requests, strict=True):
            self._child_to_parent[req.request_id] = (parent, child)
        share = len(requests) > 1 and self.engine_core.config.cache.enable_prefix_caching
        self.engine_core.add_request(requests[0])
        if share:
            self._deferred[requests[0].request_id] = requests[1:]
        else:
            for req in requests[1:]:
                self.engine_core.add_request(req)

    def _release_deferred(self, first_child_id: str) -> None:
        for req in self._deferred.pop(first_child_id, []):
            _, child = self._child_to_parent[req.request_id]
            if child.finish_reason is None:  # not aborted meanwhile
                self.engine_core.add_request(req)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Tokenize, validate and queue a request (``n`` completions).

        Raises:
            ValueError: naming the field; nothing is queued then.
        """
        parent, requests = self.make_requests(request_id, prompt, params, priority, kind)
        self.add_parent(parent, requests)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (by the ids given to ``add_request``); unknown ids are ignored.

        Their final outputs (finish reason "abort") come with the next ``step()``.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            for child in parent.children:
                if child.finish_reason is None:
                    child.finish_reason = "abort"
                    child_ids.append(child.request.request_id)
            self._deferred.pop(parent.children[0].request.request_id, None)
            self._pending[rid] = parent
        self.engine_core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or self.engine_core.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of requests that progressed."""
        touched: dict[str, _Parent] = self._pending
        self._pending = {}
        core_outputs = self.engine_core.step() if self.engine_core.has_unfinished_requests() else []
        stopped: list[str] = []
        for out in core_outputs:
            entry = self._child_to_parent.get(out.request_id)
            if entry is None:
                continue
            parent, child = entry
            if out.request_id in self._deferred:
                self._release_deferred(out.request_id)
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = _decoded(out.prompt_logprobs, child)
            if child.finish_reason is not None:
                continue  # aborted or stopped by a string before this output arrived
            if self._process(child, out):
                stopped.append(out.request_id)
            touched[parent.request_id] = parent
        if stopped:
            self.engine_core.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        results = []
        for parent in touched.values():
            output = self._make_output(parent)
            if output is not None:
                results.append(output)
            if parent.finished:
                self._parents.pop(parent.request_id, None)
                for child in parent.children:
                    self._child_to_parent.pop(child.request.request_id, None)
        return results

    def _process(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Detokenize a core output into ``child``; True when a stop string ended it early."""
        stop_terminated = out.finish_reason == "stop"
        matched = child.detok.update(out.new_token_ids, stop_terminated)
        if out.new_logprobs and child.logprobs is not None:
            for pos, tok in zip(out.new_logprobs, out.new_token_ids, strict=True):
                for tid, lp in pos.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = child.detok.decode_token(tid)
                child.logprobs.append(pos)
                assert child.cumulative_logprob is not None, "set together with logprobs"
                child.cumulative_logprob += pos[tok].logprob
        if matched is not None:
            child.finish_reason = "stop"
            child.stop_reason = matched
            return not out.finished
        if out.finished:
            child.finish_reason = out.finish_reason
            child.stop_reason = out.stop_reason
        return False

    def _make_output(self, parent: _Parent) -> RequestOutput | None:
        finished = parent.finished
        if parent.kind is OutputKind.FINAL_ONLY and not finished:
            return None
        delta = parent.kind is OutputKind.DELTA
        completions = []
        for child in parent.children:
            done = child.finish_reason is not None
            text = child.detok.get_next_output_text(finished=done, delta=delta)
            ids = child.detok.token_ids
            start = child.num_sent_tokens if delta else 0
            child.num_sent_tokens = len(ids)
            logprobs = child.logprobs[start:] if child.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=list(ids[start:]),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=parent.prompt_logprobs,
        )


def _decoded(entries: list[PositionLogprobs | None], child: _Child
             ) -> list[PositionLogprobs | None]:
    """Prompt logprobs with each ``Logprob.decoded_token`` filled in (the token's text
    on its own, as for generated tokens)."""
    for pos in entries:
        for tid, lp in (pos or {}).items():
            if lp.decoded_token is None:
                lp.decoded_token = child.detok.decode_token(tid)
    return entries

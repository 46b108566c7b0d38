"""Per-request sampling parameters, with vLLM's names and defaults.

Validated once at construction; every error is a ``RequestError`` (a ``ValueError``)
that names the field (``.field``) and its allowed range, raised before the engine
allocates anything. Checks against a model (token ids in the vocabulary) are in
``engine.validation``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.engine.structured_output.json_schema import check_json_schema
from tandem.engine.validation import RequestError

_SAMPLING_EPS = 1e-5

#: The constraint kinds of ``StructuredOutputsParams``, in the order vLLM names them.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: Longest constraint (``StructuredOutputsParams.spec()``) a request may send: bounds what
#: one request makes the compiler, the compile cache and the handoff RPC carry.
MAX_SPEC_CHARS = 128 * 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``).

    Exactly one kind is set:

    Attributes:
        json: a JSON schema (a ``dict``, or its JSON text, parsed at construction); the
            output is one JSON value that validates against it. The schema must be valid
            (its metaschema) and use only keywords the grammar backend enforces
            (``structured_output.json_schema``).
        json_object: ``True``: the output is any JSON object.
        regex: the output matches this regular expression (xgrammar's regex dialect).
        choice: the output is exactly one of these strings (non-empty list).
        grammar: an EBNF / GBNF grammar (xgrammar's dialect, start rule ``root``).
        disable_any_whitespace: JSON kinds only: no free whitespace between tokens of the
            JSON text (compact output), as vLLM's flag of that name.
        after_token_id: the grammar applies only after this token id is first generated
            (the end-of-thinking token, e.g. ``</think>``, of a reasoning model): the
            tokens up to and including it are free, the ones after it are the
            constrained answer (vLLM gates its grammar on the reasoning parser's
            ``is_reasoning_end`` the same way). ``None``: from the first token.

    The constraint is compiled by the engine (``engine.structured_output``); its shape
    and the schema rules are checked here, so that the router (which runs no grammar
    library) rejects malformed requests before any RPC.

    Raises:
        RequestError: no kind or two kinds set (naming both), a value of the wrong
            type / an empty one, an invalid JSON schema, or a spec longer than
            ``MAX_SPEC_CHARS``, naming ``structured_outputs.<kind>``.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.after_token_id is not None and (
                isinstance(self.after_token_id, bool) or not isinstance(self.after_token_id, int)
                or self.after_token_id < 0):
            raise RequestError(
                "structured_outputs.after_token_id",
                "structured_outputs.after_token_id must be a token id >= 0, got "
                f"{self.after_token_id!r}",
            )
        if self.choice is not None and not isinstance(self.choice, tuple):
            if not isinstance(self.choice, list):
                raise RequestError(
                    "structured_outputs.choice",
                    "structured_outputs.choice must be a list of strings",
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        if not kinds:
            raise RequestError(
                "structured_outputs",
                "structured_outputs must set one of " + ", ".join(STRUCTURED_OUTPUT_KINDS),
            )
        if len(kinds) > 1:
            raise RequestError(
                f"structured_outputs.{kinds[0]}",
                f"structured_outputs sets more than one kind: {' and '.join(kinds)}; set one",
            )
        kind = kinds[0]
        value = getattr(self, kind)
        name = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise RequestError(name, f"{name} is not valid JSON: {exc}") from None
                object.__setattr__(self, "json", parsed)  # one form: equal schemas compare equal
            if not isinstance(self.json, dict):
                raise RequestError(name, f"{name} must be a JSON schema object")
        elif kind == "json_object":
            if value is not True:
                raise RequestError(name, f"{name} must be true")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise RequestError(name, f"{name} must be a non-empty string")
        elif kind == "choice":
            if not value:
                raise RequestError(name, f"{name} must not be empty")
            if not all(isinstance(c, str) and c for c in value):
                raise RequestError(name, f"{name} must hold non-empty strings")
        if len(self.spec()) > MAX_SPEC_CHARS:
            raise RequestError(
                name, f"{name} is longer than {MAX_SPEC_CHARS} characters (as compact JSON)"
            )
        if kind == "json":
            # After the size cap: the metaschema check is pure Python, linear in the size.
            check_json_schema(self.json, name)

    @property
    def kind(self) -> str:
        """The kind that is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        for k in STRUCTURED_OUTPUT_KINDS:
            if getattr(self, k) is not None:
                return k
        raise AssertionError("validated in __post_init__: one kind is set")

    @property
    def field(self) -> str:
        """The request field of the constraint, e.g. ``"structured_outputs.json"``."""
        return f"structured_outputs.{self.kind}"

    def spec(self) -> str:
        """The constraint as one string: what the grammar is compiled from, what travels in
        the protobuf, and (with ``kind``) the compile cache's key. A schema is compact JSON
        with its keys in the schema's own order, a choice list a JSON array, the others as
        given.

        NOTE: never sort a schema's keys: xgrammar emits an object's properties in the order
        of its ``properties``, and clients rely on that order (reason, then answer)."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.json, separators=(",", ":"))
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        value = getattr(self, kind)
        assert isinstance(value, str), f"{kind} is a string"
        return value

    def cache_key(self) -> tuple[str, str, bool]:
        """``(kind, spec, disable_any_whitespace)``: equal keys compile to equal grammars.

        Order-sensitive, as ``spec``: two schemas that differ only in the order of their
        properties compile to grammars that emit them in different orders."""
        return (self.kind, self.spec(), self.disable_any_whitespace)


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        n: number of completions for the prompt (>= 1). They share the prompt's
            cached KV blocks through the prefix cache.
        temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
        top_k: keep the k most likely tokens; -1 disables. 0 is invalid.
        top_p: nucleus sampling, in (0, 1].
        min_p: drop tokens whose probability is below ``min_p * p_max``; in [0, 1].
        seed: seed of this request's own torch.Generator; the same seed gives the
            same tokens whatever else is in the batch.
        presence_penalty / frequency_penalty: OpenAI semantics over output
            tokens, in [-2, 2].
        repetition_penalty: CTRL-style multiplicative penalty over prompt and
            output tokens (> 0; 1 disables). Source: Keskar et al. 2019.
        logit_bias: token id -> additive bias in [-100, 100].
        min_tokens: EOS and stop_token_ids are masked until this many tokens
            were generated.
        max_tokens: maximum number of generated tokens (>= 1). ``None`` means up
            to the model's context length.
        ignore_eos: keep generating after EOS.
        stop_token_ids: extra token ids that finish the request (the token is
            kept in the output ids, as vLLM does).
        stop: strings that finish the request; checked on detokenized text.
        include_stop_str_in_output: keep the matched stop string in the text.
        logprobs: number of top logprobs to return per generated token
            (0 returns only the sampled token's logprob); ``None`` returns none.
        prompt_logprobs: per prompt token, its logprob and the top ``k`` alternatives
            (``k`` in [0, 20]; 0: the token's own only); ``None`` returns none. The
            prompt is then computed in full (no prefix-cache or KV-store hit), as vLLM.
        skip_special_tokens: drop special tokens from the detokenized text.
        spaces_between_special_tokens: as in vLLM/transformers decode.
        structured_outputs: a constraint on the output (JSON schema, regex, choice,
            grammar); the engine masks the logits to the tokens it allows before every
            other rule, and the request finishes ("stop") once the grammar is complete.

    Raises:
        RequestError: naming the field, for any value outside its range.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()

    def _verify(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise _bad("n", "be an integer >= 1", repr(self.n))
        # NOTE: `not x >= 0` (not `x < 0`) so that NaN is rejected too.
        if not self.temperature >= 0.0:
            raise _bad("temperature", "be >= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", "be in (0, 1]", self.top_p)
        if self.top_k == 0 or self.top_k < -1:
            raise _bad("top_k", "be -1 (disabled) or >= 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", "be in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("presence_penalty", "be in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("frequency_penalty", "be in [-2, 2]", self.frequency_penalty)
        if not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", "be > 0", self.repetition_penalty)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _bad("max_tokens", "be >= 1", self.max_tokens)
        if self.min_tokens < 0:
            raise _bad("min_tokens", "be >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", "be <= max_tokens", f"{self.min_tokens} > {self.max_tokens}")
        if self.min_tokens > 0 and self.structured_outputs is not None:
            # A grammar may be complete (only EOS allowed) before min_tokens: the request
            # would then have no token left to sample.
            raise RequestError(
                "min_tokens",
                "min_tokens cannot be combined with structured outputs: the constraint "
                "decides where the output ends",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise _bad("logprobs", "be in [0, 20]", self.logprobs)
        if self.prompt_logprobs is not None and not (
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20):
            raise _bad("prompt_logprobs", "be an integer in [0, 20]", self.prompt_logprobs)
        if self.seed is not None and not isinstance(self.seed, int):
            raise _bad("seed", "be an integer", repr(self.seed))
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise RequestError(
                        "logit_bias", f"logit_bias[{tok}] must be in [-100, 100], got {bias}"
                    )
        if any(not s for s in self.stop):
            raise RequestError("stop", "stop must not contain empty strings")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise RequestError(
                "structured_outputs", "structured_outputs must be a StructuredOutputsParams"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _SAMPLING_EPS


def _bad(field: str, rule: str, value: object) -> RequestError:
    return RequestError(field, f"{field} must {rule}, got {value}")


#: the fields a generation config gives defaults for (besides ``max_tokens``)
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """Default sampling values for fields a request leaves unset
    (``tandem.engine.generation_config``, vLLM's ``--generation-config``).

    Attributes:
        temperature: >= 0 (0 is greedy).
        top_p: in (0, 1].
        top_k: -1 (off) or >= 1.
        min_p: in [0, 1].
        repetition_penalty: > 0 (1 is off).
        max_tokens: default ``max_tokens`` (>= 1), ``None``: the room left in the context.
        source: the file the values came from (``None``: the API's defaults).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    source: str | None = None

    def resolve(self, **request: float | None) -> dict[str, Any]:
        """The sampling fields of a request: each one it sets, else this default.

        Args:
            request: some of ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
                ``repetition_penalty``; ``None`` (or absent) means unset.

        Returns:
            All five, as ``SamplingParams`` keyword arguments.

        Raises:
            TypeError: a name outside those five.
        """
        unknown = sorted(set(request) - set(DEFAULTED_FIELDS))
        if unknown:
            raise TypeError(f"not a defaulted sampling field: {', '.join(unknown)}")
        return {name: getattr(self, name) if request.get(name) is None else request[name]
                for name in DEFAULTED_FIELDS}

    def overridden(self) -> dict[str, Any]:
        """The values that differ from the API's defaults (for the start-up log)."""
        base = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) != getattr(base, f.name)}

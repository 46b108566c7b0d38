"""The speculative decoding configuration (vLLM's ``speculative_config``), frozen and
validated once at the edge like the rest of ``engine/config.py``, which re-exports it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from tandem.engine.config_fields import known_fields

SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model")
#: Most draft tokens one step may verify per request (``num_speculative_tokens``).
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` fields and names).

    Each step a proposer guesses up to ``num_speculative_tokens`` next tokens of every
    decoding request; the target scores the last token plus the guesses in one forward
    and the rejection sampler keeps the longest prefix the target agrees with, plus
    one token of its own (see docs/architecture.md, "Speculative decoding").

    Attributes:
        method: "ngram" (prompt lookup: the longest suffix of the sequence, between
            ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens, found earlier in it
            proposes what followed there) or "draft_model" (a small causal LM with the
            target's tokenizer, ``model``).
        num_speculative_tokens: draft tokens per request and step, in 1..16.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths tried (ngram only);
            one alone sets both (as in vLLM); neither: 2 and 5 (a 1-token match proposes
            too often on text that does not repeat).
        model: the draft model (draft_model only): a local Hugging Face folder or a
            ``.gguf`` file, loaded with the target's dtype and device.
        max_model_len: the draft's context length (``None``: the target's); it must
            reach the target's.
        disable_by_batch_size: no proposals in a step whose running batch holds more
            than this many requests (vLLM's ``disable_by_batch_size``); ``None``: never.
        acceptance_backoff: adapt each request's number of draft tokens to its
            acceptance (halved after a draft of which nothing was accepted, one more
            after one accepted in full, a pause of ``BACKOFF_PAUSE_STEPS`` steps at 0);
            ``False`` proposes ``num_speculative_tokens`` every step.

    Raises:
        ValueError: naming the field: an unknown ``method``, ``num_speculative_tokens``
            outside 1..16, lookup lengths below 1 or min > max, ``model`` missing for
            (or given to a method other than) draft_model, lookup lengths given to
            draft_model.
    """

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    acceptance_backoff: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in 1..{MAX_NUM_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        lookup_given = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("model is only for method 'draft_model' (ngram needs no model)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            if lo is None and hi is None:
                lo, hi = 2, 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            assert lo is not None and hi is not None
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if not self.model:
                raise ValueError("model is required for method 'draft_model' (the draft's path)")
            if lookup_given:
                raise ValueError(
                    "prompt_lookup_min / prompt_lookup_max are only for method 'ngram'"
                )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def from_dict(cls, value: object) -> SpeculativeConfig:
        """Build from a mapping (``LLM(speculative_config={...})``, the JSON of
        ``--speculative-config``).

        Raises:
            ValueError: naming the field: not a mapping, an unknown key, or a bad value.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        return cls(**known_fields(cls, "speculative_config", value, "a JSON object"))

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config`` (a JSON object).

        Raises:
            ValueError: naming ``speculative_config`` for bad JSON, else as ``from_dict``.
        """
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        return cls.from_dict(value)

"""xgrammar behind one small seam: compile a constraint, match tokens, fill a bitmask.

Only this module (and the compile children, ``compile_worker.py``) imports xgrammar, which
imports torch, so the router, which checks a constraint but never compiles one, stays
free of both.

Bitmask layout (xgrammar's): ``int32 [num_rows, ceil(vocab_size / 32)]``; bit ``j % 32``
of word ``j // 32`` of a row is 1 when token ``j`` is allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.engine.structured_output.compile_worker import (
    CompileFailed,
    CompileTimeout,
    CompileWorkers,
)
from tandem.engine.validation import RequestError

#: xgrammar prefixes its C++ errors with a time stamp and a source location
#: ("[19:39:51] /project/cpp/regex_converter.cc:94: "): noise for a client.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def library_message(exc: BaseException) -> str:
    """xgrammar's error text without its time stamp and C++ source location."""
    return _LOCATION.sub("", str(exc).strip()).strip()


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``: ``root ::= "a" | "b"``.

    ``json.dumps`` writes each string as a double-quoted literal with C-style escapes
    (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``), which xgrammar's EBNF string literals read.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar's kernel: ``logits[i, j] = -inf`` where bit ``j`` of ``bitmask[i]`` is 0, for
    the rows ``i`` in ``rows``; in place.

    Args:
        logits: ``[num_reqs, vocab]`` float32.
        bitmask: ``int32 [num_reqs, ceil(vocab' / 32)]``, row-aligned with ``logits``.
            Tokens past ``32 * bitmask.shape[1]`` are left as they are; the engine's
            bitmask covers the model's whole vocabulary (``XgrammarBackend.vocab_size``).
        rows: the rows to mask.
    """
    bitmask = bitmask.to(logits.device)
    num_rows, vocab = logits.shape
    num_words = bitmask.shape[1]
    if vocab == 32 * num_words and logits.is_contiguous():
        # NOTE: xgrammar's CPU kernel writes -inf token by token, slow for rows that
        # allow few tokens (the start of a JSON value), fast when nearly all are allowed
        # (inside a string). Words that forbid all 32 of their tokens are filled here in
        # one masked pass and handed to the kernel as "all allowed" (docs/benchmarks.md).
        empty = bitmask == 0
        if bool(empty.any()):
            logits.view(num_rows, num_words, 32).masked_fill_(empty.unsqueeze(-1), float("-inf"))
            bitmask = bitmask.masked_fill(empty, -1)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


class CompiledGrammar:
    """A compiled constraint (immutable; shared by every request with the same key).

    Attributes:
        key: ``StructuredOutputsParams.cache_key()`` of what was compiled.
    """

    def __init__(self, key: tuple[str, str, bool], compiled: Any) -> None:
        self.key = key
        self._compiled = compiled

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        return GrammarMatcher(xgr.GrammarMatcher(self._compiled))

    @property
    def memory_bytes(self) -> int:
        """Approximate size of the compiled grammar (for the cache's bound)."""
        return int(self._compiled.memory_size_bytes)


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe (the engine thread uses it)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self.num_accepted_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; ``False`` (state unchanged) when the grammar forbids it."""
        ok = bool(self._m.accept_token(token_id))
        if ok:
            self.num_accepted_tokens += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's tentative
        advance through draft tokens); 0 is a no-op."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)
            self.num_accepted_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` (see module doc)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token was accepted."""
        return bool(self._m.is_terminated())


#: Compile processes per engine process: a compile killed at its time limit holds one for
#: that long, so a few pathological constraints at once leave room for others.
DEFAULT_COMPILE_WORKERS = 4


def compile_constraint(compiler: Any, kind: str, spec: str, any_whitespace: bool) -> Any:
    """Compile one constraint with an ``xgrammar.GrammarCompiler`` in this process
    (``compile_worker``'s child runs it).

    Args:
        kind: one of ``STRUCTURED_OUTPUT_KINDS``; ``spec`` is
            ``StructuredOutputsParams.spec()`` of that kind.

    Returns:
        The ``xgrammar.CompiledGrammar``.

    Raises:
        RuntimeError, ValueError, TypeError: xgrammar's errors (a schema it rejects, a regex
            that does not parse, a grammar with a syntax error).
    """
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec)))
    return compiler.compile_grammar(spec)


class XgrammarBackend:
    """Compiles ``StructuredOutputsParams`` for one model's vocabulary.

    Compiles run in child processes (``compile_worker.CompileWorkers``), so that one past
    its time limit is killed rather than left running; the compiled grammar comes back
    serialised and is rebuilt here over the same vocabulary.

    Args:
        tokenizer_info: xgrammar's view of the vocabulary (see :meth:`from_tokenizer`,
            :meth:`from_vocab`).
        vocab_size: rows of the model's logits (the bitmask width).
        num_workers: compile processes (compiles that may run at once; each is started
            when compiles first overlap that much).

    Thread-safety: :meth:`compile` may run on several threads at once (each waits for a
    free worker); matchers belong to one thread.
    """

    def __init__(self, tokenizer_info: Any, vocab_size: int, num_workers: int = DEFAULT_COMPILE_WORKERS) -> None:
        self.vocab_size = vocab_size
        self._info = tokenizer_info
        self.workers = CompileWorkers.acquire(tokenizer_info.serialize_json(), num_workers)
        self._released = False

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_id: int | None, num_workers: int = DEFAULT_COMPILE_WORKERS
    ) -> XgrammarBackend:
        """From a Hugging Face tokenizer; the engine's EOS is the grammar's stop token."""
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        return cls(info, vocab_size, num_workers)

    @classmethod
    def from_vocab(
        cls, vocab: Sequence[str], eos_token_id: int, num_workers: int = DEFAULT_COMPILE_WORKERS
    ) -> XgrammarBackend:
        """From the raw text of each token id (tests with tiny models, which have no
        tokenizer); ``vocab[eos_token_id]`` is the stop token."""
        info = xgr.TokenizerInfo(
            list(vocab), xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos_token_id]
        )
        return cls(info, len(vocab), num_workers)

    def compile(self, params: StructuredOutputsParams, timeout_s: float) -> CompiledGrammar:
        """Compile one constraint (blocking; call it off the step loop).

        Args:
            timeout_s: seconds the compile may take; past them it is killed.

        Raises:
            RequestError: naming ``params.field``, with xgrammar's message, for a schema
                xgrammar rejects, a regex that does not parse, a grammar with a syntax
                error, or a compile longer than ``timeout_s``. (What xgrammar would compile
                without enforcing is refused earlier, by ``StructuredOutputsParams``.)
        """
        kind = params.kind
        try:
            text = self.workers.compile(
                kind, params.spec(), not params.disable_any_whitespace, timeout_s
            )
        except CompileTimeout:
            raise compile_timeout_error(params, timeout_s) from None
        except CompileFailed as exc:
            raise RequestError(params.field, f"{params.field}: {exc}") from None
        compiled = xgr.CompiledGrammar.deserialize_json(text, self._info)
        return CompiledGrammar(params.cache_key(), compiled)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A bitmask of ``num_rows`` rows, every token allowed."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def shutdown(self) -> None:
        """Release the compile processes (stopped once no backend of this process over
        the same vocabulary uses them). Idempotent."""
        if not self._released:
            self._released = True
            self.workers.release()


def compile_timeout_error(params: StructuredOutputsParams, timeout_s: float) -> RequestError:
    """The error of a compile that ran past ``timeout_s`` seconds (a 400: the constraint is
    too complex for this server's limit)."""
    return RequestError(
        params.field,
        f"{params.field}: the grammar did not compile within {timeout_s:g} s "
        "(too complex a schema, regex or grammar)",
    )

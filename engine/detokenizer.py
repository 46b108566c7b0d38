"""Incremental detokenization and stop-string matching for one completion.

Algorithm (vLLM's ``detokenize_incrementally``, written against ``tokenizer.decode``):
keep a window of token ids ``[prefix_offset, read_offset)`` already turned into
text plus the new ones; decode the window with and without the new tokens and
emit the difference. Decoding a window that starts a few tokens back, instead of
the lone new token, keeps tokenizer context (SentencePiece's leading-space rule,
byte-level BPE merges). A window whose text ends in U+FFFD is an incomplete UTF-8
sequence (an emoji or CJK character split across tokens): nothing is emitted
until a later token completes it, so streamed text never holds a broken character.

Stop strings are searched in the newly grown tail of the text. Streamed deltas hold
back the longest suffix that could still become a stop string, so a client never
sees text that is then cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.engine.sampling_params import SamplingParams

#: Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _backend_decode(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a fast Hugging Face
    tokenizer, where calling it gives what ``tokenizer.decode`` gives (no
    ``clean_up_tokenization_spaces`` pass), else ``None``.

    Why: two decodes per generated token, and transformers' Python wrapper cost several
    times the Rust decode itself (docs/benchmarks.md, "Kernel measurements").
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return getattr(backend, "decode", None)


class IncrementalDetokenizer:
    """Turns one completion's token ids into text, token by token.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` is all that is used), or
            ``None`` for a model without one (the text then stays empty).
        prompt_token_ids: the prompt; its last few tokens are decoding context.
        params: the request's sampling parameters (stop strings,
            ``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``).

    Attributes:
        output_text: the text so far (cut at a matched stop string).
        token_ids: generated token ids so far (the stop token included).
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._window: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.token_ids: list[int] = []
        self.output_text = ""
        self._num_sent_chars = 0

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Add generated tokens; return the stop string that matched, if one did.

        Args:
            new_token_ids: tokens produced since the last call.
            stop_terminated: the last token finished the request as EOS or a stop
                token id; its text is then left out (as vLLM does) unless
                ``include_stop_str_in_output``.

        Returns:
            The matched stop string (``output_text`` is then cut: before it, or after
            it with ``include_stop_str_in_output``), else ``None``. Several tokens at
            once (speculative decoding's accepted runs) are checked one by one, so a
            stop string ends the output at the token that completed it, exactly as
            one token per call would; the tokens after it are dropped.
        """
        if len(new_token_ids) > 1 and self.stop:
            last = len(new_token_ids) - 1
            for i, tok in enumerate(new_token_ids):
                matched = self.update([tok], stop_terminated and i == last)
                if matched is not None:
                    return matched
            return None
        self.token_ids.extend(new_token_ids)
        to_decode = list(new_token_ids)
        if stop_terminated and to_decode and not self.params.include_stop_str_in_output:
            to_decode = to_decode[:-1]
        old_len = len(self.output_text)
        for tok in to_decode:
            self.output_text += self._decode_next(tok)
        if not self.stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - old_len)

    def _decode_next(self, token_id: int) -> str:
        """Append one token to the window; return the text it completes (may be '')."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Incomplete multi-byte character (or a token with no text yet): wait.
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide the window: the text up to here is final.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window)
        if self._prefix_offset > 64:
            # Keep the window short: drop ids before the prefix offset.
            self._window = self._window[self._prefix_offset :]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string in the text grown by ``num_new_chars``."""
        if num_new_chars == 0:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.output_text = text[:end]
        return stop

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        text = self.output_text
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: all of it, or only what was not returned before.

        Args:
            finished: the completion is over; nothing is held back.
            delta: return only the new part (streaming) instead of the whole text.
        """
        end = len(self.output_text) if finished or not self.stop else None
        if end is None:
            end = len(self.output_text) - self._holdback()
        if not delta:
            return self.output_text[:end]
        start = self._num_sent_chars
        self._num_sent_chars = max(start, end)
        return self.output_text[start:end]

    def decode_token(self, token_id: int) -> str:
        """Text of one token on its own (for ``Logprob.decoded_token``)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

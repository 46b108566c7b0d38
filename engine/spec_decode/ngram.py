"""Prompt-lookup (n-gram) proposer, after vLLM's ``ngram`` method (Saxena 2023,
"Prompt Lookup Decoding"): the sequence's last ``n`` tokens, for the longest ``n`` in
``[prompt_lookup_min, prompt_lookup_max]`` that occurs earlier in prompt + output, are
looked up, and the tokens that followed their latest earlier occurrence with ``k``
tokens after it (else the earliest) are proposed.

It pays where the output copies its input (summaries, edits, code with repeated
identifiers) and costs a lookup per request and step elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.engine.config import SpeculativeConfig
from tandem.engine.spec_decode.proposer import ProposeInput, Proposer


def ngram_propose(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n..max_n`` tokens (the latest one with ``k`` tokens after it,
    else the earliest); ``[]`` when none occurs earlier.

    Args:
        tokens: the sequence so far (prompt + output).
        min_n / max_n: suffix lengths tried, longest first (``1 <= min_n <= max_n``).
        k: most tokens proposed (>= 1).
    """
    num = len(tokens)
    if num < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # Ends e (exclusive) of the earlier occurrences of the last min_n tokens that have a
    # token after them (e <= num - 1): min_n vector compares, no [num, n] window array.
    # A request whose text does not repeat pays only these (the common case in a batch
    # of unrelated requests, every step).
    m = num - min_n
    hit = arr[:m] == arr[m]
    for j in range(1, min_n):
        hit &= arr[j : j + m] == arr[m + j]
    match = np.flatnonzero(hit) + min_n
    if not match.size:
        return []
    # Longer suffixes only extend these matches backwards, one token at a time.
    for n in range(min_n + 1, min(max_n, num - 1) + 1):
        longer = match[match >= n]
        longer = longer[arr[longer - n] == arr[num - n]]
        if not longer.size:
            break
        match = longer
    # The latest occurrence followed by k tokens; else the earliest (the most tokens
    # follow it). The latest alone would, in a run like "a a a a", always be the one
    # just before the suffix, with a single token after it.
    full = match[match + k <= num]
    end = int(full[-1] if full.size else match[0])
    return arr[end : end + k].tolist()


class NgramProposer(Proposer):
    """``method="ngram"``: stateless prompt lookup over each request's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        return [
            ngram_propose(inp.token_ids, self.min_n, self.max_n, inp.max_num_tokens)
            for inp in inputs
        ]

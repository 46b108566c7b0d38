"""Draft-model proposer: a small causal LM with the target's tokenizer proposes tokens.

The draft runs on the engine's own model code (``engine/models``) with its own paged KV
cache, indexed by the target's block tables: block ``b`` of the draft cache holds the
draft's K/V for the same tokens as block ``b`` of the target's, so draft blocks are
allocated and freed with the target's and need no accounting of their own (the
scheduler reserves ``num_lookahead_tokens`` slots past each request's tokens, where the
draft writes the K/V of its own proposals).

Per request the proposer remembers how many leading tokens its cache holds (it only
ever counts tokens the request really has): each call first feeds the tokens it has
not seen (the whole prompt the first time, which is also how a disaggregated decode
instance builds the draft's KV for a prompt whose target KV came from the store), then
``k - 1`` single-token steps. A greedy request's proposals are the argmax of each step
(verified as point masses); a random request's are drawn from the draft's own
distribution ``q`` under the request's sampling rules, and ``q`` goes to the rejection
sampler (Leviathan et al. 2023; Chen et al. 2023; vLLM's draft-model proposer), which
accepts ``x`` with probability ``min(1, p(x) / q(x))``: a draft close to the target is
then accepted almost always, where a point mass on its argmax is accepted only with
probability ``p(argmax)``. Preemption or finish drops the memory, and the next
call recomputes from token 0: prefix-cache hits are not trusted for the draft, whose
blocks may never have been written by it (a remote load, a request that finished
before the draft caught up).

The sampling rules that define ``q`` are the target's, through the sampler's own code:
``logit_bias``, ``min_tokens``, penalties, temperature, top-k, top-p and min-p, each
position seeing the drafts before it as output tokens. A grammar mask is not applied
(the grammar's state past the request's tokens is unknown here): ``q`` may then put
mass where ``p`` has none, which costs acceptance, not exactness. A seeded request
draws its drafts from ``draft_position_seed(seed, output position)``, independent of
the target's draws and of the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from tandem.engine.categorical import DRAFT_STREAM, key_generator, row_keys, sample_race
from tandem.engine.config import ModelConfig, SpeculativeConfig
from tandem.engine.model_facts import head_dim_of, model_context_len
from tandem.engine.model_loader import LoadedModel, load_model
from tandem.engine.request import Request, draft_position_seed
from tandem.engine.sampler import Sampler
from tandem.engine.spec_decode.proposer import ProposeInput, Proposer
from tandem.engine.spec_decode.verify import DraftPosition
from tandem.kernels.attention import build_attention_metadata
from tandem.kernels.cache import allocate_kv_cache, kv_cache_bytes_per_block
from tandem.kernels.linear import pack_linear_layers

logger = logging.getLogger(__name__)


def check_draft_fits(
    draft: LoadedModel,
    target_vocab_size: int,
    target_max_model_len: int,
    target_tokenizer: Any,
    draft_max_model_len: int | None = None,
) -> None:
    """Start-up checks of a draft against its target.

    Raises:
        ValueError: naming ``speculative_config.model`` for another vocabulary size or
            tokenizer vocabulary, or a context shorter than the target's;
            ``speculative_config.max_model_len`` when it is below the target's.
    """
    vocab = int(draft.hf_config.vocab_size)
    if vocab != target_vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary has {vocab} tokens, the "
            f"target's {target_vocab_size} (a draft needs the target's tokenizer)"
        )
    if target_tokenizer is not None and draft.tokenizer is not None:
        if target_tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError(
                "speculative_config.model: the draft's tokenizer differs from the target's "
                "(same size, other tokens)"
            )
    if draft_max_model_len is not None and draft_max_model_len < target_max_model_len:
        raise ValueError(
            f"speculative_config.max_model_len ({draft_max_model_len}) is below the "
            f"target's max_model_len ({target_max_model_len})"
        )
    context = model_context_len(draft.hf_config)
    if context < target_max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft's context ({context} tokens) is shorter "
            f"than the target's max_model_len ({target_max_model_len}); lower max_model_len"
        )


class DraftModelProposer(Proposer):
    """``method="draft_model"``.

    Args:
        config: the speculative config (``model``: the draft's path).
        vocab_size / max_model_len / tokenizer: the target's, checked against the draft.
        dtype / device: the target's; the draft is loaded in them.
        block_size: the target's KV block size (the draft shares its block tables).
        seed: seed of the generator of unseeded random requests' draft draws.
        loaded: an already loaded draft (tests), instead of loading ``config.model``.
        deterministic: the target's ``ModelConfig.deterministic``: the draft runs the
            batch-invariant kernels too, so its proposals (and so the steps' shapes)
            do not depend on the batch either.

    Raises:
        ValueError: from the loader (naming ``model``) or ``check_draft_fits``.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        vocab_size: int,
        max_model_len: int,
        tokenizer: Any,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        seed: int = 0,
        loaded: LoadedModel | None = None,
        deterministic: bool = False,
    ) -> None:
        if loaded is None:
            name = str(dtype).removeprefix("torch.")
            try:
                # NOTE: loaded at its own context; check_draft_fits then says when that
                # is shorter than the target's, naming the field to change.
                loaded = load_model(ModelConfig(
                    model=config.model, dtype=name,  # type: ignore[arg-type]
                    device=str(device)))
            except ValueError as exc:
                raise ValueError(f"speculative_config.{exc}") from exc
        check_draft_fits(loaded, vocab_size, max_model_len, tokenizer, config.max_model_len)
        self.loaded = loaded
        self.model = loaded.model
        if loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu":
            # As the target's runner does: the packed CPU kernels, and the head's argmax.
            pack_linear_layers(self.model, deterministic)
            self.model.pack_tied_lm_head(deterministic)
        self.model.ensure_max_position(max_model_len)
        hf = loaded.hf_config
        self.num_layers = int(hf.num_hidden_layers)
        self.num_kv_heads = int(hf.num_key_value_heads)
        self.head_dim = int(head_dim_of(hf))
        self.dtype = loaded.dtype
        self.device = loaded.device
        self.block_size = block_size
        self.batch_invariant = deterministic
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv: torch.Tensor | None = None
        # request id -> leading tokens whose draft K/V is in the draft cache.
        self._num_computed: dict[str, int] = {}
        # request id -> (its last proposal, [len, vocab] float32 q of each draft): random
        # requests only, taken by the verification.
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}
        # unseeded rows' race keys, a stream apart from the target sampler's; a seeded
        # row's key is draft_position_seed's
        self.noise_generator = key_generator(seed, DRAFT_STREAM)

    @property
    def block_bytes(self) -> int:
        """Bytes of one draft KV block across the draft's layers (K and V)."""
        return kv_cache_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the zeroed draft cache of ``num_blocks`` blocks (the target's count)."""
        self._kv = allocate_kv_cache(
            num_blocks, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
            self.dtype, self.device,
        )
        self.kv_caches = [(self._kv[:, i, 0], self._kv[:, i, 1]) for i in range(self.num_layers)]
        self._num_computed.clear()

    def free(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._num_computed.pop(rid, None)
            self._probs.pop(rid, None)

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> torch.Tensor | None:
        """``q`` of a random request's verified drafts (and forgets it); ``None`` for a
        greedy request or drafts that are not a prefix of its last proposal."""
        entry = self._probs.pop(request_id, None)
        if entry is None:
            return None
        proposal, probs = entry
        n = len(draft_token_ids)
        if proposal[:n] != list(draft_token_ids):
            return None
        return probs[:n]

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        assert self._kv is not None, "initialize_kv_cache() must run before propose()"
        if not inputs:
            return []
        # 1. Catch up on the tokens the draft has not seen; the last one's logits give
        #    the first proposal.
        tokens = [inp.token_ids for inp in inputs]
        starts = [min(self._num_computed.get(inp.request.request_id, 0), len(t) - 1)
                  for inp, t in zip(inputs, tokens, strict=True)]
        ids: list[int] = []
        for t, s in zip(tokens, starts, strict=True):
            ids.extend(t[s:])
        lens = [len(t) - s for t, s in zip(tokens, starts, strict=True)]
        tables = [inp.block_table for inp in inputs]
        last_rows = torch.tensor(lens, device=self.device).cumsum(0) - 1
        proposals: list[list[int]] = [[] for _ in inputs]
        probs: list[list[torch.Tensor]] = [[] for _ in inputs]
        hidden = self._forward(ids, lens, starts, tables, last_rows)
        self._pick(hidden, inputs, list(range(len(inputs))), proposals, probs)
        for inp, t in zip(inputs, tokens, strict=True):
            self._num_computed[inp.request.request_id] = len(t)
        # 2. One token at a time for the rest, for the requests that want more.
        k_max = max(inp.max_num_tokens for inp in inputs)
        for step in range(1, k_max):
            live = [i for i, inp in enumerate(inputs) if inp.max_num_tokens > step]
            if not live:
                break
            step_ids = [proposals[i][-1] for i in live]
            positions = [len(tokens[i]) + step - 1 for i in live]
            hidden = self._forward(
                step_ids, [1] * len(live), positions, [tables[i] for i in live], None
            )
            self._pick(hidden, inputs, live, proposals, probs)
        for inp, prop, q in zip(inputs, proposals, probs, strict=True):
            rid = inp.request.request_id
            if q:
                self._probs[rid] = (prop, torch.stack(q))
            else:
                self._probs.pop(rid, None)
        return proposals

    def _forward(
        self,
        ids: list[int],
        lens: list[int],
        num_computed: list[int],
        tables: list[list[int]],
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """One draft forward over sequences laid out back to back: the hidden states at
        ``rows`` (``None``: every row), ``[len(rows), hidden]``."""
        meta = build_attention_metadata(lens, num_computed, tables, self.block_size, self.device,
                                        self.batch_invariant)
        x = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.model(x, meta.positions, self.kv_caches, meta)
        return hidden if rows is None else hidden[rows]

    def _pick(
        self,
        hidden: torch.Tensor,
        inputs: Sequence[ProposeInput],
        live: list[int],
        proposals: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Append the next draft token of each request ``inputs[i]``, ``i`` in ``live``
        (row ``b`` of ``hidden`` is ``live[b]``'s) to ``proposals[i]``: the argmax for a
        greedy request; for a random one a draw from its ``q``, appended to ``probs[i]``
        (``[vocab]`` float32)."""
        rand = [b for b, i in enumerate(live) if not inputs[i].request.sampling_params.greedy]
        picked: list[int] = [0] * len(live)
        if len(rand) < len(live):
            greedy = self.model.compute_greedy(hidden)
            if greedy is None:
                greedy = self.model.compute_logits(hidden).argmax(dim=-1)
            picked = [int(t) for t in greedy.tolist()]
        if rand:
            index = torch.tensor(rand, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[index])
            reqs = [inputs[live[b]] for b in rand]
            # The sampler reads the drafts before this position as output tokens.
            rows = [cast("Request", DraftPosition(inp.request, inp.new_token_ids + proposals[live[b]]))
                    for b, inp in zip(rand, reqs, strict=True)]
            q = Sampler.target_probs(Sampler.process_logits(logits, rows), rows)
            row_seeds: list[int | None] = []
            for b, inp in zip(rand, reqs, strict=True):
                seed = inp.request.sampling_params.seed
                position = (inp.request.num_output_tokens + len(inp.new_token_ids)
                            + len(proposals[live[b]]))
                row_seeds.append(None if seed is None else draft_position_seed(seed, position))
            toks = sample_race(q, row_keys(row_seeds, self.noise_generator)).tolist()
            for r, b in enumerate(rand):
                picked[b] = int(toks[r])
                probs[live[b]].append(q[r])
        for b, i in enumerate(live):
            proposals[i].append(picked[b])

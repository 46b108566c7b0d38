"""Per-step attention metadata: the flattened batch's positions, slots and groups.

Built once per step by the model runner from the scheduled sequences and shared
by every layer (see ``kernels/attention.py`` for how the groups are computed).
Masks are built lazily and cached per sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kernels.attention_backend import AttentionBackend


@dataclass
class PrefillSeq:
    """One multi-token sequence of a step.

    Attributes:
        token_start / token_end: its slice of the flattened batch (tokens).
        num_computed: tokens of this sequence already in the cache before this
            step (prefix hits and earlier chunks).
        block_ids: ``[ceil(seq_len / block_size)]`` int64 block ids covering the
            context, or ``None`` when ``num_computed == 0`` (attend to new K/V).
        block_table: the same block ids as a list, whatever ``num_computed`` (the
            native prefill kernel reads every sequence from the cache).
    """

    token_start: int
    token_end: int
    num_computed: int
    block_ids: torch.Tensor | None
    block_table: list[int] = field(default_factory=list)

    @property
    def num_new(self) -> int:
        return self.token_end - self.token_start

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.num_new

    def needs_mask(self, sliding_window: int | None = None) -> bool:
        """Whether its attention needs an explicit mask rather than plain causal: a
        cached prefix (prefix-cache hit, later chunk) or a window shorter than it."""
        return self.num_computed > 0 or (
            sliding_window is not None and self.seq_len > sliding_window)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once and shared by all layers.

    Attributes:
        num_tokens: tokens in the flattened batch.
        block_size: tokens per KV block.
        positions: ``[num_tokens]`` int64 absolute positions.
        slot_mapping: ``[num_tokens]`` int64 cache slots (``block * block_size + off``).
        block_idx / block_offset: ``slot_mapping // block_size`` and ``% block_size``.
        num_decodes: rows of the decode group: the sequences with one new token
            (every new token, each a row of its own, when built with
            ``batch_invariant``).
        decode_token_idx: ``[num_decodes]`` int64 token indices of the decode
            group, or ``None`` when they are the first ``num_decodes`` tokens.
        decode_block_tables: ``[num_decodes, max_blocks]`` int64, padded with 0.
        decode_seq_lens: ``[num_decodes]`` int64 context lengths (incl. the new token).
        prefills: the multi-token sequences.
        attention_backend: the implementation the model runner chose for this model
            (``kernels/attention_backend.py``); ``None``: each call picks by its
            tensors' kernel backend (``kernels/backend.py``), as on the CPU.
    """

    num_tokens: int
    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_idx: torch.Tensor
    block_offset: torch.Tensor
    num_decodes: int = 0
    decode_token_idx: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    attention_backend: AttentionBackend | None = None
    _masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict, repr=False)
    _prefill_desc: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def prefill_descriptors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefills as the native prefill kernel reads them (built once, cached).

        Returns:
            ``desc [num_prefills, 4]`` int64 rows ``(token_start, num_new,
            num_computed, table_offset)`` and ``tables [sum of blocks]`` int64:
            every prefill's block ids (cached prefix included) back to back,
            sequence ``i``'s starting at its ``table_offset``.
        """
        if self._prefill_desc is None:
            rows: list[list[int]] = []
            flat: list[int] = []
            for p in self.prefills:
                rows.append([p.token_start, p.num_new, p.num_computed, len(flat)])
                flat.extend(p.block_table)
            self._prefill_desc = (
                torch.tensor(rows, dtype=torch.int64).reshape(-1, 4),
                torch.tensor(flat, dtype=torch.int64),
            )
        return self._prefill_desc

    def decode_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """``[num_decodes, 1, 1, max_blocks * block_size]`` bool, True = attend."""
        key = ("decode", sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            max_len = self.decode_block_tables.shape[1] * self.block_size
            k_pos = torch.arange(max_len, device=self.decode_seq_lens.device)
            lens = self.decode_seq_lens[:, None]
            mask = k_pos[None, :] < lens
            if sliding_window is not None:
                mask &= k_pos[None, :] > lens - 1 - sliding_window
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, i: int, sliding_window: int | None = None) -> torch.Tensor | None:
        """``[num_new, seq_len]`` bool mask of prefill ``i``; ``None`` = plain causal."""
        key = ("prefill", i, sliding_window)
        if key in self._masks:
            return self._masks[key]
        p = self.prefills[i]
        mask = None
        if p.needs_mask(sliding_window):
            device = self.positions.device
            q_pos = torch.arange(p.num_computed, p.seq_len, device=device)[:, None]
            k_pos = torch.arange(p.seq_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        self._masks[key] = mask
        return mask


def _all_decode_rows(
    start: int,
    n: int,
    c: int,
    table: list[int],
    num_blocks: int,
    block_size: int,
    positions: list[int],
    slots: list[int],
    decode_idx: list[int],
    decode_tables: list[list[int]],
    decode_lens: list[int],
) -> None:
    """Append one decode row per new token of a sequence (``n`` tokens from flat
    index ``start``, ``c`` cached): positions ``c..c+n-1``, context lengths
    ``c+1..c+n``. Every row shares the sequence's table (one list object: the
    kernel reads only the blocks its length covers)."""
    shared = table[:num_blocks]
    for i in range(n):
        pos = c + i
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        decode_idx.append(start + i)
        decode_tables.append(shared)
        decode_lens.append(pos + 1)


def _extend_slots(slots: list[int], table: list[int], start_pos: int, end_pos: int,
                  block_size: int) -> None:
    """Append the cache slots of positions ``[start_pos, end_pos)`` of a sequence with
    block table ``table``, block by block (Python work per block, not per token)."""
    pos = start_pos
    while pos < end_pos:
        j, off = divmod(pos, block_size)
        stop = min(end_pos, (j + 1) * block_size)
        base = table[j] * block_size
        slots.extend(range(base + off, base + off + stop - pos))
        pos = stop


def _set_decodes(meta: AttentionMetadata, decode_idx: list[int],
                 decode_tables: list[list[int]], decode_lens: list[int],
                 device: torch.device | str) -> None:
    """Fill the decode group of ``meta``: its token indices (only when not the first
    ``num_decodes`` tokens), block tables padded with block 0 to the longest, and
    sequence lengths, all int64 on ``device``."""
    max_blocks = max(len(t) for t in decode_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
    meta.num_decodes = len(decode_idx)
    if decode_idx != list(range(len(decode_idx))):
        meta.decode_token_idx = torch.tensor(decode_idx, dtype=torch.int64, device=device)
    meta.decode_block_tables = torch.tensor(padded, dtype=torch.int64, device=device)
    meta.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)


def build_attention_metadata(
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    batch_invariant: bool = False,
) -> AttentionMetadata:
    """Build the per-step metadata for sequences laid out back to back.

    Args:
        query_lens: new tokens per sequence (>= 1), in batch order.
        num_computed: tokens already cached per sequence.
        block_tables: block ids per sequence, covering at least
            ``num_computed + query_len`` tokens.
        block_size: tokens per block.
        device: where the tensors go.
        batch_invariant: every query token in the decode group, as if it were the
            one new token of its sequence: token ``i`` of a sequence with ``c``
            cached tokens attends to the first ``c + i + 1`` positions of its block
            table (the step's K/V are written to the cache before attention, so
            they are there). Each token's attention is then computed by the
            per-query decode kernel in the same order whether its sequence was
            prefilled at once, in chunks, after a prefix-cache hit or decoded
            token by token (``ModelConfig.deterministic``). No prefills then.

    Raises:
        ValueError: on length mismatches, empty queries or short block tables.
    """
    if not (len(query_lens) == len(num_computed) == len(block_tables)):
        raise ValueError("query_lens, num_computed and block_tables must have equal lengths")
    positions: list[int] = []
    slots: list[int] = []
    decode_idx: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefill_specs: list[tuple[int, int, int, list[int]]] = []
    start = 0
    for n, c, table in zip(query_lens, num_computed, block_tables, strict=True):
        if n < 1:
            raise ValueError(f"query_lens must be >= 1, got {n}")
        end_pos = c + n
        num_blocks = -(-end_pos // block_size)
        if len(table) < num_blocks:
            raise ValueError(
                f"block table has {len(table)} blocks, {num_blocks} needed for {end_pos} tokens"
            )
        if batch_invariant and n > 1:
            _all_decode_rows(start, n, c, table, num_blocks, block_size, positions, slots,
                             decode_idx, decode_tables, decode_lens)
        elif n == 1:
            positions.append(c)
            slots.append(table[c // block_size] * block_size + c % block_size)
            decode_idx.append(start)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(end_pos)
        else:
            positions.extend(range(c, end_pos))
            _extend_slots(slots, table, c, end_pos, block_size)
            prefill_specs.append((start, start + n, c, table[:num_blocks]))
        start += n
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        num_tokens=start,
        block_size=block_size,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=slot_mapping,
        block_idx=slot_mapping // block_size,
        block_offset=slot_mapping % block_size,
    )
    if decode_idx:
        _set_decodes(meta, decode_idx, decode_tables, decode_lens, device)
    for s, e, c, table in prefill_specs:
        ids = torch.tensor(table, dtype=torch.int64, device=device) if c > 0 else None
        meta.prefills.append(PrefillSeq(s, e, c, ids, table))
    return meta

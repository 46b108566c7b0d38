"""CUDA graphs of decode-only steps (vLLM's full CUDA graphs for uniform decode batches).

A decode step of a small model is bound by kernel launches, not by the GPU: a few
hundred launches of microsecond kernels per step. Replaying a captured graph launches
them all at once. A graph fixes its shapes and addresses, so:

* graphs are captured at start-up, after the memory profile and the KV cache
  allocation, for a list of batch sizes (``capture_sizes``: vLLM's list, 1, 2, 4, then
  multiples of 8 to 256 and of 16 beyond, up to ``max_num_seqs``);
* a step whose every request has exactly one new token (decode-only) is padded to the
  smallest captured size at least its size (``padded_batch_size``) and replayed;
  anything else (a prompt, a chunk, draft tokens, a batch above the largest size) runs
  eagerly, unchanged;
* the inputs live in static buffers (``DecodeInputs``): ids, positions, slots, context
  lengths and block tables as wide as ``max_model_len`` needs. Padding rows get slot
  ``PAD_SLOT_ID`` (the Triton cache kernel writes nothing for it, so the KV cache is
  never touched), position 0 and a one-token context in block 0 (a finite read); their
  outputs are cut off before sampling, so they never reach a sampled token.

The capture and replay (``CudaGraphRunner``) need CUDA; everything else here is plain
Python over CPU or CUDA tensors and is unit-tested on the CPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from tandem.engine.config import CompilationConfig
from tandem.kernels.attention_backend import AttentionBackend
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.cache import PAD_SLOT_ID

logger = logging.getLogger(__name__)

#: vLLM's cap of the default list: ``min(2 * max_num_seqs, 512)``.
DEFAULT_MAX_CAPTURE_SIZE = 512
#: Eager runs before each capture: Triton compiles its kernels and cuBLAS picks its
#: algorithms on the first calls, which must not happen inside the capture.
NUM_WARMUP_RUNS = 2

Model = Callable[..., torch.Tensor]


def default_capture_sizes(max_capture_size: int) -> list[int]:
    """vLLM's default capture list up to ``max_capture_size``: 1, 2, 4, multiples of 8
    below 256, then multiples of 16 from 256.

    Raises:
        ValueError: ``max_capture_size`` < 1.
    """
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size must be >= 1, got {max_capture_size}")
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_capture_size + 1, 16)]
    return [s for s in sizes if s <= max_capture_size]


def capture_sizes(config: CompilationConfig, max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending: ``config.cudagraph_capture_sizes``
    or the default list up to ``config.max_cudagraph_capture_size`` (default
    ``min(2 * max_num_seqs, 512)``), without the sizes above ``max_num_seqs`` (no
    decode step holds more requests).

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if config.cudagraph_capture_sizes is not None:
        sizes = list(config.cudagraph_capture_sizes)
    else:
        top = config.max_cudagraph_capture_size
        if top is None:
            top = min(2 * max_num_seqs, DEFAULT_MAX_CAPTURE_SIZE)
        sizes = default_capture_sizes(top)
    return tuple(s for s in sizes if s <= max_num_seqs)


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The captured size a decode step of ``num_seqs`` requests replays: the smallest
    of ``sizes`` (ascending) at least ``num_seqs``; ``None`` when there is none (the
    step runs eagerly) or ``num_seqs`` < 1."""
    if num_seqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graphs_unsupported_reason(
    device_type: str,
    enforce_eager: bool,
    attention_backend: AttentionBackend,
    world_size: int,
    speculative: bool,
) -> str | None:
    """Why an engine captures no CUDA graphs, or ``None`` when it does.

    Graphs need CUDA, no ``enforce_eager``, the Triton paged attention (whose decode
    kernel reads a context of any length from fixed-width block tables; the SDPA
    path's shapes follow the step's longest context), one rank (no collectives in the
    graph) and no speculative decoding (its steps verify several tokens per request).
    """
    if device_type != "cuda":
        return f"device {device_type!r} is not CUDA"
    if enforce_eager:
        return "enforce_eager is set"
    if attention_backend is not AttentionBackend.TRITON_PAGED:
        return f"attention backend {attention_backend.value} (graphs need triton_paged)"
    if world_size > 1:
        return f"{world_size} ranks (graphs are captured for one rank only)"
    if speculative:
        return "speculative decoding (its steps are not uniform decodes)"
    return None


class DecodeInputs:
    """The static inputs of a captured decode step: a host copy written per step and
    the device copy the graphs read, each region as wide as the largest captured size.

    Regions (int64; ``S = max_num_seqs``, ``W = max_blocks_per_seq``): ``input_ids``,
    ``positions``, ``slot_mapping``, ``block_idx``, ``block_offset``, ``seq_lens``
    (each ``[S]``) and ``block_tables`` ``[S, W]``.

    Args:
        max_num_seqs: the largest captured size.
        max_blocks_per_seq: ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        device: where the graphs read the inputs (the host copy is pinned for CUDA).
    """

    REGIONS = ("input_ids", "positions", "slot_mapping", "block_idx", "block_offset",
               "seq_lens")

    def __init__(
        self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
        device: torch.device | str,
    ) -> None:
        if max_num_seqs < 1 or max_blocks_per_seq < 1 or block_size < 1:
            raise ValueError(
                "max_num_seqs, max_blocks_per_seq and block_size must be >= 1, got "
                f"{max_num_seqs}, {max_blocks_per_seq}, {block_size}"
            )
        device = torch.device(device)
        pin = device.type == "cuda"
        shape = (len(self.REGIONS), max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.host = torch.zeros(shape, dtype=torch.int64, device="cpu", pin_memory=pin)
        self.host_tables = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int64,
                                       device="cpu", pin_memory=pin)
        self.device_rows = torch.zeros(shape, dtype=torch.int64, device=device)
        self.device_tables = torch.zeros(self.host_tables.shape, dtype=torch.int64,
                                         device=device)
        # numpy views of the host copy: per-element writes at a fraction of torch's cost
        self._rows = self.host.numpy()
        self._tables = self.host_tables.numpy()

    def fill(
        self,
        token_ids: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        padded_size: int,
    ) -> None:
        """Write a decode step into the host copy: request ``i`` feeds ``token_ids[i]``
        at position ``num_computed[i]`` from block table ``block_tables[i]``; rows
        ``len(token_ids)..padded_size - 1`` are padding (``PAD_SLOT_ID``, position 0,
        a one-token context in block 0). Table columns past a row's context keep stale
        block ids, which the decode kernel never reads.

        Raises:
            ValueError: lengths that differ, more requests than ``padded_size`` or a
                ``padded_size`` above ``max_num_seqs``, or a block table that does not
                cover its position or is wider than ``max_blocks_per_seq`` needs.
        """
        n = len(token_ids)
        if not (n == len(num_computed) == len(block_tables)):
            raise ValueError("token_ids, num_computed and block_tables must have equal lengths")
        if not n <= padded_size <= self.max_num_seqs:
            raise ValueError(
                f"padded_size must be in [{n}, {self.max_num_seqs}], got {padded_size}"
            )
        bs = self.block_size
        rows, tables = self._rows, self._tables
        for i in range(n):
            c = num_computed[i]
            j, off = divmod(c, bs)
            table = block_tables[i]
            if j >= len(table) or j >= self.max_blocks_per_seq:
                raise ValueError(
                    f"block_tables[{i}] has {len(table)} blocks, position {c} needs {j + 1} "
                    f"(at most {self.max_blocks_per_seq})"
                )
            rows[0, i] = token_ids[i]
            rows[1, i] = c
            rows[2, i] = table[j] * bs + off
            rows[3, i] = table[j]
            rows[4, i] = off
            rows[5, i] = c + 1
            tables[i, : j + 1] = table[: j + 1]
        if padded_size > n:
            rows[:, n:padded_size] = 0
            rows[2, n:padded_size] = PAD_SLOT_ID
            rows[5, n:padded_size] = 1
            tables[n:padded_size, 0] = 0

    def upload(self, size: int) -> None:
        """Copy the host copy to the device copy: the per-row values whole (a few KiB,
        one contiguous copy rather than six strided ones) and the first ``size`` block
        table rows. Blocking: the next ``fill`` must not overwrite what is in flight."""
        self.device_rows.copy_(self.host)
        self.device_tables[:size].copy_(self.host_tables[:size])

    def metadata(self, size: int, backend: AttentionBackend) -> AttentionMetadata:
        """The attention metadata of a ``size``-row decode step over the device copy
        (views: a graph captured with it reads whatever ``upload`` wrote last)."""
        d = self.device_rows
        return AttentionMetadata(
            num_tokens=size,
            block_size=self.block_size,
            positions=d[1, :size],
            slot_mapping=d[2, :size],
            block_idx=d[3, :size],
            block_offset=d[4, :size],
            num_decodes=size,
            decode_block_tables=self.device_tables[:size],
            decode_seq_lens=d[5, :size],
            attention_backend=backend,
        )

    def input_ids(self, size: int) -> torch.Tensor:
        """The device copy's token ids of a ``size``-row step."""
        return self.device_rows[0, :size]


class CudaGraphRunner:
    """Captures the model's decode step at each size and replays it (CUDA only).

    Args:
        model: the model; called as ``model(input_ids, positions, kv_caches, meta)`` and
            returning the final hidden states ``[num_tokens, hidden_size]``.
        sizes: the sizes to capture, ascending (``capture_sizes``).
        max_blocks_per_seq / block_size: the block table geometry.
        device: the model's CUDA device.

    Raises:
        ValueError: no sizes.
    """

    def __init__(
        self, model: Model, sizes: Sequence[int], max_blocks_per_seq: int, block_size: int,
        device: torch.device,
    ) -> None:
        if not sizes:
            raise ValueError("sizes: no batch size to capture")
        self.model = model
        self.sizes = tuple(sizes)
        self.device = device
        self.inputs = DecodeInputs(self.sizes[-1], max_blocks_per_seq, block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        #: captured size -> replays so far (what ``make gpu-check`` reports)
        self.num_replays: dict[int, int] = {}

    @torch.inference_mode()
    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture one graph per size over ``kv_caches`` (largest first, sharing one
        memory pool, as vLLM does). The graphs hold the caches' addresses: capture
        again after a new cache is allocated. Inputs are all padding, so the capture
        writes nothing into the cache.

        Raises:
            ValueError: the device is not CUDA.
        """
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.graphs.clear()
        self.outputs.clear()
        # NOTE: a capture runs on the current device's stream and the Triton kernels
        # launch on the current device: both must be the model's (cuda:1 is not the
        # default of a thread that never switched).
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            backend = AttentionBackend.TRITON_PAGED
            for size in reversed(self.sizes):
                self.inputs.fill([], [], [], size)
                self.inputs.upload(size)
                meta = self.inputs.metadata(size, backend)
                ids = self.inputs.input_ids(size)
                for _ in range(NUM_WARMUP_RUNS):
                    self.model(ids, meta.positions, kv_caches, meta)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(ids, meta.positions, kv_caches, meta)
                self.graphs[size] = graph
                self.outputs[size] = out
            torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for %d decode batch sizes (%d..%d)",
                    len(self.sizes), self.sizes[0], self.sizes[-1])

    def run(
        self,
        token_ids: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """Replay the decode step of these requests (one new token each; see
        ``DecodeInputs.fill``): their final hidden states ``[len(token_ids),
        hidden_size]`` (a view of the graph's output, valid until the next replay), or
        ``None`` when no captured size holds them (the caller runs eagerly)."""
        size = padded_batch_size(len(token_ids), self.sizes)
        if size is None or size not in self.graphs:
            return None
        self.inputs.fill(token_ids, num_computed, block_tables, size)
        self.inputs.upload(size)
        self.graphs[size].replay()
        self.num_replays[size] = self.num_replays.get(size, 0) + 1
        return self.outputs[size][: len(token_ids)]

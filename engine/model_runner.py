"""Model runner: one forward step over a ``SchedulerOutput`` (nano-vllm / vLLM v1 style).

Per step it flattens every scheduled token into one "super sequence" (token
ids, positions, slot mapping from the block tables), runs our model, which
writes the new K/V into the paged cache and runs paged attention, gathers the
last hidden state of each request that reached the end of its known tokens,
computes float32 logits and samples with ``engine/sampler.py``.

The runner owns the KV cache tensor (binding layout)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

(1 instead of 2, one head, for an MLA model's latent: ``ModelFacts.kv_spec``), so
``kv_cache[b]`` is block ``b`` of every layer (what the KV connector moves).
A ``Worker`` (engine/worker.py) owns the runner and an executor drives the worker;
KV connector calls (load before, save after the forward) belong to the engine
core, to which ``Executor.register_kv_caches`` hands this tensor.

Under tensor / pipeline parallelism (``engine/distributed.py``) one runner runs per
rank, each given the same ``SchedulerOutput``: its cache holds only its pipeline
stage's layers (``layer_range``) and its KV heads (``kv_head_range``) of the full
model's cache, with the same block ids on every rank. A later stage receives the
previous stage's hidden states and residual, an earlier one sends them on; the last
stage's TP ranks compute the logits together and its first TP rank (the driver)
samples and returns the step's output, the others an empty one.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from tandem.engine import distributed, kv_budget
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_device import on_device, resolve_cuda_index, runs_on_own_device
from tandem.engine.cuda_graphs import CudaGraphRunner, capture_sizes, graphs_unsupported_reason
from tandem.engine.input_batch import build_input_batch
from tandem.engine.model_facts import ModelFacts, resolve_model_facts
from tandem.engine.model_loader import LoadedModel, load_model
from tandem.engine.models.interface import IntermediateTensors
from tandem.engine.models.kv_scales import check_kv_scales_used
from tandem.engine.models.registry import architecture_name
from tandem.engine.prompt_logprobs import prompt_logprobs_into
from tandem.engine.quantization import weight_bytes
from tandem.engine.runner_env import tune_glibc_malloc, warn_batch_variant
from tandem.engine.sampler import Sampler
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.spec_decode.proposer import Proposer, create_proposer
from tandem.engine.step_outputs import propose_into, sample_into, verify_into
from tandem.kernels.attention import AttentionMetadata, build_attention_metadata
from tandem.kernels.attention_backend import (
    AttentionBackend,
    choose_attention_backend,
    detect_attention_facts,
)
from tandem.kernels.cache import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_layer_views,
)
from tandem.kernels.kv_quant import (
    check_fp8_kv_cache_supported,
    is_fp8,
    resolve_kv_cache_dtype,
    scales_id,
)
from tandem.kernels.linear import pack_linear_layers

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs the model for the scheduler's batches.

    Args:
        config: the engine configuration.
        loaded: a model from ``model_loader.load_model``; ``None`` loads
            ``config.model`` (tests reuse one loaded model across runners). Under
            several ranks it must have been built for this rank (after
            ``distributed.init_distributed``).

    Every call that touches the GPU (the load here, the profile, the cache allocation
    and graph capture, each step) runs with this engine's CUDA device current
    (``engine/cuda_device.py``), whichever thread makes it.

    Attributes:
        loaded: the ``LoadedModel``.
        cuda_index: the CUDA device index (a bare "cuda": the constructing thread's
            current device), ``None`` on the CPU.
        vocab_size / eos_token_id / max_model_len: model facts for the engine.
        num_layers / num_kv_heads / head_dim / dtype / device / block_size:
            the layout of this rank's KV cache (its layers and KV heads).
        layer_range / kv_head_range: which layers and KV heads of the full model's
            cache this rank's holds (the whole ranges with one rank).
        total_num_layers / total_num_kv_heads: those of the full model.
        is_driver: whether this rank returns the step's output (last pipeline
            stage, TP rank 0; the only rank with one rank).
        kv_cache: the cache tensor once ``initialize_kv_cache`` ran, else ``None``.

    Raises:
        ValueError: from the loader (unknown path, unsupported architecture, a
            parallel layout the model does not split into), when ``max_model_len``
            exceeds the loaded model's rotary table, naming ``speculative_config``
            with more than one rank (not supported yet), or naming ``loaded`` when
            it was built for another rank.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.cuda_index: int | None = resolve_cuda_index(
            loaded.device if loaded is not None else config.model.device)
        self._memory_at_start: kv_budget.MemorySnapshot | None = None
        with on_device(self.cuda_index):
            if self.cuda_index is not None:
                self._memory_at_start = kv_budget.take_snapshot(self.cuda_index)
            self._build(config, loaded)

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        self.config = config
        self.tp_group = distributed.get_tp_group()
        self.pp_group = distributed.get_pp_group()
        world = distributed.get_world_group().world_size
        if config.speculative is not None and world > 1:
            raise ValueError(
                "speculative_config: speculative decoding is not supported with "
                f"tensor_parallel_size * pipeline_parallel_size > 1 (got {world} ranks)"
            )
        if config.model.device == "cpu" and sys.platform.startswith("linux"):
            tune_glibc_malloc()
        self._load(config, loaded)
        hf = self.loaded.hf_config
        self.facts: ModelFacts = resolve_model_facts(
            hf, config.model.max_model_len, model_id=str(self.loaded.model_id),
            eos_token_id=self.loaded.eos_token_id, dtype=str(self.loaded.dtype),
            device=str(self.loaded.device), model_impl=self.loaded.model_impl,
            architecture=architecture_name(hf), weight_bytes=weight_bytes(self.model),
        )
        self.vocab_size: int = self.facts.vocab_size
        self.eos_token_id: int | None = self.facts.eos_token_id
        self.max_model_len: int = self.facts.max_model_len
        # The model may have been loaded for a shorter context (a shared LoadedModel).
        self.model.ensure_max_position(self.max_model_len)
        shard = self.model.shard
        shard.check_ranks(self.tp_group, self.pp_group)
        self.layer_range: range = shard.layers
        self.kv_head_range: range = shard.kv_heads
        self.total_num_layers: int = self.facts.num_layers
        self.total_num_kv_heads: int = self.facts.num_kv_heads
        self.num_layers: int = len(self.layer_range)
        self.num_kv_heads: int = len(self.kv_head_range)
        self.is_driver: bool = self.tp_group.is_first_rank and self.pp_group.is_last_rank
        self.head_dim: int = self.facts.head_dim
        # K and V per token (2), or an MLA model's one latent entry (1): KVCacheSpec
        self.kv_components: int = self.facts.kv_spec.num_components
        self.dtype: torch.dtype = self.loaded.dtype
        self.device: torch.device = (self.loaded.device if self.cuda_index is None
                                     else torch.device("cuda", self.cuda_index))
        self._init_kv_cache_dtype(config.cache.cache_dtype)
        self.block_size: int = config.cache.block_size
        self.sampler = Sampler(seed=config.model.seed)
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._init_attention()
        self.cuda_graphs: CudaGraphRunner | None = None
        self.proposer: Proposer | None = None
        if config.speculative is not None:
            self.proposer = create_proposer(
                config.speculative,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                tokenizer=self.loaded.tokenizer,
                dtype=self.dtype,
                device=self.device,
                block_size=self.block_size,
                deterministic=self.batch_invariant,
                seed=config.model.seed,
            )

    def _load(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        """The model (``loaded``, or loaded here), its linears packed for a bf16 CPU."""
        self.loaded = loaded if loaded is not None else load_model(config.model)
        self.model = self.loaded.model
        # Batch-invariant kernels (ModelConfig.deterministic): the packed linears at
        # every batch size and every query token through the decode attention kernel.
        self.batch_invariant = config.model.deterministic
        if self.loaded.dtype == torch.bfloat16 and self.loaded.device.type == "cpu":
            inv = self.batch_invariant
            n = pack_linear_layers(self.model, inv) + int(self.model.pack_tied_lm_head(inv))
            if n:
                logger.info("prepared %d bf16 linear layers for this CPU", n)
        if self.batch_invariant:
            warn_batch_variant(self.model, self.loaded.dtype)

    def _init_attention(self) -> None:
        """The attention backend for this device, dtype and head size."""
        self.attention = choose_attention_backend(
            self.device.type, self.dtype, self.head_dim, detect_attention_facts()
        )
        # NOTE: the CPU keeps its per-call choice (kernels/backend.py: native, else the
        # torch reference); elsewhere every step's metadata names the chosen backend.
        self._attention_backend: AttentionBackend | None = (
            None if self.device.type == "cpu" else self.attention.backend
        )
        if self.device.type != "cpu":
            logger.info("attention backend %s (%s; FlashAttention prefill: %s)",
                        self.attention.backend.value, self.attention.reason,
                        self.attention.prefill_flash)

    def _init_kv_cache_dtype(self, name: str) -> None:
        """The cache's element type (``kv_cache_dtype``) and, for an FP8 cache, every
        attention layer's ``(k_scale, v_scale)`` (1.0 unless the model set calibrated ones,
        vLLM's default), whose identity joins the facts and so the layout fingerprint.

        Raises:
            ValueError: naming ``kv_cache_dtype``: unknown, or FP8 on a GPU that cannot
                convert it.
        """
        self.kv_cache_dtype: torch.dtype = resolve_kv_cache_dtype(name, self.dtype)
        if not is_fp8(self.kv_cache_dtype):
            return
        capability = (torch.cuda.get_device_capability(self.device)
                      if self.device.type == "cuda" else None)
        check_fp8_kv_cache_supported(self.kv_cache_dtype, self.device.type, capability)
        check_kv_scales_used(self.model)
        scales = [(float(m.k_scale), float(m.v_scale)) for m in self.model.modules()
                  if hasattr(m, "k_scale") and hasattr(m, "v_scale")]
        self.facts = dataclasses.replace(
            self.facts, kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            kv_scales=scales_id(scales))
        logger.info("KV cache dtype %s (model %s), %d layers' K/V scales %s", self.facts.
                    kv_cache_dtype, self.facts.dtype, len(scales), self.facts.kv_scales)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V), plus the proposer's own
        cache for that block (a draft model's)."""
        own = kv_cache_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
            self.kv_cache_dtype,
            self.kv_components,
        )
        return own + (self.proposer.block_bytes if self.proposer is not None else 0)

    @runs_on_own_device
    def determine_num_blocks(self) -> int:
        """Number of KV blocks this rank's cache gets (its layers and heads: with
        several ranks each finds its own count and the executor takes the minimum).

        Order: ``cache.num_blocks_override``; else ``cache.kv_cache_memory_bytes //
        block_bytes``; else ``gpu_memory_utilization`` of the device's total memory less
        this process's weights, profiled activations, non-torch memory and the largest
        masked prefill's attention temporaries (CUDA, vLLM's rule), or of the available
        host memory less estimated activations (CPU); see ``engine/kv_budget.py``. The
        profiled budget is also capped at what ``max_num_seqs`` full-length sequences
        could use. Logs blocks, tokens and bytes.

        Raises:
            ValueError: when the budget holds less than one block; naming
                ``gpu_memory_utilization`` when that fraction of the GPU was not free
                when the engine started.
        """
        cache_cfg = self.config.cache
        block_bytes = self.block_bytes
        if cache_cfg.num_blocks_override is not None:
            num_blocks = cache_cfg.num_blocks_override
            source = "num_blocks_override"
        elif cache_cfg.kv_cache_memory_bytes is not None:
            num_blocks = cache_cfg.kv_cache_memory_bytes // block_bytes
            source = "kv_cache_memory_bytes"
        else:
            budget = self._profile_budget_bytes()
            sched = self.config.scheduler
            blocks_per_seq = -(-self.max_model_len // self.block_size)
            num_blocks = min(budget // block_bytes, blocks_per_seq * sched.max_num_seqs)
            source = f"gpu_memory_utilization={cache_cfg.gpu_memory_utilization}"
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes: the KV cache budget holds no block of {block_bytes} bytes"
            )
        logger.info(
            "KV cache (%s): %d blocks, %d tokens, %.1f MiB (%d bytes per block)",
            source,
            num_blocks,
            num_blocks * self.block_size,
            num_blocks * block_bytes / 2**20,
            block_bytes,
        )
        return int(num_blocks)

    def _profile_budget_bytes(self) -> int:
        """KV budget left by the weights and the activations of the largest step
        (``engine/kv_budget.py``): CUDA, a real profiling forward; CPU, an estimate."""
        util = self.config.cache.gpu_memory_utilization
        if self.cuda_index is None:
            return kv_budget.cpu_kv_budget_bytes(
                util, kv_budget.available_memory_bytes(), self.activation_bytes_estimate())
        assert self._memory_at_start is not None
        kv_budget.check_free_memory(util, self._memory_at_start, str(self.device))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.cuda_index)
        self.profile_run()
        torch.cuda.synchronize(self.cuda_index)
        peak = torch.cuda.max_memory_allocated(self.cuda_index)
        after = kv_budget.take_snapshot(self.cuda_index)
        sched = self.config.scheduler
        unprofiled = kv_budget.unprofiled_prefill_bytes(
            device_type=self.device.type, num_heads=self.model.shard.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            elem_bytes=self.dtype.itemsize, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len, flash=self.attention.prefill_flash)
        return kv_budget.cuda_kv_budget_bytes(util, self._memory_at_start, after, peak,
                                              unprofiled)

    def activation_bytes_estimate(self) -> int:
        """``kv_budget.activation_bytes_estimate`` of this rank's model and the
        scheduler's largest step, bytes."""
        shard = self.model.shard
        sched = self.config.scheduler
        return kv_budget.activation_bytes_estimate(
            hidden_size=int(self.loaded.hf_config.hidden_size), num_heads=shard.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=shard.intermediate_size, elem_bytes=self.dtype.itemsize,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs, vocab_size=self.vocab_size)

    @runs_on_own_device
    @torch.inference_mode()
    def profile_run(self) -> None:
        """One dummy forward at the maximum batch (``max_num_batched_tokens`` tokens
        in sequences of at most ``max_model_len``) plus logits for ``max_num_seqs``
        rows, with a temporary KV cache; also warms up the kernels. With several ranks
        every rank of the engine runs it at once (the TP collectives); pipeline stages
        exchange no data: a later stage starts from zeros."""
        sched = self.config.scheduler
        total = min(sched.max_num_batched_tokens, self.max_model_len * sched.max_num_seqs)
        lens = []
        while total > 0:
            lens.append(min(total, self.max_model_len))
            total -= lens[-1]
        tables, next_block = [], 0
        for n in lens:
            nb = -(-n // self.block_size)
            tables.append(list(range(next_block, next_block + nb)))
            next_block += nb
        kv, views = self._allocate_kv_cache(next_block)
        meta = build_attention_metadata(lens, [0] * len(lens), tables, self.block_size,
                                        self.device, self.batch_invariant)
        meta.attention_backend = self._attention_backend
        ids = torch.zeros(meta.num_tokens, dtype=torch.int64, device=self.device)
        intermediate = None
        if not self.pp_group.is_first_rank:
            shape = (meta.num_tokens, int(self.loaded.hf_config.hidden_size))
            zeros = torch.zeros(shape, dtype=self.dtype, device=self.device)
            intermediate = IntermediateTensors(zeros, zeros.clone())
        hidden = self._forward(ids, meta, views, intermediate)
        if isinstance(hidden, torch.Tensor):  # the last pipeline stage
            rows = min(sched.max_num_seqs, meta.num_tokens)
            self.model.compute_logits(hidden[:rows])
        del kv, views, hidden

    def _forward(
        self,
        ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """The model over ``ids`` (``[num_tokens]``): hidden states on the last
        pipeline stage, the next stage's input on the others."""
        if intermediate is None:
            return self.model(ids, meta.positions, kv_caches, meta)
        return self.model(ids, meta.positions, kv_caches, meta, intermediate)

    @runs_on_own_device
    def initialize_kv_cache(self, num_blocks: int, shared_file: str | None = None) -> None:
        """Allocate the zeroed KV cache (zeros: padded attention reads stay finite)
        and the per-layer ``(k, v)`` views the model writes into; ``shared_file``: map
        this zero-filled file as the cache (see ``kernels.cache.allocate_kv_cache``)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.cuda_graphs = None  # graphs hold the old cache's addresses
        self.kv_cache, self.kv_caches = self._allocate_kv_cache(num_blocks, shared_file)
        self.num_blocks = num_blocks
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        if self.device.type == "cuda":
            self._capture_cuda_graphs()

    def _capture_cuda_graphs(self) -> None:
        """Capture the decode steps' CUDA graphs over the current cache (after the memory
        profile, as vLLM does), unless the engine cannot use them (logged)."""
        cfg = self.config
        reason = graphs_unsupported_reason(
            self.device.type, cfg.model.enforce_eager, self.attention.backend,
            cfg.parallel.world_size, cfg.speculative is not None,
        )
        sizes = capture_sizes(cfg.compilation, cfg.scheduler.max_num_seqs)
        if reason is None and not sizes:
            reason = "no capture size at or below max_num_seqs"
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return
        max_blocks = -(-self.max_model_len // self.block_size)
        runner = CudaGraphRunner(self.model, sizes, max_blocks, self.block_size, self.device)
        runner.capture(self.kv_caches)
        self.cuda_graphs = runner

    def _allocate_kv_cache(
        self, num_blocks: int, shared_file: str | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A zeroed KV cache of ``num_blocks`` blocks in this model's layout (see
        ``allocate_kv_cache``) and its per-layer ``(key, value)`` views, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``kv_cache_layer_views``)."""
        kv = allocate_kv_cache(
            num_blocks,
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.kv_cache_dtype,
            self.device,
            shared_file,
            self.kv_components,
        )
        return kv, kv_cache_layer_views(kv)

    @runs_on_own_device
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward every scheduled token, sample where due.

        For each request in ``sched.scheduled_requests`` the tokens
        ``all_token_ids[num_computed_tokens : num_computed_tokens + n]`` are fed
        (``n = sched.num_scheduled_tokens[request_id]``) and their K/V written into
        the blocks of ``sched.block_tables[request_id]``. A request is sampled iff
        ``num_computed_tokens + n == request.num_tokens``. The runner mutates no
        request state (the scheduler advances ``num_computed_tokens``).

        Speculative decoding: a request with draft tokens
        (``sched.scheduled_spec_token_ids``) is fed its known tokens then the drafts,
        and its last ``k + 1`` positions are verified (``spec_decode.verify``); after
        sampling, the proposer drafts tokens for the requests in
        ``sched.num_lookahead_tokens``.

        Returns:
            ``ModelRunnerOutput`` with a sampled token (and logprobs when asked)
            for every request sampled this step, the verified requests' emitted tokens
            and the next step's draft tokens.

        Raises:
            AssertionError: when ``initialize_kv_cache`` has not run.
        """
        assert self.kv_cache is not None, "initialize_kv_cache() must run before execute_model()"
        out = ModelRunnerOutput()
        if self.proposer is not None:
            self.proposer.free(sched.preempted_req_ids | sched.finished_req_ids)
        reqs = sched.scheduled_requests
        if not reqs:
            return out
        batch = build_input_batch(sched)
        hidden: torch.Tensor | IntermediateTensors | None = None
        if self.cuda_graphs is not None and batch.is_decode_only:
            # decode-only (one token per request): a captured graph, if one holds it
            hidden = self.cuda_graphs.run(batch.input_ids, batch.num_computed, batch.tables)
        if hidden is None:
            meta = build_attention_metadata(
                batch.query_lens, batch.num_computed, batch.tables, self.block_size,
                self.device, self.batch_invariant,
            )
            meta.attention_backend = self._attention_backend
            ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)
            intermediate = None
            if not self.pp_group.is_first_rank:
                shape = (batch.num_tokens, int(self.loaded.hf_config.hidden_size))
                got = self.pp_group.recv({"hidden": shape, "residual": shape}, self.dtype,
                                         self.device)
                intermediate = IntermediateTensors(got["hidden"], got["residual"])
            hidden = self._forward(ids, meta, self.kv_caches, intermediate)
        if isinstance(hidden, IntermediateTensors):
            self.pp_group.send({"hidden": hidden.hidden, "residual": hidden.residual})
            return out
        prompt_logprobs_into(self.model, hidden, sched, out)  # only requests that ask
        if batch.sample_reqs:
            if len(batch.sample_rows) == batch.num_tokens:
                last = hidden
            else:
                last = hidden[torch.tensor(batch.sample_rows, dtype=torch.int64,
                                           device=self.device)]
            sample_into(self.model, self.sampler, last, batch.sample_reqs, sched, out)
        if batch.spec_reqs:
            rows = hidden[torch.tensor(batch.spec_rows, dtype=torch.int64, device=self.device)]
            verify_into(self.model, self.sampler, self.proposer, rows, batch.spec_reqs, sched,
                        out)
        if self.proposer is not None and sched.num_lookahead_tokens:
            rows_of = batch.hidden_rows_of(sched) if self.proposer.uses_hidden_states else {}
            propose_into(self.proposer, sched, out, hidden, rows_of)
        return out if self.is_driver else ModelRunnerOutput()

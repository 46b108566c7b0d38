"""The Transformers modeling backend: any decoder-only causal LM through transformers' code.

vLLM's ``--model-impl transformers`` (and SGLang's equivalent): instead of a native
implementation per architecture, the model is transformers' own ``*ForCausalLM``, run
with tandem's inputs and KV cache. Its attention layers call tandem's paged attention
through transformers' public ``AttentionInterface`` (``transformers_attention.py``);
everything else (projections, norms, rotary embedding, MoE routing, MLA's low-rank
projections) is transformers' code. The scheduler, sampler, prefix cache, chunked
prefill, preemption, structured outputs and the KV connector sit above the model and
work unchanged.

Loading: transformers' ``from_pretrained`` with the checkpoint's state dict (it builds
the model on the meta device, applies the checkpoint conversions some architectures
declare, e.g. per-expert MoE weights into fused expert tensors, restores the rotary
buffers and ties embeddings). On one rank, sibling projections the modeling code
applies to one input (q/k/v, gate/up) are fused into one GEMM each
(``transformers_fusion.py``). Then a probe runs a few tokens through the model to learn
each layer's KV geometry and to check that ``compute_logits`` reproduces the model's
own logits.

Refused at load, naming the architecture and the reason: state that is not a KV cache
(Mamba, RWKV, linear-attention and hybrid models), encoder-decoders, multimodal
configs, chunked or other non-window local attention, layers whose KV geometry differs,
and pipeline parallelism (not implemented for this backend).

Tensor parallelism follows the config's ``base_model_tp_plan`` where it has only
``colwise`` / ``rowwise`` splits (``transformers_tp.py``): each rank loads the model,
keeps its part of the split linears (its attention heads, so its KV cache holds those
heads only) and all-reduces the rowwise outputs; embedding and LM head stay whole, and
TP rank 0 computes the logits. Other plan styles, or no plan, are refused.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.engine import distributed
from tandem.engine.model_facts import head_dim_of
from tandem.engine.models import transformers_attention as tattn
from tandem.engine.models import transformers_fusion, transformers_tp
from tandem.engine.models.interface import IntermediateTensors, KVCacheViews
from tandem.engine.models.sharding import ModelShard
from tandem.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

#: model types whose state is not (only) a KV cache: state-space, recurrent and
#: linear-attention layers, alone or mixed with attention (transformers 5 names)
NON_KV_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba",
    "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe",
    "lfm3", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
    "kimi_linear", "minimax", "olmo_hybrid", "bailing_hybrid",
})

#: model types whose layers share or reuse another layer's K/V (one cache per layer here)
SHARED_KV_MODEL_TYPES = frozenset({"gemma3n", "gemma3n_text"})

#: ``config.layer_types`` entries the paged cache serves
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

#: tokens of the load-time probe
PROBE_TOKENS = 3


def _arch(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return str(archs[0]) if archs else str(getattr(config, "model_type", None))


def check_supported(config: Any) -> None:
    """Refuse a config the Transformers backend cannot serve.

    Raises:
        ValueError: naming the architecture and the reason: an encoder-decoder, a
            multimodal config (``vision_config`` / ``audio_config``), state that is not
            a KV cache (a known state-space / recurrent / hybrid model type, or
            ``layer_types`` with a non-attention entry), layers sharing K/V, or a model
            type transformers has no causal LM for.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    arch, model_type = _arch(config), getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model architecture {arch!r} is an encoder-decoder; tandem serves "
                         "decoder-only causal LMs")
    for name in ("vision_config", "audio_config", "speech_config", "vision_tower_config"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"model architecture {arch!r} is multimodal (its config has "
                             f"{name}); tandem serves text-only decoder models")
    if model_type in NON_KV_MODEL_TYPES:
        raise ValueError(f"model architecture {arch!r} keeps state that is not a KV cache "
                         f"(model_type {model_type!r}: recurrent, state-space or linear "
                         "attention layers); tandem's paged KV cache cannot hold it")
    if model_type in SHARED_KV_MODEL_TYPES:
        raise ValueError(f"model architecture {arch!r} shares K/V between layers; tandem's "
                         "paged cache holds each layer's own")
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)
    if other:
        raise ValueError(f"model architecture {arch!r} has layers of type {other} "
                         f"(config.layer_types); tandem's paged KV cache serves "
                         f"{sorted(ATTENTION_LAYER_TYPES)} only")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"model architecture {arch!r}: transformers has no causal LM for "
                         f"model_type {model_type!r}")


def check_parallel(config: Any, arch: str) -> None:
    """Raises ValueError naming ``pipeline_parallel_size`` when this process is one of
    several pipeline stages (not implemented for this backend), and as
    ``transformers_tp.check_tp_plan`` (naming ``tensor_parallel_size``) when it is one
    of several TP ranks and the config's TP plan cannot be served."""
    tp, pp = distributed.get_tp_group().world_size, distributed.get_pp_group().world_size
    if tp > 1:
        transformers_tp.check_tp_plan(config, arch, tp)
    if pp > 1:
        raise ValueError(f"pipeline_parallel_size {pp}: the Transformers modeling backend "
                         f"({arch}) runs on one rank; use pipeline_parallel_size=1")


def config_windows(config: Any) -> list[int | None]:
    """Per-layer sliding window (tokens) the config declares, ``None`` for full
    attention: ``layer_types`` where given, else ``sliding_window`` on every layer
    (Mistral's convention) unless ``use_sliding_window`` is false."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    return [int(window)] * n


def _shard(config: Any, num_heads: int, num_kv_heads: int, head_dim: int,
           tp_rank: int = 0, tp_size: int = 1) -> ModelShard:
    """TP rank ``tp_rank``'s ``ModelShard`` (every layer, the whole vocabulary) with the
    cache geometry given: ``num_heads`` / ``num_kv_heads`` held by this rank, which
    holds the model's KV heads ``[tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads)``."""
    hidden = int(config.hidden_size)
    ffn = int(getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
              or 4 * hidden)
    vocab = int(config.vocab_size)
    return ModelShard(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, num_heads=num_heads,
        kv_heads=range(tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads), head_dim=head_dim,
        intermediate_size=ffn // tp_size if ffn % tp_size == 0 else ffn,
        layers=range(int(config.num_hidden_layers)), vocab_size=vocab, vocab_per_rank=vocab,
    )


class TransformersForCausalLM(nn.Module):
    """A ``CausalLM`` that runs transformers' own modeling code of ``config``.

    Built like the native models by ``registry.build_model``: the constructor checks the
    config and holds no parameters; ``load_weights`` builds the transformers model from
    the checkpoint and probes it.

    Args:
        config: the transformers config (any decoder-only causal LM transformers has).
        max_position: positions the engine serves (at most ``max_position_embeddings``).
        dtype / device: of the weights.

    Attributes:
        shard: this TP rank's part (every layer) with the probed KV geometry: query
            heads, K/V heads (this rank's) and the cache head size (``max(dk, dv)``).
        hf: the transformers ``*ForCausalLM`` (after ``load_weights``).

    Raises:
        ValueError: as ``check_supported`` and ``check_parallel``; naming
            ``max_model_len`` when ``max_position`` exceeds ``max_position_embeddings``.
    """

    def __init__(
        self,
        config: Any,
        max_position: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.arch = _arch(config)
        check_supported(config)
        check_parallel(config, self.arch)
        tp = distributed.get_tp_group()
        self._tp_rank, self._tp_size = tp.rank_in_group, tp.world_size
        self.config = config
        self._dtype, self._device = dtype, torch.device(device)
        self.windows = config_windows(config)
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        # until the probe knows better
        self.shard = _shard(config, heads // self._tp_size, kv // self._tp_size, head_dim,
                            self._tp_rank, self._tp_size)
        self._limit = int(getattr(config, "max_position_embeddings", 0) or max_position)
        self.ensure_max_position(max_position)
        self.hf: Any = None
        self._layer_of: dict[int, int] = {}
        self._pass_kwargs = True

    @property
    def max_position(self) -> int:
        """``max_position_embeddings``: transformers' rotary embedding computes cos/sin
        per call, so there is no table to grow."""
        return self._limit

    def ensure_max_position(self, max_position: int) -> None:
        """A no-op within ``max_position_embeddings``.

        Raises:
            ValueError: naming ``max_model_len`` beyond it.
        """
        if max_position > self._limit:
            raise ValueError(f"max_model_len {max_position} exceeds the model's "
                             f"max_position_embeddings {self._limit}")

    # ---- loading ----

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Build the transformers model from a Hugging Face state dict and probe it.

        The pairs are gathered into one state dict (the checkpoint is in memory once
        beside the model while loading) and given to transformers' ``from_pretrained``,
        which converts checkpoint layouts the architecture declares.

        Raises:
            ValueError: naming the tensors the model lacks, the checkpoint lacks or that
                have the wrong shape, or a failed conversion; as ``_probe``.
        """
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, GgufConfig

        tattn.register()
        state = {name: t for name, t in weights if "rotary_emb.inv_freq" not in name}
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
        config = copy.deepcopy(self.config)
        if isinstance(getattr(config, "quantization_config", None), GgufConfig):
            # NOTE: a GGUF's tensors reach here dequantized by the loader: left on the
            # config, the GGUF entry makes from_pretrained treat them as pre-quantized.
            del config.quantization_config
        try:
            hf, info = cls.from_pretrained(
                None, config=config, state_dict=state, dtype=self._dtype,
                attn_implementation=tattn.ATTN_IMPLEMENTATION, output_loading_info=True,
                # reported in ``info`` (below), to raise naming the tensors
                ignore_mismatched_sizes=True)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"weights do not fit {self.arch}: {e}") from e
        del state
        problems = []
        if info.get("unexpected_keys"):
            problems.append(f"unexpected weight(s) {sorted(info['unexpected_keys'])[:8]}")
        if info.get("missing_keys"):
            problems.append(f"weights missing from the checkpoint: "
                            f"{sorted(info['missing_keys'])[:8]}")
        if info.get("mismatched_keys"):
            problems.append(f"weight(s) with the wrong shape: "
                            f"{sorted(map(str, info['mismatched_keys']))[:8]}")
        if info.get("error_msgs"):
            problems.append("; ".join(map(str, info["error_msgs"]))[:500])
        if problems:
            raise ValueError(f"{self.arch}: " + "; ".join(problems))
        self.hf = hf.to(self._device).eval().requires_grad_(False)
        params = inspect.signature(self.hf.base_model.forward).parameters.values()
        self._pass_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        if self._tp_size == 1:
            # NOTE: one rank only: a tensor-parallel plan splits each projection by itself.
            fusion = transformers_fusion.fuse_projections(self.hf.base_model, self._probe_run)
            logger.info("%s: %d projection groups fused", self.arch, len(fusion.fused))
            self._probe()
            return
        # NOTE: every rank loads the whole model, then keeps its part of the split modules.
        transformers_tp.shard_base_model(self.hf.base_model, self.config, self.arch,
                                         self._tp_rank, self._tp_size)
        try:
            self._probe()
        except RuntimeError as e:  # a module the plan leaves whole saw a split activation
            raise ValueError(f"tensor_parallel_size {self._tp_size}: {self.arch} split by its "
                             f"tensor-parallel plan fails to run: {e}") from e

    def _probe_run(self) -> None:
        """One forward of the base model over a fresh probe sequence."""
        ids = torch.arange(PROBE_TOKENS, device=self._device) % int(self.config.vocab_size)
        pos = torch.arange(PROBE_TOKENS, device=self._device)
        ctx = tattn.probe_context(PROBE_TOKENS, self._device, self.windows, self._layer_of)
        self._run(self.hf.base_model, ids, pos, ctx)

    def _probe(self) -> None:
        """Run ``PROBE_TOKENS`` tokens through the model: learn every layer's KV geometry
        (set ``shard``) and check that ``compute_logits`` of the base model's states
        equals the model's own logits (a logit scaling it does not know is refused).

        Raises:
            ValueError: naming the architecture, when a layer runs no attention or not
                once, layers differ in KV geometry, or the logits disagree.
        """
        n_layers = int(self.config.num_hidden_layers)
        ids = torch.arange(PROBE_TOKENS, device=self._device) % int(self.config.vocab_size)
        pos = torch.arange(PROBE_TOKENS, device=self._device)
        ctx = tattn.probe_context(PROBE_TOKENS, self._device, self.windows, self._layer_of)
        hidden = self._run(self.hf.base_model, ids, pos, ctx).last_hidden_state[0]
        if ctx.calls != n_layers or sorted(ctx.geometry) != list(range(n_layers)):
            raise ValueError(f"model architecture {self.arch!r}: {ctx.calls} attention calls "
                             f"over {n_layers} layers (layers without attention keep other "
                             "state); tandem's paged KV cache serves one attention per layer")
        geos = set(ctx.geometry.values())
        if len(geos) != 1:
            raise ValueError(f"model architecture {self.arch!r}: layers differ in KV geometry "
                             f"{sorted(geos, key=str)}; tandem's cache has one per model")
        geo = geos.pop()
        tp = self._tp_size
        if tp > 1 and (geo.num_heads, geo.num_kv_heads) != (self.shard.num_heads,
                                                            len(self.shard.kv_heads)):
            raise ValueError(f"tensor_parallel_size {tp}: {self.arch} split by its "
                             f"tensor-parallel plan runs {geo.num_heads} query / "
                             f"{geo.num_kv_heads} KV heads per rank, not "
                             f"{self.shard.num_heads} / {len(self.shard.kv_heads)}")
        self.shard = _shard(self.config, geo.num_heads, geo.num_kv_heads, geo.head_dim,
                            self._tp_rank, tp)
        # The engine sizes its cache from the config (``model_facts.resolve_model_facts``):
        # where the modeling code's K/V differ from what the config's fields say (MLA
        # expands its latent to every head, K and V of different sizes), the config this
        # model was given is told the cache geometry. The transformers model keeps its
        # own copy of the config.
        cfg_kv = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        if int(cfg_kv) != geo.num_kv_heads * tp:
            self.config.num_key_value_heads = geo.num_kv_heads * tp
        if head_dim_of(self.config) != geo.head_dim:
            self.config.head_dim = geo.head_dim
        if geo.k_head_dim != geo.v_head_dim:
            logger.info("%s: K head %d, V head %d: V zero-padded to %d in the KV cache",
                        self.arch, geo.k_head_dim, geo.v_head_dim, geo.head_dim)
        ours = self._logits(hidden).float()
        ctx2 = tattn.probe_context(PROBE_TOKENS, self._device, self.windows, self._layer_of)
        theirs = self._run(self.hf, ids, pos, ctx2).logits[0].float()
        tol = 1e-3 if self._dtype == torch.float32 else 3e-2
        if not torch.allclose(ours, theirs, rtol=tol, atol=tol * float(theirs.abs().max())):
            raise ValueError(f"model architecture {self.arch!r}: its logits are not the LM head "
                             "of its final hidden states (an unknown logit transform); "
                             "tandem cannot compute them")

    def _run(self, module: Any, ids: torch.Tensor, pos: torch.Tensor,
             ctx: tattn.StepContext) -> Any:
        """``module`` (the base model or the causal LM) over ``ids`` as a batch of 1."""
        extra = {tattn.STEP_KWARG: ctx} if self._pass_kwargs else {}
        with tattn.step_context(ctx):
            try:
                return module(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                              **extra)
            except TypeError as e:
                if not extra or tattn.STEP_KWARG not in str(e):
                    raise
                # The modeling code passes the kwargs somewhere that takes none: the
                # context variable carries the step instead.
                self._pass_kwargs = False
                return module(input_ids=ids[None], position_ids=pos[None], use_cache=False)

    # ---- the step ----

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheViews],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The transformers base model over the step's flattened tokens.

        Args:
            input_ids / positions: ``[num_tokens]`` int64.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size,
                num_kv_heads, head_dim]`` (``shard``'s geometry).
            attn_metadata: the step's ``AttentionMetadata``.
            intermediate: unused (one pipeline stage).

        Returns:
            ``[num_tokens, hidden_size]`` final (normed) hidden states, model dtype.
        """
        ctx = tattn.StepContext(meta=attn_metadata, kv_caches=kv_caches, windows=self.windows,
                                layer_of=self._layer_of)
        out = self._run(self.hf.base_model, input_ids, positions, ctx)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """``[num_seqs, hidden_size]`` -> ``[num_seqs, vocab_size]`` logits by the model's
        LM head, then the transforms transformers' causal LMs apply: Gemma 2/3's
        ``final_logit_softcapping``, Granite's ``logits_scaling`` (divides), Cohere's
        ``logit_scale`` (multiplies). Float32 unless ``upcast=False``. Under tensor
        parallelism TP rank 0 computes them (the head is whole on every rank) and the
        other ranks return ``None``."""
        if self._tp_rank != 0:
            return None
        logits = self._logits(hidden)
        return logits.float() if upcast else logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` on any rank, in the head's dtype."""
        logits = self.hf.get_output_embeddings()(hidden)
        cfg = self.config
        scale = getattr(self.hf, "logit_scale", None)
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            logits = logits * scale
        div = getattr(cfg, "logits_scaling", None)
        if div:
            logits = logits / div
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """No fused greedy head here: ``None`` (the caller computes logits)."""
        return None

    def pack_tied_lm_head(self, batch_invariant: bool = False) -> bool:
        """No packed tied head for transformers' modules: False."""
        return False

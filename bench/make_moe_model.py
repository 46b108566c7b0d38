"""Write a random-weight Qwen3-MoE of realistic proportions for ``tandem bench throughput``.

The MoE benchmark of issue 37: 8 of 64 experts active per token, bf16. Sizes default to a
scaled-down Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of 768, top-8): hidden
1024, 8 layers, 16 query heads x head_dim 64 with 4 KV heads, 64 experts of
``moe_intermediate_size`` 256, top-8, ``norm_topk_prob`` (as Qwen3-MoE), vocabulary
32000, untied LM head. About 490 M parameters, of which about 110 M active per token (embeddings included).

Weights are drawn as transformers initialises the model (normal, std
``initializer_range`` = 0.02; RMSNorm weights 1) from ``--seed``, stored in bfloat16 as a
Hugging Face folder (``config.json`` + ``model.safetensors``, per-expert tensor names as
the Hub's Qwen3-MoE checkpoints, no tokenizer: ``bench throughput`` then draws prompt ids
from the config's vocabulary).

    python -m tandem.bench.make_moe_model /tmp/qwen3-moe-bench
    tandem bench throughput --model /tmp/qwen3-moe-bench --backend tandem --backend hf \\
        --dtype bfloat16 --num-prompts 64 --input-len 256 --output-len 128
"""

from __future__ import annotations

import argparse
import sys


def make_config(layers: int = 8, experts: int = 64, top_k: int = 8) -> object:
    """The ``transformers.Qwen3MoeConfig`` described in the module docstring.

    Raises:
        ValueError: ``top_k`` outside ``[1, experts]`` or ``layers`` < 1.
    """
    from transformers import Qwen3MoeConfig

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    return Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=256,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        architectures=["Qwen3MoeForCausalLM"], torch_dtype="bfloat16",
    )


def main(argv: list[str] | None = None) -> int:
    """Write the folder named on the command line. Returns 0."""
    p = argparse.ArgumentParser(prog="python -m tandem.bench.make_moe_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="output folder (created; files in it are overwritten)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--experts", type=int, default=64, help="routed experts (default 64)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    from transformers import Qwen3MoeForCausalLM

    try:
        config = make_config(args.layers, args.experts, args.top_k)
    except ValueError as exc:
        p.error(str(exc))
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.folder, safe_serialization=True)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {args.folder}: {n / 1e6:.1f} M parameters, {args.experts} experts, "
          f"top-{args.top_k}, {args.layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())

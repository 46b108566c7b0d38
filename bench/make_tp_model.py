"""Write a random-weight model of SmolLM2-135M's size whose heads split at TP=2 and 4.

SmolLM2-135M has 9 query heads and 3 KV heads (head_dim 64): no tensor-parallel size
above 1 divides both, so ``tandem bench throughput --tensor-parallel-size 2`` cannot run
on it. This writes a Hugging Face folder (``config.json`` + ``model.safetensors``, no
tokenizer: ``bench throughput`` then draws prompt ids from the config's vocabulary) of a
Llama with SmolLM2-135M's sizes (hidden 576, intermediate 1536, 30 layers, vocabulary
49152, tied embeddings, RoPE theta 100000) but 12 query heads x head_dim 48 and 4 KV
heads. The Q/K/V/O projections and the KV cache per token (4 x 48 = 3 x 64 = 192 values
per layer for K and for V) have the same shapes as the real model's, so a step costs
the same FLOPs and bytes; only the attention's head split differs.

Weights are drawn as transformers initialises a Llama (normal, std
``initializer_range`` = 0.02; RMSNorm weights 1) from ``--seed``, stored in bfloat16
(the real checkpoint's dtype; the engine casts to its ``--dtype``).

    python -m tandem.bench.make_tp_model /tmp/smollm2-135m-tp
    tandem bench throughput --model /tmp/smollm2-135m-tp --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import sys


def make_config(heads: int = 12, kv_heads: int = 4) -> object:
    """The ``transformers.LlamaConfig`` described in the module docstring.

    Raises:
        ValueError: ``heads`` does not divide the hidden size 576, or ``kv_heads`` does
            not divide ``heads``.
    """
    from transformers import LlamaConfig

    hidden = 576
    if heads < 1 or hidden % heads:
        raise ValueError(f"heads must divide the hidden size {hidden}, got {heads}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads ({heads}), got {kv_heads}")
    return LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
    )


def main(argv: list[str] | None = None) -> int:
    """Write the folder named on the command line. Returns 0."""
    p = argparse.ArgumentParser(prog="python -m tandem.bench.make_tp_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="output folder (created; files in it are overwritten)")
    p.add_argument("--heads", type=int, default=12, help="query heads (default 12)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    from transformers import LlamaForCausalLM

    try:
        config = make_config(args.heads, args.kv_heads)
    except ValueError as exc:
        p.error(str(exc))
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.folder, safe_serialization=True)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {args.folder}: {n / 1e6:.1f} M parameters, {args.heads} heads, "
          f"{args.kv_heads} KV heads")
    return 0


if __name__ == "__main__":
    sys.exit(main())

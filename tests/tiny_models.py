"""Tiny random-weight transformers models for the tests (beside ``waiting.py``; ``tests/``
is on pytest's pythonpath).

One way to build them: a transformers config of a supported architecture with small
sizes, seeded weights (optionally drawn wider than transformers' init so that greedy
logits are far from ties), and, for tests that drive the engine directly, our model
built from those weights and wrapped as a ``LoadedModel``. Each test keeps its own sizes
and seeds: the helpers only remove the repeated construction.
"""

from __future__ import annotations

import torch
import transformers

from tandem.engine.model_loader import LoadedModel
from tandem.engine.models.registry import build_model

#: architectures whose config class is not ``<Name>Config``
TEXT_CONFIGS = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def tiny_config(
    arch: str,
    *,
    vocab: int,
    hidden: int,
    ffn: int,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    max_len: int = 128,
    special_tokens: bool = True,
    **extra: object,
) -> transformers.PretrainedConfig:
    """The transformers config of ``arch`` (e.g. ``"Qwen3ForCausalLM"``) with these sizes.

    ``vocab``, ``hidden``, ``ffn``, ``heads``, ``kv_heads``, ``layers`` and ``max_len`` are
    ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``num_hidden_layers`` and ``max_position_embeddings``.
    ``special_tokens=False`` sets BOS, EOS and pad to None (nothing stops generation
    early). ``extra`` goes to the config class as is (``tie_word_embeddings``,
    ``sliding_window``, ``head_dim``, ...).

    Raises:
        AttributeError: transformers has no ``<Name>Config`` for ``arch``.
    """
    if not special_tokens:
        extra = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **extra}
    # Gemma3ForCausalLM is the text-only model; "Gemma3Config" is the multimodal one's.
    name = TEXT_CONFIGS.get(arch, arch.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, name)
    return config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      architectures=[arch], **extra)


def tiny_hf_model(
    config: transformers.PretrainedConfig,
    *,
    std: float | None = None,
    norms: tuple[float, float] | None = None,
    seed: int = 0,
) -> transformers.PreTrainedModel:
    """The transformers model of ``config`` (class ``config.architectures[0]``), in eval
    mode and torch's default dtype (float32), its weights drawn after
    ``torch.manual_seed(seed)``.

    ``std``: every parameter whose name lacks "norm" is then redrawn from N(0, std), in
    ``named_parameters`` order; None keeps transformers' init. ``norms``: the norm weights
    are redrawn from U(norms) in that same pass; None keeps them at their init (ones).
    """
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).eval()
    if std is None:
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
            elif norms is not None:
                p.uniform_(*norms)
    return model


def as_loaded_model(hf: transformers.PreTrainedModel, model_id: str, max_len: int) -> LoadedModel:
    """Our float32 CPU model built from ``hf``'s weights, as the engine loads a model:
    no tokenizer, no EOS, ``max_len`` positions."""
    model = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", max_len)
    return LoadedModel(
        model=model,
        hf_config=hf.config,
        tokenizer=None,
        model_id=model_id,
        dtype=torch.float32,
        device=torch.device("cpu"),
        eos_token_id=None,
        max_position=max_len,
    )


def hf_greedy_steps(
    model: transformers.PreTrainedModel, prompt: list[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """(tokens, per-step logits) of transformers' greedy ``generate`` for exactly ``n``
    new tokens (``min_new_tokens=n``: EOS does not end it early)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt) :].tolist(), [lg[0] for lg in out.logits]

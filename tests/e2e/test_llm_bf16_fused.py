"""The real default model in bfloat16 through the one-call decode path.

The fused decode (``kernels/fused_decode.py``) runs the per-op path's kernels in
the same order with the same roundings, so on the real model the greedy tokens,
and the logprobs of every step, must be exactly those of the per-op path; and
the path must actually be taken (every decode-only step of these requests).
"""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.kernels.fused_decode import FusedDecode

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not FusedDecode.available(), reason="no AMX-BF16 on this CPU"),
]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
]


def _generate(fused: bool, monkeypatch, params: SamplingParams, quantization: str | None
              ) -> tuple[list, int]:
    calls = []
    real_call = FusedDecode.__call__

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(FusedDecode, "__call__", spy)
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory=64 << 20,
              quantization=quantization)
    model = llm.llm_engine.engine_core.executor.driver_worker.model_runner.model
    assert isinstance(model, LlamaForCausalLM)
    model.fused_decode_enabled = fused
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return outs, len(calls)


@pytest.mark.parametrize("quantization", ["none", "gguf"], ids=["dequantized", "blocks"])
@pytest.mark.parametrize("logprobs", [None, 3], ids=["greedy-head", "logprobs"])
def test_fused_decode_gives_the_per_op_tokens_on_the_real_model(monkeypatch, logprobs,
                                                                 quantization):
    """``none``: the .gguf dequantized to bf16 at load; ``gguf``: on its Q4_1 blocks
    (the integer-dot linears inside the fused step)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
    fused, fused_calls = _generate(True, monkeypatch, params, quantization)
    per_op, per_op_calls = _generate(False, monkeypatch, params, quantization)
    assert per_op_calls == 0
    assert fused_calls >= 20, f"the fused path ran on only {fused_calls} steps"
    for a, b in zip(fused, per_op, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        if logprobs is not None:
            assert a.outputs[0].logprobs == b.outputs[0].logprobs

"""Quantized-weight compute: packing of integer weights and the linears that read them.

* ``packing.py``: int32 bit packing (GPTQ, AWQ's interleaved order, compressed-tensors)
  and the canonical layout every integer method is repacked into at load.
* ``grouped.py``: ``y = x @ dequant(W).T`` for the canonical group-quantized layout (the
  torch reference, dequantizing one tile of output rows at a time) and the int8 paths.
* ``triton_grouped.py``: the same contract on CUDA tensors, a Triton W4A16 / W8A16 GEMM
  that unpacks and scales the weight in registers.
* ``fp8_gemm.py``: FP8 weights through ``torch._scaled_mm`` on GPUs with FP8, and the
  capability rule that picks the path.

The methods that read checkpoints and build these layers live in
``tandem.engine.quantization``; GGUF's native block types plug in beside these files.
"""

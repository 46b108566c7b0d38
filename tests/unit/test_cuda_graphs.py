"""CUDA-graph logic that needs no GPU: capture sizes, bucketing, padding, eligibility,
the config and flags. The capture itself runs on CUDA only (``make gpu-check``)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.config import CompilationConfig, EngineConfig, ModelConfig
from tandem.engine.cuda_graphs import (
    CudaGraphRunner,
    DecodeInputs,
    capture_sizes,
    default_capture_sizes,
    graphs_unsupported_reason,
    padded_batch_size,
)
from tandem.kernels.attention_backend import AttentionBackend
from tandem.kernels.cache import PAD_SLOT_ID

VLLM_512 = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def test_default_list_is_vllms():
    assert default_capture_sizes(512) == VLLM_512
    assert default_capture_sizes(512)[:8] == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_capture_sizes(300)[-4:] == [248, 256, 272, 288]
    assert default_capture_sizes(10) == [1, 2, 4, 8]
    assert default_capture_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_capture_size"):
        default_capture_sizes(0)


@pytest.mark.parametrize(
    "config,max_num_seqs,expected",
    [
        # default cap min(2 * max_num_seqs, 512), then nothing above max_num_seqs
        (CompilationConfig(), 128, (1, 2, 4, *range(8, 129, 8))),
        (CompilationConfig(), 1000, tuple(VLLM_512)),
        (CompilationConfig(), 3, (1, 2)),
        (CompilationConfig(max_cudagraph_capture_size=16), 128, (1, 2, 4, 8, 16)),
        (CompilationConfig(cudagraph_capture_sizes=(64, 3, 1, 3)), 128, (1, 3, 64)),
        (CompilationConfig(cudagraph_capture_sizes=(64, 3, 1)), 32, (1, 3)),
    ],
)
def test_capture_sizes(config, max_num_seqs, expected):
    assert capture_sizes(config, max_num_seqs) == expected


@pytest.mark.parametrize(
    "num_seqs,expected",
    [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (127, 128), (128, 128), (129, None),
     (0, None)],
)
def test_padded_batch_size_is_the_smallest_captured_size_that_holds_the_batch(num_seqs, expected):
    sizes = capture_sizes(CompilationConfig(), 128)
    assert padded_batch_size(num_seqs, sizes) == expected


def test_padded_batch_size_with_explicit_sizes():
    assert [padded_batch_size(n, (2, 6)) for n in range(1, 8)] == [2, 2, 6, 6, 6, 6, None]
    assert padded_batch_size(1, ()) is None


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"device_type": "cpu"}, "not CUDA"),
        ({"enforce_eager": True}, "enforce_eager"),
        ({"attention_backend": AttentionBackend.TORCH_SDPA}, "torch_sdpa"),
        ({"world_size": 2}, "2 ranks"),
        ({"speculative": True}, "speculative"),
    ],
)
def test_graphs_unsupported_reason(kwargs, fragment):
    args = {"device_type": "cuda", "enforce_eager": False,
            "attention_backend": AttentionBackend.TRITON_PAGED, "world_size": 1,
            "speculative": False}
    assert graphs_unsupported_reason(**args) is None
    reason = graphs_unsupported_reason(**(args | kwargs))
    assert reason is not None and fragment in reason


def test_decode_inputs_fill_pads_rows_to_the_dummy_slot():
    inputs = DecodeInputs(max_num_seqs=8, max_blocks_per_seq=4, block_size=4, device="cpu")
    # three decodes: positions 0, 5 (block 1 of its table) and 13 (block 3)
    inputs.fill([11, 12, 13], [0, 5, 13], [[7], [2, 9], [1, 3, 5, 6]], padded_size=4)
    inputs.upload(4)
    meta = inputs.metadata(4, AttentionBackend.TRITON_PAGED)
    assert inputs.input_ids(4).tolist() == [11, 12, 13, 0]
    assert meta.positions.tolist() == [0, 5, 13, 0]
    assert meta.slot_mapping.tolist() == [7 * 4, 9 * 4 + 1, 6 * 4 + 1, PAD_SLOT_ID]
    assert meta.block_idx.tolist() == [7, 9, 6, 0]
    assert meta.block_offset.tolist() == [0, 1, 1, 0]
    assert meta.decode_seq_lens.tolist() == [1, 6, 14, 1]
    assert meta.decode_block_tables.shape == (4, 4)
    assert meta.decode_block_tables[:, 0].tolist() == [7, 2, 1, 0]
    assert meta.decode_block_tables[2].tolist() == [1, 3, 5, 6]
    assert (meta.num_tokens, meta.num_decodes, meta.prefills) == (4, 4, [])
    assert meta.decode_token_idx is None
    assert meta.attention_backend is AttentionBackend.TRITON_PAGED


def test_decode_inputs_refill_overwrites_every_row_a_graph_reads():
    inputs = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=2, block_size=4, device="cpu")
    inputs.fill([5, 6, 7, 8], [1, 2, 3, 4], [[1], [2], [3], [4, 0]], padded_size=4)
    inputs.fill([9], [6], [[3, 2]], padded_size=2)
    inputs.upload(2)
    meta = inputs.metadata(2, AttentionBackend.TRITON_PAGED)
    assert inputs.input_ids(2).tolist() == [9, 0]
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, PAD_SLOT_ID]
    assert meta.decode_seq_lens.tolist() == [7, 1]
    assert meta.decode_block_tables[:, 0].tolist() == [3, 0]


@pytest.mark.parametrize(
    "args,match",
    [
        (([1, 2], [0], [[0]], 2), "equal lengths"),
        (([1, 2], [0, 0], [[0], [0]], 1), "padded_size"),
        (([1], [0], [[0]], 9), "padded_size"),
        (([1], [4], [[0]], 1), "position 4 needs 2"),
        (([1], [16], [[0, 1, 2, 3, 4]], 1), "at most 4"),
    ],
)
def test_decode_inputs_fill_rejects(args, match):
    inputs = DecodeInputs(max_num_seqs=8, max_blocks_per_seq=4, block_size=4, device="cpu")
    with pytest.raises(ValueError, match=match):
        inputs.fill(*args)


def test_graph_runner_refuses_to_capture_on_the_cpu():
    runner = CudaGraphRunner(lambda *a: torch.empty(0), (1, 2), 4, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):
        runner.capture([])
    assert runner.run([1], [0], [[0]]) is None  # nothing captured: the caller runs eagerly
    with pytest.raises(ValueError, match="no batch size"):
        CudaGraphRunner(lambda *a: torch.empty(0), (), 4, 16, torch.device("cpu"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cudagraph_capture_sizes": (1, 0)}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": (1, True)}, "cudagraph_capture_sizes"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
        ({"cudagraph_capture_sizes": (8, 64), "max_cudagraph_capture_size": 32},
         "below the largest"),
    ],
)
def test_compilation_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompilationConfig(**kwargs)


def test_compilation_config_from_dict():
    c = CompilationConfig.from_dict({"cudagraph_capture_sizes": [4, 1], "max_cudagraph_capture_size": 8})
    assert c == CompilationConfig((1, 4), 8)
    assert CompilationConfig.from_dict(c) is c
    with pytest.raises(ValueError, match="unknown field 'cudagraph_sizes'"):
        CompilationConfig.from_dict({"cudagraph_sizes": [1]})
    with pytest.raises(ValueError, match="list of integers"):
        CompilationConfig.from_dict({"cudagraph_capture_sizes": 8})
    with pytest.raises(ValueError, match="mapping"):
        CompilationConfig.from_dict([1, 2])


def test_enforce_eager_must_be_a_bool():
    assert ModelConfig(enforce_eager=True).enforce_eager
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig(enforce_eager="yes")  # type: ignore[arg-type]


def test_flags_reach_the_engine_config():
    # The services' stack (grpc's health and reflection packages) is not on every image
    # that runs this module: `make gpu-check` runs it on a bare GPU box without them.
    pytest.importorskip("grpc_health", reason="the services' gRPC packages are not installed")
    pytest.importorskip("redis", reason="the services' Redis client is not installed")
    from tandem.services.common.server import build_engine_config, build_parser

    parse = build_parser("tandem serve", None).parse_args
    ns = parse(["--role", "both", "--enforce-eager", "--cuda-graph-sizes", "8", "1", "4",
                "--max-cudagraph-capture-size", "16"])
    config = build_engine_config(ns, "both")
    assert config.model.enforce_eager
    assert config.compilation == CompilationConfig((1, 4, 8), 16)
    default = build_engine_config(parse(["--role", "both"]), "both")
    assert not default.model.enforce_eager
    assert default.compilation == EngineConfig().compilation == CompilationConfig()
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        build_engine_config(parse(["--role", "both", "--max-cudagraph-capture-size", "0"]),
                            "both")

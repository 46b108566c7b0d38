"""``--gpu-memory-utilization`` (vLLM's flag) on every engine command, ``LLM(...)``, and
``tandem up`` splitting one GPU between the engines on it (issue 36)."""

from __future__ import annotations

import pytest

from tandem.contracts.role import Role
from tandem.services.common.server import build_engine_config, build_parser, in_flag_words

REDIS = ["--redis-url", "redis://127.0.0.1:1/0"]


@pytest.mark.parametrize("role,argv", [(None, ["--role", "both"]), (Role.PREFILL, REDIS),
                                       (Role.DECODE, REDIS)])
def test_every_engine_command_takes_the_flag(role, argv):
    parser = build_parser("tandem", role)
    config = build_engine_config(parser.parse_args([*argv, "--gpu-memory-utilization", "0.45"]),
                                 role or "both")
    assert config.cache.gpu_memory_utilization == 0.45
    default = build_engine_config(parser.parse_args(argv), role or "both")
    assert default.cache.gpu_memory_utilization == 0.9


def test_a_bad_fraction_is_named_as_the_flag():
    parser = build_parser("tandem serve", None)
    ns = parser.parse_args(["--role", "both", "--gpu-memory-utilization=1.5"])
    with pytest.raises(ValueError) as err:
        build_engine_config(ns, "both")
    assert in_flag_words(str(err.value), ns, parser) == (
        "--gpu-memory-utilization must be in (0, 1], got 1.5")


def test_llm_takes_it(monkeypatch):
    from tandem.engine import llm as llm_mod

    seen = []
    monkeypatch.setattr(llm_mod, "LLMEngine", lambda config, loaded=None: seen.append(config))
    llm_mod.LLM(gpu_memory_utilization=0.3)
    assert seen[0].cache.gpu_memory_utilization == 0.3
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        llm_mod.LLM(gpu_memory_utilization=0.0)


def test_bench_throughput_takes_it():
    from tandem.bench.throughput import parse_args

    assert parse_args(["--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5


def _share(cfg, role_args=()) -> list[str]:
    from tandem.up import gpu_memory_utilization_args

    return gpu_memory_utilization_args(cfg, [*cfg.engine_args, *role_args])


def test_tandem_up_splits_one_gpu_between_its_engines():
    """A prefill and a decode engine on one GPU get 0.45 each (0.9 together, vLLM's one
    engine's default); engines on GPUs of their own keep the default; the CPU gets
    nothing; the user's own setting stands."""
    from tandem.up import StackConfig, build_parser, config_from_args, engines_share_a_gpu

    cfg = config_from_args(build_parser().parse_args(["--device", "cuda"]))
    assert cfg.engine_args == ["--device", "cuda"]
    assert _share(cfg) == ["--gpu-memory-utilization", "0.45"]
    assert engines_share_a_gpu(cfg)
    cfg = config_from_args(build_parser().parse_args(
        ["--device", "cuda:1", "--prefill", "2", "--gpu-memory-utilization", "0.8"]))
    assert _share(cfg) == ["--gpu-memory-utilization", "0.266"]  # 3 engines, rounded down
    apart = StackConfig(prefill_engine_args=["--device=cuda:0"],
                        decode_engine_args=["--device=cuda:1"])
    assert _share(apart, apart.prefill_engine_args) == []
    assert not engines_share_a_gpu(apart)
    assert _share(StackConfig(colocated=True, engine_args=["--device", "cuda"])) == []
    assert _share(StackConfig(colocated=True, replicas=3, engine_args=["--device=cuda:0"])) == [
        "--gpu-memory-utilization", "0.3"]
    assert _share(StackConfig()) == [] and not engines_share_a_gpu(StackConfig())
    own = StackConfig(engine_args=["--device", "cuda", "--gpu-memory-utilization=0.6"])
    assert _share(own) == []
    # tensor-parallel ranks sit on devices 0..tp-1: a TP=2 engine shares cuda:1
    tp = StackConfig(prefill_engine_args=["--device=cuda:1"],
                     decode_engine_args=["--device=cuda", "-tp", "2"])
    assert _share(tp, tp.prefill_engine_args) == ["--gpu-memory-utilization", "0.45"]
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        config_from_args(build_parser().parse_args(["--gpu-memory-utilization", "0"]))


def test_tandem_up_passes_the_share_and_starts_gpu_sharers_one_by_one(tmp_path, monkeypatch):
    from tandem.up import Stack, StackConfig

    stack = Stack(StackConfig(engine_args=["--device", "cuda"]))
    stack.tmpdir = tmp_path
    for name, cmd in (("prefill-0", ["prefill"]), ("decode-0", ["decode"])):
        argv = stack._engine_part(name, cmd).argv
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
    waves: list[list[str]] = []
    monkeypatch.setattr(Stack, "_launch", lambda self, parts: waves.append(
        [p.name for p in parts]))
    monkeypatch.setattr("tandem.up.free_port", lambda: 1)
    stack = Stack(StackConfig(engine_args=["--device", "cuda"], redis_url="redis://x:1/0",
                              log_dir=tmp_path, port=0, grpc_port=0))
    try:
        stack.start()
    finally:
        stack.close()
    assert waves == [["kvstore"], ["prefill-0"], ["decode-0"], ["router"]]

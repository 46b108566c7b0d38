"""`tandem up` argument and environment checks that need no model and no engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def test_port_in_use_fails_fast_naming_the_flag(tmp_path) -> None:
    """Bug (H9): with the router's port already taken, `tandem up` started redis, the KV
    store and every engine (a minute of model loading) before the router failed to bind,
    and then reported only "router exited with code 1". It must fail at once, naming the
    port and the flag, and leave nothing behind."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "tandem.cli", "up", "--colocated",
             "--model", str(tmp_path / "no-such-model"), "--port", str(port),
             "--grpc-port", "0", "--redis-url", "redis://127.0.0.1:1/0"],
            capture_output=True, text=True, timeout=120,
            env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode != 0
    assert f"--port {port}" in proc.stderr, proc.stderr
    assert "in use" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("tandem-up-*")), "temp dir left behind"


def test_engines_share_the_available_memory_for_kv_caches() -> None:
    """Bug (H9): every engine sized its KV cache from the memory free when it started (up
    to 4 GiB each); engines started together all saw the same free memory, so `tandem up`
    with 2+ engines could claim it several times over (out of memory on a small box)."""
    from tandem.up import StackConfig, kv_cache_args

    def budget(cfg: StackConfig, available: int) -> int:
        args = kv_cache_args(cfg, available_bytes=available)
        assert args[0] == "--kv-cache-memory"
        return int(args[1])

    gib = 1 << 30
    for cfg, num_engines in ((StackConfig(num_prefill=2, num_decode=2), 4),
                             (StackConfig(colocated=True, replicas=3), 3)):
        assert budget(cfg, 6 * gib) * num_engines <= 6 * gib // 2
    assert budget(StackConfig(), 64 * gib) == 4 * gib  # the engine's own cap
    # The user's own sizing (or a GPU) is left alone.
    for extra in (["--kv-cache-memory", "1000"], ["--num-kv-blocks=64"], ["--device=cuda"]):
        assert kv_cache_args(StackConfig(engine_args=extra), available_bytes=gib) == []


def test_banner_names_logs_and_kv_store_metrics() -> None:
    """The ready banner says where the children's logs are (unless --verbose sends them
    to the terminal) and, disaggregated, where the KV store's and each engine's metrics
    are."""
    from types import SimpleNamespace

    from tandem.up import StackConfig, banner

    def stack(verbose: bool, kv: str, log_dir: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(http_url="http://127.0.0.1:8000", grpc_address="127.0.0.1:50051",
                               redis_url="redis://127.0.0.1:7/0", kvstore_metrics_url=kv,
                               log_dir=log_dir or "/tmp/tandem-up-x",
                               engine_metrics_urls={"prefill-0": "http://127.0.0.1:5/metrics"},
                               config=StackConfig(verbose=verbose, log_dir=log_dir))

    text = banner(stack(False, "http://127.0.0.1:9/metrics"), "1 prefill + 1 decode")
    assert "  logs         /tmp/tandem-up-x   (removed on exit)" in text
    assert "  KV store     http://127.0.0.1:9/metrics" in text
    assert "  prefill-0 metrics http://127.0.0.1:5/metrics" in text
    text = banner(stack(False, "", "tandem-logs"), "1 prefill + 1 decode")
    assert "  logs         tandem-logs   (<part>.log; .1 .. .5 earlier runs)" in text
    text = banner(stack(True, ""), "colocated x1")
    assert "logs" not in text and "KV store" not in text
    assert "  OpenAI API   http://127.0.0.1:8000/v1" in text


def test_pinned_engines_get_their_cpu_count_of_openmp_threads() -> None:
    """Pinned engines get as many OpenMP threads as CPUs (what the user set wins); no
    other OpenMP setting is added: every engine keeps the services' spin."""
    from tandem.up import StackConfig, parts_env

    assert parts_env(StackConfig(cpus_per_engine=2), {})["OMP_NUM_THREADS"] == "2"
    assert parts_env(StackConfig(cpus_per_engine=2), {"OMP_NUM_THREADS": "1"}) == {
        "OMP_NUM_THREADS": "1"}
    assert parts_env(StackConfig(), {"GOMP_SPINCOUNT": "10000"}) == {"GOMP_SPINCOUNT": "10000"}


def test_engines_that_share_cores_take_turns_per_step(tmp_path) -> None:
    """Unpinned CPU engines of one stack get one shared step lock; one engine, pinned
    engines, GPU engines and pipeline-parallel engines get none; a user's own lock is
    kept."""
    from tandem.up import StackConfig, takes_cpu_turns

    assert takes_cpu_turns(StackConfig())
    assert takes_cpu_turns(StackConfig(colocated=True, replicas=2))
    assert not takes_cpu_turns(StackConfig(colocated=True))
    assert not takes_cpu_turns(StackConfig(cpus_per_engine=1))
    assert not takes_cpu_turns(StackConfig(engine_args=["--device=cuda"]))
    assert not takes_cpu_turns(StackConfig(engine_args=["--pipeline-parallel-size=2"]))
    assert not takes_cpu_turns(StackConfig(engine_args=["-pp", "2"]))
    assert takes_cpu_turns(StackConfig(engine_args=["--pipeline-parallel-size=1"]))
    assert not takes_cpu_turns(StackConfig(cpu_turns=False))
    from tandem.up import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args([])).cpu_turns
    assert not config_from_args(build_parser().parse_args(["--no-cpu-turns"])).cpu_turns
    # every engine of a stack names the same lock file, in the stack's folder
    from tandem.up import Stack

    own = StackConfig(engine_args=["--shared-cpu-lock=/x"])
    stack = Stack(own)
    stack.tmpdir = tmp_path
    assert stack._engine_part("d", ["decode"]).argv.count("--shared-cpu-lock=/x") == 1
    assert "--shared-cpu-lock" not in stack._engine_part("d", ["decode"]).argv
    for cfg, turns in ((StackConfig(), True), (StackConfig(cpus_per_engine=1), False)):
        stack = Stack(cfg)
        stack.tmpdir = tmp_path  # what start() makes
        locks = set()
        for name, cmd in (("prefill-0", ["prefill"]), ("decode-0", ["decode"])):
            argv = stack._engine_part(name, cmd).argv
            assert ("--shared-cpu-lock" in argv) == turns
            if turns:
                locks.add(argv[argv.index("--shared-cpu-lock") + 1])
        assert locks == ({str(tmp_path / "cpu-turns.lock")} if turns else set())


def test_engines_that_take_turns_get_a_512_token_step_budget(tmp_path) -> None:
    """A turn waits for the other engine's whole step: engines taking turns get
    ``--max-num-batched-tokens 512`` (not the engine's 2048) unless the user sets it;
    pinned engines keep the engine's default."""
    from tandem.up import Stack, StackConfig

    def budget(cfg: StackConfig) -> list[str]:
        stack = Stack(cfg)
        stack.tmpdir = tmp_path
        argv = stack._engine_part("prefill-0", ["prefill"]).argv
        return [a for i, a in enumerate(argv) if a.startswith("--max-num-batched-tokens")
                or (i and argv[i - 1] == "--max-num-batched-tokens")]

    assert budget(StackConfig()) == ["--max-num-batched-tokens", "512"]
    assert budget(StackConfig(colocated=True, replicas=2)) == ["--max-num-batched-tokens",
                                                               "512"]
    assert budget(StackConfig(cpus_per_engine=1)) == []
    assert budget(StackConfig(cpu_turns=False)) == []
    assert budget(StackConfig(engine_args=["--max-num-batched-tokens=1024"])) == [
        "--max-num-batched-tokens=1024"]
    assert budget(StackConfig(engine_args=["--max-num-batched-tokens", "4096"])) == [
        "--max-num-batched-tokens", "4096"]


def test_per_role_engine_args_reach_only_their_engines_after_the_common_ones(
        tmp_path) -> None:
    from tandem.up import Stack, StackConfig, build_parser, config_from_args, takes_cpu_turns

    cfg = StackConfig(engine_args=["--dtype=float32"],
                      prefill_engine_args=["--max-num-batched-tokens=1024"],
                      decode_engine_args=["--max-num-seqs=8", "--dtype=bfloat16"])
    stack = Stack(cfg)
    stack.tmpdir = tmp_path
    prefill = stack._engine_part("prefill-0", ["prefill"]).argv
    decode = stack._engine_part("decode-0", ["decode"]).argv
    assert "--max-num-batched-tokens=1024" in prefill and "--max-num-seqs=8" not in prefill
    # the prefill engine's own budget stands; the decode engine gets the turns' default
    assert "--max-num-batched-tokens" not in prefill
    assert decode[decode.index("--max-num-batched-tokens") + 1] == "512"
    assert "--max-num-seqs=8" in decode and "--max-num-batched-tokens=1024" not in decode
    # the role's flag comes after the common one, so it wins
    assert decode.index("--dtype=bfloat16") > decode.index("--dtype=float32")
    # a decode engine with pipeline stages takes no turns, so neither does the stack
    assert not takes_cpu_turns(StackConfig(decode_engine_args=["-pp", "2"]))
    ns = build_parser().parse_args(["--prefill-engine-arg=--max-num-seqs=4"])
    assert config_from_args(ns).prefill_engine_args == ["--max-num-seqs=4"]
    ns = build_parser().parse_args(["--colocated", "--decode-engine-arg=--max-num-seqs=4"])
    with pytest.raises(ValueError, match="use --engine-arg"):
        config_from_args(ns)


def test_kvstore_disk_flags_are_checked_before_anything_starts(tmp_path) -> None:
    from tandem.up import build_parser, config_from_args

    ns = build_parser().parse_args(["--kvstore-disk-path", str(tmp_path / "kv"),
                                    "--kvstore-disk-capacity", "1M"])
    cfg = config_from_args(ns)
    assert (cfg.kvstore_disk_path, cfg.kvstore_disk_capacity_bytes) == (str(tmp_path / "kv"),
                                                                        1 << 20)
    ns = build_parser().parse_args(["--kvstore-disk-path", str(tmp_path / "kv")])
    with pytest.raises(ValueError, match="--kvstore-disk-capacity go together"):
        config_from_args(ns)
    (tmp_path / "file").write_text("x")
    ns = build_parser().parse_args(["--kvstore-disk-path", str(tmp_path / "file" / "kv"),
                                    "--kvstore-disk-capacity", "1M"])
    with pytest.raises(ValueError, match=r"file/kv is not a writable directory"):
        config_from_args(ns)


@pytest.mark.parametrize("argv, flag", [
    (["--port", "70000"], "--port"),
    (["--grpc-port=-2"], "--grpc-port"),
    (["--cpus-per-engine=-1"], "--cpus-per-engine"),
    (["--kvstore-capacity=-1"], "--kvstore-capacity"),
    (["--kvstore-disk-capacity=-5", "--kvstore-disk-path", "DIR"], "--kvstore-disk-capacity"),
    (["--kvstore-disk-capacity", "1M", "--kvstore-disk-path", "/proc/nope"],
     "--kvstore-disk-path"),
])
def test_bad_flag_values_fail_before_anything_starts_naming_the_flag(tmp_path, argv,
                                                                     flag) -> None:
    """Bug: `tandem up --port 70000` died in a traceback (OverflowError from bind),
    `--cpus-per-engine=-1` started the stack, a negative `--kvstore-capacity` or
    `--kvstore-disk-capacity` started redis and the store node, which then failed naming
    its own flag (and rc 1), and an unwritable `--kvstore-disk-path` was reported as
    `--disk-path`. Each must be a ValueError naming `tandem up`'s flag (exit 2)."""
    from tandem.up import build_parser, config_from_args

    argv = [str(tmp_path / "kv") if a == "DIR" else a for a in argv]
    with pytest.raises(ValueError, match=f"^{flag} "):
        config_from_args(build_parser().parse_args(argv))


def test_kvstore_capacity_takes_size_suffixes_as_the_disk_capacity_does() -> None:
    """Bug: `--kvstore-capacity 512M` was refused ("invalid int value") while
    `--kvstore-disk-capacity 64M` and `tandem kvstore --capacity 512M` take suffixes."""
    from tandem.up import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--kvstore-capacity", "512M"]))
    assert cfg.kvstore_capacity_bytes == 512 << 20

"""`tandem bench latency`: disaggregated (prefill -> KV store -> decode) vs colocated.

Starts, on this host, Redis (unless ``--redis-url``), one ``tandem kvstore`` node,
one prefill, one decode and one colocated (``--role both``) engine service, then
for each prompt length sends the same kind of request both ways, one at a time:

* disaggregated: ``Prefill`` (TTFT = its round trip: the prefill answers with the
  first token once the blocks are published), then ``Decode`` (its first message
  carries ``kv_pull_ns``; the time to it is the time to the second token);
* colocated: ``Decode`` without a first token (TTFT = time to its first message).

Reported per length (medians over ``--repeats`` fresh random prompts, so no
prefix-cache hits): TTFT both ways, publish and pull times, the handoff
(publish + pull) as a share of the disaggregated TTFT, and the time to the
second token. The handoff is what disaggregation adds on top of the prefill
compute: publish delays the first token, pull delays the second.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.contracts.role import ROLES, Role
from tandem.launch import Launcher, Part, free_port, grpc_serving, http_ok, redis_ok, tandem_argv


class _Cluster:
    """The processes of one benchmark run (``tandem.launch``); ``close`` stops them all."""

    def __init__(self, ns: argparse.Namespace, workdir: Path) -> None:
        self._launcher = Launcher(workdir)
        self.redis_url = ns.redis_url
        self.addresses: dict[Role, str] = {}
        try:
            self._start(ns)
        except BaseException:
            self.close()  # a part that failed to start leaves none of the others running
            raise

    def _start(self, ns: argparse.Namespace) -> None:
        if self.redis_url is None:
            if shutil.which("redis-server") is None:
                raise RuntimeError("redis-server not found: install it or pass --redis-url")
            port = free_port()
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            self._launcher.launch([Part("redis", [
                "redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                "--bind", "127.0.0.1"], lambda u=self.redis_url: redis_ok(u))], 30)
        store_port, metrics_port = free_port(), free_port()
        self._launcher.launch([Part("kvstore", tandem_argv(
            "kvstore", "--listen", f"127.0.0.1:{store_port}", "--capacity",
            str(ns.store_capacity), "--redis-url", self.redis_url, "--metrics-port",
            str(metrics_port)), lambda: http_ok(f"http://127.0.0.1:{metrics_port}/health"))],
            120)
        engine = ["--dtype", ns.dtype, "--device", ns.device, "--kv-cache-memory",
                  str(ns.kv_cache_memory), "--max-model-len", str(ns.max_model_len)]
        if ns.model:
            engine += ["--model", ns.model]
        engines = []
        for role in ROLES:
            address = f"127.0.0.1:{free_port()}"
            args = ["serve", "--role", role.value, "--listen", address, *engine]
            if role.uses_store:
                args += ["--redis-url", self.redis_url]
            engines.append(Part(role.value, tandem_argv(*args),
                                lambda a=address: grpc_serving(a)))
            self.addresses[role] = address
        self._launcher.launch(engines, 600)

    def close(self) -> None:
        self._launcher.close(timeout_s=30)


@dataclass
class Row:
    """Medians for one prompt length; times in milliseconds."""

    prompt_tokens: int
    ttft_colocated_ms: float
    ttft_disagg_ms: float
    prefill_compute_ms: float
    publish_ms: float
    pull_ms: float
    handoff_share_of_ttft: float
    second_token_colocated_ms: float
    second_token_disagg_ms: float


def _measure(cluster: _Cluster, length: int, repeats: int, vocab: int, rng: random.Random):
    import grpc

    from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    pch = grpc.insecure_channel(cluster.addresses[Role.PREFILL])
    dch = grpc.insecure_channel(cluster.addresses[Role.DECODE])
    cch = grpc.insecure_channel(cluster.addresses[Role.BOTH])
    pstub = prefill_pb2_grpc.PrefillServiceStub(pch)
    dstub = decode_pb2_grpc.DecodeServiceStub(dch)
    cstub = decode_pb2_grpc.DecodeServiceStub(cch)
    samples: dict[str, list[float]] = {f: [] for f in Row.__dataclass_fields__ if f.endswith("ms")}
    shares = []
    for _ in range(repeats):
        prompt = [rng.randrange(10, vocab) for _ in range(length)]
        t0 = time.perf_counter()
        msgs = cstub.Decode(decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling_params=sp),
                            timeout=600)
        first = next(msgs)
        t1 = time.perf_counter()
        assert len(first.token_ids) == 1
        t2 = None
        for _m in msgs:
            t2 = t2 or time.perf_counter()  # the second token's message
        t2 = t2 or t1
        samples["ttft_colocated_ms"].append((t1 - t0) * 1e3)
        samples["second_token_colocated_ms"].append((t2 - t0) * 1e3)

        prompt = [rng.randrange(10, vocab) for _ in range(length)]
        t0 = time.perf_counter()
        pre = pstub.Prefill(prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp),
                            timeout=600)
        t1 = time.perf_counter()
        req = decode_pb2.DecodeRequest(
            request_id=pre.request_id, prompt_token_ids=prompt, first_token_id=pre.first_token_id,
            block_hashes=pre.block_hashes, sampling_params=sp,
            kv_layout_fingerprint=pre.kv_layout_fingerprint, hash_algorithm=pre.hash_algorithm)
        dmsgs = dstub.Decode(req, timeout=600)
        dfirst = next(dmsgs)
        t2 = time.perf_counter()
        for _m in dmsgs:
            pass
        ttft = (t1 - t0) * 1e3
        publish = pre.publish_ns / 1e6
        pull = dfirst.kv_pull_ns / 1e6
        samples["ttft_disagg_ms"].append(ttft)
        samples["prefill_compute_ms"].append(pre.compute_ns / 1e6)
        samples["publish_ms"].append(publish)
        samples["pull_ms"].append(pull)
        samples["second_token_disagg_ms"].append((t2 - t0) * 1e3)
        shares.append((publish + pull) / ttft)
    for ch in (pch, dch, cch):
        ch.close()
    med = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    return Row(prompt_tokens=length, handoff_share_of_ttft=round(statistics.median(shares), 4),
               **med)


def _markdown(rows: list[Row]) -> str:
    head = ("| prompt tokens | TTFT colocated (ms) | TTFT disagg (ms) | prefill compute (ms) "
            "| publish (ms) | pull (ms) | handoff / TTFT | 2nd token colocated (ms) "
            "| 2nd token disagg (ms) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.prompt_tokens} | {r.ttft_colocated_ms:.1f} | {r.ttft_disagg_ms:.1f} "
            f"| {r.prefill_compute_ms:.1f} | {r.publish_ms:.1f} | {r.pull_ms:.1f} "
            f"| {100 * r.handoff_share_of_ttft:.1f}% | {r.second_token_colocated_ms:.1f} "
            f"| {r.second_token_disagg_ms:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a markdown table (and JSON with ``--json``). Returns 0."""
    p = argparse.ArgumentParser(prog="tandem bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", default="128,256,512,1024,2048",
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3, help="requests per length and mode")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine")
    p.add_argument("--store-capacity", type=int, default=2 << 30, help="KV store bytes")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--keep-logs", action="store_true", help="keep the services' logs")
    ns = p.parse_args(argv)
    lengths = [int(x) for x in ns.lengths.split(",") if x]
    if not lengths or min(lengths) < 1:
        p.error("--lengths must be positive integers")
    if max(lengths) + 2 > ns.max_model_len:
        p.error("--max-model-len must exceed the longest prompt")

    from tandem.engine.model_files import load_tokenizer

    vocab = len(load_tokenizer(ns.model))
    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-latency-"))
    cluster = _Cluster(ns, workdir)
    rows: list[Row] = []
    try:
        rng = random.Random(ns.seed)
        _measure(cluster, min(lengths), 1, vocab, rng)  # warm-up (first-call overheads)
        for length in lengths:
            row = _measure(cluster, length, ns.repeats, vocab, rng)
            rows.append(row)
            print(f"{length} tokens: {json.dumps(asdict(row))}", flush=True)
    finally:
        cluster.close()
        if ns.keep_logs:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(f"host: {os.cpu_count()} CPUs, {ns.device}, dtype {ns.dtype}, model "
          f"{ns.model or 'SmolLM2-135M-Instruct (GGUF)'}")
    print(_markdown(rows))
    if ns.json is not None:
        ns.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

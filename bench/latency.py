"""`tandem bench latency`: disaggregated (prefill -> KV store -> decode) vs colocated.

Starts, on this host, Redis (unless ``--redis-url``), one ``tandem kvstore`` node,
one prefill, one decode and one colocated (``--role both``) engine service, then
for each prompt length sends the same kind of request both ways, one at a time:

* disaggregated: ``Prefill`` (TTFT = its round trip: the prefill answers with the
  first token as soon as it is sampled, while its publish of the blocks runs on),
  then ``Decode`` (its first message carries ``kv_pull_ns``, which includes any wait
  for blocks still being published; the time to it is the time to the second token);
* colocated: ``Decode`` without a first token (TTFT = time to its first message).

Reported per length (medians over ``--repeats`` fresh random prompts, so no
prefix-cache hits): TTFT both ways, publish and pull times, the handoff
(publish + pull) as a share of the disaggregated TTFT, and the time to the
second token. The handoff is what disaggregation adds on top of the prefill
compute; since the prefill answers before its publish ends, ``publish`` is 0 unless
the publish ended first (``PrefillResponse.kv_publish_pending`` false), and the
publish delays the second token (through the pull's wait), not the first.

With ``--output-len N`` (> 2) each request generates N tokens and the decode rate
(tokens after the first per second of streaming, batch 1) is reported both ways;
``--speculative-config JSON`` runs the decode and colocated engines with speculative
decoding and prints their acceptance (scraped from their ``/metrics``), to set beside
the same run without it. ``--prompt-pattern repeated`` makes prompts that prompt
lookup can copy from (a random quarter of the prompt, repeated).
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
from tandem.engine.config import KV_CACHE_DTYPES, QUANTIZATION_CHOICES
from tandem.launch import Launcher, Part, free_port, grpc_serving, http_ok, redis_ok, tandem_argv


class _Cluster:
    """The processes of one benchmark run (``tandem.launch``); ``close`` stops them all."""

    def __init__(self, ns: argparse.Namespace, workdir: Path) -> None:
        self._launcher = Launcher(workdir)
        self.redis_url = ns.redis_url
        self.addresses: dict[Role, str] = {}
        self.metrics_urls: dict[Role, str] = {}
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
                  str(ns.kv_cache_memory), "--max-model-len", str(ns.max_model_len),
                  "--tensor-parallel-size", str(ns.tensor_parallel_size),
                  "--pipeline-parallel-size", str(ns.pipeline_parallel_size),
                  "--kv-cache-dtype", ns.kv_cache_dtype]
        if ns.quantization:
            engine += ["--quantization", ns.quantization]
        if ns.model:
            engine += ["--model", ns.model]
        engines = []
        for role in ROLES:
            address = f"127.0.0.1:{free_port()}"
            args = ["serve", "--role", role.value, "--listen", address, *engine]
            if role.uses_store:
                args += ["--redis-url", self.redis_url]
            if role != Role.PREFILL:
                port = free_port()
                self.metrics_urls[role] = f"http://127.0.0.1:{port}/metrics"
                args += ["--metrics-port", str(port)]
                if ns.speculative_config:
                    args += ["--speculative-config", ns.speculative_config]
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
    decode_tok_s_colocated: float | None = None
    decode_tok_s_disagg: float | None = None


def make_prompt(rng: random.Random, length: int, vocab: int, pattern: str) -> list[int]:
    """Random ids in ``[10, vocab)``; ``pattern="repeated"``: a random segment of
    ``ceil(length / 4)`` ids repeated to ``length``."""
    if pattern != "repeated":
        return [rng.randrange(10, vocab) for _ in range(length)]
    seg = [rng.randrange(10, vocab) for _ in range(-(-length // 4))]
    return (seg * 4)[:length]


def spec_decode_counters(metrics_text: str) -> dict[str, float]:
    """The ``tandem:spec_decode_*`` totals in a Prometheus text exposition (summed over
    labels), with ``acceptance_rate`` and ``mean_acceptance_length`` (vLLM's: accepted
    per draft, plus one)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removeprefix("tandem:")
            if name.startswith("spec_decode_") and name.endswith("_total"):
                if "position" in sample.labels:
                    continue
                key = name.removesuffix("_total")
                totals[key] = totals.get(key, 0.0) + sample.value
    drafts = totals.get("spec_decode_num_drafts", 0.0)
    draft_tokens = totals.get("spec_decode_num_draft_tokens", 0.0)
    accepted = totals.get("spec_decode_num_accepted_tokens", 0.0)
    totals["acceptance_rate"] = accepted / draft_tokens if draft_tokens else 0.0
    totals["mean_acceptance_length"] = 1 + (accepted / drafts if drafts else 0.0)
    return totals


def _measure(cluster: _Cluster, length: int, repeats: int, vocab: int, rng: random.Random,
             output_len: int = 2, pattern: str = "random"):
    import grpc

    from tandem.services.decode.client import DecodeCall
    from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pch = grpc.insecure_channel(cluster.addresses[Role.PREFILL])
    dch = grpc.insecure_channel(cluster.addresses[Role.DECODE])
    cch = grpc.insecure_channel(cluster.addresses[Role.BOTH])
    pstub = prefill_pb2_grpc.PrefillServiceStub(pch)
    dstub = decode_pb2_grpc.DecodeServiceStub(dch)
    cstub = decode_pb2_grpc.DecodeServiceStub(cch)
    samples: dict[str, list[float]] = {f: [] for f in Row.__dataclass_fields__ if f.endswith("ms")}
    rates: dict[str, list[float]] = {"decode_tok_s_colocated": [], "decode_tok_s_disagg": []}
    shares = []
    for _ in range(repeats):
        prompt = make_prompt(rng, length, vocab, pattern)
        t0 = time.perf_counter()
        msgs = DecodeCall(cstub, decode_pb2.DecodeRequest(prompt_token_ids=prompt,
                                                           sampling_params=sp), timeout=600)
        first = next(msgs)
        t1 = time.perf_counter()
        assert len(first.token_ids) == 1
        t2 = None
        num_after_first, t_last = 0, t1
        for m in msgs:
            t2 = t2 or time.perf_counter()  # the second token's message
            num_after_first += len(m.token_ids)
            t_last = time.perf_counter()
        t2 = t2 or t1
        if num_after_first and t_last > t1:
            rates["decode_tok_s_colocated"].append(num_after_first / (t_last - t1))
        samples["ttft_colocated_ms"].append((t1 - t0) * 1e3)
        samples["second_token_colocated_ms"].append((t2 - t0) * 1e3)

        prompt = make_prompt(rng, length, vocab, pattern)
        t0 = time.perf_counter()
        pre = pstub.Prefill(prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp),
                            timeout=600)
        t1 = time.perf_counter()
        req = decode_pb2.DecodeRequest(
            request_id=pre.request_id, prompt_token_ids=prompt, first_token_id=pre.first_token_id,
            block_hashes=pre.block_hashes, sampling_params=sp,
            kv_layout_fingerprint=pre.kv_layout_fingerprint, hash_algorithm=pre.hash_algorithm,
            kv_publish_pending=pre.kv_publish_pending)
        dmsgs = DecodeCall(dstub, req, timeout=600)
        dfirst = next(dmsgs)
        t2 = time.perf_counter()
        # Decode rate from the second token on (the first came from the prefill).
        num_after_second, t_last = 0, t2
        for m in dmsgs:
            num_after_second += len(m.token_ids)
            t_last = time.perf_counter()
        if num_after_second and t_last > t2:
            rates["decode_tok_s_disagg"].append(num_after_second / (t_last - t2))
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
    med_rates = {k: round(statistics.median(v), 2) if v else None for k, v in rates.items()}
    return Row(prompt_tokens=length, handoff_share_of_ttft=round(statistics.median(shares), 4),
               **med, **med_rates)


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
    ns, lengths = _parse_args(argv)
    from tandem.engine.model_files import load_tokenizer

    vocab = len(load_tokenizer(ns.model))
    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-latency-"))
    cluster = _Cluster(ns, workdir)
    rows: list[Row] = []
    spec: dict[str, dict[str, float]] = {}
    try:
        rng = random.Random(ns.seed)
        _measure(cluster, min(lengths), 1, vocab, rng)  # warm-up (first-call overheads)
        for length in lengths:
            row = _measure(cluster, length, ns.repeats, vocab, rng, ns.output_len,
                           ns.prompt_pattern)
            rows.append(row)
            print(f"{length} tokens: {json.dumps(asdict(row))}", flush=True)
        import urllib.request

        if ns.speculative_config:
            # NOTE: the engines refresh their /metrics counters once a second
            # (services/common/server.py): two periods pass before the scrape.
            time.sleep(2.0)
        for role, url in cluster.metrics_urls.items():
            if not ns.speculative_config:
                break
            with urllib.request.urlopen(url, timeout=10) as resp:
                spec[role.value] = spec_decode_counters(resp.read().decode())
    finally:
        cluster.close()
        if ns.keep_logs:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    _report(ns, rows, spec)
    return 0


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int]]:
    """The command line, checked, and its prompt lengths (exits with status 2, naming
    the flag, on a bad one)."""
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
    p.add_argument("--output-len", type=int, default=2,
                   help="tokens generated per request (> 2: the decode rate is reported)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding on the decode and colocated engines")
    p.add_argument("--prompt-pattern", choices=("random", "repeated"), default="random",
                   help="repeated: a random quarter of the prompt repeated four times")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_CHOICES),
                   help="every engine's quantized weights (the engines' --quantization)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="every engine's KV cache dtype: fp8 halves a 16-bit model's KV "
                        "bytes in the store and over the handoff")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="every engine with this many tensor-parallel worker processes")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="every engine with this many pipeline stages")
    ns = p.parse_args(argv)
    if ns.tensor_parallel_size < 1 or ns.pipeline_parallel_size < 1:
        p.error("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    if ns.output_len < 2:
        p.error("--output-len must be >= 2")
    if ns.speculative_config is not None:
        from tandem.engine.config import SpeculativeConfig

        try:
            SpeculativeConfig.from_json(ns.speculative_config)
        except ValueError as exc:
            p.error(f"--speculative-config: {exc}")
    lengths = [int(x) for x in ns.lengths.split(",") if x]
    if not lengths or min(lengths) < 1:
        p.error("--lengths must be positive integers")
    if max(lengths) + ns.output_len > ns.max_model_len:
        p.error("--max-model-len must exceed the longest prompt")

    return ns, lengths


def _report(ns: argparse.Namespace, rows: list[Row], spec: dict[str, dict[str, float]]
            ) -> None:
    """Print the host line, the table, decode rates and speculative decoding's counters;
    write the JSON file when ``--json`` names one."""
    print()
    print(f"host: {os.cpu_count()} CPUs, {ns.device}, dtype {ns.dtype}, model "
          f"{ns.model or 'SmolLM2-135M-Instruct (GGUF)'}, quantization "
          f"{ns.quantization or 'the checkpoint default'}, kv cache {ns.kv_cache_dtype}")
    print(_markdown(rows))
    if ns.output_len > 2:
        for r in rows:
            print(f"{r.prompt_tokens} tokens: decode {r.decode_tok_s_colocated} tok/s colocated, "
                  f"{r.decode_tok_s_disagg} tok/s disaggregated (batch 1)")
    for role, c in spec.items():
        print(f"speculative decoding ({role}): acceptance rate {c['acceptance_rate']:.3f}, "
              f"mean acceptance length {c['mean_acceptance_length']:.2f} "
              f"({c.get('spec_decode_num_accepted_tokens', 0):.0f} of "
              f"{c.get('spec_decode_num_draft_tokens', 0):.0f} draft tokens)")
    if ns.json is not None:
        doc: object = [asdict(r) for r in rows]
        if spec:
            doc = {"rows": doc, "speculative": spec}
        ns.json.write_text(json.dumps(doc, indent=2))

if __name__ == "__main__":
    sys.exit(main())

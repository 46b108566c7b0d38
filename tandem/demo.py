"""`make demo`: start the disaggregated stack, ask it a real question, print the answers, stop.

Starts what `tandem up` starts (redis-server, a KV store node, 1 prefill, 1 decode, the
router) on free ports, streams one chat answer over HTTP with the official ``openai``
client and one over the public gRPC API, prints them as they arrive, and stops everything
(no processes or files left behind).
"""

from __future__ import annotations

import argparse
import sys
import time

QUESTION = "What are the three primary colors? Answer in one sentence."


def ask_http(url: str, question: str, max_tokens: int) -> str:
    """Stream a chat answer through the OpenAI API; prints tokens as they arrive."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id
    start = time.perf_counter()
    ttft = None
    text = ""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, stream=True)
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.content or ""
        if ttft is None:
            ttft = time.perf_counter() - start
        text += delta
        print(delta, end="", flush=True)
    print(f"\n  [HTTP: {time.perf_counter() - start:.2f} s, first token after "
          f"{(ttft or 0) * 1000:.0f} ms]")
    return text


def ask_grpc(address: str, question: str, max_tokens: int) -> str:
    """Stream a chat answer through ``tandem.v1.GenerationService.Generate``."""
    import grpc

    from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    text = ""
    start = time.perf_counter()
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatMessages(messages=[
                generation_pb2.ChatMessage(role="user", content=question)]),
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
        for msg in stub.Generate(request, timeout=600):
            text += msg.text
            print(msg.text, end="", flush=True)
            if msg.HasField("usage"):
                t = msg.timings
                print(f"\n  [gRPC: {time.perf_counter() - start:.2f} s, "
                      f"{msg.usage.completion_tokens} tokens; TTFT {t.ttft_ns / 1e6:.0f} ms = "
                      f"prefill queue {t.prefill_queue_ns / 1e6:.0f} + compute "
                      f"{t.prefill_compute_ns / 1e6:.0f} + KV publish "
                      f"{t.kv_publish_ns / 1e6:.0f} ms (+ overhead); KV pull on decode "
                      f"{t.kv_pull_ns / 1e6:.0f} ms]")
    return text


def main(argv: list[str] | None = None) -> int:
    from tandem.up import Stack, StackConfig, StackError, raise_on_sigterm

    p = argparse.ArgumentParser(prog="tandem demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--colocated", action="store_true")
    args = p.parse_args(argv)
    cfg = StackConfig(port=0, grpc_port=0, model=args.model, colocated=args.colocated,
                      engine_args=["--kv-cache-memory", str(512 << 20)])
    raise_on_sigterm()
    print("Starting tandem (redis, KV store, prefill, decode, router) ...", flush=True)
    try:
        with Stack(cfg) as stack:
            print(f"Up: {stack.http_url} (HTTP), {stack.grpc_address} (gRPC)\n")
            print(f"Q: {args.question}\n\nA (HTTP, openai client, streamed):")
            ask_http(stack.http_url, args.question, args.max_tokens)
            print("\nA (gRPC GenerationService.Generate, streamed):")
            ask_grpc(stack.grpc_address, args.question, args.max_tokens)
            print("\nStopping ...")
    except StackError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    print("Done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

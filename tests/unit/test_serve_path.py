"""The streamed request path's accounting and batching: engine outputs grouped as they are
ready (``RequestStream.batches``), the request's ``Timings`` (no per-token attribution),
SSE chunks queued together written at once (``streaming._take_ready``), the router's event
loop choice, and the decode stub of ``tandem bench router-ceiling`` over real gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.bench.router_ceiling import StubDecodeServicer
from tandem.engine.outputs import EngineCoreOutput
from tandem.launch import free_port
from tandem.services.common.engine_loop import RequestStream
from tandem.services.router.main import event_loop_runner
from tandem.services.router.sequence import SeqDelta, Timings
from tandem.services.router.streaming import _TAKE, _take_ready
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc


class _NoLoop:
    """Stands in for the EngineLoop: records aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_nowait(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _out(tok: int, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput("r", [tok], finish_reason=finish)


def test_outputs_queued_together_come_as_one_batch_with_their_step_ends() -> None:
    async def run() -> list[list[tuple[list[int], int]]]:
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(_NoLoop(), "r", queue)  # type: ignore[arg-type]
        queue.put_nowait((_out(1), 10))
        got = []
        async for batch in stream.batches():
            got.append([(o.new_token_ids, t) for o, t in batch])
            if len(got) == 1:  # the consumer fell behind: three steps meanwhile
                for tok, t in ((2, 20), (3, 30), (4, 40)):
                    queue.put_nowait((_out(tok, "length" if tok == 4 else None), t))
        assert stream.finished
        return got

    assert asyncio.run(run()) == [[([1], 10)], [([2], 20), ([3], 30), ([4], 40)]]


def test_an_engine_error_comes_after_the_outputs_queued_before_it() -> None:
    async def run() -> tuple[list[int], bool]:
        queue: asyncio.Queue = asyncio.Queue()
        loop = _NoLoop()
        stream = RequestStream(loop, "r", queue)  # type: ignore[arg-type]
        for item in ((_out(1), 1), (_out(2), 2), ValueError("grammar")):
            queue.put_nowait(item)
        seen: list[int] = []
        with pytest.raises(ValueError, match="grammar"):
            async with stream:
                async for out in stream:
                    seen.extend(out.new_token_ids)
        return seen, bool(loop.aborted)

    # the engine dropped the request itself: no abort is sent for it
    assert asyncio.run(run()) == ([1, 2], False)


def test_timings_count_decode_tokens_and_no_per_token_latency() -> None:
    """The default path keeps no per-token attribution (it lives in the trace now)."""
    t = Timings(ttft_ns=5, decode_tokens=4)
    d = t.to_dict()
    assert d == {"ttft_ns": 5, "decode_tokens": 4}
    assert not any(k in Timings.__dataclass_fields__ for k in (
        "decode_grpc_ns", "decode_detokenize_ns", "decode_sse_ns", "decode_engine_ns"))


def test_sse_chunks_queued_together_are_one_write() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for item in ("b", "LAST", "usage", None):
        queue.put_nowait(item)
    assert _take_ready("a", queue) == ("abLASTusage", None)
    assert _take_ready("now", asyncio.Queue()) == ("now", _TAKE)


def test_event_loop_choice() -> None:
    assert event_loop_runner("asyncio") is asyncio.run
    uvloop = pytest.importorskip("uvloop")
    assert event_loop_runner("auto") is uvloop.run
    assert event_loop_runner("uvloop") is uvloop.run


def test_decode_stub_streams_max_tokens_with_the_first_message_fields() -> None:
    async def run() -> list[decode_pb2.DecodeResponse]:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(  # type: ignore[arg-type]
            StubDecodeServicer([5, 6], 0.0, "m"), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = decode_pb2_grpc.DecodeServiceStub(ch)
                req = decode_pb2.DecodeRequest(
                    request_id="r", prompt_token_ids=[1],
                    sampling_params=common_pb2.SamplingParams(max_tokens=3))
                load = await stub.GetLoad(common_pb2.GetLoadRequest())
                assert (load.role, load.model) == ("both", "m")
                start = decode_pb2.DecodeStreamRequest(stream=0, start=req)
                return [item.response async for resp in stub.DecodeStream(iter([start]))
                        for item in resp.items]
        finally:
            await server.stop(None)

    msgs = asyncio.run(run())
    assert [list(m.token_ids) for m in msgs] == [[5], [6], [5]]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[0].HasField("queue_ns") and not msgs[-1].HasField("queue_ns")


def test_bench_serve_sends_the_temperature_it_is_given(capsys) -> None:
    """``--temperature`` (vllm bench serve's flag) reaches every request's body; a negative
    one, or one on the greedy multi-turn dataset, is refused before any request."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tandem.bench.serve import main, run_rate

    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n'
                             b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
                             b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
        results, _ = asyncio.run(run_rate(url, "m", [([1000] * 4, 1)], float("inf"), 1.0,
                                          None, True, 0, temperature=0.7))
    finally:
        server.shutdown()
        thread.join(10)
    assert results[0].success and results[0].output_tokens == 1
    assert bodies[0]["temperature"] == 0.7
    assert main(["--temperature", "-1"]) == 2
    assert "--temperature: must be >= 0" in capsys.readouterr().err
    assert main(["--temperature", "0.5", "--dataset-name", "multi-turn"]) == 2
    assert "--temperature: the multi-turn dataset is greedy" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["completion", "chat", "chat-usage"])
def test_sse_template_chunks_equal_the_models_chunks(kind: str) -> None:
    """A streamed text chunk rendered from its template (``SSETemplate``) is the very text
    the chunk's model gives through ``sse``: the same deltas through a streamer whose
    templates are off give the same SSE lines, whatever the text holds."""
    from types import SimpleNamespace

    from tandem.services.router import chat_streamers as A
    from tandem.services.router import protocol as P

    fe = SimpleNamespace(model_name="m")

    def streamer() -> A.OpenAIStreamer:
        if kind == "completion":
            req = P.CompletionRequest(model="m", prompt="x", stream=True, n=2)
            return A.CompletionStreamer(fe, req, "cmpl-1", 2, ["x"], 1)  # type: ignore[arg-type]
        opts = {"include_usage": True, "continuous_usage_stats": True}
        creq = P.ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True, n=2,
            stream_options=opts if kind == "chat-usage" else None)
        return A.ChatStreamer(fe, creq, "chat-1", 1)  # type: ignore[arg-type]

    fast, slow = streamer(), streamer()
    slow.created = fast.created
    slow._templates = {0: None, 1: None}
    texts = ["Hello", ' "quoted"\n\\', "é😀", "\x00 nul", "", "end"]
    lines: list[tuple[list[str], list[str]]] = []
    for i, text in enumerate(texts):
        for idx in (0, 1):
            d = SeqDelta(index=idx, text=text, token_ids=[i],
                         finish_reason="stop" if i == len(texts) - 1 else None)
            got = [c if isinstance(c, str) else c() for c in fast.chunks(idx, d)]
            want = [c if isinstance(c, str) else c() for c in slow.chunks(idx, d)]
            lines.append((got, want))
    assert all(got == want for got, want in lines)
    assert sum(len(got) for got, _ in lines) >= 2 * (len(texts) - 1)
    if kind != "chat-usage":
        assert all(t is not None for t in fast._templates.values()) and fast._templates
    else:
        assert not fast._templates  # running usage: every chunk through its model

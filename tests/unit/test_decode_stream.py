"""``DecodeStream``: many decode requests over one call. The server side
(``services.decode.stream``) groups what is ready together, reports each request's failure
as its item and stops what is cancelled; the router side (``services.router.decode_mux``,
through ``InstancePool.decode``) hands each request its messages and errors as a call of
its own would, over real gRPC; ``services.decode.client.DecodeCall`` does so for one
blocking request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from tandem.bench.router_ceiling import StubDecodeServicer
from tandem.engine.validation import RequestError
from tandem.launch import free_port
from tandem.services.common.errors import FIELD_METADATA_KEY
from tandem.services.decode.client import DecodeCall
from tandem.services.decode.stream import serve_decode_stream
from tandem.services.router.client import InstancePool
from tandem.services.router.discovery import StaticDiscovery
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc


def _start(stream: int, rid: str, max_tokens: int = 3) -> decode_pb2.DecodeStreamRequest:
    return decode_pb2.DecodeStreamRequest(stream=stream, start=_req(rid, max_tokens))


def _cancel(stream: int) -> decode_pb2.DecodeStreamRequest:
    return decode_pb2.DecodeStreamRequest(stream=stream, cancel=True)


def _req(rid: str, max_tokens: int = 3) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=[1],
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens))


async def _poll(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait for an observable condition (the tests' polling rule, in asyncio)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class _Requests:
    """The caller's side of a DecodeStream: messages put in, ``close()`` half-closes."""

    def __init__(self) -> None:
        self._q: asyncio.Queue[decode_pb2.DecodeStreamRequest | None] = asyncio.Queue()

    def put(self, msg: decode_pb2.DecodeStreamRequest) -> None:
        self._q.put_nowait(msg)

    def close(self) -> None:
        self._q.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[decode_pb2.DecodeStreamRequest]:
        while (msg := await self._q.get()) is not None:
            yield msg


def test_outputs_ready_together_travel_as_one_message_in_order() -> None:
    """Two requests woken by one "engine step" each put a message: they go out as one
    DecodeStreamResponse, in the order the step woke them; the call ends once the
    caller closed its side and both requests are over."""
    async def run() -> list[list[tuple[str, list[int]]]]:
        step = asyncio.Event()
        started: list[str] = []

        async def responses(req: decode_pb2.DecodeRequest
                            ) -> AsyncIterator[decode_pb2.DecodeResponse]:
            started.append(req.request_id)
            await step.wait()
            yield decode_pb2.DecodeResponse(token_ids=[ord(req.request_id)],
                                            finish_reason=common_pb2.FINISH_REASON_LENGTH)

        reqs = _Requests()
        reqs.put(_start(0, "a"))
        reqs.put(_start(1, "b"))
        reqs.close()
        out = []
        gen = serve_decode_stream(reqs, responses)
        first = asyncio.ensure_future(gen.__anext__())
        await _poll(lambda: started == ["a", "b"], "both requests running")
        step.set()
        resp = await first
        out.append([(i.stream, list(i.response.token_ids)) for i in resp.items])
        async for resp in gen:
            out.append([(i.stream, list(i.response.token_ids)) for i in resp.items])
        return out

    assert asyncio.run(run()) == [[(0, [97]), (1, [98])]]


def test_a_failed_request_is_its_item_and_the_others_go_on() -> None:
    async def run() -> list[decode_pb2.DecodeStreamItem]:
        async def responses(req: decode_pb2.DecodeRequest
                            ) -> AsyncIterator[decode_pb2.DecodeResponse]:
            if req.request_id == "bad":
                raise RequestError("sampling_params.top_p", "sampling_params.top_p: must be "
                                   "in (0, 1]")
            yield decode_pb2.DecodeResponse(token_ids=[7],
                                            finish_reason=common_pb2.FINISH_REASON_STOP)

        reqs = _Requests()
        for stream, rid in enumerate(("bad", "good")):
            reqs.put(_start(stream, rid))
        reqs.close()
        return [i async for r in serve_decode_stream(reqs, responses) for i in r.items]

    items = {i.stream: i for i in asyncio.run(run())}
    bad, good = items[0], items[1]
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.error.field == "sampling_params.top_p"
    assert "must be in (0, 1]" in bad.error.message
    assert not bad.HasField("response")
    assert list(good.response.token_ids) == [7] and not good.HasField("error")


def test_cancel_stops_a_stream_and_a_running_stream_number_is_refused() -> None:
    """A cancel ends the stream's generator at once (its ``finally`` frees the engine's
    request); a second start with a running stream's number is refused, naming
    ``stream``; the call ending cancels what still runs."""
    async def run() -> tuple[list[str], list[decode_pb2.DecodeStreamItem]]:
        ended: list[str] = []
        forever = asyncio.Event()

        async def responses(req: decode_pb2.DecodeRequest
                            ) -> AsyncIterator[decode_pb2.DecodeResponse]:
            try:
                yield decode_pb2.DecodeResponse(token_ids=[1])
                await forever.wait()
                yield decode_pb2.DecodeResponse(token_ids=[2])
            finally:
                ended.append(req.request_id)

        reqs = _Requests()
        reqs.put(_start(0, "a"))
        reqs.put(_start(1, "b"))
        gen = serve_decode_stream(reqs, responses)
        items: list[decode_pb2.DecodeStreamItem] = []
        while len(items) < 2:
            items += (await gen.__anext__()).items
        reqs.put(_start(0, "c"))
        items += (await gen.__anext__()).items
        reqs.put(_cancel(0))
        reqs.put(_cancel(7))
        await _poll(lambda: ended == ["a"], "request a to end")
        await gen.aclose()  # the call ends with b still running
        assert ended == ["a", "b"]
        return ended, items

    _, items = asyncio.run(run())
    assert [i.stream for i in items] == [0, 1, 0]
    assert items[2].error.field == "stream" and "is running" in items[2].error.message


class _Counting(StubDecodeServicer):
    """The router-ceiling stub, counting its calls; ``bad*`` ids fail with a field error."""

    def __init__(self, interval_s: float = 0.0) -> None:
        super().__init__([5, 6], interval_s, "m")
        self.calls = {"DecodeStream": 0}

    async def responses(self, request: Any) -> Any:
        if request.request_id.startswith("bad"):
            raise RequestError("sampling_params.top_p", "sampling_params.top_p: must be in "
                               "(0, 1]")
        async for msg in super().responses(request):
            yield msg

    async def DecodeStream(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        self.calls["DecodeStream"] += 1
        async for resp in super().DecodeStream(request_iterator, context):
            yield resp


async def _serve(servicer: Any, address: str) -> grpc.aio.Server:
    """A started gRPC server with ``servicer`` as its DecodeService, on ``address``."""
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


def _with_server(servicer: Any, body: Callable[[str, InstancePool, grpc.aio.Server],
                                               Awaitable[None]]) -> None:
    async def run() -> None:
        address = f"127.0.0.1:{free_port()}"
        server = await _serve(servicer, address)
        pool = InstancePool(StaticDiscovery(decode=[address]))
        try:
            await body(address, pool, server)
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(run())


def test_router_requests_share_one_call_and_get_their_own_messages() -> None:
    servicer = _Counting()

    async def body(address: str, pool: InstancePool, server: grpc.aio.Server) -> None:
        async def collect(rid: str, n: int) -> list[list[int]]:
            return [list(m.token_ids) async for m in pool.decode(address, _req(rid, n))]

        got = await asyncio.gather(collect("x", 3), collect("y", 5), collect("z", 1))
        assert got == [[[5], [6], [5]], [[5], [6], [5], [6], [5]], [[5]]]
        assert servicer.calls == {"DecodeStream": 1}

    _with_server(servicer, body)


def test_router_cancel_aborts_on_the_instance_and_errors_keep_their_field() -> None:
    servicer = _Counting(interval_s=0.005)

    async def body(address: str, pool: InstancePool, server: grpc.aio.Server) -> None:
        call = pool.decode(address, _req("long", 10_000))
        seen = 0
        async for _ in call:
            seen += 1
            if seen == 2:
                break
        assert not call.done()
        call.cancel()
        assert call.done()
        await _poll(lambda: servicer._num_open == 0, "the instance to drop the request")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pool.decode(address, _req("bad-1")):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (FIELD_METADATA_KEY, "sampling_params.top_p") in list(
            err.value.trailing_metadata())
        # the call is still up for the next request
        assert [list(m.token_ids) async for m in pool.decode(address, _req("after", 2))] \
            == [[5], [6]]
        assert servicer.calls["DecodeStream"] == 1

    _with_server(servicer, body)


def test_a_broken_call_fails_every_request_on_it_and_the_next_opens_a_new_one() -> None:
    servicer = _Counting(interval_s=0.005)
    port = free_port()

    async def run() -> None:
        address = f"127.0.0.1:{port}"
        server = await _serve(servicer, address)
        pool = InstancePool(StaticDiscovery(decode=[address]))
        try:
            calls = [pool.decode(address, _req(f"r{i}", 10_000)) for i in range(3)]
            iters = [c.__aiter__() for c in calls]
            for it in iters:
                await it.__anext__()
            await server.stop(None)  # the instance goes away mid-stream
            for it in iters:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        await it.__anext__()
                assert err.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                            grpc.StatusCode.CANCELLED)
            assert all(c.done() for c in calls)
            server = await _serve(servicer, address)  # restarted on its address
            got = [list(m.token_ids) async for m in pool.decode(address, _req("again", 2))]
            assert got == [[5], [6]]
            assert servicer.calls["DecodeStream"] == 2
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(run())


def test_one_blocking_request_on_a_call_of_its_own() -> None:
    """``DecodeCall``: one request's messages in order, a stream's error raised as a
    ``grpc.RpcError`` with its code, details and field, ``cancel()`` aborting it."""
    servicer = _Counting(interval_s=0.005)

    async def body(address: str, pool: InstancePool, server: grpc.aio.Server) -> None:
        def blocking() -> None:
            with grpc.insecure_channel(address) as channel:
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
                msgs = list(DecodeCall(stub, _req("a", 3), timeout=30))
                assert [list(m.token_ids) for m in msgs] == [[5], [6], [5]]
                assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                with pytest.raises(grpc.RpcError) as err:
                    list(DecodeCall(stub, _req("bad-1"), timeout=30))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "top_p" in err.value.details()
                assert (FIELD_METADATA_KEY, "sampling_params.top_p") in tuple(
                    err.value.trailing_metadata())
                call = DecodeCall(stub, _req("long", 10_000), timeout=30)
                next(call)
                call.cancel()
                with pytest.raises(grpc.RpcError) as err:
                    list(call)
                assert err.value.code() == grpc.StatusCode.CANCELLED

        await asyncio.to_thread(blocking)
        await _poll(lambda: servicer._num_open == 0, "the instance to drop the request")
        assert servicer.calls == {"DecodeStream": 3}

    _with_server(servicer, body)


def test_a_draining_server_ends_the_call_once_its_streams_are_over() -> None:
    """With ``draining`` set, the call ends as soon as no stream runs on it, though the
    caller never closes its side (a server's grace period must not wait for it)."""
    async def run() -> tuple[list[int], bool]:
        draining = asyncio.Event()
        release = asyncio.Event()

        async def responses(req: decode_pb2.DecodeRequest
                            ) -> AsyncIterator[decode_pb2.DecodeResponse]:
            yield decode_pb2.DecodeResponse(token_ids=[1])
            await release.wait()
            yield decode_pb2.DecodeResponse(token_ids=[2],
                                            finish_reason=common_pb2.FINISH_REASON_LENGTH)

        reqs = _Requests()  # never closed
        reqs.put(_start(0, "a"))
        gen = serve_decode_stream(reqs, responses, draining)
        got = [t for i in (await gen.__anext__()).items for t in i.response.token_ids]
        draining.set()
        nxt = asyncio.ensure_future(gen.__anext__())
        release.set()  # the running stream still finishes
        got += [t for i in (await nxt).items for t in i.response.token_ids]
        ended = False
        try:
            await asyncio.wait_for(gen.__anext__(), 10)
        except StopAsyncIteration:
            ended = True
        return got, ended

    assert asyncio.run(run()) == ([1, 2], True)


class _Engine(_Counting):
    """The stub with two rules of the real engine: a request id in flight is refused
    (INVALID_ARGUMENT, as ``EngineLoop.add_request``), and each token is the prompt's
    first token, so a stream's tokens say whose they are."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: set[str] = set()
        #: tokens sent, all streams together
        self.num_sent = 0

    async def responses(self, request: Any) -> Any:
        rid = request.request_id
        if rid in self.in_flight:
            raise ValueError(f"request_id {rid!r} is already in flight")
        self.in_flight.add(rid)
        try:
            n = request.sampling_params.max_tokens
            for i in range(n):
                await asyncio.sleep(0)
                self.num_sent += 1
                yield decode_pb2.DecodeResponse(
                    token_ids=[request.prompt_token_ids[0]],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if i == n - 1 else 0)
        finally:
            self.in_flight.discard(rid)


def test_a_request_id_in_flight_is_the_instances_400_not_the_routers_error() -> None:
    """Two streams with one request id reach the instance, which refuses the second
    (INVALID_ARGUMENT: the router's 400); the router raised a ValueError
    of its own (a 500) before."""
    servicer = _Engine()

    async def body(address: str, pool: InstancePool, server: grpc.aio.Server) -> None:
        first = pool.decode(address, _req("dup", 10_000))
        it = first.__aiter__()
        await it.__anext__()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pool.decode(address, _req("dup", 2)):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already in flight" in (err.value.details() or "")
        first.cancel()

    _with_server(servicer, body)


def test_a_cancelled_streams_late_messages_never_reach_a_new_stream_of_its_id() -> None:
    """Cancel a stream while its messages are still arriving and start its request id
    again at once: the new stream gets only its own tokens (streams are numbered, never
    reused), many times over."""
    servicer = _Engine()

    async def body(address: str, pool: InstancePool, server: grpc.aio.Server) -> None:
        for _ in range(20):
            old = pool.decode(address, _req_prompt("same", 1, 10_000))
            it = old.__aiter__()
            await it.__anext__()
            # cancel with the old stream's tokens still on their way: the instance has
            # sent some past the one the router read
            sent = servicer.num_sent
            await _poll(lambda sent=sent: servicer.num_sent >= sent + 8,
                        "more old tokens sent")
            old.cancel()
            new = [t async for m in pool.decode(address, _req_prompt("same", 2, 3))
                   for t in m.token_ids]
            assert new == [2, 2, 2]
            await _poll(lambda: not servicer.in_flight, "the old request to be over")

    _with_server(servicer, body)


def _req_prompt(rid: str, first: int, max_tokens: int) -> decode_pb2.DecodeRequest:
    req = _req(rid, max_tokens)
    req.prompt_token_ids[0] = first
    return req

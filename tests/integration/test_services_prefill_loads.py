"""A prefill that loads a stored prefix takes its load result from the mailbox.

Bug pinned: the KV connector posts a request's finished store load to
``TransferEvents`` (``on_load_done``), kept until a handler takes it with ``pop_load``;
only the decode servicer took it, so every prefill that loaded a stored prefix left its
``LoadResult`` in the prefill instance's mailbox for the life of the process.

Prefill A (a `tandem serve --role prefill` process) computes and publishes a prompt;
prefill B, the same engine and servicer built in this process (as ``services.common.
server`` builds them) so that the test reads its mailbox, serves the prompt again and
loads A's blocks from a real KV store node over real Redis.
"""

from __future__ import annotations

import asyncio

import grpc
from ports import free_port
from services_harness import params, random_prompt, wait_published

from tandem.contracts.role import Role
from tandem.engine.engine_core import EngineCore
from tandem.services.common.context import ServiceContext
from tandem.services.common.engine_loop import EngineLoop
from tandem.services.common.server import build_engine_config, build_parser
from tandem.services.prefill.servicer import PrefillServicer
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "64", "--block-size", "16"]


def test_prefill_takes_the_load_result_of_a_stored_prefix(tiny, redis_url, prefill) -> None:
    prompt = random_prompt(23, 100)  # 6 full blocks and a partial one
    computed = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="on-a", prompt_token_ids=prompt, sampling_params=params(1)
        ),
        timeout=60,
    )
    assert computed.num_cached_tokens == 0
    wait_published(redis_url, computed)  # A answers before its publish ends

    ns = build_parser("tandem prefill", Role.PREFILL).parse_args(
        ["--model", tiny, "--redis-url", redis_url, "--dtype", "float32", *ENGINE_ARGS]
    )
    config = build_engine_config(ns, Role.PREFILL)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        engine_loop = await EngineLoop.launch(
            lambda: EngineCore(config), loop, lambda engine: engine.connector_worker.has_pending
        )
        ctx = ServiceContext(Role.PREFILL, engine_loop, config)
        ctx.attach_connector_events(loop)
        assert ctx.transfers is not None
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(ctx), server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = prefill_pb2_grpc.PrefillServiceStub(channel)
                loaded = await stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="on-b", prompt_token_ids=prompt, sampling_params=params(1)
                    ),
                    timeout=60,
                )
            assert loaded.first_token_id == computed.first_token_id
            assert loaded.num_cached_tokens == 96, "B computed the prefix instead of loading it"
            # The load finished before B computed the tail; the handler has answered.
            assert ctx.transfers.pending_loads() == 0, "the load result stayed in the mailbox"
        finally:
            await server.stop(0)
            await engine_loop.shutdown()
            ctx.close()

    asyncio.run(scenario())

"""The node's stream-message budget: with many streams in flight its default coalescing
interval widens (fewer, larger messages), while a client that set its own interval, or asked
for per-token messages, gets exactly that. Real loopback gRPC, a real NodeServer over the
labelled simulated engine."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.client import MeshClient, build_request
from gpumesh.node.app import NodeServer
from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.config import NodeConfig, load_node_config
from gpumesh.node.api.inference import NodeInferenceServicer
from gpumesh.node.state import ServingState
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig


class _Context:
    def invocation_metadata(self):
        return ()


async def test_the_budget_applies_to_the_default_interval_only():
    servicer = NodeInferenceServicer(SimEngine(SimEngineConfig(model_name="sim")), ServingState("n"),
                                 CoalescePolicy(0.02, 64, messages_per_s=2000))

    async def policy(**options):
        req = build_request([1, 2, 3], max_tokens=8)
        for k, v in options.items():
            setattr(req.stream_options, k, v)
        return (await servicer._prepare(req, _Context())).coalescing

    assert await policy() == CoalescePolicy(0.02, 64, 2000)
    assert await policy(max_tokens_per_chunk=8) == CoalescePolicy(0.02, 8, 2000)
    assert await policy(flush_interval_ms=5) == CoalescePolicy(0.005, 64, 0.0)  # kept as asked
    assert (await policy(per_token=True)).per_token


async def _messages(client: MeshClient, max_tokens: int) -> tuple[int, int]:
    msgs = tokens = 0
    async for chunk in client.stream(
            build_request([1, 2, 3], max_tokens=max_tokens, ignore_eos=True), timeout=60):
        msgs += 1
        tokens += len(chunk.token_ids)
    return msgs, tokens


async def test_many_streams_get_fewer_larger_messages():
    # 5 ms base interval, a budget of 10 messages/s: with 6 streams sending the interval is
    # 0.25 s (the cap; even a stream alone would get 0.1 s). Each stream takes ~0.6 s (120
    # tokens, a simulated step of ~5 ms), so about 3-4 messages each, against ~120 at the base
    # interval (101 measured with the budget off).
    node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                 serving={"port": 0, "node_id": "budget"},
                                 streaming={"flush_interval_ms": 5, "stream_messages_per_s": 10}),
                      SimEngine(SimEngineConfig(model_name="sim", time_scale=2.0)))
    await node.start()
    try:
        async with MeshClient(f"127.0.0.1:{node.port}") as client:
            got = await asyncio.gather(*(_messages(client, 120) for _ in range(6)))
    finally:
        await node.stop()
    assert all(tokens == 120 for _, tokens in got), got
    assert max(msgs for msgs, _ in got) <= 12, got


def test_the_budget_is_set_by_toml_or_env_and_validated(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('[engine]\nkind = "sim"\n[streaming]\nstream_messages_per_s = 500\n')
    assert load_node_config(toml, environ={}).streaming.stream_messages_per_s == 500
    env = {"GPUMESH_NODE_STREAMING__STREAM_MESSAGES_PER_S": "0"}
    assert load_node_config(toml, environ=env).streaming.stream_messages_per_s == 0
    assert NodeConfig().streaming.stream_messages_per_s == 2000
    toml.write_text('[engine]\nkind = "sim"\n[streaming]\nstream_messages_per_s = -1\n')
    with pytest.raises(ValueError, match="streaming.stream_messages_per_s: must be >= 0"):
        load_node_config(toml, environ={})

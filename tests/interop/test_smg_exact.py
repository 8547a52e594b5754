"""SMG's event-driven (exact) cache_aware mode against gpumesh sim nodes: the nodes stream
their KV block events on VllmEngine.SubscribeKvEvents, and a real SMG gateway (smg 1.13.0)
sends a request to the node that holds its prefix, also when SMG never routed that prefix
itself (the prefix is put on a node directly, bypassing SMG)."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from tests.interop.smgproc import SmgProcess, smg_over_sim_nodes

pytestmark = [pytest.mark.slow]
tokenizers = pytest.importorskip("tokenizers")

ROUTED = "x-smg-routed-worker-id"


@pytest.fixture(scope="module")
async def fleet(tiny_model_dir: Path, smg_exe: Path):
    async with smg_over_sim_nodes(smg_exe, tiny_model_dir, "smg-x",
                                  extra=["--log-level", "info"]) as pair:
        yield pair


def _post(base: str, body: dict) -> str:
    """POST /v1/completions (unary); returns the worker SMG routed it to."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        json.load(resp)
        return resp.headers.get(ROUTED, "")


def _metric(smg: SmgProcess, name: str) -> float:
    url = f"http://127.0.0.1:{smg.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return sum(float(line.rpartition(" ")[2]) for line in r.read().decode().splitlines()
                   if line.startswith(name))


async def test_smg_exact_mode_routes_to_the_node_holding_the_prefix(fleet, tiny_model_dir):
    smg, nodes = fleet
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    words = [w for w in ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo "
                         "lima mike november oscar papa quebec romeo sierra tango").split()]
    for k, home in enumerate([1, 0, 1, 0]):
        rng = random.Random(k)
        prefix = " ".join(rng.choice(words) for _ in range(400))
        ids = tok.encode(prefix + " first").ids
        # Put the prefix on one node directly: SMG never sees this request.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{nodes[home].port}") as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            req = vpb.GenerateRequest(request_id=f"warm-{k}", tokenized=vpb.TokenizedInput(
                input_ids=ids), sampling_params=vpb.SamplingParams(max_tokens=1),
                stream=False)
            async for _ in stub.Generate(req, timeout=30):
                pass
        log = nodes[home].vllm_service.kv_log
        assert log is not None and len(log.held) >= len(ids) // 16 - 1
        await asyncio.sleep(1.0)   # SMG applies the streamed events
        routed = await asyncio.to_thread(_post, smg.base, {
            "model": str(tiny_model_dir), "prompt": prefix + " second", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert routed.endswith(f":{nodes[home].port}"), (k, routed, smg.log())
    assert "Learned block_size from KV event" in smg.log() or \
        _metric(smg, "smg_kv_event_subscriptions_total") > 0, smg.log()


async def test_stream_snapshot_and_resume(fleet):
    """A fresh subscriber gets the held blocks as a snapshot; a cursor the node never issued
    is refused with OUT_OF_RANGE (SMG then subscribes from 0)."""
    _, nodes = fleet
    log = nodes[1].vllm_service.kv_log
    assert log is not None and log.held
    async with grpc.aio.insecure_channel(f"127.0.0.1:{nodes[1].port}") as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=10)
        blocks = 0
        first = None
        async for b in call:
            if b.load.load_only:
                continue
            first = first or b
            assert b.snapshot.count >= 1
            blocks += sum(len(e.stored.blocks) for e in b.events if e.HasField("stored"))
            if b.snapshot.index == b.snapshot.count - 1:
                break
        call.cancel()
        assert first is not None and first.events[0].HasField("cleared")
        assert blocks == len(log.held)
        bad = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(
            start_sequence_number=log.seq + 1000), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in bad:
                pass
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE

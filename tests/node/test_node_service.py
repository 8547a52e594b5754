"""The node over real loopback gRPC, with the real vLLM CPU engine on the tiny model, in its own
process (as deployed), heartbeating to a recording control plane."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gpumesh import metadata as md
from gpumesh import tickets
from gpumesh.client import build_request
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.procs import RecordingControlPlane, free_port, node_proc, wait_serving

pytestmark = [pytest.mark.vllm]

SECRET = "node-test-secret"
NODE_ID = "vnode"


@pytest.fixture(scope="module")
async def cp():
    plane = RecordingControlPlane()
    addr = await plane.start()
    yield plane, addr
    await plane.stop()


@pytest.fixture(scope="module")
async def node(cp, tiny_model_dir, tmp_path_factory):
    plane, cp_addr = cp
    cfg = tmp_path_factory.mktemp("node") / "node.toml"
    cfg.write_text(f'[security]\nticket_secret = "{SECRET}"\n'
                   '[engine]\nnum_gpu_blocks_override = 64\nmax_model_len = 512\n'
                   'served_name = "tiny"\naliases = ["tiny-alias"]\n'
                   '[membership]\nheartbeat_busy_interval_s = 0.1\nheartbeat_idle_interval_s = 0.5\n'
                   '[serving]\ndrain_timeout_s = 20\n')
    port = free_port()
    proc = node_proc(NODE_ID, port, [cp_addr], model=str(tiny_model_dir), core=0, config=cfg)
    addr = f"127.0.0.1:{port}"
    try:
        await wait_serving(addr, proc)
        async with grpc.aio.insecure_channel(addr) as ch:
            yield proc, addr, ch
    finally:
        proc.close()


def stub(node) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(node[2])


async def _stream(node, req, **kw):
    chunks = []
    async for c in stub(node).GenerateStream(req, timeout=60, **kw):
        chunks.append(c)
    return chunks


async def test_stream_and_unary_agree_under_greedy(node):
    req = build_request("The mesh routes tokens", model="tiny", max_tokens=24, temperature=0,
                        ignore_eos=True)
    unary = await stub(node).Generate(req, timeout=60)
    chunks = await _stream(node, req)
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert len(unary.token_ids) == 24
    assert unary.finish_reason == pb.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens > 0
    assert chunks[0].request_id


async def test_coalescing_default_and_per_token(node):
    req = build_request("Count with me", model="tiny", max_tokens=40, temperature=0,
                        ignore_eos=True)
    coalesced = await _stream(node, req)
    per_token_req = build_request("Count with me", model="tiny", max_tokens=40, temperature=0,
                                  ignore_eos=True, per_token=True)
    per_token = await _stream(node, per_token_req)
    # per_token: the node does not coalesce; each engine output is its own message (vLLM
    # itself merges deltas only when its consumer lags, so messages stay ~1 token).
    assert sum(len(c.token_ids) for c in per_token) == 40
    assert len(coalesced[0].token_ids) == 1  # the first token goes alone
    assert len(coalesced) < len(per_token)
    assert "".join(c.text for c in coalesced) == "".join(c.text for c in per_token)


async def test_stop_string_ends_with_stop(node):
    base = build_request("Once upon a time", model="tiny", max_tokens=40, temperature=0,
                         ignore_eos=True)
    full = (await stub(node).Generate(base, timeout=60)).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    req = build_request("Once upon a time", model="tiny", max_tokens=40, temperature=0,
                        stop=[stop])
    resp = await stub(node).Generate(req, timeout=60)
    assert resp.finish_reason == pb.FINISH_REASON_STOP
    assert stop not in resp.text
    assert full.startswith(resp.text)


async def test_chat_and_token_id_prompts(node):
    chat = build_request([("system", "be brief"), ("user", "hi")], model="tiny-alias",
                         max_tokens=4, ignore_eos=True)
    resp = await stub(node).Generate(chat, timeout=60)
    assert resp.usage.completion_tokens == 4 and resp.usage.prompt_tokens > 4
    ids = build_request([5, 6, 7, 8], model="", max_tokens=3, ignore_eos=True)
    resp = await stub(node).Generate(ids, timeout=60)
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 3


@pytest.mark.parametrize("req, code, needle", [
    (build_request("hi", model="nope"), grpc.StatusCode.NOT_FOUND, "tiny"),
    (build_request("", model="tiny"), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (pb.GenerateRequest(model="tiny"), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    (build_request("hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (build_request("hi", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (build_request("hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (build_request("hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (build_request("hi", max_tokens=600), grpc.StatusCode.OUT_OF_RANGE, "512"),
    (build_request([1] * 510, max_tokens=8), grpc.StatusCode.OUT_OF_RANGE, "context window"),
    (build_request([10**9], max_tokens=2), grpc.StatusCode.INVALID_ARGUMENT, ""),
])
async def test_bad_input_gets_clear_status_and_node_keeps_serving(node, req, code, needle):
    for call in (stub(node).Generate, lambda r, **kw: _stream(node, r)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(req, timeout=30)
        assert err.value.code() == code, err.value.details()
        assert needle in err.value.details()
    ok = await stub(node).Generate(build_request("still fine", max_tokens=2), timeout=60)
    assert ok.usage.completion_tokens >= 1


async def test_cancel_aborts_in_engine(node, cp):
    plane, _ = cp
    req = build_request("a long answer", model="tiny", max_tokens=480, ignore_eos=True,
                        per_token=True)
    call = stub(node).GenerateStream(req, timeout=120)
    got = 0
    async for _ in call:
        got += 1
        if got == 3:
            break
    t_cancel = time.time()
    call.cancel()
    # The engine's own running count (from vLLM's scheduler stats) drops back to 0, and the
    # node's in-flight count too, long before 480 tokens could have been generated. (Placed
    # by the heartbeats' own send stamps: this process may read a backlog late.)
    seen_running = False
    for _ in range(100):
        await asyncio.sleep(0.1)
        recent = [m.heartbeat.load for _, m in plane.received
                  if m.WhichOneof("kind") == "heartbeat"
                  and m.heartbeat.sent_unix_ms > (t_cancel + 0.3) * 1000]
        seen_running = seen_running or any(h.load.num_running for h in plane.heartbeats(NODE_ID))
        if recent and recent[-1].num_running == 0 and recent[-1].in_flight == 0:
            break
    else:
        pytest.fail("engine still running the cancelled request")
    assert seen_running


async def test_deadline_aborts_in_engine(node, cp):
    plane, _ = cp
    req = build_request("deadline", model="tiny", max_tokens=480, ignore_eos=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(node).Generate(req, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    t0 = time.time()
    for _ in range(100):
        await asyncio.sleep(0.1)
        recent = [m.heartbeat.load for _, m in plane.received
                  if m.WhichOneof("kind") == "heartbeat"
                  and m.heartbeat.sent_unix_ms > (t0 + 0.3) * 1000]
        if recent and recent[-1].num_running == 0 and recent[-1].in_flight == 0:
            return
    pytest.fail("engine still running after the deadline")


async def test_heartbeats_carry_real_engine_numbers(node, cp):
    plane, _ = cp
    regs = [m.registration for m in plane.messages[NODE_ID]
            if m.WhichOneof("kind") == "registration"]
    assert regs and regs[0].models[0].name == "tiny" and regs[0].engine == "vllm"
    assert regs[0].models[0].max_context_length == 512
    t0 = time.time()
    # Keep four 450-token streams going (a new one as one ends) until a heartbeat shows at
    # least two running. Heartbeats are placed by their own send stamp (the node's wall clock,
    # taken with the load snapshot), not by when this process read them. Why a closed loop and
    # not four streams started together: on 2 cores this test process's event loop can stall
    # for 1-3 s (a loop-lag monitor saw it, the main thread sitting in epoll, while the node
    # kept sending heartbeats every 0.1 s), so four calls created at once can reach the node
    # one by one, each after the last ended (CI saw one running throughout).
    def beats() -> list:
        return [m.heartbeat for _, m in plane.received
                if m.WhichOneof("kind") == "heartbeat" and m.heartbeat.sent_unix_ms > t0 * 1000]

    async def one(i: int) -> int:
        n = 0
        req = build_request(f"load {i}", model="tiny", max_tokens=450, ignore_eos=True)
        async for chunk in stub(node).GenerateStream(req, timeout=120):
            n += len(chunk.token_ids)
        return n

    streams: set[asyncio.Task[int]] = set()
    started = 0
    deadline = time.monotonic() + 90
    try:
        while not any(h.load.num_running >= 2 for h in beats()):
            assert time.monotonic() < deadline, [(h.load.num_running, h.load.in_flight)
                                                 for h in beats()]
            while len(streams) < 4:
                streams.add(asyncio.create_task(one(started)))
                started += 1
            done, streams = await asyncio.wait(streams, timeout=0.2)
            assert all(t.result() == 450 for t in done)
        if streams:   # let the rest end: the node is idle for the next test
            done, streams = await asyncio.wait(streams, timeout=60)
            assert not streams and all(t.result() == 450 for t in done)
    finally:
        for t in streams:
            t.cancel()
    t_end = time.time()
    # Wait for an idle heartbeat sent after the streams ended: every earlier one has arrived.
    for _ in range(100):
        if any(h.sent_unix_ms > t_end * 1000 and not h.load.in_flight for h in beats()):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("no idle heartbeat after the streams ended")
    during = [h for h in beats() if h.load.in_flight]
    assert max(h.load.in_flight for h in during) >= 2
    assert max(h.load.kv_cache_usage for h in during) > 0
    assert max(h.load.generation_tokens_per_s for h in during) > 0
    assert max(h.load.prefill_capacity_tokens_per_s for h in during) > 0
    # Timed steps of the tiny model on a CPU core: well above 0, well under a second.
    assert 0 < max(h.load.decode_step_s for h in during) < 1.0
    seqs = [h.seq for h in plane.heartbeats(NODE_ID)]
    assert all(b > a for a, b in zip(seqs, seqs[1:]))
    # Busy heartbeats come at the configured 0.1 s pace (well under the 0.5 s idle pace).
    ts = [h.sent_unix_ms / 1000 for h in during]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    assert gaps and gaps[len(gaps) // 2] < 0.3


async def test_per_router_accounts_from_metadata_and_tickets(node, cp):
    plane, _ = cp
    md_req = build_request("accounted", model="tiny", max_tokens=2)
    await stub(node).Generate(md_req, timeout=60, metadata=((md.ROUTER_ID, "router-a"),))
    ticket, _ = tickets.issue(SECRET.encode(), "router-b", NODE_ID, 5, ttl_s=30)
    t_req = build_request("ticketed", model="tiny", max_tokens=2)
    t_req.ticket = ticket
    await stub(node).Generate(t_req, timeout=60)
    forged = build_request("forged", model="tiny", max_tokens=2)
    forged.ticket = ticket[:-3] + "AAA"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(node).Generate(forged, timeout=60)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    other = build_request("x", max_tokens=2)
    other.ticket, _ = tickets.issue(SECRET.encode(), "router-b", "another-node", 5, ttl_s=30)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(node).Generate(other, timeout=60)
    assert "another-node" in err.value.details()
    # A stream the client cancels after its first chunk ends too (finished_requests).
    long_req = build_request("cancelled", model="tiny", max_tokens=200, ignore_eos=True)
    call = stub(node).GenerateStream(long_req, timeout=60,
                                     metadata=((md.ROUTER_ID, "router-c"),))
    await call.read()
    call.cancel()

    def last_accounts() -> dict:
        return {a.router_id: a for a in plane.heartbeats(NODE_ID)[-1].load.router_accounts}

    for _ in range(100):   # the next heartbeat after the cancel shows it ended
        c = last_accounts().get("router-c")
        if c is not None and c.finished_requests == 1:
            break
        await asyncio.sleep(0.1)
    accounts = last_accounts()
    assert accounts["router-a"].admitted_requests == 1
    assert accounts["router-a"].first_token_requests == 1
    assert accounts["router-b"].admitted_requests == 1
    assert accounts["router-b"].admitted_prompt_tokens > 0
    for rid in ("router-a", "router-b", "router-c"):     # admitted, all ended: none held
        assert accounts[rid].HasField("finished_requests"), rid
        assert accounts[rid].finished_requests == accounts[rid].admitted_requests == 1, rid


async def test_reflection_lists_services_and_health_serving(node):
    ch = node[2]
    h = await health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service="gpumesh.v1.Inference"), timeout=5)
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)

    async def one():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for resp in refl.ServerReflectionInfo(one(), timeout=5):
        names = {s.name for s in resp.list_services_response.service}
        break
    assert {"gpumesh.v1.Inference", "grpc.health.v1.Health"} <= names


async def test_drain_last(node, cp):
    """Runs last in this module: the node drains and exits."""
    plane, _ = cp
    proc = node[0]
    long_req = build_request("drain me", model="tiny", max_tokens=150, ignore_eos=True)
    started = asyncio.Event()

    async def stream() -> int:
        got = 0
        async for chunk in stub(node).GenerateStream(long_req, timeout=120):
            got += len(chunk.token_ids)
            started.set()
        return got

    in_flight = asyncio.ensure_future(stream())
    # under way (first chunk in) before the drain order: one that came after would be refused
    await asyncio.wait_for(started.wait(), 60)
    plane.drain(NODE_ID)
    hs = health_pb2_grpc.HealthStub(node[2])
    for _ in range(50):
        await asyncio.sleep(0.1)
        h = await hs.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        if h.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
    else:
        pytest.fail("health never went NOT_SERVING")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(node).Generate(build_request("new", max_tokens=2), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert any(h.load.draining for h in plane.heartbeats(NODE_ID))
    assert await in_flight == 150  # the in-flight request still finishes
    # stop() blocks: run it off the loop that also serves the recording control plane.
    assert await asyncio.to_thread(proc.stop, 30) == 0
    for _ in range(20):
        if plane.messages[NODE_ID][-1].WhichOneof("kind") == "deregistration":
            break
        await asyncio.sleep(0.1)
    assert plane.messages[NODE_ID][-1].WhichOneof("kind") == "deregistration"

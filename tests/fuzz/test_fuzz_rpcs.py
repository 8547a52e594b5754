"""Property-based fuzzing of every RPC's request and every control-plane message, against a
real router and a real simulated node (processes, tests/fuzz/conftest.py).

The properties, for any input hypothesis draws: the call ends with a status that names what
was wrong (never UNKNOWN or INTERNAL), no process dies, and a good request still routes
afterwards. Bounded: a few hundred examples in all, no deadline per example."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# GPUMESH_FUZZ_EXAMPLES=N for a longer run (docs/security.md); the suite's default is bounded.
FUZZ = settings(max_examples=int(os.environ.get("GPUMESH_FUZZ_EXAMPLES", "60")), deadline=None,
                derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

text = st.text(max_size=40) | st.sampled_from(["sim", "", "\x00", "é" * 3, "a" * 5000])
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=draw(text), request_id=draw(text), routing_key=draw(text),
                             ticket=draw(text))
    kind = draw(st.sampled_from(["none", "text", "chat", "token_ids"]))
    if kind == "text":
        req.text = draw(text)
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            req.chat.messages.add(role=draw(text), content=draw(text))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(u32, max_size=20)))
    s = req.sampling
    if draw(st.booleans()):
        s.max_tokens = draw(st.integers(0, 40) | u32)
    if draw(st.booleans()):
        s.temperature = draw(floats)
    if draw(st.booleans()):
        s.top_p = draw(floats)
    if draw(st.booleans()):
        s.top_k = draw(u32)
    if draw(st.booleans()):
        s.seed = draw(u64)
    s.stop.extend(draw(st.lists(text, max_size=3)))
    s.ignore_eos = draw(st.booleans())
    o = req.stream_options
    o.flush_interval_ms = draw(u32)
    o.max_tokens_per_chunk = draw(u32)
    o.per_token = draw(st.booleans())
    return req


def _status(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# (what, status) -> count over this run; GPUMESH_FUZZ_TALLY=FILE writes it as JSON at the end
TALLY: Counter[tuple[str, str]] = Counter()


def _ok(code: grpc.StatusCode, what: str = "request", n: int = 1) -> None:
    TALLY[(what, code.name)] += n
    assert code not in FORBIDDEN, code


def _drain_stream(call) -> None:
    for _ in call:
        pass


@FUZZ
@given(req=generate_requests(), target=st.sampled_from(["router", "node"]),
       stream=st.booleans())
def test_generate_requests(fuzz_mesh, req, target, stream):
    ch = fuzz_mesh.router_channel if target == "router" else fuzz_mesh.node_channel
    stub = pb_grpc.InferenceStub(ch)
    if stream:
        code = _status(lambda: _drain_stream(stub.GenerateStream(req, timeout=10)))
    else:
        code = _status(lambda: stub.Generate(req, timeout=10))
    _ok(code)
    assert fuzz_mesh.alive()


@FUZZ
@given(raw=st.binary(max_size=200),
       method=st.sampled_from(["/gpumesh.v1.Inference/Generate",
                               "/gpumesh.v1.Inference/ListModels",
                               "/gpumesh.v1.Router/GetFleet", "/gpumesh.v1.Router/Pick"]),
       target=st.sampled_from(["router", "node"]))
def test_raw_bytes_on_every_unary_rpc(fuzz_mesh, raw, method, target):
    ch = fuzz_mesh.router_channel if target == "router" else fuzz_mesh.node_channel
    call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
    _ok(_status(lambda: call(raw, timeout=10)), "raw request bytes")
    assert fuzz_mesh.alive()


@FUZZ
@given(req=generate_requests(), exclude=st.lists(text, max_size=3))
def test_pick_requests(fuzz_mesh, req, exclude):
    stub = cpb_grpc.RouterStub(fuzz_mesh.router_channel)
    _ok(_status(lambda: stub.Pick(cpb.PickRequest(request=req, exclude_node_ids=exclude),
                                  timeout=10)), "pick")
    assert fuzz_mesh.alive()


@st.composite
def served_models(draw) -> cpb.ServedModel:
    return cpb.ServedModel(name=draw(text), aliases=draw(st.lists(text, max_size=3)),
                           max_context_length=draw(u32), tensor_parallel_size=draw(u32),
                           capacity_weight=draw(st.floats(allow_nan=True)))


@st.composite
def node_messages(draw) -> cpb.NodeMessage:
    kind = draw(st.sampled_from(["registration", "heartbeat", "kv_cache", "deregistration"]))
    if kind == "kv_cache":
        return cpb.NodeMessage(kv_cache=cpb.KvCacheUpdate(
            model=draw(st.sampled_from(["sim", "other"]) | text), seq=draw(u64),
            snapshot=draw(st.booleans()), cleared=draw(st.booleans()),
            stored=draw(st.lists(u64, max_size=8)), removed=draw(st.lists(u64, max_size=8)),
            block_size=draw(u32)))
    if kind == "registration":
        return cpb.NodeMessage(registration=cpb.Registration(
            node_id=draw(st.sampled_from(["fz-a", "fz-b", "fuzz-node"]) | text),
            address=draw(st.sampled_from(["127.0.0.1:1", "h:80"]) | text),
            models=draw(st.lists(served_models(), max_size=4)), incarnation=draw(text),
            engine=draw(text), gpu_model=draw(text), max_concurrency=draw(u32),
            frontend_addresses=draw(st.lists(text, max_size=2))))
    if kind == "heartbeat":
        load = cpb.LoadReport(
            num_running=draw(u32), num_waiting=draw(u32), pending_prefill_tokens=draw(u64),
            kv_cache_usage=draw(st.floats()), prefix_cache_hit_rate=draw(st.floats()),
            generation_tokens_per_s=draw(st.floats()), in_flight=draw(u32),
            draining=draw(st.booleans()), prompt_tokens_per_s=draw(st.floats()),
            kv_capacity_tokens=draw(u64), prefill_capacity_tokens_per_s=draw(st.floats()),
            decode_step_s=draw(st.floats()))
        for _ in range(draw(st.integers(0, 2))):
            load.gpus.add(index=draw(u32), utilization=draw(st.floats()),
                          memory_used_bytes=draw(u64), memory_total_bytes=draw(u64))
        for _ in range(draw(st.integers(0, 2))):
            load.router_accounts.add(router_id=draw(text), admitted_requests=draw(u64),
                                     finished_requests=draw(u64))
        return cpb.NodeMessage(heartbeat=cpb.Heartbeat(
            seq=draw(u64), sent_unix_ms=draw(st.integers(-2**63, 2**63 - 1)), load=load))
    return cpb.NodeMessage(deregistration=cpb.Deregistration(reason=draw(text)))


_VALID_IDS = itertools.count()


@FUZZ
@given(messages=st.lists(node_messages(), min_size=1, max_size=6), registered=st.booleans())
def test_control_plane_message_sequences(fuzz_mesh, messages, registered):
    """``registered``: the sequence follows a valid Registration (of a made-up node, a new id
    each time: one that sent garbage stays quarantined), so what comes after it reaches
    validation, the registry and the prefix index."""
    if registered:
        messages = [cpb.NodeMessage(registration=cpb.Registration(
            node_id=f"fz-valid-{next(_VALID_IDS)}", address="127.0.0.1:1", incarnation="fz", engine="sim",
            models=[cpb.ServedModel(name="fz-model")])), *messages]
    stub = cpb_grpc.ControlPlaneStub(fuzz_mesh.router_channel)
    call = stub.Connect(iter(messages), timeout=10)
    code = _status(lambda: _drain_stream(call))
    _ok(code, "control-plane message", len(messages))
    assert fuzz_mesh.alive()
    # a hostile stream never takes the real node's place
    fleet = cpb_grpc.RouterStub(fuzz_mesh.router_channel).GetFleet(cpb.GetFleetRequest(),
                                                                   timeout=10)
    real = [n for n in fleet.nodes if n.node_id == "fuzz-node"]
    assert all(n.address.startswith("127.0.0.1:") for n in real)
    for n in fleet.nodes:
        if n.state != cpb.NODE_STATE_QUARANTINED:
            for m in n.models:
                assert math.isfinite(m.capacity_weight)


def test_good_requests_still_route_after_fuzzing(fuzz_mesh):
    """Runs last in this module (pytest keeps file order): the mesh still works."""
    assert fuzz_mesh.alive()
    fuzz_mesh.good_request_routes()
    out = os.environ.get("GPUMESH_FUZZ_TALLY")
    if out:
        rows = [{"what": w, "status": c, "count": n} for (w, c), n in sorted(TALLY.items())]
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")


def _vllm_methods() -> list[tuple[str, bool]]:
    from smg_grpc_proto import vllm_engine_pb2 as vpb

    svc = vpb.DESCRIPTOR.services_by_name["VllmEngine"]
    return [(f"/{svc.full_name}/{m.name}", m.server_streaming) for m in svc.methods
            if not m.client_streaming]


@FUZZ
@given(raw=st.binary(max_size=200), method=st.sampled_from(_vllm_methods()))
def test_raw_bytes_on_the_nodes_vllm_service(fuzz_mesh, raw, method):
    """vLLM's native gRPC service on the node: garbage bytes get a specific status."""
    name, streaming = method
    ch = fuzz_mesh.node_channel
    if streaming:
        call = ch.unary_stream(name, request_serializer=None, response_deserializer=None)
        code = _status(lambda: _drain_stream(call(raw, timeout=5)))
    else:
        call = ch.unary_unary(name, request_serializer=None, response_deserializer=None)
        code = _status(lambda: call(raw, timeout=5))
    assert code not in FORBIDDEN, (name, code)
    assert fuzz_mesh.alive()

"""LoRA adapter routing: the serves_adapter filter, the prediction's preference for nodes
holding the adapter (a missing adapter costs its load time), and the router's NOT_FOUND for an
adapter no node serves (table-driven, no servers)."""

from __future__ import annotations

import random

import grpc
import pytest

from gpumesh.router.dispatch.context import check_routing_fields
from gpumesh.router.errors import RouterError
from gpumesh.router.fleet import Registry
from gpumesh.router.scheduling import (
    Candidate,
    NoCandidate,
    NodeState,
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
)
from gpumesh.router.scheduling.filters import request_filters, serves_adapter
from gpumesh.types import LoadReport, ModelSpec, Registration
from gpumesh.v1 import inference_pb2 as pb



def cand(i: int, *, serves: tuple[str, ...] = ("a", "b"), loaded: tuple[str, ...] = (),
         load_s: float = 0.0, pending: int = 0, stale: bool = False,
         max_concurrency: int = 0, in_flight: int = 0) -> Candidate:
    report = None if stale else LoadReport(pending_prefill_tokens=pending,
                                           loaded_adapters=loaded, adapter_load_s=load_s)
    return Candidate(node_id=f"n{i}", address=f"n{i}:1",
                     state=NodeState.STALE if stale else NodeState.HEALTHY,
                     capacity_weight=1.0, max_concurrency=max_concurrency, report=report,
                     report_age_s=0.1, kv_cache_usage=0.0, router_in_flight=in_flight,
                     outstanding_prompt_tokens=0, outstanding_requests=0,
                     unreported_prompt_tokens=0, unreported_requests=0, adapters=serves)


def test_serves_adapter_filter_drops_nodes_that_cannot() -> None:
    cs = [cand(0, serves=("a",)), cand(1, serves=()), cand(2, serves=("b", "a"))]
    kept, dropped = serves_adapter("a")(cs)
    assert [c.node_id for c in kept] == ["n0", "n2"]
    assert dropped == {"n1": "does not serve adapter 'a'"}
    assert request_filters(RequestInfo("m", 1)) == ()


def pick(cs, adapter: str) -> str:
    p = build_policy(RoutingSettings(adapter_load_s=1.0))   # 8,000 prompt tokens/s default
    info = RequestInfo("m", 100, adapter=adapter)
    return select(p, cs, info, random.Random(1),
                  (*default_filters(0.92), *request_filters(info))).node_id


@pytest.mark.parametrize("nodes, expect", [
    # equal load: the node holding the adapter
    ([{"loaded": ()}, {"loaded": ("a",)}, {"loaded": ("b",)}], "n1"),
    # a short extra queue does not outweigh a 1 s load ...
    ([{"loaded": ("a",), "pending": 200}, {"pending": 0}], "n0"),
    # ... a long one does (20,000 queued tokens at 8,000/s: 2.5 s of wait)
    ([{"loaded": ("a",), "pending": 20_000}, {"pending": 0}], "n1"),
    # the only node that can serve it wins even when busier
    ([{"serves": (), "pending": 0}, {"serves": ("a",), "pending": 5000}], "n1"),
    # a fast measured load narrows the gap: the lighter node wins
    ([{"loaded": ("a",), "pending": 300}, {"pending": 0, "load_s": 0.01}], "n1"),
])
def test_adapter_preference_trades_with_load(nodes, expect) -> None:
    assert pick([cand(i, **kw) for i, kw in enumerate(nodes)], "a") == expect


def test_only_busy_adapter_nodes_queue_instead_of_going_elsewhere() -> None:
    """Nodes that serve the adapter are all at their limit: the request waits (busy), it is
    never sent to a node that cannot serve it."""
    cs = [cand(0, serves=(), pending=0), cand(1, serves=("a",), max_concurrency=1,
                                               in_flight=1)]
    info = RequestInfo("m", 100, adapter="a")
    p = build_policy(RoutingSettings())
    with pytest.raises(NoCandidate) as e:
        select(p, cs, info, random.Random(1), (*default_filters(0.92), *request_filters(info)))
    assert e.value.busy


def test_router_answers_not_found_for_an_adapter_no_node_serves() -> None:
    reg = Registry("r1", lease_ttl_s=10, freshness_s=5, clock=lambda: 0.0)
    for i, adapters in enumerate((("a",), ("b",))):
        reg.register(Registration(f"n{i}", f"n{i}:1", (ModelSpec("m", adapters=adapters),),
                                  "inc"), stream_id=i)
    check_routing_fields(pb.GenerateRequest(adapter="b"), reg, "m")   # served by n1
    with pytest.raises(RouterError) as e:
        check_routing_fields(pb.GenerateRequest(adapter="zzz"), reg, "m")
    assert e.value.code is grpc.StatusCode.NOT_FOUND and "a, b" in str(e.value)
    for bad in (pb.GenerateRequest(adapter="x" * 129), pb.GenerateRequest(routing_key="k" * 257)):
        with pytest.raises(RouterError) as e:
            check_routing_fields(bad, reg, "m")
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [m.adapters for m in reg.models()] == [("a", "b")]


@pytest.mark.parametrize("adapters, loaded, load_s, ok", [
    (("a", "b"), ("a",), 0.2, True),
    (tuple(f"a{i}" for i in range(1025)), (), 0.0, False),   # too many adapters listed
    (("x" * 129,), (), 0.0, False),                          # name too long
    (("a",), ("",), 0.0, False),                             # empty loaded name
    (("a",), (), float("nan"), False),                       # load time not finite
    (("a",), (), -1.0, False),
])
def test_node_adapter_fields_are_validated_where_they_enter(adapters, loaded, load_s,
                                                             ok) -> None:
    from gpumesh.router.fleet.validation import (
        InvalidNodeInput,
        NodeLimits,
        valid_load,
        valid_registration,
    )
    from gpumesh.v1 import control_pb2 as cpb

    reg = cpb.Registration(node_id="n1", address="h:1", incarnation="i", models=[
        cpb.ServedModel(name="m", adapters=adapters)])
    load = cpb.LoadReport(loaded_adapters=loaded, adapter_load_s=load_s)
    try:
        r = valid_registration(reg, NodeLimits())
        l = valid_load(load, NodeLimits())
    except InvalidNodeInput:
        assert not ok
    else:
        assert ok and r.models[0].adapters == adapters and l.loaded_adapters == loaded

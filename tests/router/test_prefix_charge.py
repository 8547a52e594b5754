"""What a dispatch charges the chosen node: the prompt tokens that node would still prefill,
i.e. the prompt less the prefix it holds (``locality.prefill_tokens``), in both of the
dispatcher's charges (proxy streams; blind: unary and lookaside). That charge is this
router's unreported load on the node (``unreported_prompt_tokens`` in the prediction,
scheduling.predictor): the prefill queue ahead and the KV estimate. A request without a cached prefix is charged its whole prompt."""

from __future__ import annotations

import random

import pytest

from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch.dispatcher import Dispatcher
from gpumesh.router.dispatch.context import RequestContext
from gpumesh.router.dispatch.records import DispatchRecord
from gpumesh.router.fleet import Registry
from gpumesh.router.scheduling import (
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
)
from gpumesh.types import LoadReport, ModelSpec, Registration
from gpumesh.v1 import inference_pb2 as pb
from tests.clock import ManualClock

RID = "r1"
KV = 100_000


def _fleet() -> tuple[Registry, Dispatcher]:
    clock = ManualClock()
    reg = Registry(RID, lease_ttl_s=3.0, freshness_s=1.0, clock=clock)
    for i, nid in enumerate(("holder", "other")):
        reg.register(Registration(nid, f"{nid}:1", (ModelSpec("m", ()),), "i1"), i + 1)
        reg.heartbeat(nid, i + 1, 1, 0, LoadReport(kv_cache_usage=0.1, kv_capacity_tokens=KV,
                                                   prefill_capacity_tokens_per_s=20_000.0))
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    d = Dispatcher(RouterConfig(serving={"router_id": RID}), reg, None,  # type: ignore[arg-type]
                   profile, default_filters(0.92), random.Random(1), clock)
    return reg, d


def _charged(reg: Registry, nid: str) -> tuple[int, int]:
    (c,) = [c for c in reg.candidates("m") if c.node_id == nid]
    return c.unreported_prompt_tokens, c.outstanding_prompt_tokens


CACHED = RequestInfo("m", 2000, cached_tokens={"holder": 1984})


async def _dispatch(d: Dispatcher, info: RequestInfo, mode: str,
                    exclude: frozenset[str] = frozenset()) -> str:
    if mode == "blind":    # lookaside Pick: the blind charge
        ctx = RequestContext(pb.GenerateRequest(), b"", info, d.clock() + 5.0, "")
        return (await d.pick(ctx, DispatchRecord(), exclude)).node_id
    dec = d.decide(info, exclude)   # proxy: the charge a stream makes on the decided node
    d._proxy_charge(info)(dec.node_id, dec)
    return dec.node_id


@pytest.mark.parametrize("mode", ["proxy", "blind"])
async def test_a_dispatch_charges_only_the_tokens_the_node_does_not_hold(mode: str) -> None:
    reg, d = _fleet()
    assert await _dispatch(d, CACHED, mode) == "holder"
    assert _charged(reg, "holder") == (16, 16)          # 2000 - 1984, not 2000
    # the same request on a node that holds none of it is charged its whole prompt
    assert await _dispatch(d, CACHED, mode, frozenset({"holder"})) == "other"
    assert _charged(reg, "other") == (2000, 2000)


@pytest.mark.parametrize("mode", ["proxy", "blind"])
async def test_without_a_cached_prefix_the_whole_prompt_is_charged(mode: str) -> None:
    reg, d = _fleet()
    nid = await _dispatch(d, RequestInfo("m", 2000), mode)
    assert _charged(reg, nid) == (2000, 2000)
    # a prefix held elsewhere changes nothing for the node that does not hold it
    other = "other" if nid == "holder" else "holder"
    info = RequestInfo("m", 2000, cached_tokens={nid: 1000})
    assert await _dispatch(d, info, mode, frozenset({nid})) == other
    assert _charged(reg, other) == (2000, 2000)

"""When the router disaggregates a request (router.dispatch.disagg.plan), table-driven over
candidate sets; and what it refuses from clients."""

from __future__ import annotations

import grpc
import pytest

from gpumesh.router import errors
from gpumesh.router.dispatch import disagg
from gpumesh.router.scheduling import Candidate, RequestInfo
from gpumesh.router.scheduling.types import NodeState
from gpumesh.v1 import inference_pb2 as pb

H, S, D = NodeState.HEALTHY, NodeState.STALE, NodeState.DRAINING


def cand(node_id: str, role: str, state: NodeState = H, in_flight: int = 0,
         max_concurrency: int = 0, kv: float = 0.0) -> Candidate:
    return Candidate(node_id=node_id, address=f"{node_id}:1", state=state,
                     capacity_weight=1.0, max_concurrency=max_concurrency, report=None,
                     report_age_s=0.0, kv_cache_usage=kv, router_in_flight=in_flight,
                     outstanding_prompt_tokens=0, outstanding_requests=0,
                     unreported_prompt_tokens=0, unreported_requests=0, role=role)


REQ = pb.GenerateRequest(model="m")
P, Dc, B = cand("p", "prefill"), cand("d", "decode"), cand("b", "both")
ALL = frozenset({"p", "d", "b"})


@pytest.mark.parametrize(("cands", "prompt", "want"), [
    # prefill + decode, long prompt: disaggregated (legs exclude everyone else)
    ([P, Dc, B], 600, (ALL - {"p"}, ALL - {"d"})),
    # a short prompt while a both node serves the model: whole
    ([P, Dc, B], 100, None),
    # no both node: even short prompts are disaggregated
    ([P, Dc], 10, (frozenset({"d"}), frozenset({"p"}))),
    # no healthy prefill node, or none at all: whole
    ([cand("p", "prefill", S), Dc, B], 600, None),
    ([Dc, B], 600, None),
    ([cand("p", "prefill", D), Dc], 600, None),
    # no decode node with room: whole
    ([P, cand("d", "decode", in_flight=4, max_concurrency=4), B], 600, None),
    ([P, cand("d", "decode", kv=0.95), B], 600, None),
    ([P, cand("d", "decode", S), B], 600, None),
    # one decode node full, another with room: the leg may use only the one with room
    ([P, cand("d", "decode", kv=0.95), cand("e", "decode")], 600,
     (frozenset({"d", "e"}), frozenset({"p", "d"}))),
])
def test_plan(cands, prompt: int, want) -> None:
    info = RequestInfo(model="m", prompt_tokens=prompt)
    assert disagg.plan(cands, REQ, info, 512) == want


@pytest.mark.parametrize("field", ["adapter", "resume"])
def test_adapters_and_continuations_are_served_whole(field: str) -> None:
    req = pb.GenerateRequest(model="m")
    if field == "adapter":
        req.adapter = "alpha"
    else:
        req.resume.ids.extend([1, 2])
    assert disagg.plan([P, Dc], req, RequestInfo(model="m", prompt_tokens=600), 0) is None


def test_clients_may_not_set_kv_transfer_params() -> None:
    with pytest.raises(errors.RouterError) as err:
        disagg.check_client_request(pb.GenerateRequest(kv_transfer_params="{}"))
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    disagg.check_client_request(pb.GenerateRequest())


def test_has_room() -> None:
    assert disagg.has_room(cand("d", "decode"))
    assert not disagg.has_room(cand("d", "decode", in_flight=2, max_concurrency=2))
    assert not disagg.has_room(cand("d", "decode", kv=0.9))

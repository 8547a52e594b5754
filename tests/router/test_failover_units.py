"""Pure pieces of failover: continuation requests, outlier ejection, the in-flight watch and
the first-token deadline (table-driven; the clock is injected)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from gpumesh.router import errors
from gpumesh import migration
from gpumesh.router.dispatch import failover
from gpumesh.router.dispatch.ejection import EjectionPolicy, OutlierEjector
from gpumesh.router.dispatch.watch import InFlightWatch
from gpumesh.v1 import inference_pb2 as pb
from tests.clock import ManualClock


def chunk(ids: list[int], finish: int = 0) -> bytes:
    return pb.GenerateStreamResponse(token_ids=ids, finish_reason=finish).SerializeToString()


def test_resume_request_carries_delivered_tokens_and_keeps_the_rest() -> None:
    req = pb.GenerateRequest(model="m", text="hi", request_id="r1")
    req.sampling.max_tokens = 10
    req.sampling.temperature = 0.0
    p = migration.StreamProgress()
    for c in (chunk([5]), chunk([6, 7])):
        p.observe(c)
    nxt = migration.resume_request(req, p)
    assert nxt is not None and list(nxt.resume.ids) == [5, 6, 7]
    assert nxt.text == "hi" and nxt.sampling.max_tokens == 10 and nxt.request_id == "r1"
    assert not req.HasField("resume")          # the original is untouched
    p.observe(chunk(list(range(7))))            # 10 delivered: nothing left to generate
    assert migration.resume_request(req, p) is None
    end = pb.GenerateStreamResponse.FromString(
        migration.final_chunk(req, p, 3).SerializeToString())
    assert end.finish_reason == pb.FINISH_REASON_LENGTH and end.usage.completion_tokens == 10


def test_progress_notes_the_final_chunk_and_opt_out() -> None:
    p = migration.StreamProgress()
    assert not p.started
    p.observe(chunk([1], pb.FINISH_REASON_STOP))
    assert p.started and p.finished
    assert not migration.migratable(pb.GenerateRequest(no_migration=True))
    assert migration.migratable(pb.GenerateRequest())


def test_ejection_after_consecutive_failures_with_exponential_backoff() -> None:
    c = ManualClock(100.0)
    e = OutlierEjector(EjectionPolicy(consecutive_failures=3, base_s=1.0, max_s=3.0), c)
    for _ in range(2):
        e.failure("a", "UNAVAILABLE")
    assert not e.ejected("a")
    e.success("a", 0.1)                          # a success resets the count
    for _ in range(2):
        e.failure("a", "UNAVAILABLE")
    assert not e.ejected("a")
    e.failure("a", "UNAVAILABLE")
    assert e.ejected("a")
    c.t += 1.01
    assert not e.ejected("a")                    # re-admitted after 1 s
    for _ in range(3):
        e.failure("a", "UNAVAILABLE")
    assert e.ejected("a")
    c.t += 1.5
    assert e.ejected("a")                        # second ejection in a row: 2 s
    c.t += 0.6
    assert not e.ejected("a")
    for _ in range(3):
        e.failure("a", "UNAVAILABLE")
    c.t += 3.01
    assert not e.ejected("a")                    # capped at max_s = 3 s


def test_latency_outlier_ejected_only_against_enough_peers() -> None:
    c = ManualClock(100.0)
    e = OutlierEjector(EjectionPolicy(latency_factor=5.0, latency_min_s=0.5, min_peers=2,
                                      min_samples=3), c)
    for _ in range(5):
        e.success("slow", 3.0)
    assert not e.ejected("slow")                 # no peers measured yet
    for node in ("a", "b"):
        for _ in range(3):
            e.success(node, 0.2)
    for _ in range(3):
        e.success("slow", 3.0)
    assert e.ejected("slow")


def test_ejection_filter_keeps_everyone_when_all_are_ejected() -> None:
    c = ManualClock(100.0)
    e = OutlierEjector(EjectionPolicy(consecutive_failures=1), c)
    cands = [SimpleNamespace(node_id="a"), SimpleNamespace(node_id="b")]
    e.failure("a", "x")
    kept, dropped = e(cands)  # type: ignore[arg-type]
    assert [k.node_id for k in kept] == ["b"] and "a" in dropped
    e.failure("b", "x")
    kept, dropped = e(cands)  # type: ignore[arg-type]
    assert len(kept) == 2 and not dropped


@pytest.mark.parametrize("code,now,deadline,blames", [
    (grpc.StatusCode.UNAVAILABLE, 1, 10, True),
    (grpc.StatusCode.INTERNAL, 1, 10, True),
    (grpc.StatusCode.INVALID_ARGUMENT, 1, 10, False),    # the client's fault
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 1, 10, False),  # overload, not a fault
    (grpc.StatusCode.DEADLINE_EXCEEDED, 1, 10, True),    # the node's own deadline
    (grpc.StatusCode.DEADLINE_EXCEEDED, 10, 10, False),  # the client's deadline
])
def test_blames_node(code, now, deadline, blames) -> None:
    assert failover.blames_node(errors.RouterError(code, "x"), now, deadline) is blames


def test_continuable_bounded_by_migrations_and_deadline() -> None:
    e = errors.RouterError(grpc.StatusCode.UNAVAILABLE, "lost")
    assert failover.continuable(e, 0, 2, 1.0, 10.0)
    assert not failover.continuable(e, 2, 2, 1.0, 10.0)
    assert not failover.continuable(e, 0, 2, 10.0, 10.0)
    bad = errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert not failover.continuable(bad, 0, 2, 1.0, 10.0)


def test_first_token_wait_follows_the_expected_wait() -> None:
    cfg = SimpleNamespace(dispatch=SimpleNamespace(first_token_timeout_s=120.0,
                                                   first_token_min_s=10.0,
                                                   first_token_wait_factor=4.0))
    d = SimpleNamespace(considered=(SimpleNamespace(node_id="a", expected_wait_s=2.0),
                                    SimpleNamespace(node_id="b", expected_wait_s=None)))
    assert failover.first_token_wait(d, "a", cfg) == 18.0  # type: ignore[arg-type]
    assert failover.first_token_wait(d, "b", cfg) == 10.0  # type: ignore[arg-type]
    d2 = SimpleNamespace(considered=(SimpleNamespace(node_id="a", expected_wait_s=100.0),))
    assert failover.first_token_wait(d2, "a", cfg) == 120.0  # type: ignore[arg-type]


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_watch_loses_stalled_streams_on_stale_nodes_only() -> None:
    c = ManualClock(100.0)
    healthy = {"a": True, "b": False}
    w = InFlightWatch(lambda n, now: healthy.get(n, False), c, stall_s=0.5)
    on_a, on_b, moving_b = FakeCall(), FakeCall(), FakeCall()
    ta, tb, tm = w.track("a", on_a), w.track("b", on_b), w.track("b", moving_b)
    unary = w.track("b", FakeCall(), streaming=False)
    c.t += 0.6
    tm.progress(c.t)
    assert w.sweep() == 1
    assert on_b.cancelled and tb.lost and not on_a.cancelled and not moving_b.cancelled
    assert not unary.lost                        # a unary call shows no progress
    w.node_gone("b")                             # lease expired: the unary call too
    assert unary.lost and not tm.lost            # the moving stream keeps going
    for t in (ta, tb, tm, unary):
        w.untrack(t)
    assert w.in_flight("b") == 0


def test_watch_leaves_the_only_node_of_a_model_alone() -> None:
    """A stalled stream on a silent node is failed over only where another node can take it:
    on the model's only node, failing over could only fail it (a saturated node that reports
    late is still working); the node's departure from the fleet still ends the wait."""
    c = ManualClock(100.0)
    alternatives = {"a": False}
    w = InFlightWatch(lambda n, now: False, c, stall_s=0.5,
                      replaceable=lambda n, now: alternatives[n])
    call = FakeCall()
    t = w.track("a", call)
    c.t += 5.0
    assert w.sweep() == 0 and not call.cancelled and not t.lost
    alternatives["a"] = True                     # a second node came up
    assert w.sweep() == 1 and call.cancelled and t.lost


async def test_lost_call_tells_our_cancellation_from_the_clients() -> None:
    t = SimpleNamespace(lost="stalled", node_id="n")
    e = failover.lost_call(asyncio.CancelledError(), t)  # type: ignore[arg-type]
    assert isinstance(e, errors.RouterError) and e.code is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(asyncio.CancelledError):
        failover.lost_call(asyncio.CancelledError(), SimpleNamespace(lost="", node_id="n"))  # type: ignore[arg-type]

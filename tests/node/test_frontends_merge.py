"""node.frontends.merge_reports: one node's load report from its front-end processes'."""

from __future__ import annotations

import pytest

from gpumesh.types import LoadReport
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.node.report import merge_reports
from gpumesh.wire import load_report_from_proto


def report(**kw) -> LoadReport:
    accounts = kw.pop("accounts", ())
    gpus = kw.pop("gpus", ())
    return load_report_from_proto(cpb.LoadReport(
        router_accounts=[cpb.RouterAccount(router_id=r, admitted_requests=a,
                                           admitted_prompt_tokens=10 * a,
                                           first_token_requests=f,
                                           first_token_prompt_tokens=10 * f,
                                           finished_requests=d) for r, a, f, d in accounts],
        gpus=[cpb.GpuStats(index=i, utilization=u) for i, u in gpus], **kw))


def test_engine_figures_from_the_freshest_snapshot_own_counts_summed() -> None:
    main = report(num_running=5, num_waiting=1, kv_cache_usage=0.2, kv_capacity_tokens=8192,
                  in_flight=3, pending_prefill_tokens=40, generation_tokens_per_s=100.0,
                  prompt_tokens_per_s=10.0, prefill_capacity_tokens_per_s=1000.0,
                  decode_step_s=0.012, gpus=[(0, 0.9)],
                  accounts=[("r1", 10, 9, 7), ("r2", 4, 4, 4)])
    other = report(num_running=8, num_waiting=2, kv_cache_usage=0.5, kv_capacity_tokens=8192,
                   in_flight=4, pending_prefill_tokens=60, generation_tokens_per_s=120.0,
                   prompt_tokens_per_s=5.0, prefill_capacity_tokens_per_s=900.0,
                   decode_step_s=0.030, gpus=[(0, 0.1)], accounts=[("r1", 6, 5, 3)])
    m = merge_reports([(100.0, main), (100.5, other)])
    # the engine's state: the other front end saw the latest step's scheduler stats
    assert (m.num_running, m.num_waiting, m.kv_cache_usage) == (8, 2, 0.5)
    assert m.kv_capacity_tokens == 8192
    # each front end's own requests
    assert (m.in_flight, m.pending_prefill_tokens) == (7, 100)
    assert (m.generation_tokens_per_s, m.prompt_tokens_per_s) == (220.0, 15.0)
    assert m.prefill_capacity_tokens_per_s == 1900.0
    # the step: the smallest (a front end that missed steps' stats times longer intervals)
    assert m.decode_step_s == 0.012
    # GPUs: the main process's samples only
    assert [(g.index, g.utilization) for g in m.gpus] == [(0, 0.9)]
    acc = {a.router_id: a for a in m.router_accounts}
    assert (acc["r1"].admitted_requests, acc["r1"].admitted_prompt_tokens,
            acc["r1"].first_token_requests, acc["r1"].finished_requests) == (16, 160, 14, 10)
    assert acc["r2"].finished_requests == 4
    # the inputs are not modified
    assert main.in_flight == 3 and len(main.router_accounts) == 2


def test_draining_if_any_front_end_drains_and_unknown_steps_are_skipped() -> None:
    a = report(decode_step_s=0.0, draining=False)
    b = report(decode_step_s=0.0, draining=True)
    m = merge_reports([(0.0, a), (0.0, b)])
    assert m.draining and m.decode_step_s == 0.0
    assert merge_reports([(0.0, a), (0.0, report(decode_step_s=0.02))]).decode_step_s == 0.02
    with pytest.raises(ValueError):
        merge_reports([])

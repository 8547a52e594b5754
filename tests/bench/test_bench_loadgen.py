"""The load generator against a tiny in-test Inference server with a scripted stream."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh_bench import cli
from gpumesh_bench.loadgen import LoadConfig, run_load
from gpumesh_bench.stats import SLO, summarize
from gpumesh_bench.workload import LengthDist, WorkloadSpec, iter_requests
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc


class Scripted(pb_grpc.InferenceServicer):
    """First token after 5 ms alone, then 4-token chunks every 2 ms; every 7th request
    (index 3 mod 7) fails with RESOURCE_EXHAUSTED; even indices are served by n0, odd by n1."""

    def __init__(self) -> None:
        self.seen: list[pb.GenerateRequest] = []
        self.active = self.peak = 0

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        self.seen.append(request)
        idx = int(request.request_id.rsplit("-", 1)[-1])
        context.set_trailing_metadata(((md.NODE_ID, f"n{idx % 2}"),))
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(0.005)
            if idx % 7 == 3:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
            n = request.sampling.max_tokens
            yield pb.GenerateStreamResponse(text="a", token_ids=[1], request_id=request.request_id)
            sent = 1
            while sent < n:
                await asyncio.sleep(0.002)
                k = min(4, n - sent)
                sent += k
                last = sent == n
                yield pb.GenerateStreamResponse(
                    text="b" * k, token_ids=[2] * k,
                    finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                    usage=pb.Usage(prompt_tokens=len(request.text.split()), completion_tokens=n) if last else None)
        finally:
            self.active -= 1


@pytest.fixture
async def server():
    srv = grpc.aio.server()
    svc = Scripted()
    pb_grpc.add_InferenceServicer_to_server(svc, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield svc, f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


WL = WorkloadSpec(LengthDist.parse("uniform:5:40"), LengthDist.parse("uniform:2:20"), seed=1)


async def test_closed_loop(server) -> None:
    svc, target = server
    cfg = LoadConfig(target=target, concurrency=4, num_requests=30, progress_s=0)
    run = await run_load(cfg, iter_requests(WL))
    assert [r.index for r in run.results] == list(range(30))
    assert svc.peak <= 4
    want = list(itertools.islice(iter_requests(WL), 30))
    by_status = {r.index: r for r in run.results}
    for w in want:
        res = by_status[w.index]
        if w.index % 7 == 3:
            assert res.status == "RESOURCE_EXHAUSTED" and res.ttft_s is None
            assert res.node_id == f"n{w.index % 2}"  # trailing metadata survives errors
        else:
            assert res.status == "OK" and res.output_tokens == w.max_tokens
            assert res.prompt_tokens == w.prompt_tokens  # the synthesized text hits its target
            assert res.node_id == f"n{w.index % 2}"
            assert 0.004 < res.ttft_s <= res.latency_s
            assert res.chunks == 1 + -(-(w.max_tokens - 1) // 4)
    sent = {m.request_id: m for m in svc.seen}
    assert all(m.sampling.ignore_eos and m.sampling.HasField("max_tokens") for m in sent.values())
    s = summarize(run.results, SLO(ttft_ms=1000, tpot_ms=1000))
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 4} and s["ok"] == 26
    assert set(s["node_share"]) == {"n0", "n1"} and sum(s["node_share"].values()) == pytest.approx(1)
    assert s["goodput_fraction"] == pytest.approx(26 / 30)


async def test_open_loop_poisson_and_duration(server) -> None:
    _, target = server
    wl = dataclasses.replace(WL, rate=200.0)
    cfg = LoadConfig(target=target, rate=200.0, num_requests=40, progress_s=0)
    run = await run_load(cfg, iter_requests(wl))
    assert len(run.results) == 40
    reqs = list(itertools.islice(iter_requests(wl), 40))
    # each request started at (about) its arrival offset, whatever the latency
    lag = [res.start_s - w.arrival_s for res, w in zip(run.results, reqs)]
    assert min(lag) >= -0.001 and sorted(lag)[len(lag) // 2] < 0.02
    # duration bound: exactly the requests that arrive before it (whenever they start)
    cfg = LoadConfig(target=target, rate=200.0, duration_s=0.1, progress_s=0)
    run = await run_load(cfg, iter_requests(wl))
    assert 5 <= len(run.results) <= 40
    assert [r.index for r in run.results] == [w.index for w in reqs if w.arrival_s < 0.1]


async def test_cli_run_multiprocess_report_and_plot(server, tmp_path) -> None:
    svc, target = server
    out = tmp_path / "r.json"
    argv = ["run", "--target", target, "--concurrency", "4", "--requests", "24", "--procs", "2",
            "--prompt", "fixed:8", "--output", "fixed:6", "--label", "rr", "--slo-ttft-ms", "500",
            "--json", str(out), "--md", str(tmp_path / "r.md"), "--progress", "0"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    doc = json.loads(out.read_text())
    assert [r["index"] for r in doc["requests"]] == list(range(24))  # the union of both processes
    assert len({m.request_id for m in svc.seen}) == 24
    assert doc["summary"]["ok"] == 24 - 3 and doc["config"]["label"] == "rr"
    assert doc["summary"]["slo"]["tpot_ms"] is None  # infinity is written as null
    assert "| rr | c=4 |" in (tmp_path / "r.md").read_text()
    # a second "policy" at another load, then the table and the plot over both
    out2 = tmp_path / "r2.json"
    argv2 = ["run", "--target", target, "--rate", "100", "--requests", "10", "--label", "p2c",
             "--json", str(out2), "--progress", "0", "--no-requests"]
    assert await asyncio.to_thread(cli.main, argv2) == 0
    assert "requests" not in json.loads(out2.read_text())
    png = tmp_path / "p.png"
    assert await asyncio.to_thread(cli.main, ["plot", str(out), str(out2), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["report", str(out), str(out2)]) == 0


async def test_trace_replay(server, tmp_path) -> None:
    _, target = server
    trace = tmp_path / "t.jsonl"
    assert cli.main(["trace", "--out", str(trace), "--requests", "12", "--rate", "100",
                     "--prompt", "fixed:5", "--output", "fixed:3"]) == 0
    out = tmp_path / "t.json"
    argv = ["run", "--target", target, "--trace", str(trace), "--json", str(out), "--progress", "0"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["requests"] == 12 and doc["config"]["rate"] > 0
    assert all(r["output_tokens"] == 3 for r in doc["requests"] if r["status"] == "OK")


async def test_spread_workers_against_a_server_without_router_service_uses_the_target(
        server) -> None:
    """--spread-workers asks GetFleet for a router's workers; a node (no Router service:
    UNIMPLEMENTED) is driven as given. The multi-worker case: tests/integration/test_dataplane."""
    svc, target = server
    cfg = LoadConfig(target=target, concurrency=2, num_requests=6, progress_s=0,
                     spread_workers=True)
    run = await run_load(cfg, iter_requests(WL))
    assert len(run.results) == 6 and len(svc.seen) == 6


async def test_flush_interval_is_asked_for_when_set(server) -> None:
    svc, target = server
    for ms in (0, 20):
        svc.seen.clear()
        cfg = LoadConfig(target=target, concurrency=2, num_requests=4, progress_s=0,
                         flush_interval_ms=ms)
        await run_load(cfg, iter_requests(WL))
        assert {m.stream_options.flush_interval_ms for m in svc.seen} == {ms}

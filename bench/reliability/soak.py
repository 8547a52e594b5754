"""``gpumesh bench soak``: hours of load with things breaking, looking for slow leaks and lost
requests.

A ``FaultMesh`` (``--routers`` routers, ``--nodes`` simulated nodes, each admitting
``--max-concurrency`` requests) carries a closed-loop load that keeps ``--load`` (0.8) of the
fleet's admission slots busy (clients = load x nodes x max_concurrency; each stream
``--max-tokens`` tokens). Meanwhile:

- node churn: every ``--churn-every-s`` one node (round robin) is killed — SIGKILL and SIGTERM
  in turn — and restarted ``--down-s`` later;
- router restart: at half time router 1 is stopped gracefully (SIGTERM: drains) and started
  again on its port (with one router: SIGKILL, restarted at once);
- every ``--sample-every-s`` the resident memory of each process is sampled.

Reports (stdout, and ``--out`` JSON, by default under bench/reliability/results/): the tally
(sent, succeeded, migrated, retried, failed by code, lost; see ``faultmesh.Tally``) and RSS over
time; the RSS growth of router 0 (which runs throughout) compares the median of the first and
the last tenth of the samples after the first ``--warmup-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpumesh_bench import REPO_ROOT
from gpumesh_bench.reliability.faultmesh import FaultMesh, MeshSpec, Tally, closed_loop, rss_mb

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--max-concurrency", type=int, default=8, help="per node")
    p.add_argument("--load", type=float, default=0.8, help="share of admission slots kept busy")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--time-scale", type=float, default=20.0, help="sim engine slow-down")
    p.add_argument("--churn-every-s", type=float, default=60.0)
    p.add_argument("--down-s", type=float, default=2.0)
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--out", default="",
                   help="JSON result file (default bench/reliability/results/soak-*.json)")


def growth_pct(samples: list[tuple[float, float]], warmup_s: float) -> float | None:
    """RSS growth (%) from the first to the last tenth of ``samples`` (t, MiB) after
    ``warmup_s``: medians of each tenth; None with fewer than 10 samples."""
    xs = [mb for t, mb in samples if t >= warmup_s and mb > 0]
    if len(xs) < 10:
        return None
    k = max(1, len(xs) // 10)
    first, last = statistics.median(xs[:k]), statistics.median(xs[-k:])
    return 100.0 * (last - first) / first


async def soak(a: argparse.Namespace) -> dict[str, Any]:
    mesh = FaultMesh(MeshSpec(nodes=a.nodes, routers=a.routers, time_scale=a.time_scale,
                              max_concurrency=a.max_concurrency))
    await mesh.start()
    tally, stop = Tally(), asyncio.Event()
    clients = max(1, round(a.load * a.nodes * a.max_concurrency))
    t0 = time.monotonic()
    duration = a.minutes * 60
    rss: dict[str, list[tuple[float, float]]] = {}
    events: list[tuple[float, str]] = []
    load = asyncio.create_task(closed_loop(mesh.router_addresses, tally, stop,
                                           concurrency=clients, max_tokens=a.max_tokens,
                                           timeout_s=60.0))

    def event(what: str) -> None:
        events.append((round(time.monotonic() - t0, 2), what))
        log.info("soak %.0fs: %s", time.monotonic() - t0, what)

    async def sampler() -> None:
        while True:
            now = time.monotonic() - t0
            for name, pid in mesh.pids().items():
                rss.setdefault(name, []).append((round(now, 1), round(rss_mb(pid), 1)))
            await asyncio.sleep(a.sample_every_s)

    async def stop_node(i: int, sig: signal.Signals) -> None:
        node = mesh.nodes[i]
        assert node is not None
        mesh.signal_node(i, sig)
        try:
            await asyncio.to_thread(node.popen.wait, 60)
        except subprocess.TimeoutExpired:   # a drain that does not end: kill it
            event(f"node n{i} still draining after 60 s: SIGKILL")
            mesh.signal_node(i, signal.SIGKILL)
        event(f"node n{i} {sig.name} (exit {node.popen.returncode})")

    async def start_node(i: int) -> None:
        for _ in range(3):
            proc = mesh.start_node(i)
            try:
                await mesh.wait_fleet(a.nodes, 60, watch=False)
                event(f"node n{i} restarted")
                return
            except Exception as e:  # noqa: BLE001 - recorded, then tried again
                event(f"node n{i} restart failed ({type(e).__name__}: {e}; exit "
                      f"{proc.popen.poll()}): trying again")
                proc.kill()

    async def churn() -> None:
        k = 0
        while True:
            await asyncio.sleep(a.churn_every_s)
            i = k % a.nodes
            try:
                await stop_node(i, signal.SIGKILL if k % 2 == 0 else signal.SIGTERM)
                await asyncio.sleep(a.down_s)
                await start_node(i)
            except Exception as e:  # noqa: BLE001 - the soak goes on; the event says why
                event(f"churn of n{i} failed: {type(e).__name__}: {e}")
            k += 1

    async def router_restart() -> None:
        await asyncio.sleep(duration / 2)
        r = 1 if a.routers > 1 else 0
        sig = signal.SIGTERM if a.routers > 1 else signal.SIGKILL
        try:
            mesh.signal_router(r, sig)
            proc = mesh.routers[r]
            assert proc is not None
            await asyncio.to_thread(proc.popen.wait, 120)
            event(f"router r{r} {sig.name} (exit {proc.popen.returncode})")
            mesh.start_router(r)
            await mesh.wait_fleet(a.nodes, 60, router=r, watch=False)
            event(f"router r{r} restarted, its fleet rebuilt")
        except Exception as e:  # noqa: BLE001 - the soak goes on; the event says why
            event(f"router restart failed: {type(e).__name__}: {e}")

    tasks = [asyncio.create_task(c()) for c in (sampler, churn, router_restart)]
    try:
        await asyncio.sleep(duration)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        await asyncio.wait_for(load, 120)
        mesh.stop()
    wall = time.monotonic() - t0
    return {
        "command": "gpumesh bench soak " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "",
        "minutes": a.minutes, "nodes": a.nodes, "routers": a.routers, "clients": clients,
        "max_concurrency": a.max_concurrency, "max_tokens": a.max_tokens, "wall_s": wall,
        "sent": tally.sent, "succeeded": tally.succeeded, "migrated": tally.migrated,
        "retried": tally.retried, "failed": dict(tally.failed), "incomplete": tally.incomplete,
        "failure_examples": tally.examples,
        "lost": tally.lost, "stall_p99_s": tally.p99_stall_s(),
        "requests_per_s": tally.sent / wall,
        "router0_rss_growth_pct": growth_pct(rss.get("router0", []), a.warmup_s),
        "rss_mb": rss, "events": events,
    }


def main(a: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = asyncio.run(soak(a))
    out = Path(a.out) if a.out else (REPO_ROOT / "bench" / "reliability" / "results" /
                                     f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("rss_mb", "events")}
    for name, samples in sorted(result["rss_mb"].items()):
        mbs = [mb for _, mb in samples if mb > 0]
        if mbs:
            summary[f"rss_{name}_mb_first_last_max"] = (mbs[0], mbs[-1], max(mbs))
    print(json.dumps(summary, indent=1))
    print(f"written {out}")
    return 0 if result["lost"] == 0 else 1

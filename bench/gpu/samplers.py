"""What a bench observes beside its load: the router's view of each node (``FleetSampler``,
GetFleet once a second) and the host's cores per process group (``CpuSampler``)."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import grpc

from gpumesh_bench.gpu.group import fleet_once

# --- load and measurement ---------------------------------------------------------------------

class FleetSampler:
    """Polls a router's GetFleet once a second in a thread (the bench runs in processes)."""

    def __init__(self, router: str, status_at_s: float | None,
                 origin: float | None = None) -> None:
        """``origin``: the ``time.time()`` that sample times count from (the load's start
        instant, so ``summary(warm, warm + window)`` is the load's own window); None: from
        entering the context."""
        self.router = router
        self._origin = origin
        self.samples: list[dict[str, Any]] = []
        self.status_text = ""
        self._status_at = status_at_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        if self._origin is None:
            self._origin = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        assert self._origin is not None
        while not self._stop.wait(1.0):
            t = time.time() - self._origin
            with contextlib.suppress(grpc.RpcError):
                f = fleet_once(self.router)
                for n in f.nodes:
                    ld = n.load
                    self.samples.append({
                        "t": round(t, 1), "node": n.node_id, "running": ld.num_running,
                        "waiting": ld.num_waiting, "kv": round(ld.kv_cache_usage, 4),
                        "tok_s": round(ld.generation_tokens_per_s), "in_flight": ld.in_flight,
                        "step_s": ld.decode_step_s,
                        "gpus": [(g.index, round(g.utilization, 2), g.memory_used_bytes,
                               g.memory_total_bytes) for g in ld.gpus], "gpu_model": n.gpu_model})
            if self._status_at is not None and not self.status_text and t >= self._status_at:
                r = subprocess.run([sys.executable, "-m", "gpumesh.cli", "status", "--router",
                                    self.router], capture_output=True, text=True, timeout=20, check=False)
                self.status_text = r.stdout + r.stderr

    def summary(self, t_lo: float, t_hi: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for node in sorted({s["node"] for s in self.samples}):
            ss = [s for s in self.samples if s["node"] == node and t_lo <= s["t"] <= t_hi]
            if not ss:
                continue
            util = [g[1] for s in ss for g in s["gpus"]]
            mem = [g[2] for s in ss for g in s["gpus"]]
            out[node] = {
                "kv_mean": _mean([s["kv"] for s in ss]), "kv_max": max(s["kv"] for s in ss),
                "running_mean": _mean([s["running"] for s in ss]),
                # the node servicer's requests: in_flight - running - waiting is what sits in
                # the node process outside the engine (arriving, or streaming its last tokens)
                "in_flight_mean": _mean([s["in_flight"] for s in ss]),
                "waiting_max": max(s["waiting"] for s in ss),
                "step_ms_mean": _mean([s.get("step_s", 0.0) * 1000 for s in ss]),
                "tok_s_mean": _mean([s["tok_s"] for s in ss]),
                "gpu_util_mean": _mean(util) if util else math.nan,
                "gpu_mem_gib": max(mem) / 2**30 if mem else math.nan,
                "gpu_model": ss[-1]["gpu_model"]}
        return out

    def imbalance(self, t_lo: float, t_hi: float) -> dict[str, float]:
        """Two nodes: |in_flight A - in_flight B| (node-reported, the servicer's requests) and
        total waiting over the window's polls (each poll shows the last report of each)."""
        nodes = sorted({s["node"] for s in self.samples})
        if len(nodes) != 2:
            return {}
        by_t: dict[float, dict[str, dict[str, Any]]] = {}
        for s in self.samples:
            if t_lo <= s["t"] <= t_hi:
                by_t.setdefault(s["t"], {})[s["node"]] = s
        pairs = [v for v in by_t.values() if len(v) == 2]
        if not pairs:
            return {}
        diff = sorted(abs(v[nodes[0]]["in_flight"] - v[nodes[1]]["in_flight"]) for v in pairs)
        wait = [v[nodes[0]]["waiting"] + v[nodes[1]]["waiting"] for v in pairs]
        return {"polls": len(pairs), "in_flight_diff_p50": _pct(diff, 50),
                "in_flight_diff_max": diff[-1], "in_flight_diff_mean": _mean(diff),
                "waiting_sum_mean": _mean(wait), "waiting_sum_max": max(wait)}


class CpuSampler:
    """Where the host's cores go during a window: CPU seconds per process group between two
    instants (``time.time()``), as cores. Groups: each node's own process (vLLM's front end:
    output processing, detokenising, our gRPC servicer), the node's children (vLLM's engine
    core and, with TP, its workers), each router (its workers included), the load generator's
    processes; plus the whole machine's busy cores. Reads /proc through psutil (a vLLM
    dependency), so it costs nothing while the window runs."""

    def __init__(self, t_lo: float, t_hi: float) -> None:
        self.t_lo, self.t_hi = t_lo, t_hi
        self.cores: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(max(5.0, self.t_hi - time.time() + 5.0))

    @staticmethod
    def _snapshot() -> tuple[dict[int, tuple[int, list[str], float]], float]:
        import psutil

        procs: dict[int, tuple[int, list[str], float]] = {}
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times"]):
            with contextlib.suppress(psutil.Error, TypeError, AttributeError):
                ct = p.info["cpu_times"]
                procs[p.info["pid"]] = (p.info["ppid"], p.info["cmdline"] or [],
                                        ct.user + ct.system)
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        return procs, busy

    @staticmethod
    def label(pid: int, procs: dict[int, tuple[int, list[str], float]], me: int) -> str | None:
        """The group a process belongs to, by its nearest gpumesh ancestor (None: not ours).
        A node's other front-end processes (``frontends``) count as its front end."""
        from gpumesh.node.frontends import PROCESS_TITLE

        own = procs[pid][1] if pid in procs else []
        front = pid if own and own[0].startswith(PROCESS_TITLE) else None
        cur, hops = pid, 0
        while cur in procs and hops < 50:
            if cur == me:
                return "load generator" if pid != me else "bench driver"
            cmd = procs[cur][1]
            if "gpumesh.cli" in cmd and len(cmd) > cmd.index("gpumesh.cli") + 1:
                kind = cmd[cmd.index("gpumesh.cli") + 1]
                if kind not in ("node", "router"):
                    return None
                flag = "--node-id" if kind == "node" else "--router-id"
                name = cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else "?"
                if kind == "router":
                    return f"router {name}"
                return f"node {name}" + (" front end" if pid in (cur, front) else " engine")
            cur, hops = procs[cur][0], hops + 1
        return None

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # a diagnostic: never fails a bench
            time.sleep(max(0.0, self.t_lo - time.time()))
            a, busy_a = self._snapshot()
            t_a = time.time()
            time.sleep(max(0.0, self.t_hi - time.time()))
            b, busy_b = self._snapshot()
            dt = max(1e-6, time.time() - t_a)
            me = os.getpid()
            out: dict[str, float] = {}
            busiest: dict[str, float] = {}   # routers, node front ends: the busiest process
            for pid, (_, _, cpu) in b.items():
                lab = self.label(pid, b, me)
                if lab is None:
                    continue
                c = (cpu - a[pid][2] if pid in a else cpu) / dt
                out[lab] = out.get(lab, 0.0) + c
                if lab.startswith("router ") or lab.endswith(" front end"):
                    busiest[lab] = max(busiest.get(lab, 0.0), c)
            for lab, c in busiest.items():
                # One worker near a full core while the sum is well below workers x 1: the
                # kernel's SO_REUSEPORT split of client connections, not the router's total.
                out[f"{lab} busiest process"] = c
            out["machine (all processes)"] = (busy_b - busy_a) / dt
            self.cores = {k: round(v, 2) for k, v in sorted(out.items())}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _pct(xs: Sequence[float], p: float) -> float:
    from gpumesh_bench.stats import percentile

    return percentile(list(xs), p)

"""SMG gateways in front of the simulated fleet's nodes: ``smg launch`` processes
(gpumesh.launcher), their policy variants and their time constants scaled like gpumesh's."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh.launcher import free_port, wait_until
from gpumesh_bench.fleet import bench_child


@dataclass(frozen=True)
class SmgSpec:
    name: str                  # label
    policy: str
    interval_s: int            # --load-monitor-interval (integer seconds in SMG 1.13.0)
    flags: tuple[str, ...] = ()


def parse_smg(items: Sequence[str], time_scale: float) -> list[SmgSpec]:
    """``NAME=POLICY[@INTERVAL][:FLAGS]``; INTERVAL ``scaled`` = 10 s x time_scale."""
    out = []
    for it in items:
        name, _, rest = it.partition("=")
        head, _, flags = rest.partition(":")
        policy, _, iv = head.partition("@")
        interval = (max(1, round(10 * time_scale)) if iv == "scaled" else int(iv or 1))
        out.append(SmgSpec(name, policy, interval, tuple(flags.split())))
    return out


def smg_scaled_flags(time_scale: float) -> list[str]:
    """SMG's seconds / rates for a fleet slowed ``time_scale`` times (its defaults: 0.15 s KV
    pressure weight, 2000 tok/s fallback throughput)."""
    if time_scale <= 0 or time_scale == 1:
        return []
    return ["--least-load-kv-pressure-weight", f"{0.15 * time_scale:g}",
            "--least-load-default-throughput", f"{2000 / time_scale:g}"]


class SmgGateway:
    def __init__(self, exe: str | Path, spec: SmgSpec, workers: Sequence[str], model: str,
                 log_dir: Path, time_scale: float, cpus: str = "") -> None:
        self.spec = spec
        self.port, self.metrics_port = free_port(), free_port()
        self.argv = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                     "--worker-urls", *[f"grpc://{w}" for w in workers],
                     "--policy", spec.policy, "--model-path", model,
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                     "--load-monitor-interval", str(spec.interval_s), "--log-level", "warn",
                     *smg_scaled_flags(time_scale), *spec.flags]
        self.child = bench_child(f"smg-{spec.name}", self.argv, log_dir, cpus=cpus)
        self.base = f"http://127.0.0.1:{self.port}"
        self.n_workers = len(workers)

    def workers(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.base + "/workers", timeout=3) as r:
            return json.load(r).get("workers", [])

    def ready(self) -> bool:
        """Every worker registered, healthy and ready (raises ChildExited once SMG exited)."""
        self.child.check_alive()
        with contextlib.suppress(OSError, ValueError):
            ws = self.workers()
            return len(ws) == self.n_workers and all(
                w.get("is_healthy") and w.get("status") == "ready" for w in ws)
        return False

    def wait_ready(self, timeout_s: float) -> None:
        """Until :meth:`ready` (blocking); TimeoutError after ``timeout_s``."""
        wait_until(self.ready, timeout_s, watch=[self.child], what=self.child.name)

    def overload_metrics(self) -> dict[str, float]:
        """SMG's own counters of overload-protection and liveness fallbacks (Prometheus)."""
        out: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=3) as r:
                for line in r.read().decode().splitlines():
                    if not line.startswith("#") and ("overload" in line or "fallback" in line):
                        k, _, v = line.rpartition(" ")
                        if float(v):
                            out[k] = float(v)
        return out

    def load_versions(self) -> dict[str, str]:
        """Worker URL -> where its load came from ("pushed", a GetLoads version, or none)."""
        with contextlib.suppress(OSError, ValueError):
            return {w["url"]: (w.get("engine_load") or {}).get("version", "none")
                    for w in self.workers()}
        return {}

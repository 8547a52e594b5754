"""One front-door bench: the seed workload in a closed loop through one door (gpumesh gRPC,
OpenAI HTTP/SSE, or the bare engine's in-process loop), measured over one window, with the
CPU seconds of the door's own processes in that window.

Every door gets the same requests: ``gpumesh_bench.workload.synth_prompt`` text of the same
(seed, index) and the same output length (``ignore_eos``); all start at one instant and are
measured by ``gpumesh_bench.stats.window_metrics`` (QPS, TTFT and latency percentiles) over
the same window offsets."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumesh_bench.gpu.frontdoors.servers import BareEngine, tree_cpu
from gpumesh_bench.loadgen import LoadConfig, RequestResult


@dataclass
class Door:
    """How a bench reaches one front door. ``kind``: "grpc" (``address`` = host:port of a
    gpumesh router or node), "http" (``address`` = base URL of an OpenAI server: nginx or SMG),
    "bare" (``bare`` = the bare-engine processes, the load split evenly over them). ``roots``:
    the pids whose process trees are this door's processes (CPU accounting; vLLM engine
    processes are counted apart). ``model``: the model name HTTP requests carry."""

    name: str
    kind: str
    address: str = ""
    model: str = ""
    roots: list[int] = field(default_factory=list)
    bare: list[BareEngine] = field(default_factory=list)
    worker_nodes: dict[str, str] = field(default_factory=dict)


class _WordPrompts:
    """``smg_clients.http_send``'s prompt source: the gRPC load's own prompt text (one word
    per token of the dummy models' whitespace tokenizer)."""

    def prompt(self, n: int, seed: int, index: int) -> tuple[str, list[int]]:
        from gpumesh_bench.workload import synth_prompt

        return synth_prompt(n, seed, index), [0] * n


def _http_child(cfg: LoadConfig, prompt: str, output: str, model: str,
                worker_nodes: dict[str, str], k: int, n: int,
                start_at: float) -> list[dict[str, Any]]:
    from gpumesh_bench.multiproc import StreamSpec, proc_config, proc_requests
    from gpumesh_bench.loadgen import drive
    from gpumesh_bench.peers.smg_clients import http_send
    from gpumesh_bench.workload import LengthDist, WorkloadSpec

    spec = StreamSpec(WorkloadSpec(LengthDist.parse(prompt), LengthDist.parse(output), 0, model, 0.0))
    pcfg = proc_config(cfg, k, n)
    prompts = _WordPrompts()

    async def go() -> list[RequestResult]:
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            run = await drive(pcfg, proc_requests(spec, 0, k, n),
                              lambda r, t0: http_send(s, cfg.target, model, prompts,
                                                      worker_nodes, r, pcfg, t0))
            return run.results

    return [dataclasses.asdict(r) for r in asyncio.run(go())]


def http_load(cfg: LoadConfig, prompt: str, output: str, model: str,
              worker_nodes: dict[str, str], procs: int, start_at: float) -> list[RequestResult]:
    """``procs`` processes of streamed ``/v1/completions`` requests, ``cfg.concurrency`` in
    all, from one start instant (results' ``start_s`` count from it)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as ex:
        futs = [ex.submit(_http_child, cfg, prompt, output, model, worker_nodes, k, procs, start_at)
                for k in range(procs)]
        rows = [d for f in futs for d in f.result()]
    return sorted((RequestResult(**d) for d in rows), key=lambda r: r.index)


def grpc_load(cfg: LoadConfig, prompt: str, output: str, procs: int,
              start_at: float) -> list[RequestResult]:
    from gpumesh_bench.multiproc import StreamSpec, run_multi
    from gpumesh_bench.workload import LengthDist, WorkloadSpec

    spec = StreamSpec(WorkloadSpec(LengthDist.parse(prompt), LengthDist.parse(output), 0, "", 0.0))
    return run_multi(cfg, spec, procs, start_at=start_at).results


def bare_load(engines: Sequence[BareEngine], concurrency: int, duration_s: float,
              prompt_tokens: int, output_tokens: int, start_at: float,
              out_dir: Path) -> list[RequestResult]:
    """Each bare engine runs ``concurrency / len(engines)`` streams from ``start_at``."""
    n = len(engines)
    outs = []
    for k, e in enumerate(engines):
        out = out_dir / f"bare-{e.name}-{time.time_ns()}.json"
        outs.append(out)
        e.send({"cmd": "run", "concurrency": concurrency // n + (k < concurrency % n),
                "duration_s": duration_s, "start_at": start_at, "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens, "seed": 0, "index_base": k * 10**7,
                "out": str(out)})
    rows = [d for e, out in zip(engines, outs, strict=True)
            for d in e.collect(out, duration_s + (start_at - time.time()) + 240)]
    for out in outs:
        with contextlib.suppress(OSError):
            out.unlink()
    return sorted((RequestResult(**{**d, "node_id": f"{d['node_id']}-{i // 10**7}"})
                   for i, d in ((d["index"], d) for d in rows)), key=lambda r: r.index)


class _WindowCpu:
    """CPU seconds of some process trees between two instants (a thread; reads /proc)."""

    def __init__(self, groups: dict[str, list[int]], t_lo: float, t_hi: float) -> None:
        self.groups, self.t_lo, self.t_hi = groups, t_lo, t_hi
        self.cores: dict[str, float] = {}
        self._th = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _WindowCpu:
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._th.join(max(5.0, self.t_hi - time.time() + 10.0))

    def _snap(self) -> dict[str, float]:
        import psutil

        out: dict[str, float] = {}
        for g, roots in self.groups.items():
            c = tree_cpu(roots)
            out[f"{g} front"] = c["front"]
            out[f"{g} engine"] = c["engine"]
        t = psutil.cpu_times()
        out["machine"] = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        return out

    def _run(self) -> None:
        with contextlib.suppress(Exception):   # a diagnostic: never fails a bench
            time.sleep(max(0.0, self.t_lo - time.time()))
            a, ta = self._snap(), time.time()
            time.sleep(max(0.0, self.t_hi - time.time()))
            b, tb = self._snap(), time.time()
            dt = max(1e-6, tb - ta)
            self.cores = {k: round((b[k] - a.get(k, 0.0)) / dt, 3) for k in b}


def door_bench(door: Door, *, concurrency: int, warmup_s: float, window_s: float,
               prompt: str, output: str, procs: int, out_dir: Path,
               groups: dict[str, list[int]] | None = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """One closed-loop run through ``door``; a record with the window metrics, the door's CPU
    (cores in the window: ``cpu``; per output token: ``front_cpu_us_per_token``)."""
    from gpumesh_bench.stats import window_metrics

    dur = warmup_s + window_s
    n_procs = max(1, min(procs, concurrency))
    start_at = time.time() + (2.0 + 0.2 * n_procs if door.kind != "bare" else 1.0)
    cfg = LoadConfig(target=door.address, concurrency=concurrency, duration_s=dur,
                     timeout_s=180.0, seed=0, progress_s=0.0, label=door.name)
    cpu_groups = {"door": door.roots, **(groups or {})}
    with _WindowCpu(cpu_groups, start_at + warmup_s, start_at + dur) as cpu:
        if door.kind == "grpc":
            res = grpc_load(cfg, prompt, output, n_procs, start_at)
        elif door.kind == "http":
            res = http_load(cfg, prompt, output, door.model, door.worker_nodes, n_procs, start_at)
        else:
            p_tok = int(prompt.split(":")[-1])
            o_tok = int(output.split(":")[-1])
            res = bare_load(door.bare, concurrency, dur, p_tok, o_tok, start_at, out_dir)
    m = window_metrics(res, warmup_s, window_s)
    share: dict[str, int] = {}
    for r in res:
        if r.status == "OK" and warmup_s <= r.start_s + r.latency_s <= dur:
            share[r.node_id or "?"] = share.get(r.node_id or "?", 0) + 1
    rec: dict[str, Any] = {"door": door.name, "kind": door.kind, "concurrency": concurrency,
                           "warmup_s": warmup_s, "window_s": window_s, "prompt": prompt,
                           "output": output, "procs": n_procs if door.kind != "bare" else 0,
                           **m, "node_share": share, "cpu": cpu.cores}
    front = cpu.cores.get("door front")
    if front is not None and m.get("out_tok_s"):
        rec["front_cpu_us_per_token"] = round(front / m["out_tok_s"] * 1e6, 2)
    bad = [r for r in res if r.status != "OK"]
    log(f"[doors] {door.name:22} c={concurrency:<4} done_qps={m['done_qps']:7.1f} "
        f"qps={m['qps']:7.1f} p50={m['lat_p50']:.3f}s p99={m['lat_p99']:.3f}s "
        f"ttft50={m['ttft_p50']:.3f}s ttft99={m['ttft_p99']:.3f}s "
        f"front={front if front is not None else float('nan'):.2f} cores "
        f"({rec.get('front_cpu_us_per_token', float('nan'))} us/tok) errors={len(bad)} {share}")
    if res and len(bad) > len(res) / 2:
        raise RuntimeError(f"{door.name}: {len(bad)} of {len(res)} requests failed: "
                           f"{m.get('error_kinds')}")
    return rec

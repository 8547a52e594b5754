"""The references a node is measured against on the same GPUs: the raw-vLLM reference tool
(its own engines, unmodified) and the node's own engine in a closed loop without gRPC
(``gpumesh bench engine-loop``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh.launcher import ChildProcess
from gpumesh_bench.gpu.env import Env, GpuNodeSpec, node_toml
from gpumesh_bench.gpu.group import gpu_pids, wait_gpus_free
from gpumesh_bench.gpu.records import RAW_CONCURRENCY, fmt

# --- phases -------------------------------------------------------------------------------------

def phase_raw(env: Env, shape: str = "0.5b", dp: bool = False) -> None:
    """The raw-vLLM reference tool in this run at the reference's concurrency C: one
    engine on GPU 0; ``dp``: also two engines at once, C/2 each on GPUs 0 and 1 (the
    reference's data-parallel method), recorded as one row."""
    if env.engine != "vllm" or not env.raw_tool:
        print("[gpu-bench] raw: skipped (needs --engine vllm and --raw-tool)", flush=True)
        return
    c = RAW_CONCURRENCY[shape]
    tag = shape.replace(".", "")
    run_raw(env, shape, "raw vLLM (in session)", [("0", c, 0)], tag)
    if dp:
        run_raw(env, shape, "raw vLLM data parallel (in session)",
                [(g, c // 2, int(g)) for g in ("0", "1")], f"{tag}-dp")


def run_raw(env: Env, shape: str, setup: str, parts: Sequence[tuple[str, int, int]], tag: str,
            *, phase: str = "raw", gpu_mem: float | None = None,
            extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One run of the raw-vLLM reference tool (``env.raw_tool``, unmodified): an engine per
    (GPU, concurrency, seed) part, all at once, recorded as one row (QPS and tokens/s summed,
    latency percentiles the worst part's). ``gpu_mem``: the tool's ``--gpu-mem`` (its own
    default, 0.85, when None). Returns the record, or None when a part gave no result."""

    def argv(conc: int, json_out: Path, seed: int) -> list[str]:
        cmd = [sys.executable, env.raw_tool, "--shape", shape, "--tp", "1", "--concurrency",
               str(conc), "--seconds", str(env.window_s), "--warmup", str(env.warmup_s),
               "--base", str(env.models["0.5b"]), "--json", str(json_out), "--seed", str(seed)]
        return cmd + (["--gpu-mem", f"{gpu_mem:g}"] if gpu_mem is not None else [])

    def launch(cmd: list[str], gpu: str, log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})

    suffix = [f"-{g}" if len(parts) > 1 else "" for g, _, _ in parts]
    runs = [(g, argv(c, env.logs / f"raw-{tag}{x}.jsonl", seed), env.logs / f"raw-{tag}{x}.log")
            for (g, c, seed), x in zip(parts, suffix)]
    for _, cmd, _ in runs:
        Path(cmd[cmd.index("--json") + 1]).unlink(missing_ok=True)
    before = set(gpu_pids())   # a node sharing the GPU (phase vsraw) keeps its memory
    procs = [launch(cmd, g, log) for g, cmd, log in runs]
    for p in procs:
        try:
            p.wait(300)
        except subprocess.TimeoutExpired:
            p.kill()
    wait_gpus_free(keep=before)
    rows = []
    for _, cmd, log in runs:
        out = Path(cmd[cmd.index("--json") + 1])
        rows += [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    if len(rows) != len(runs):
        print(f"[gpu-bench] raw {shape} {setup}: no result\n"
              + "\n".join(log.read_text(errors="replace")[-1500:] for _, _, log in runs))
        return None
    rec = {"phase": phase, "setup": setup, "shape": shape, "call": env.call,
           "concurrency": sum(r["concurrency"] for r in rows),
           "qps": round(sum(r["qps"] for r in rows), 2),
           "lat_p50": max(r["lat_p50"] for r in rows), "lat_p99": max(r["lat_p99"] for r in rows),
           "ttft_p50": max(r["ttft_p50"] for r in rows),
           "out_tok_s": round(sum(r["out_tok_s"] for r in rows), 1),
           "command": " & ".join(f"CUDA_VISIBLE_DEVICES={g} python3 seed_table.py "
                                 + " ".join(cmd[2:]) for g, cmd, _ in runs),
           "engine": "vllm-raw", "parts": rows, **(extra or {})}
    env.records.append(rec)
    print(f"[gpu-bench] {phase:8} {shape} {setup:36} c={rec['concurrency']:<4} "
          f"qps={rec['qps']:7.1f} p50={rec['lat_p50']:.3f}s", flush=True)
    env.save()
    return rec


ENG_SETUPS = ("engine loop, 1 GPU (node's engine, no gRPC)",
              "engine loop, 2 GPUs data parallel (node's engine, no gRPC)")


def _max(xs: Sequence[Any]) -> Any:
    vs = [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
    return max(vs) if vs else None


def phase_eng(env: Env, shape: str, gpus: int) -> None:
    """The node's own engine in a closed loop in one process, without gRPC
    (``gpumesh bench engine-loop``, gpumesh_bench.overhead.engine_loop), on the node TOML a node
    of this shape gets in the other phases (same engine arguments, ``--engine-arg`` included),
    at the raw reference's concurrency C: one loop on GPU 0, then (two GPUs or more) two loops
    at once on GPUs 0 and 1, C/2 each, starting their load together, recorded as one row the way
    ``phase_raw`` combines its data-parallel pair (QPS and tokens/s summed, latency percentiles
    the worse of the two). Raw vs these rows is the node's engine configuration; these rows vs
    the node direct is the node's serving path (servicer, coalescing, gRPC)."""
    c = RAW_CONCURRENCY[shape]
    run_eng(env, shape, ENG_SETUPS[0], [("0", c)], f"{shape.replace('.', '')}-1gpu")
    if gpus >= 2:
        run_eng(env, shape, ENG_SETUPS[1], [("0", c // 2), ("1", c // 2)],
                f"{shape.replace('.', '')}-2gpu")


def run_eng(env: Env, shape: str, setup: str, parts: Sequence[tuple[str, int]], tag: str, *,
            phase: str = "eng", gpu_mem: float = 0.85,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine-loop row: a loop per (GPU, concurrency) part, their load started together,
    each engine at ``gpu_mem`` of its GPU. Raises when a loop gave no record."""
    n = len(parts)
    sync = env.logs / f"eng-{tag}-sync"
    if sync.exists():
        for f in sync.iterdir():
            f.unlink()
    children: list[tuple[ChildProcess, Path]] = []
    cmds: list[str] = []
    before = set(gpu_pids())   # a node sharing the GPU (phase vsraw) keeps its memory
    for g, conc in parts:
        spec = GpuNodeSpec(f"eng{tag}-{g}", shape, g, gpu_mem)
        cfg = env.logs / f"{spec.name}.toml"
        cfg.write_text(node_toml(env, spec))
        out = env.logs / f"{spec.name}.json"
        out.unlink(missing_ok=True)
        args = ["bench", "engine-loop", "--config", str(cfg), "--concurrency", str(conc),
                "--warmup", f"{env.warmup_s:g}", "--seconds", f"{env.window_s:g}",
                "--prompt", env.prompt, "--output", env.output, "--json", str(out)]
        if n > 1:
            args += ["--sync-dir", str(sync), "--sync-count", str(n)]
        child_env = {"CUDA_VISIBLE_DEVICES": g} if env.engine == "vllm" else {}
        ch = ChildProcess.gpumesh(spec.name, args, env.logs / f"{spec.name}.log",
                                    env=child_env, append=True)
        children.append((ch, out))
        cmds.append(ch.command() + f"   # {cfg.name}: "
                    + node_toml(env, spec).replace("\n", "; "))
    env.meta.setdefault("commands", {})[f"eng{tag}"] = cmds
    # Until every loop has exited or written its record 20 s ago (a process that hangs in
    # its exit after a CUDA engine's shutdown must not cost the budget), or one has died
    # without a record (its partner would wait for it at the sync barrier).
    deadline = time.monotonic() + 300
    written: dict[str, float] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        for ch, out in children:
            if ch.name not in written and out.exists():
                written[ch.name] = now
        alive = [ch for ch, _ in children if ch.alive()]
        if all(now - written.get(ch.name, now) > 20 for ch in alive):
            break
        if any(not ch.alive() and not out.exists() for ch, out in children):
            break
        time.sleep(0.5)
    for ch, _ in children:
        if ch.alive():
            print(f"[gpu-bench] eng {shape} {setup}: {ch.name} "
                  + ("had not exited 20 s after its record" if ch.name in written
                     else "timed out or waited for a failed partner") + ": stopped",
                  flush=True)
    for ch, _ in children:
        ch.stop()
    if env.engine == "vllm":
        wait_gpus_free(keep=before)
    rows = [json.loads(out.read_text()) for _, out in children if out.exists()]
    if len(rows) != n:
        raise RuntimeError(f"eng {shape} {setup}: {n - len(rows)} of {n} loops gave no "
                           "result\n" + "\n".join(ch.tail(1500) for ch, _ in children))
    rec: dict[str, Any] = {
        "phase": phase, "setup": setup, "shape": shape, "call": env.call,
        "concurrency": sum(r["concurrency"] for r in rows),
        "prompt": env.prompt, "output": env.output,
        "warmup_s": env.warmup_s, "window_s": env.window_s,
        "requests": sum(r["requests"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "completed": sum(r["completed"] for r in rows),
        "qps": round(sum(r["qps"] for r in rows), 2),
        "done_qps": round(sum(r["done_qps"] for r in rows), 2),
        "out_tok_s": round(sum(r["out_tok_s"] for r in rows), 1),
        **{k: _max([r.get(k) for r in rows])
           for k in ("lat_p50", "lat_p99", "ttft_p50", "ttft_p99", "tpot_p50")},
        "engine_load": {f"gpu{g}": r.get("engine_load") for (g, _), r in zip(parts, rows)},
        "cpu_cores": {f"loop gpu{g} {k}": v for (g, _), r in zip(parts, rows)
                      for k, v in (r.get("cpu_cores") or {}).items()},
        "kv_tokens": rows[0].get("kv_tokens"), "init_s": [r.get("init_s") for r in rows],
        "command": " & ".join(ch.command() for ch, _ in children),
        "engine": env.engine, "parts": rows, **(extra or {})}
    if env.engine == "vllm" and env.engine_args:
        rec["engine_args"] = env.engine_args
    if env.node_options:
        rec["node_options"] = env.node_options
    env.records.append(rec)
    env.save()
    run = " / ".join(f"{fmt((r.get('engine_load') or {}).get('running_mean'), 0)}"
                     for r in rows)
    print(f"[gpu-bench] {phase:8} {shape} {setup:58} c={rec['concurrency']:<4} "
          f"qps={rec['qps']:7.1f} done_qps={rec['done_qps']:7.1f} "
          f"p50={fmt(rec['lat_p50'], 3)}s tpot50={fmt((rec['tpot_p50'] or 0) * 1000)}ms "
          f"running {run} errors={rec['errors']}", flush=True)
    return rec

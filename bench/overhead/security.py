"""``gpumesh bench overhead --parts security --baseline-pkgs DIR``: the router's CPU per
32-token stream with the hostile-peer checks (membership before content, bounded control
streams, request ids in flight, node certificate verification) against the same router code
without them, side by side.

Two secured meshes run at once: each a router (mutual TLS with client certificates required,
an API-keys file) and its simulated node, dialled over mutual TLS. The ``with`` router runs
this checkout; the ``without`` router runs the code in ``--baseline-pkgs`` (a folder holding
a ``gpumesh`` package with ``router`` and ``node`` inside, e.g. made from an older commit with
``git archive``), started with ``python -S -P`` and that folder first on PYTHONPATH so that the
editable install does not shadow it. Both nodes run this checkout. Both routers are pinned to
core 0, the nodes and this load generator to core 1 (``--no-pin``: unpinned). Each repeat
runs the same closed loop (32 streams in flight, 32 tokens each, a unique request id and the
API key on each) against both, in alternating order; router CPU is read from /proc. The
result pairs the two by repeat: with / without router CPU per stream (median, min, max).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from gpumesh.ports import free_port
from gpumesh.router.auth.keys import hash_key
from gpumesh.security.certs import make_mesh_certs
from gpumesh.security.client import ClientTls
from gpumesh_bench.fleet import bench_child, group_cpu_s
from gpumesh_bench.overhead.paired import interleave, paired_result, ratio_line, tls_flags
from gpumesh_bench.workload import synth_prompt

KEY = "bench-security-key"


async def _loop(target: str, tls: ClientTls, duration_s: float) -> tuple[int, int, float]:
    """32 closed-loop 32-token streams; (completed, errors, wall s)."""
    from gpumesh.client import MeshClient, build_request

    prompts = [synth_prompt(128, 0, i) for i in range(64)]
    done = errors = 0
    async with MeshClient(target, tls=tls, api_key=KEY) as c:
        async def one(i: int) -> None:
            req = build_request(prompts[i % 64], max_tokens=32, ignore_eos=True)
            req.request_id = uuid.uuid4().hex
            async for _ in c.stream(req, timeout=60):
                pass

        await one(0)   # warm the channel
        t0 = time.perf_counter()
        end = t0 + duration_s

        async def worker(k: int) -> None:
            nonlocal done, errors
            i = k
            while time.perf_counter() < end:
                try:
                    await one(i)
                    done += 1
                except Exception:  # noqa: BLE001 - counted; the table shows errors
                    errors += 1
                i += 32

        await asyncio.gather(*(worker(k) for k in range(32)))
        return done, errors, time.perf_counter() - t0


async def _wait(target: str, tls: ClientTls, kids: list[Any]) -> None:
    from gpumesh.client import MeshClient, build_request
    from gpumesh.launcher import wait_until_async

    async with MeshClient(target, tls=tls, api_key=KEY) as c:
        async def ready() -> bool:
            try:
                await c.generate(build_request("hi", max_tokens=1), timeout=2)
                return True
            except Exception:  # noqa: BLE001 - not up yet
                return False

        await wait_until_async(ready, 120, watch=kids, poll_s=0.3, what=f"{target} routing")


def run(a: argparse.Namespace, out: Path, pin: bool) -> dict[str, Any]:
    base = Path(a.baseline_pkgs).resolve()
    if not (base / "gpumesh" / "router").is_dir():
        raise SystemExit(f"--baseline-pkgs {base}: no gpumesh/router package inside")
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-security-"))
    certs = tmp / "certs"
    make_mesh_certs(certs, node_ids=["sim-with", "sim-without"])
    keys = tmp / "keys.toml"
    keys.write_text(f'[[key]]\nname = "bench"\nsha256 = "{hash_key(KEY)}"\nrole = "client"\n')
    log_dir = out / "logs" / "security"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"GPUMESH_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}
    old_env = {**env, "PYTHONPATH": f"{base}:{sysconfig.get_paths()['purelib']}:"
               + ":".join(p for p in sys.path if p.endswith("site-packages"))}
    rcpu, ncpu = ("0", "1") if pin else ("", "")
    ports = {k: free_port() for k in ("r-with", "r-without", "n-with", "n-without")}
    gm = [sys.executable, "-m", "gpumesh.cli", "--log-level", "warning"]
    gm_old = [sys.executable, "-S", "-P", "-m", "gpumesh.cli", "--log-level", "warning"]
    secure = [*tls_flags(certs, "router"), "--tls-require-client-cert", "--api-keys-file",
              str(keys), "--policy", "least_request"]

    def router(name: str, argv0: list[str], e: dict[str, str]) -> Any:
        return bench_child(name, [*argv0, "router", "--host", "127.0.0.1", "--port",
                                  str(ports[name]), "--router-id", f"bench-{name}", *secure],
                           log_dir, e, rcpu)

    def node(name: str, node_id: str, rport: int) -> Any:
        return bench_child(name, [*gm, "node", "--engine", "sim", "--model", "sim", "--port",
                                  str(ports[name]), "--node-id", node_id, "--router",
                                  f"127.0.0.1:{rport}", *tls_flags(certs, node_id),
                                  "--tls-require-client-cert"], log_dir, env, ncpu)

    kids = [router("r-with", gm, env), router("r-without", gm_old, old_env),
            node("n-with", "sim-with", ports["r-with"]),
            node("n-without", "sim-without", ports["r-without"])]
    client = ClientTls(str(certs / "ca.pem"), str(certs / "client.pem"), str(certs / "client.key"))
    variants = {"with": (f"127.0.0.1:{ports['r-with']}", kids[0].pid),
                "without": (f"127.0.0.1:{ports['r-without']}", kids[1].pid)}

    def measure(v: tuple[str, int]) -> dict[str, Any]:
        target, pgid = v
        c0 = group_cpu_s(pgid)
        n, errors, wall = asyncio.run(_loop(target, client, a.duration))
        cpu = group_cpu_s(pgid) - c0
        return {"streams": n, "errors": errors, "req_per_s": n / wall,
                "router_cpu_ms_per_stream": cpu * 1000 / max(1, n)}

    try:
        for target, _ in variants.values():
            asyncio.run(_wait(target, client, kids))
        runs = interleave("security", variants, a.repeats, "router_cpu_ms_per_stream", measure)
    finally:
        for k in kids:
            k.stop(10.0)
    return paired_result(runs, "router_cpu_ms_per_stream", "with", "without")


def markdown(r: dict[str, Any]) -> str:
    lines = ["### Hostile-peer checks: with vs without (32-token streams, 32 in flight, mutual "
             "TLS and API keys, routers pinned to core 0)", "",
             "| variant | req/s | router CPU ms per stream | errors |", "|---|---|---|---|"]
    for name in ("without", "with"):
        v = r[name]
        lines.append(f"| {name} | {v['req_per_s']:.1f} | {v['router_cpu_ms_per_stream']:.3f} | "
                     f"{v['errors']:.0f} |")
    c = r["cpu_ratio"]
    lines += ["", ratio_line(c, "with / without"), ""]
    return "\n".join(lines)

"""``gpumesh bench overhead --parts tls``: the router's CPU per 32-token stream with TLS on
every hop against plaintext, side by side.

Two meshes run at once on the same cores: a plaintext router and its simulated node, and a
TLS router (mutual TLS required of every caller, certificates from ``gpumesh certs``) and its
node, which it dials over mutual TLS; the node heartbeats over mutual TLS too. Both routers
are pinned to core 0, both nodes and this load generator to core 1 (``--no-pin``: unpinned).
Each repeat runs the same closed loop (32 streams in flight, 32 tokens each, 128-token
prompts) against both, in alternating order; the router's CPU is read from /proc before and
after. The table gives per-variant medians and the TLS / plaintext ratio of router CPU per
stream, paired by repeat (median, min, max).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpumesh.ports import free_port
from gpumesh.security.certs import make_mesh_certs
from gpumesh.security.client import ClientTls
from gpumesh_bench.fleet import bench_child, group_cpu_s
from gpumesh_bench.overhead.paired import interleave, paired_result, ratio_line, tls_flags


async def _wait_healthy(target: str, tls: ClientTls | None, node: str, kids: list[Any]) -> None:
    from gpumesh.client import MeshClient
    from gpumesh.launcher import wait_until_async
    from gpumesh.v1 import control_pb2 as cpb

    async with MeshClient(target, tls=tls) as c:
        async def ready() -> bool:
            fleet = await c.fleet(timeout=2)
            return any(n.node_id == node and n.state == cpb.NODE_STATE_HEALTHY
                       for n in fleet.nodes)

        await wait_until_async(ready, 120, watch=kids, poll_s=0.2, what=f"{node} healthy")


async def _measure(target: str, pgid: int, tls: ClientTls | None, a: argparse.Namespace
                   ) -> dict[str, Any]:
    from gpumesh_bench.overhead.router import drive, summarize

    c0 = group_cpu_s(pgid)
    samples, errors, wall = await drive(target, concurrency=32, duration_s=a.duration,
                                        max_tokens=32, tls=tls)
    return summarize(samples, errors, wall, group_cpu_s(pgid) - c0)


def run(a: argparse.Namespace, out: Path, pin: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-tls-"))
    certs = tmp / "certs"
    make_mesh_certs(certs, node_ids=["sim-tls"])
    log_dir = out / "logs" / "tls"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"GPUMESH_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}
    rcpu, ncpu = ("0", "1") if pin else ("", "")
    ports = {k: free_port() for k in ("router-plain", "router-tls", "node-plain", "node-tls")}
    gm = [sys.executable, "-m", "gpumesh.cli", "--log-level", "warning"]

    def router(name: str, extra: list[str]) -> Any:
        return bench_child(name, [*gm, "router", "--host", "127.0.0.1", "--port",
                                  str(ports[name]), "--policy", "least_request",
                                  "--router-id", f"bench-{name}", *extra], log_dir, env, rcpu)

    def node(name: str, node_id: str, router_port: int, extra: list[str]) -> Any:
        return bench_child(name, [*gm, "node", "--engine", "sim", "--model", "sim", "--port",
                                  str(ports[name]), "--node-id", node_id, "--router",
                                  f"127.0.0.1:{router_port}", *extra], log_dir, env, ncpu)

    kids = [router("router-plain", []),
            router("router-tls", [*tls_flags(certs, "router"), "--tls-require-client-cert"]),
            node("node-plain", "sim-plain", ports["router-plain"], []),
            node("node-tls", "sim-tls", ports["router-tls"],
                 [*tls_flags(certs, "sim-tls"), "--tls-require-client-cert"])]
    op = ClientTls(str(certs / "ca.pem"), str(certs / "operator.pem"), str(certs / "operator.key"))
    client = ClientTls(str(certs / "ca.pem"), str(certs / "client.pem"), str(certs / "client.key"))
    variants = {"plaintext": (f"127.0.0.1:{ports['router-plain']}", kids[0].pid, None),
                "tls": (f"127.0.0.1:{ports['router-tls']}", kids[1].pid, client)}
    try:
        asyncio.run(_wait_healthy(variants["plaintext"][0], None, "sim-plain", kids))
        asyncio.run(_wait_healthy(variants["tls"][0], op, "sim-tls", kids))
        runs = interleave("tls", variants, a.repeats, "router_cpu_ms_per_req",
                          lambda v: asyncio.run(_measure(*v, a)))
    finally:
        for k in kids:
            k.stop(10.0)
    return paired_result(runs, "router_cpu_ms_per_req", "tls", "plaintext")


def markdown(r: dict[str, Any]) -> str:
    lines = ["### TLS vs plaintext (32-token streams, 32 in flight, routers pinned to core 0)", "",
             "| variant | req/s | router CPU ms per stream | router CPU % | TTFT p50 ms | "
             "TTFT p99 ms | errors |", "|" + "---|" * 7]
    for name in ("plaintext", "tls"):
        v = r[name]
        lines.append(f"| {name} | {v['req_per_s']:.1f} | {v['router_cpu_ms_per_req']:.3f} | "
                     f"{v['router_cpu_pct']:.0f} | {v['ttft_p50_ms']:.2f} | {v['ttft_p99_ms']:.2f}"
                     f" | {v['errors']:.0f} |")
    c = r["cpu_ratio"]
    lines += ["", ratio_line(c, "TLS / plaintext"), ""]
    return "\n".join(lines)

"""The phases of a GPU bench call: each starts its nodes and routers (a ``Group``), benches
them in its setups and stops them, GPUs freed, before the next phase."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumesh_bench.gpu.env import POLICIES, Env, GpuNodeSpec, GpuRouterSpec
from gpumesh_bench.gpu.group import Group
from gpumesh_bench.gpu.measure import bench
from gpumesh_bench.gpu.records import RAW_CONCURRENCY

if TYPE_CHECKING:
    from gpumesh_bench.gpu.affinity import Placement

def _pair(env: Env, shape: str, gpus: int) -> tuple[str, str, list[GpuNodeSpec], list[GpuRouterSpec]]:
    """Node A on GPU 0 behind router r1; with two GPUs also node B on GPU 1 and router r2
    (policy ``env.policy``) fronting A and B. Returns (A, B, nodes, routers)."""
    a, b = f"a{shape.replace('.', '')}", f"b{shape.replace('.', '')}"
    two = gpus >= 2
    dp = ("r2", "r2b") if env.router_env_b else ("r2",)
    nodes = [GpuNodeSpec(a, shape, "0", 0.85, routers=("r1", *dp) if two else ("r1",))]
    routers = [GpuRouterSpec("r1", members=(a,))]
    if two:
        # After A serves: B then finds vLLM's compile cache warm instead of racing A to fill it.
        nodes.append(GpuNodeSpec(b, shape, "1", 0.85, routers=dp, after=a))
        routers.append(GpuRouterSpec("r2", policy=env.policy, members=(a, b)))
        if env.router_env_b:
            routers.append(GpuRouterSpec("r2b", policy=env.policy, members=(a, b),
                                      env=dict(env.router_env_b)))
    return a, b, nodes, routers


def _placements(env: Env, g: Group, phase: str) -> list[Placement | None]:
    """The CPU placements a phase's benches run under (``--pin``): [None] (off), [pinned]
    (on), [None, pinned] (both); a host too small to pin runs unpinned and says so."""
    if env.pin == "off":
        return [None]
    try:
        pl = g.placement()
    except ValueError as e:
        print(f"[gpu-bench] {phase}: not pinned: {e}", flush=True)
        env.meta.setdefault("not_pinned", {})[phase] = str(e)
        return [None]
    env.meta.setdefault("cpu_sets", {})[phase] = pl.describe()
    print(f"[gpu-bench] {phase}: cpu sets {pl.describe()}", flush=True)
    return [pl] if env.pin == "on" else [None, pl]


def _pair_phase(env: Env, shape: str, gpus: int, phase: str, sweep: bool) -> None:
    c1 = RAW_CONCURRENCY[shape]
    a, b, nodes, routers = _pair(env, shape, gpus)
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        pl = _placements(env, g, phase)[-1]   # the main table: pinned under on and both
        kv = {"kv_tokens": g.kv_tokens[a]}
        bench(env, phase=phase, setup="1 GPU, direct to node", shape=shape, target=g.addr[a],
              concurrency=c1, poll=g.addr["r1"], extra=kv, placement=pl)
        bench(env, phase=phase, setup="1 GPU, through router", shape=shape, target=g.addr["r1"],
              concurrency=c1, poll=g.addr["r1"], status=True, extra=kv, placement=pl)
        if gpus >= 2:
            for c in (c1, 2 * c1):
                bench(env, phase=phase, setup="2 GPUs data parallel, router", shape=shape,
                      target=g.addr["r2"], concurrency=c, poll=g.addr["r2"], status=c == c1,
                      placement=pl)
            # The same two nodes with the client splitting its streams itself: what data
            # parallel gives on this machine without a router, so the router's share shows.
            bench(env, phase=phase, setup="2 GPUs data parallel, direct (client splits)",
                  shape=shape, target=g.addr[a], concurrency=2 * c1, poll=g.addr["r2"],
                  split=(g.addr[a], g.addr[b]), placement=pl)
        if sweep:
            _sweep(env, shape, g.addr[a], g.addr["r1"])


def _sweep(env: Env, shape: str, target: str, poll: str) -> None:
    """Step time vs batch (TPOT at concurrency C) and prefill time vs prompt length."""
    for c in (1, 32, 256, 512):
        bench(env, phase="sweep", setup="decode sweep, direct", shape=shape, target=target,
              concurrency=c, poll=poll, warmup_s=2.0, window_s=6.0)
    for n in (1024, 1900):
        bench(env, phase="sweep", setup="prefill probe, direct", shape=shape, target=target,
              concurrency=1, prompt=f"fixed:{n}", output="fixed:1", warmup_s=1.0, window_s=3.0)


def phase_p05(env: Env, gpus: int) -> None:
    _pair_phase(env, "0.5b", gpus, "p05", sweep=True)


def phase_ab(env: Env, shape: str, gpus: int, phase: str, rounds: int = 2,
             dp_only: bool = False) -> None:
    """Repeats, interleaved on the same nodes: one GPU direct vs through the router (ABAB),
    then (two GPUs) data parallel through the router vs the client splitting its streams;
    ``dp_only``: data parallel router vs client split, ``rounds`` times (ABAB); with a
    multi-worker router also the router with the load spread over its workers (ABCABC)."""
    c1 = RAW_CONCURRENCY[shape]
    a, b, nodes, routers = _pair(env, shape, gpus)
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        if dp_only and gpus >= 2:
            x = {"policy": env.policy, "workers": env.workers}
            pins = _placements(env, g, phase)
            for k in range(rounds):
                for pl in pins:
                    tag = ", pinned" if pl is not None else ""
                    y = {**x, "round": k, "pinned": pl is not None}
                    bench(env, phase=phase, setup=f"2 GPUs data parallel, router{tag} #{k}",
                          shape=shape, target=g.addr["r2"], concurrency=2 * c1,
                          poll=g.addr["r2"], extra=y, placement=pl)
                    if env.router_env_b:
                        bench(env, phase=phase, shape=shape, target=g.addr["r2b"],
                              setup=f"2 GPUs data parallel, router B{tag} #{k}",
                              concurrency=2 * c1, poll=g.addr["r2b"],
                              extra={**y, "router_env_b": env.router_env_b}, placement=pl)
                    if env.workers > 1 and not env.spread_workers:
                        bench(env, phase=phase, shape=shape, target=g.addr["r2"],
                              setup=f"2 GPUs data parallel, router, spread over workers{tag} #{k}",
                              concurrency=2 * c1, poll=g.addr["r2"], extra=y, spread=True,
                              placement=pl)
                    bench(env, phase=phase,
                          setup=f"2 GPUs data parallel, direct (client splits){tag} #{k}",
                          shape=shape, target=g.addr[a], concurrency=2 * c1, poll=g.addr["r2"],
                          split=(g.addr[a], g.addr[b]), extra=y, placement=pl)
            return
        for k in range(rounds):
            x = {"round": k}
            bench(env, phase=phase, setup=f"1 GPU, direct to node #{k}", shape=shape,
                  target=g.addr[a], concurrency=c1, poll=g.addr["r1"], extra=x)
            bench(env, phase=phase, setup=f"1 GPU, through router #{k}", shape=shape,
                  target=g.addr["r1"], concurrency=c1, poll=g.addr["r1"], extra=x)
        if gpus >= 2:
            bench(env, phase=phase, setup="2 GPUs data parallel, router #0", shape=shape,
                  target=g.addr["r2"], concurrency=2 * c1, poll=g.addr["r2"])
            bench(env, phase=phase, setup="2 GPUs data parallel, direct (client splits) #0",
                  shape=shape, target=g.addr[a], concurrency=2 * c1, poll=g.addr["r2"],
                  split=(g.addr[a], g.addr[b]))


def phase_msg(env: Env, shape: str, gpus: int, phase: str, rounds: int = 2) -> None:
    """The node's stream-message budget on and off on the same nodes, interleaved (ABAB):
    every request of B asks for the node's base interval (20 ms) itself, which the node keeps
    as asked, i.e. the fixed interval of a node without the budget. One GPU direct to the node
    at the reference's concurrency, then (two GPUs) data parallel through the router at twice
    it, ``rounds`` times each. Each record names its pair: ``base_setup``, ``round`` and
    ``leg`` ("budget" or "fixed"), which the report pairs by."""
    c1 = RAW_CONCURRENCY[shape]
    a, _, nodes, routers = _pair(env, shape, gpus)
    # the node's base interval (scaled with a slowed simulation, as node_toml scales it)
    fixed = (max(1, round(20 * env.sim_time_scale))
             if env.engine == "sim" and env.sim_scale_intervals else 20)
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        runs = [("1 GPU, direct to node", g.addr[a], c1, g.addr["r1"])]
        if gpus >= 2:
            runs.append(("2 GPUs data parallel, router", g.addr["r2"], 2 * c1, g.addr["r2"]))
        for setup, target, c, poll in runs:
            for k in range(rounds):
                for leg, label, f in (("budget", "message budget", 0),
                                      ("fixed", f"fixed {fixed} ms", fixed)):
                    bench(env, phase=phase, setup=f"{setup}, {label} #{k}", shape=shape,
                          target=target, concurrency=c, poll=poll, flush_interval_ms=f,
                          extra={"round": k, "leg": leg, "base_setup": setup})


def phase_fe(env: Env, shape: str, gpus: int, phase: str, rounds: int = 1,
             counts: tuple[int, int] = (1, 2)) -> None:
    """Nodes with one front-end process against nodes with several (node option
    ``frontends``, node.frontends), ABAB over ``rounds`` (the option is the nodes' process
    layout, so each leg starts fresh nodes): one GPU direct to the node and through the
    router at the reference's concurrency, then (two GPUs) data parallel through the router
    at twice it. Records carry ``leg`` ("fe<N>"), ``base_setup``, ``round`` and ``frontends``;
    the report pairs them with the one-front-end bench of the same round."""
    if env.engine != "vllm" and max(counts) > 1:
        raise ValueError("several front ends per node need vLLM nodes (the simulator has one)")
    c1 = RAW_CONCURRENCY[shape]
    a, _, nodes, routers = _pair(env, shape, gpus)
    saved = dict(env.node_options)
    try:
        for k in range(rounds):
            for n in (counts if k % 2 == 0 else tuple(reversed(counts))):
                env.node_options = {**saved, "frontends": n}
                with Group(env, nodes, routers) as g:
                    g.start()
                    env.meta.setdefault("commands", {})[f"{phase} frontends={n}"] = g.commands
                    runs = [("1 GPU, direct to node", g.addr[a], c1, g.addr["r1"]),
                            ("1 GPU, through router", g.addr["r1"], c1, g.addr["r1"])]
                    if gpus >= 2:
                        runs.append(("2 GPUs data parallel, router", g.addr["r2"], 2 * c1,
                                     g.addr["r2"]))
                    for setup, target, c, poll in runs:
                        bench(env, phase=phase, setup=f"{setup}, {n} front ends #{k}",
                              shape=shape, target=target, concurrency=c, poll=poll,
                              extra={"round": k, "leg": f"fe{n}", "base_setup": setup,
                                     "frontends": n})
    finally:
        env.node_options = saved


def phase_p05q(env: Env, gpus: int) -> None:
    """``p05`` without the sweep (its records are ``p05``'s): a rerun of the main table."""
    _pair_phase(env, "0.5b", gpus, "p05", sweep=False)


def phase_p7(env: Env, gpus: int) -> None:
    _pair_phase(env, "7b", gpus, "p7", sweep=False)


def phase_share(env: Env) -> None:
    nodes = [GpuNodeSpec("s1", "0.5b", "0", 0.42, routers=("rs",)),
             GpuNodeSpec("s2", "0.5b", "0", 0.42, routers=("rs",), after="s1")]
    with Group(env, nodes, [GpuRouterSpec("rs", members=("s1", "s2"))]) as g:
        g.start()
        env.meta.setdefault("commands", {})["share"] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        bench(env, phase="share", setup="2 nodes share 1 GPU, router", shape="0.5b",
              target=g.addr["rs"], concurrency=128, poll=g.addr["rs"], status=True)


def phase_unequal(env: Env, gpus: int = 1, phase: str = "unequal") -> None:
    """Two 0.5B nodes, ``small`` with its KV cache cut; one router per policy, each benched.
    On one GPU both share GPU 0 (0.42 of memory each); with ``gpus`` >= 2 each has its own."""
    routers = [GpuRouterSpec(f"q-{p.replace('_', '-')}", p, ("big", "small")) for p in POLICIES]
    names = tuple(r.name for r in routers)
    two = gpus >= 2
    mem = 0.85 if two else 0.42
    nodes = [GpuNodeSpec("big", "0.5b", "0", mem, routers=names),
             GpuNodeSpec("small", "0.5b", "1" if two else "0", mem, blocks=env.small_kv_blocks,
                      routers=names, after="big")]
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        for r in routers:
            bench(env, phase=phase, setup=f"policy {r.policy}", shape="0.5b",
                  target=g.addr[r.name], concurrency=128, prompt="fixed:512",
                  output="uniform:128:256", poll=g.addr[r.name], extra={"policy": r.policy},
                  warmup_s=3.0, window_s=12.0)


def _tp_phase(env: Env, shape: str, phase: str) -> None:
    nodes = [GpuNodeSpec(f"t{shape.replace('.', '')}", shape, "0,1", 0.85, tp=2, routers=("rt",))]
    with Group(env, nodes, [GpuRouterSpec("rt", members=(nodes[0].name,))]) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        bench(env, phase=phase, setup="2 GPUs tensor parallel, router", shape=shape,
              target=g.addr["rt"], concurrency=RAW_CONCURRENCY[shape], poll=g.addr["rt"],
              status=True)

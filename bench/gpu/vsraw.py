"""The vsraw phases: the mesh against raw vLLM on the same GPUs, round by round (see
``phase_vsraw``), and what a round costs in seconds (a call stops before a round that would
not fit its budget)."""

from __future__ import annotations


from gpumesh_bench.gpu.env import Env, GpuNodeSpec, GpuRouterSpec
from gpumesh_bench.gpu.group import Group
from gpumesh_bench.gpu.measure import bench
from gpumesh_bench.gpu.reference import run_eng, run_raw
from gpumesh_bench.gpu.records import RAW_CONCURRENCY

VSRAW_GPU_MEM = 0.42   # the node's and the raw engine's share of GPU 0 (as phase share)
# With --vs-variant: three engines on a GPU (node, variant node, raw), 0.84 in all. KV at 0.28
# of an H200 still holds C x (32 + 256) tokens many times over (0.5B and 7B).
VSRAW_GPU_MEM_VARIANT = 0.28
VSRAW_LEGS = ("raw", "eng", "router", "router-x", "direct", "direct-x")
# A round's legs (s). Raw: the raw tool's engine start (warm compile cache), its window and
# exit; a node bench: the load generator's start, warm-up and window. Measured on H200 hosts
# with vLLM's compile cache already filled: phase raw 55.5 s (0.5B, engine start 15.8-18.6 s),
# raw7 with data parallel 155.5 s; a 0.5B bench ~23 s; vsraw05's rounds of raw + 2 benches
# ~100 s each. A host's first raw run also compiles (~+50 s).
VSRAW_RAW_S = {"0.5b": 55, "7b": 80}
VSRAW_BENCH_S = {"0.5b": 28, "7b": 36}
VSRAW_ENG_S = {"0.5b": 60, "7b": 80}   # --vs-eng: an engine loop's start, window and exit
# The nodes' start (s), before the first round (a phase needs that and one round to begin);
# twice that with --vs-variant (a second set of nodes)
VSRAW_START_S = {"vsraw05": 100, "vsraw7": 150, "vsrawdp05": 140, "vsrawdp7": 200}


def vsraw_round_s(shape: str, env: Env) -> float:
    """Seconds one vsraw round of ``shape`` needs (its legs)."""
    legs = vsraw_legs(env)
    return (VSRAW_RAW_S[shape] * ("raw" in legs) + VSRAW_ENG_S[shape] * ("eng" in legs)
            + VSRAW_BENCH_S[shape] * len([x for x in legs if x not in ("raw", "eng")]))


def vsraw_need(phase: str, env: Env) -> float:
    """Seconds a vsraw phase needs for its nodes' start and one round."""
    shape = "7b" if phase.endswith("7") else "0.5b"
    return VSRAW_START_S[phase] * (2 if env.vs_variant else 1) + vsraw_round_s(shape, env)


def vsraw_legs(env: Env) -> tuple[str, ...]:
    """The legs of a vsraw round in their first-round order (``--vs-eng``, ``--vs-variant``,
    ``--vs-legs``)."""
    legs = [x for x in VSRAW_LEGS
            if (x != "eng" or env.vs_eng) and (not x.endswith("-x") or env.vs_variant)]
    if env.vs_legs:
        legs = [x for x in legs if x in env.vs_legs]
    return tuple(legs)


def phase_vsraw(env: Env, shape: str, phase: str, rounds: int = 3, dp: bool = False) -> None:
    """The mesh against raw vLLM on the same GPUs, interleaved: the nodes (``env.node_options``
    included, e.g. frontends=2) and their router stay up at ``VSRAW_GPU_MEM`` of their GPU's
    memory while, in each round, the raw reference tool (unmodified, its own engines at the
    same share, started and stopped per run), the nodes through the router and the nodes
    direct are benched in turn at the reference's concurrency C; the order reverses every
    round (raw, router, direct; direct, router, raw; ...) so drift within a call weighs on
    both sides. Only one engine per GPU has requests at a time (an idle vLLM engine core
    waits on its input queue).

    One GPU: node A on GPU 0 behind r1; raw = one engine at C. ``dp`` (two GPUs): nodes A and
    B on GPUs 0 and 1 behind r2; raw = two engines at once, C/2 each (the reference's data
    parallel method); "direct" = the client splitting its C streams over A and B.

    ``env.vs_eng`` (``--vs-eng``): every round also runs the node's own engine without gRPC
    (``run_eng``: an engine loop per GPU at the same share, started per run) next to raw,
    so raw vs engine loop (the node's engine configuration) and engine loop vs direct (its
    serving path) come from the same rounds.

    ``env.vs_variant`` (``--vs-variant``): nodes X (and Y) with those engine arguments on top
    of the bench's, behind their own router, on the same GPUs; legs "router-x" and "direct-x"
    bench them in the same rounds, so raw, the nodes and the variant nodes pair round by round
    (every engine at ``VSRAW_GPU_MEM_VARIANT``, three to a GPU). ``env.vs_legs`` keeps some.

    Records carry ``round``, ``leg`` ("raw", "eng", "router", "direct", "router-x",
    "direct-x"), ``base_setup`` and, for the variant's legs, ``variant``;
    the report gives each bench's QPS over its round's raw run and the median over rounds:
    the mesh-to-raw ratio with the host's run-to-run spread (1.5x between raw runs of one machine)
    paired out. Without a raw tool (``--engine sim``) the raw legs are skipped and said so."""
    c = RAW_CONCURRENCY[shape]
    tag = shape.replace(".", "")
    a, b, xa, xb = f"v{tag}", f"w{tag}", f"x{tag}", f"y{tag}"
    variant = dict(env.vs_variant)
    mem = VSRAW_GPU_MEM_VARIANT if variant else VSRAW_GPU_MEM
    r = "r2" if dp else "r1"
    xr = f"{r}x"
    sets = [(a, b, r, {})] + ([(xa, xb, xr, variant)] if variant else [])
    nodes: list[GpuNodeSpec] = []
    routers: list[GpuRouterSpec] = []
    for first, second, router, args in sets:
        after = nodes[-1].name if nodes else ""   # one start at a time (profiling per process)
        mine = [GpuNodeSpec(first, shape, "0", mem, routers=(router,), after=after,
                         engine_args=args)]
        if dp:
            mine.append(GpuNodeSpec(second, shape, "1", mem, routers=(router,), after=first,
                                 engine_args=args))
        nodes += mine
        routers.append(GpuRouterSpec(router, policy=env.policy,
                                  members=tuple(n.name for n in mine)))
    if dp:
        base, raw_parts = "2 GPUs data parallel", [("0", c // 2), ("1", c // 2)]
    else:
        base, raw_parts = "1 GPU", [("0", c)]
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        raw_ok = env.engine == "vllm" and bool(env.raw_tool)
        if not raw_ok:
            print(f"[gpu-bench] {phase}: raw legs skipped (need --engine vllm and --raw-tool)",
                  flush=True)
        legs = vsraw_legs(env)
        per_round = vsraw_round_s(shape, env)
        for k in range(rounds):
            if env.out_of_time("gpu-bench", phase, k, rounds, per_round):
                break
            for leg in (legs if k % 2 == 0 else tuple(reversed(legs))):
                x = {"round": k, "leg": leg, "base_setup": base, "gpu_mem": mem}
                if leg.endswith("-x"):
                    x["variant"] = variant
                n1, n2, rt = (xa, xb, xr) if leg.endswith("-x") else (a, b, r)
                sfx = ", variant" if leg.endswith("-x") else ""
                if leg == "raw":
                    if raw_ok and run_raw(
                            env, shape, f"raw vLLM, same GPU{'s' if dp else ''} #{k}",
                            [(gpu, conc, 2 * k + n) for n, (gpu, conc) in enumerate(raw_parts)],
                            f"{phase}-{k}", phase=phase, gpu_mem=mem,
                            extra=x) is None:   # its log's tail is printed; the rest still run
                        env.meta.setdefault("failed", []).append(f"{phase} raw #{k}: no result")
                elif leg == "eng":
                    try:
                        run_eng(env, shape, f"engine loop, same GPU{'s' if dp else ''} #{k}",
                                raw_parts, f"{tag}-{phase}-{k}", phase=phase,
                                gpu_mem=mem, extra=x)
                    except RuntimeError as e:   # the other legs and rounds still run
                        print(f"[gpu-bench] {phase}: {e}"[:3000], flush=True)
                        env.meta.setdefault("failed", []).append(f"{phase} eng #{k}: {e}"[:500])
                elif leg.startswith("router"):
                    via = "router" if dp else "through router"
                    bench(env, phase=phase, setup=f"{base}, {via}{sfx} #{k}", shape=shape,
                          target=g.addr[rt], concurrency=c, poll=g.addr[rt],
                          extra={**x, "kv_tokens": g.kv_tokens[n1]})
                else:
                    bench(env, phase=phase, shape=shape, target=g.addr[n1], concurrency=c,
                          setup=(f"{base}, direct (client splits){sfx} #{k}" if dp
                                 else f"{base}, direct to node{sfx} #{k}"),
                          split=(g.addr[n1], g.addr[n2]) if dp else (), poll=g.addr[rt],
                          extra={**x, "kv_tokens": g.kv_tokens[n1]})

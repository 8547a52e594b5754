"""``gpumesh sim``: the virtual-time fleet simulator's command line (docs/simulator.md).

  gpumesh sim run   --fleet F [--workload W | --trace T.jsonl] [--load L | --rate R]
                    [--policies P,...] [--requests N] [--seeds 1,2,3] [--slo TTFT_MS:TPOT_MS]
                    [--json OUT] [--md OUT]
                    (a trace runs all its requests unless --requests cuts it; --load and
                    --rate rescale its arrival times; neither: its own times)
  gpumesh sim grid  [--fleets F,...] [--workloads W,...] [--loads 0.8,0.95] [--policies P,...]
                    [--seeds 5] [--requests 20000] [--slo ...] [--shard K/N]
                    [--have GRID.jsonl ...] [--replace [P,...]] [--capacities CAP.json]
                    [--router KEY=VALUE ...] [--skip F/W,...] [--no-report] --out DIR
  gpumesh sim merge GRID.jsonl... --out MERGED.jsonl
  gpumesh sim report DIR/grid.jsonl... --out DIR
  gpumesh sim plan  --fleet F [--fleet G ...] (--trace T.jsonl | --workload W) --slo TTFT:TPOT
                    [--rates R,...] [--attainment 0.99] [--policy P] [--out DIR]
  gpumesh sim pd    [--workloads prompt-512,...] [--loads 0.5,0.8,0.95] [--splits agg,2P2D,...]
                    [--shape 7b-h200] [--gpus 4] [--seeds 3] [--requests 2000]
                    [--link-gbytes 25] [--link-latency-ms 1] --out DIR
                    (when prefill/decode pools beat aggregated serving on the same GPUs)
  gpumesh sim trace --workload W --requests N --rate R --out T.jsonl [--seed S]
  gpumesh sim validate [--model DIR] [--workloads shared-prefix,unique] [--policies P,...]
                    [--requests 2000] [--rate R[,R2]] [--cores 0,1] [--engine-arg K=V ...]
                    [--profile PROFILE.toml] --out DIR    (the simulator against real engines)
  gpumesh sim --fleet F ... --trace T --slo ...      (= plan)

F: a built-in fleet (homo, hetero-speed, hetero-kv, hetero-kvspeed, large), a fleet TOML or
an inline fleet (2xprefill:7b-h200,2xdecode:7b-h200; 4x0.5b-h200).
W: lognormal, bimodal, long-output, long-prompt, mixed, bursty, ramp, join-leave, slowdown,
conversations, prompt-N. Times are simulated seconds; --slo in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh_bench.sim import capacity as cap_mod
from gpumesh_bench.sim import fleets, grid, pdtable, report, validate
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.metrics import SLOSpec
from gpumesh_bench.sim.smg_policy import POLICIES as SMG_POLICIES

SUBCOMMANDS = ("run", "grid", "merge", "report", "plan", "trace", "validate", "pd")


def _slo(s: str) -> SLOSpec:
    try:
        t, _, p = s.partition(":")
        return SLOSpec(float(t), float(p) if p else float("inf"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--slo takes TTFT_MS:TPOT_MS, got {s!r}") from e


def _workload(s: str) -> str:
    try:
        return wl.check_name(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _seeds(s: str) -> list[int]:
    """"5" -> seeds 1..5; "1,4,7" -> those."""
    return [int(x) for x in s.split(",")] if "," in s else list(range(1, int(s) + 1))


def _policies(s: str) -> str:
    """Router policies and SMG references, comma-separated (checked here, not mid-run)."""
    from gpumesh.router.config import POLICIES

    unknown = [p for p in s.split(",") if p not in POLICIES and p not in SMG_POLICIES]
    if unknown or not s:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join((*POLICIES, *SMG_POLICIES))}")
    return s


def _positive(s: str) -> int:
    try:
        n = int(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from e
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {s!r}")
    return n


def _shard(s: str) -> tuple[int, int]:
    try:
        k, _, n = s.partition("/")
        shard = (int(k), int(n))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--shard takes K/N, got {s!r}") from e
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N, got {s!r}")
    return shard


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpumesh sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="one fleet, one workload, several policies and seeds")
    r.add_argument("--fleet", default="hetero-speed")
    r.add_argument("--workload", default="lognormal", type=_workload,
                   help="a named workload or prompt-N")
    r.add_argument("--trace", default="")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--load", type=float, default=None,
                   help="fraction of the fleet's measured capacity on the workload's (or the "
                        "trace's) request mix (default 0.8; with --trace: the trace's own "
                        "times unless --load or --rate is given)")
    g.add_argument("--rate", type=float, default=0.0, help="requests per simulated second")
    r.add_argument("--policies", type=_policies, default=",".join(grid.POLICIES),
                   help="router policies and SMG references (smg_cache_aware, "
                        "smg_cache_aware_approx), comma-separated")
    r.add_argument("--requests", type=_positive, default=None,
                   help="requests per run (default 20,000; with --trace: all of the trace, "
                        "or its first N)")
    r.add_argument("--seeds", type=_seeds, default=_seeds("5"))
    r.add_argument("--slo", type=_slo, default=SLOSpec())
    r.add_argument("--json", default="")
    r.add_argument("--md", default="")
    pdtable.add_pd_arguments(r)

    gr = sub.add_parser("grid", help="fleets x workloads x loads, every policy")
    gr.add_argument("--fleets", default="hetero-speed,homo")
    gr.add_argument("--workloads", default="lognormal,long-output,mixed")
    gr.add_argument("--loads", type=_floats, default=[0.8, 0.95])
    gr.add_argument("--policies", type=_policies, default=",".join(grid.POLICIES),
                    help="as for run")
    gr.add_argument("--seeds", type=_seeds, default=_seeds("5"))
    gr.add_argument("--requests", type=int, default=20000)
    gr.add_argument("--slo", type=_slo, default=SLOSpec())
    gr.add_argument("--out", required=True)
    gr.add_argument("--shard", type=_shard, default=(0, 1),
                    help="K/N: run the units i with i %% N == K of the grid (grid.py)")
    gr.add_argument("--have", action="append", default=[],
                    help="a grid.jsonl whose (cell, policy) units count as done (repeat)")
    gr.add_argument("--replace", nargs="?", const="*", default="",
                    help="re-run --policies (or only these, P,...) even where --have or OUT "
                         "holds them; their runs are replaced")
    gr.add_argument("--capacities", default="",
                    help='JSON {"fleet/workload": req/s} of capacities already measured')
    gr.add_argument("--router", action="append", default=[], metavar="KEY=VALUE",
                    help="a router setting (RouterConfig field) for every run, e.g. "
                         "kv_hard_threshold=0.9 or routing=objective=min_ttft; repeatable")
    gr.add_argument("--skip", default="",
                    help="fleet/workload,... pairs to leave out of the grid")
    gr.add_argument("--no-report", action="store_true", help="skip grid.md and the PNGs")

    mg = sub.add_parser("merge", help="fold grid.jsonl files into one (a record per cell)")
    mg.add_argument("files", nargs="+")
    mg.add_argument("--out", required=True)

    rp = sub.add_parser("report", help="tables and plots of grid.jsonl files")
    rp.add_argument("files", nargs="+")
    rp.add_argument("--out", required=True)

    pl = sub.add_parser("plan", help="capacity planning: which fleet holds the SLO at which rate")
    _plan_args(pl)

    t = sub.add_parser("trace", help="write a named workload as a JSONL trace")
    t.add_argument("--workload", default="lognormal", choices=wl.WORKLOADS)
    t.add_argument("--requests", type=int, default=20000)
    t.add_argument("--rate", type=float, required=True)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--out", required=True)

    pd = sub.add_parser("pd", help="when prefill/decode pools beat aggregated serving on the "
                        "same GPUs, by prompt length and load (the table)")
    pdtable.add_arguments(pd)

    v = sub.add_parser("validate", help="fidelity check: the same traces through real vLLM "
                       "engines behind real routers and through the simulator")
    validate.add_arguments(v)
    return p


def _plan_args(pl: argparse.ArgumentParser, required: bool = True) -> None:
    pl.add_argument("--fleet", action="append", required=required,
                    help="a built-in fleet or a fleet TOML (repeat to compare)")
    pl.add_argument("--trace", default="")
    pl.add_argument("--workload", default="lognormal", choices=wl.WORKLOADS)
    pl.add_argument("--slo", type=_slo, required=required)
    pl.add_argument("--rates", type=_floats, default=[])
    pl.add_argument("--attainment", type=float, default=0.99)
    pl.add_argument("--ttft-p99-ms", type=float, default=float("inf"))
    pl.add_argument("--e2e-p99-ms", type=float, default=float("inf"))
    pl.add_argument("--policy", default="predicted_latency")
    pl.add_argument("--seeds", type=_seeds, default=_seeds("3"))
    pl.add_argument("--requests", type=_positive, default=None,
                    help="requests per run (default: all of the trace; 5,000 of a workload)")
    pl.add_argument("--out", default="sim-plan")


def _run_trace(a: argparse.Namespace, fleet: fleets.FleetSpec) -> dict[str, Any]:
    """The run's workload from ``--trace``: its first ``--requests`` (default all), at
    ``--rate``, at ``--load`` x the fleet's capacity on its request mix, or at its own times."""
    full = wl.load_trace(a.trace)
    trace = wl.head(full, a.requests)
    info: dict[str, Any] = {"trace": a.trace, "requests_in_trace": len(full.arrivals),
                            "load": 0.0}
    if a.rate > 0:
        rate = a.rate
    elif a.load is not None:
        info["capacity"] = cap_mod.trace_capacity(fleet, trace)
        info["load"] = a.load
        rate = a.load * info["capacity"]
    else:
        rate = wl.mean_rate(trace)   # the trace's own arrival times
        info["rate_from"] = "the trace's own arrival times"
    if rate != wl.mean_rate(trace):
        trace = wl.rescale(trace, rate)
    return {**info, "workload": trace.name, "rate": rate, "trace_replayed": True,
            "seeds_vary": "the simulator's own randomness only (the trace is fixed)",
            "_trace": trace}


def _cmd_run(a: argparse.Namespace) -> int:
    fleet = pdtable.pd_overrides(a, fleets.resolve(a.fleet))
    if a.trace:
        run = _run_trace(a, fleet)
    else:
        load = 0.8 if a.load is None else a.load
        cap = grid.capacity(fleet, a.workload) if a.rate <= 0 else 0.0
        run = {"workload": a.workload, "load": load if a.rate <= 0 else 0.0,
               "rate": a.rate if a.rate > 0 else load * cap, "trace_replayed": False,
               "seeds_vary": "the workload (each seed draws its own) and the simulator",
               **({"capacity": cap} if cap else {})}
    trace = run.pop("_trace", None)
    n = len(trace.arrivals) if trace is not None else a.requests or 20000
    t0 = time.process_time()
    cell = grid.run_cell(fleet, a.workload, run["rate"], a.policies.split(","), a.seeds,
                         n, a.slo, trace=trace)
    rec = {"fleet": fleet.name, **run, "requests": n, "seeds": a.seeds,
           "slo": {"ttft_ms": a.slo.ttft_ms, "tpot_ms": a.slo.tpot_ms},
           "nodes": [x.node_id for x in fleet.nodes],
           "speeds": [x.engine.speed for x in fleet.nodes], **cell}
    md = (f"{fleet.name} / {rec['workload']} at {rec['rate']:.1f} req/s, {n} requests x "
          f"{len(a.seeds)} seeds ({time.process_time() - t0:.1f} s CPU)\n\n"
          + report.ci_label(rec) + report.warnings_md(rec) + "\n\n"
          + report.cell_table(rec) + "\n\n" + report.share_table(rec) + "\n"
          + (_pd_line(rec, fleet) if fleet.disaggregated else ""))
    sys.stdout.write(md)
    if a.md:
        Path(a.md).write_text(md, encoding="utf-8")
    if a.json:
        Path(a.json).write_text(json.dumps(rec) + "\n", encoding="utf-8")
    return 0


def _pd_line(rec: dict[str, Any], fleet: fleets.FleetSpec) -> str:
    """A disaggregated fleet's link, rule and the share of requests disaggregated."""
    share = ", ".join(f"{p} {sum(m['disaggregated'] for m in runs) / len(runs):.1%}"
                      for p, runs in rec["runs"].items())
    return (f"\nKV link {fleet.link.bandwidth_bytes_per_s / 1e9:g} GB/s + "
            f"{fleet.link.latency_s * 1000:g} ms; disaggregated (mean over seeds): {share}\n")


def _cmd_plan(a: argparse.Namespace) -> int:
    trace = wl.load_trace(a.trace) if a.trace else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for f in a.fleet:
        fleet = fleets.resolve(f)
        results[fleet.name] = cap_mod.plan(
            fleet, a.slo, trace=trace, workload=a.workload, rates=a.rates, policy=a.policy,
            seeds=a.seeds, n=a.requests, attainment=a.attainment,
            ttft_p99_ms=a.ttft_p99_ms, e2e_p99_ms=a.e2e_p99_ms)
    md = cap_mod.markdown(results, a.slo, a.attainment)
    (out / "plan.md").write_text(md + "\n", encoding="utf-8")
    (out / "plan.json").write_text(json.dumps(cap_mod.as_json(results)) + "\n",
                                   encoding="utf-8")
    png = cap_mod.plot(results, a.attainment, out / "plan.png")
    sys.stdout.write(md + f"\n\nplot: {png}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in SUBCOMMANDS and args[0] not in ("-h", "--help"):
        args = ["plan", *args]   # `gpumesh sim --fleet ... --trace ... --slo ...`
    a = build_parser().parse_args(args)
    if a.cmd == "run":
        return _cmd_run(a)
    if a.cmd == "plan":
        return _cmd_plan(a)
    if a.cmd == "pd":
        return pdtable.command(a)
    if a.cmd == "validate":
        a.argv = args[1:]
        return validate.validate(a)
    if a.cmd == "grid":
        caps = json.loads(Path(a.capacities).read_text()) if a.capacities else None
        path = grid.grid(a.fleets.split(","), a.workloads.split(","), a.loads,
                         a.policies.split(","), a.seeds, a.requests, a.slo, Path(a.out),
                         log=lambda m: print(m, file=sys.stderr, flush=True),
                         shard=a.shard, have=[Path(h) for h in a.have],
                         replace=True if a.replace == "*" else a.replace.split(",") if a.replace
                         else False,
                         capacities=caps,
                         router=fleets.router_settings(a.router) or None,
                         skip=[x for x in a.skip.split(",") if x])
        if a.no_report or not grid.read_records(path):
            print(path)
            return 0
        md, pngs = report.write(report.load_cells([path]), Path(a.out))
        print(f"{md}\n" + "\n".join(map(str, pngs)))
        return 0
    if a.cmd == "merge":
        records = grid.merge_records(r for f in a.files for r in grid.read_records(Path(f)))
        grid.write_records(Path(a.out), records)
        print(f"{len(records)} cells -> {a.out}")
        return 0
    if a.cmd == "report":
        md, pngs = report.write(report.load_cells(a.files), Path(a.out))
        print(f"{md}\n" + "\n".join(map(str, pngs)))
        return 0
    if a.cmd == "trace":
        w = wl.build(a.workload, a.requests, a.rate, a.seed, ["n0", "n1"])
        with open(a.out, "w", encoding="utf-8") as f:
            for x in w.arrivals:
                rec = {"arrival_s": round(x.arrival_s, 6), "prompt_tokens": x.prompt_tokens,
                       "max_tokens": x.output_tokens}
                if x.blocks:
                    rec["blocks"] = list(x.blocks)
                f.write(json.dumps(rec) + "\n")
        print(f"{len(w.arrivals)} requests -> {a.out}")
        return 0
    raise AssertionError(a.cmd)


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``gpumesh sim`` to the ``gpumesh`` command line (``gpumesh.commands`` entry
    point); the arguments after ``sim`` go to :func:`main` unparsed."""
    s = sub.add_parser("sim", help="virtual-time fleet simulator and capacity planning",
                       add_help=False)
    s.add_argument("-h", "--help", action="store_true", dest="sim_help")
    # `gpumesh sim --fleet ... --slo ...` (plan): argparse gives a leading option to no
    # REMAINDER positional, so the plan's options are declared here too
    _plan_args(s, required=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(func=_from_gpumesh)


def _from_gpumesh(a: argparse.Namespace) -> int:
    if a.sim_help:
        return main(["--help"])
    if a.fleet:
        if a.slo is None:
            raise SystemExit("gpumesh sim --fleet ...: --slo TTFT_MS:TPOT_MS is required")
        if a.rest:
            raise SystemExit(f"gpumesh sim: unexpected arguments {a.rest}")
        return _cmd_plan(a)
    return main(a.rest)


if __name__ == "__main__":
    sys.exit(main())

"""Capacity measurement and the policy grid: fleets x workloads x loads x policies x seeds.

Capacity of a (fleet, workload): a closed-loop saturation run through ``least_request``
(a fixed baseline, so that a change to the default policy does not move the load levels;
``max_num_seqs`` requests outstanding per node, so every node has a
full batch and a queue), completions per simulated second between the 20th and the 80th
percentile of completion times (ramp-up and drain left out). The ``large`` fleet is 128
copies of ``hetero-speed``'s mix, so its capacity is taken as 128 x that one's.

A cell (fleet, workload, load): for each seed one trace at load x capacity, run under every
policy (the same requests and arrival times for all: paired), ``metrics.run_metrics`` per run,
aggregated over seeds. Results are written cell by cell to ``OUT/grid.jsonl`` (one JSON
record per cell, with every seed's metrics), so an interrupted grid keeps what it finished.

Sharding and merging (``gpumesh sim grid --shard K/N --have FILE --replace``,
``gpumesh sim merge``): the work is the ordered list of units (cell, policy), cells in
workload x fleet x load order, each cell's policies in the order given; units whose policy a
record of the output or of a ``--have`` file already holds are dropped (except the
policies named by ``--replace``),
and process K of N runs the units i with i % N == K of what is left, so N processes started
with the same arguments split the work between them. Each finished unit is merged into
``OUT/grid.jsonl`` at once (one record per cell; a policy's runs replace that policy's runs
in the cell's record), so a process stopped at any point keeps every unit it finished.
``merge_records`` folds the records of one cell from several files into one.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpumesh_bench.sim import fleets as fleets_mod
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.metrics import SLOSpec, aggregate, run_metrics

log = logging.getLogger(__name__)

POLICIES = ("predicted_latency", "least_request", "power_of_two", "round_robin")


def capacity(fleet: fleets_mod.FleetSpec, workload: str, seed: int = 1000,
             router: dict[str, Any] | None = None) -> float:
    """Completions per simulated second at saturation (module docstring)."""
    if fleet.name == "large":
        return 128 * capacity(fleets_mod.builtin("hetero-speed"), workload, seed, router)
    conc = sum(n.engine.max_num_seqs for n in fleet.nodes)
    n = max(3000, 4 * conc)
    w = wl.build(workload, n, 1.0, seed, [x.node_id for x in fleet.nodes], fleet.fastest)
    w = wl.Workload(w.name, w.arrivals, [])   # capacity of the unchanged fleet
    r = simulate(fleet, w, "least_request", seed, closed_concurrency=conc,
                 router_overrides=router)
    ends = sorted(x.end_s for x in r.records if not x.error)
    lo, hi = int(0.2 * len(ends)), int(0.8 * len(ends))
    return (hi - lo) / (ends[hi] - ends[lo])


def run_cell(fleet: fleets_mod.FleetSpec, workload: str, rate: float, policies: Iterable[str],
             seeds: Iterable[int], n: int, slo: SLOSpec,
             router: dict[str, Any] | None = None,
             trace: wl.Workload | None = None) -> dict[str, Any]:
    """Every policy on the same per-seed traces; returns per-policy per-seed metrics and
    their aggregates, plus the CPU seconds of one run (the first). With ``trace`` every seed
    replays that same trace (the seeds then vary only the simulator's own randomness:
    heartbeat phases, decision sampling, token draws); else each seed draws its own workload.
    When a run cut outputs at the context length, a warning is logged and the record's
    ``warnings`` says how many."""
    per: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    cpu: list[float] = []
    for seed in seeds:
        if trace is not None:
            w = trace
        else:
            w = wl.build(workload, n, rate, seed, [x.node_id for x in fleet.nodes],
                         fleet.fastest)
        for p in per:
            t = time.process_time()
            res = simulate(fleet, w, p, seed, router_overrides=router)
            cpu.append(time.process_time() - t)
            per[p].append(run_metrics(res, slo))
    out: dict[str, Any] = {"runs": per, "agg": {p: aggregate(v) for p, v in per.items()},
                           "cpu_s_per_run": cpu}
    cut = max((m.get("cut_outputs", 0) for v in per.values() for m in v), default=0)
    if cut:
        msg = (f"outputs cut at the context length: up to {cut} requests per run "
               "(prompt + max_tokens over the node's max_context_length)")
        log.warning("%s", msg)
        out["warnings"] = [msg]
    return out


Key = tuple[str, str, float, int, tuple[int, ...]]


def cell_key(rec: dict[str, Any]) -> Key:
    """(fleet, workload, load, requests, seeds): what identifies a cell's record."""
    return (rec["fleet"], rec["workload"], float(rec["load"]), int(rec["requests"]),
            tuple(rec["seeds"]))


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a grid.jsonl, plain or gzipped (``.gz``: how the repository keeps its
    results); [] when it does not exist."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def merge_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per cell, in order of first appearance: a later record's policies replace
    the same policies of an earlier one and add the others (policies in ``POLICIES`` order,
    others after)."""
    merged: dict[Key, dict[str, Any]] = {}
    for rec in records:
        k = cell_key(rec)
        old = merged.get(k)
        if old is None:
            merged[k] = {**rec, "runs": dict(rec["runs"]), "agg": dict(rec["agg"]),
                         "cpu_s_per_run": list(rec.get("cpu_s_per_run", []))}
            continue
        old["runs"].update(rec["runs"])
        old["agg"].update(rec["agg"])
        old["cpu_s_per_run"] = old["cpu_s_per_run"] + list(rec.get("cpu_s_per_run", []))
    for rec in merged.values():
        order = [p for p in POLICIES if p in rec["runs"]]
        order += [p for p in rec["runs"] if p not in order]
        rec["runs"] = {p: rec["runs"][p] for p in order}
        rec["agg"] = {p: rec["agg"][p] for p in order}
    return list(merged.values())


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Writes ``records`` to ``path`` as JSON lines (through a temporary file, then renamed,
    so a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    tmp.replace(path)


def units(fleet_names: list[str], workloads: list[str], loads: list[float],
          policies: list[str], n: int, seeds: list[int], have: Iterable[dict[str, Any]] = (),
          replace: bool | Iterable[str] = False, shard: tuple[int, int] = (0, 1),
          skip: Iterable[str] = ()) -> list[tuple[str, str, float, str]]:
    """The (fleet, workload, load, policy) units shard K of N runs (module docstring), in
    workload x fleet x load order. ``fleet_names`` are built-in fleet names or TOML paths, as
    ``fleets.resolve`` takes; ``replace``: True = every policy, or the policies to run even
    where ``have`` holds them; ``skip``: "fleet/workload" pairs left out."""
    k, nshards = shard
    if not 0 <= k < nshards:
        raise ValueError(f"shard {k}/{nshards}: K must be in [0, N)")
    rerun = set(policies) if replace is True else set(replace or ())
    held: set[tuple[Key, str]] = set()
    for rec in have:
        held.update((cell_key(rec), p) for p in rec["runs"] if p not in rerun)
    names = {f: fleets_mod.resolve(f).name for f in fleet_names}
    skipped = set(skip)
    todo = []
    for w in workloads:
        for fname in fleet_names:
            if f"{names[fname]}/{w}" in skipped:
                continue
            for load in loads:
                key = (names[fname], w, float(load), n, tuple(seeds))
                todo += [(fname, w, load, p) for p in policies if (key, p) not in held]
    return [u for i, u in enumerate(todo) if i % nshards == k]


def grid(fleet_names: list[str], workloads: list[str], loads: list[float],
         policies: list[str], seeds: list[int], n: int, slo: SLOSpec, out: Path,
         log: Any = print, *, shard: tuple[int, int] = (0, 1), have: Iterable[Path] = (),
         replace: bool | Iterable[str] = False, capacities: dict[str, float] | None = None,
         router: dict[str, Any] | None = None, skip: Iterable[str] = ()) -> Path:
    """Runs this shard's units (module docstring) one by one, merging each into
    ``out/grid.jsonl``; returns that path. ``have``: more grid.jsonl files whose units count
    as done (and whose capacities are reused); ``replace``: run the given policies (True) or
    these of them even where a record holds them (their runs are replaced); ``capacities``: known capacities by
    "fleet/workload" (measured here where missing); ``router``: RouterConfig overrides for
    every run (kept in the records it writes); ``skip``: "fleet/workload" pairs left out."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "grid.jsonl"
    records = merge_records(read_records(path))
    known = records + [r for h in have for r in read_records(Path(h))]
    caps: dict[str, float] = dict(capacities or {})
    for c in known:
        caps.setdefault(f'{c["fleet"]}/{c["workload"]}', c["capacity"])
    todo = units(fleet_names, workloads, loads, policies, n, seeds, known, replace, shard,
                 skip)
    log(f"shard {shard[0]}/{shard[1]}: {len(todo)} units")
    fleet_cache: dict[str, fleets_mod.FleetSpec] = {}
    for fname, w, load, policy in todo:
        fleet = fleet_cache.get(fname) or fleets_mod.resolve(fname)
        fleet_cache[fname] = fleet
        key = f"{fleet.name}/{w}"
        if key not in caps:
            caps[key] = capacity(fleet, w)
            log(f"capacity {key}: {caps[key]:.1f} req/s")
        t0 = time.time()
        cell = run_cell(fleet, w, load * caps[key], [policy], seeds, n, slo, router=router)
        rec = {**({"router": router} if router else {}),"fleet": fleet.name, "workload": w, "load": load, "requests": n,
               "seeds": seeds, "capacity": caps[key], "rate": load * caps[key],
               "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
               "nodes": [x.node_id for x in fleet.nodes],
               "speeds": [x.engine.speed for x in fleet.nodes], **cell}
        records = merge_records([*records, rec])
        write_records(path, records)
        log(f"{key} load {load} {policy}: {time.time() - t0:.0f} s wall, "
            f"{max(cell['cpu_s_per_run']):.1f} s CPU per run at most")
    return path

"""Routing-decision micro-benchmark: the scheduler alone, over in-memory fleets.

For each fleet size N, a ``router.fleet.Registry`` is filled with N registered nodes, each
with a fresh heartbeat (random load: running, waiting, pending prefill tokens, KV usage,
throughputs, KV capacity), and this router's own in-flight counts. One decision is what the
dispatcher does per request: ``registry.candidate_source(model)`` (the per-node cached
candidates, read lazily) and ``scheduling.select_from`` (filters -> capacity -> the profile's
pick, over a random sample of ``decision_sample_size`` nodes on fleets larger than that).
Both are timed together ("decision") and ``select_from`` alone ("select"), per policy, with
``time.perf_counter_ns``; p50/p99 in microseconds over ``iters`` decisions (after a warm-up).
No I/O, no event loop.

So that the per-node caches are not unrealistically warm, each decision is followed (untimed)
by what a live router sees between two decisions: the chosen node is charged (a dispatch, as
the dispatcher does), the oldest of this router's bench credits finishes, and one random node
sends a heartbeat; the next decision rebuilds whatever of those it looks at.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections import deque
from typing import Any

from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet import Registry
from gpumesh.router.scheduling import (
    Policy,
    RequestInfo,
    build_policy,
    default_filters,
    select_from,
)
from gpumesh.types import LoadReport, ModelSpec, Registration, RouterAccount

POLICIES = ("predicted_latency", "least_request", "power_of_two", "round_robin")


# Every report carries this router's account (the node has admitted one of its requests).
_ACCOUNTS = (RouterAccount("bench-router", 1, 100, 1, 100),)


def random_load(rng: random.Random) -> LoadReport:
    return LoadReport(num_running=rng.randint(0, 256), num_waiting=rng.randint(0, 16),
                      pending_prefill_tokens=rng.randint(0, 20_000),
                      kv_cache_usage=rng.random() * 0.95,
                      generation_tokens_per_s=rng.uniform(1000, 30_000),
                      prompt_tokens_per_s=rng.uniform(1000, 100_000), in_flight=10,
                      kv_capacity_tokens=10_200_000, router_accounts=_ACCOUNTS)


def build_registry(n: int, seed: int = 0) -> Registry:
    logging.getLogger("gpumesh.router.fleet.registry").setLevel(logging.WARNING)  # one line per node otherwise
    rng = random.Random(seed)
    clock = [1000.0]
    reg = Registry("bench-router", lease_ttl_s=3.0, freshness_s=1.5, max_concurrency_default=0,
                   known_model_retention_s=60.0, clock=lambda: clock[0])
    for i in range(n):
        nid = f"node-{i:05d}"
        reg.register(Registration(nid, f"10.0.{i // 250}.{i % 250}:50051",
                                  (ModelSpec("m", (), 8704, 1, rng.choice((0.5, 1, 1, 2))),),
                                  f"inc{i}"), stream_id=i + 1)
        for _ in range(rng.randint(0, 6)):  # some of this router's requests in flight
            reg.charge(nid, rng.randint(64, 4096))
        reg.heartbeat(nid, i + 1, 1, 0, random_load(rng))
    return reg


def _pcts(ns: list[int]) -> dict[str, float]:
    ns.sort()
    k = len(ns)
    return {"p50_us": ns[k // 2] / 1000, "p99_us": ns[min(k - 1, int(k * 0.99))] / 1000,
            "mean_us": sum(ns) / k / 1000}


def bench_one(reg: Registry, profile: Policy, iters: int, rng: random.Random) -> dict[str, Any]:
    cfg = RouterConfig(serving={"router_id": "x"})
    filters = default_filters(cfg.membership.kv_hard_threshold)
    d = cfg.routing.sample_size
    req = RequestInfo("m", 512)
    ids = [v.entry.node_id for v in reg.fleet()]
    seqs = dict.fromkeys(ids, 1)
    churn = random.Random(7)
    credits: deque[Any] = deque()

    def between() -> None:   # untimed: one dispatch, one finish, one heartbeat
        credits.append(reg.charge(chosen, 512))
        if len(credits) > 64:
            credits.popleft().finish()
        nid = churn.choice(ids)
        seqs[nid] += 1
        reg.heartbeat(nid, int(nid[len("node-"):]) + 1, seqs[nid], 0, random_load(churn))

    for _ in range(min(50, iters)):
        chosen = select_from(profile, reg.candidate_source("m"), req, rng, filters, d).node_id
        between()
    full, sel = [], []
    gc.disable()
    try:
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            source = reg.candidate_source("m")
            t1 = time.perf_counter_ns()
            chosen = select_from(profile, source, req, rng, filters, d).node_id
            t2 = time.perf_counter_ns()
            full.append(t2 - t0)
            sel.append(t2 - t1)
            between()
    finally:
        gc.enable()
    for c in credits:
        c.finish()
    return {"decision": _pcts(full), "select": _pcts(sel)}


def run(sizes: list[int], iters: int, policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    cfg = RouterConfig(serving={"router_id": "x"})
    rows = []
    for n in sizes:
        reg = build_registry(n)
        # fewer iterations for big fleets, at least 200 (p99 needs them)
        it = max(200, min(iters, iters * 256 // max(n, 1)))
        for pol in policies:
            r = bench_one(reg, build_policy(cfg.routing.model_copy(update={"policy": pol})),
                          it, random.Random(1))
            rows.append({"nodes": n, "policy": pol, "iters": it, **r})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| nodes | policy | decision p50 µs | decision p99 µs | select-only p50 µs | "
            "select-only p99 µs | decisions/s per core (1/mean) |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        d, s = r["decision"], r["select"]
        lines.append(f"| {r['nodes']} | {r['policy']} | {d['p50_us']:.1f} | {d['p99_us']:.1f} | "
                     f"{s['p50_us']:.1f} | {s['p99_us']:.1f} | {1e6 / d['mean_us']:,.0f} |")
    return "\n".join(lines) + "\n"

"""Routing-decision micro-benchmark: the scheduler alone, over in-memory fleets.

For each fleet size N, a ``router.registry.Registry`` is filled with N registered nodes, each
with a fresh heartbeat (random load: running, waiting, pending prefill tokens, KV usage,
throughputs), and this router's own in-flight counts. One decision is what the dispatcher does
per request: ``registry.candidates(model)`` (the frozen per-request view) and
``scheduling.select`` (filters -> capacity -> the profile's pick). Both are timed together
("decision") and ``select`` alone ("select"), per policy, with ``time.perf_counter_ns``;
p50/p99 in microseconds over ``iters`` decisions (after a warm-up). No I/O, no event loop.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from typing import Any

from router.config import RouterConfig
from router.registry import AccountSample, ModelSpec, NodeRegistration, Registry
from router.scheduling import (
    LoadSample,
    RequestInfo,
    WaitModel,
    build_profile,
    default_filters,
    select,
)
from router.scheduling.profiles import Profile

POLICIES = ("weighted_least_load", "least_request", "power_of_two", "round_robin")


def build_registry(n: int, seed: int = 0) -> Registry:
    logging.getLogger("router.registry").setLevel(logging.WARNING)  # one line per node otherwise
    rng = random.Random(seed)
    clock = [1000.0]
    reg = Registry("bench-router", lease_ttl_s=3.0, freshness_s=1.5, max_concurrency_default=0,
                   known_model_retention_s=60.0, clock=lambda: clock[0])
    for i in range(n):
        nid = f"node-{i:05d}"
        reg.register(NodeRegistration(nid, f"10.0.{i // 250}.{i % 250}:50051",
                                      (ModelSpec("m", (), 8704, 1, rng.choice((0.5, 1, 1, 2))),),
                                      f"inc{i}"), stream_id=i + 1)
        for _ in range(rng.randint(0, 6)):  # some of this router's requests in flight
            reg.charge(nid, rng.randint(64, 4096))
        load = LoadSample(num_running=rng.randint(0, 256), num_waiting=rng.randint(0, 16),
                          pending_prefill_tokens=rng.randint(0, 20_000),
                          kv_cache_usage=rng.random() * 0.95,
                          generation_tokens_per_s=rng.uniform(1000, 30_000),
                          prompt_tokens_per_s=rng.uniform(1000, 100_000), in_flight=10)
        reg.heartbeat(nid, i + 1, 1, 0, load, [("bench-router", AccountSample(1, 100, 1, 100))])
    return reg


def _pcts(ns: list[int]) -> dict[str, float]:
    ns.sort()
    k = len(ns)
    return {"p50_us": ns[k // 2] / 1000, "p99_us": ns[min(k - 1, int(k * 0.99))] / 1000,
            "mean_us": sum(ns) / k / 1000}


def bench_one(reg: Registry, profile: Profile, iters: int, rng: random.Random) -> dict[str, Any]:
    filters = default_filters(RouterConfig(router_id="x").kv_hard_threshold)
    req = RequestInfo("m", 512)
    for _ in range(min(50, iters)):
        select(profile, reg.candidates("m"), req, rng, filters)
    full, sel = [], []
    gc.disable()
    try:
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            cands = reg.candidates("m")
            t1 = time.perf_counter_ns()
            select(profile, cands, req, rng, filters)
            t2 = time.perf_counter_ns()
            full.append(t2 - t0)
            sel.append(t2 - t1)
    finally:
        gc.enable()
    return {"decision": _pcts(full), "select": _pcts(sel)}


def run(sizes: list[int], iters: int, policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    cfg = RouterConfig(router_id="x")
    wm = WaitModel(cfg.reference_prompt_tokens_per_s, cfg.kv_penalty_s, cfg.kv_usage_cap,
                   cfg.decode_s_per_request, cfg.wait_scale_s)
    rows = []
    for n in sizes:
        reg = build_registry(n)
        # fewer iterations for big fleets, at least 200 (p99 needs them)
        it = max(200, min(iters, iters * 256 // max(n, 1)))
        for pol in policies:
            r = bench_one(reg, build_profile(pol, cfg.scorer_weights, wm), it, random.Random(1))
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

"""Routing decisions with prefix locality at fleet scale (``gpumesh bench overhead --parts
prefix``): the decision time with a full prefix index, and the index's memory.

For each fleet size N, a ``Registry`` is filled as in ``microbench`` (random fresh loads) and
the model's ``PrefixIndex`` with about ``blocks`` (node, block) entries: ``tenants`` shared
system prompts of ``prefix_blocks`` 16-token blocks each, every node holding the prefixes of
a few tenants in full (precise entries, as from KV events). A decision is what the
dispatcher does per request: ``PrefixLocality.annotate`` (the index walk over the request's
hashes) + ``registry.candidate_source`` + ``select_from`` with ``predicted_latency``, each
followed (untimed) by a dispatch, a finish and a heartbeat as in ``microbench``, interleaved
with the same decision for a prompt no node holds (side by side in one run: the machine's
noise hits both). Timed with ``time.perf_counter_ns``; p50 / p99 in microseconds. The request's hashing (tokenize +
hash, off the event loop in the router) is timed apart: it is per request, not per node.
Memory: ``tracemalloc`` over building the index (the bytes it holds per entry).
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from typing import Any

from gpumesh.kvblocks import block_hashes
from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.scheduling import RequestInfo, build_policy, default_filters, select_from
from gpumesh_bench.overhead.decision import build_registry, random_load


def _tenant_tokens(t: int, prefix_blocks: int) -> list[int]:
    rng = random.Random(t)
    return [rng.randrange(32_000) for _ in range(prefix_blocks * 16)]


def build_index(nodes: list[str], blocks: int, tenants: int, prefix_blocks: int
                ) -> tuple[PrefixIndexes, list[list[int]], int]:
    """The index, each tenant's prompt tokens, and the bytes the index holds."""
    prefixes = [_tenant_tokens(t, prefix_blocks) for t in range(tenants)]
    hashes = [block_hashes(p) for p in prefixes]
    per_node = max(1, blocks // max(len(nodes), 1) // prefix_blocks)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    indexes = PrefixIndexes(max_entries=blocks * 2)
    ix = indexes.model("m")
    rng = random.Random(3)
    for n in nodes:
        for t in rng.sample(range(tenants), min(per_node, tenants)):
            ix.add(n, hashes[t])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return indexes, prefixes, used


def _pcts(ns: list[int]) -> dict[str, float]:
    ns.sort()
    k = len(ns)
    return {"p50_us": ns[k // 2] / 1000, "p99_us": ns[min(k - 1, int(k * 0.99))] / 1000,
            "mean_us": sum(ns) / k / 1000}


def run(sizes: list[int], iters: int, blocks: int = 1_000_000, tenants: int = 512,
        prefix_blocks: int = 250) -> list[dict[str, Any]]:
    cfg = RouterConfig(serving={"router_id": "x"})
    filters = default_filters(cfg.membership.kv_hard_threshold)
    rows = []
    for n in sizes:
        reg = build_registry(n)
        nodes = [v.entry.node_id for v in reg.fleet()]
        indexes, prefixes, used = build_index(nodes, blocks, tenants, prefix_blocks)
        ix = indexes.model("m")
        loc = PrefixLocality("precise", indexes, clock=lambda: 0.0)
        profile = build_policy(cfg.routing)
        rng, pick = random.Random(1), random.Random(2)
        reqs = []
        hash_ns = []
        for k in range(64):
            tokens = prefixes[pick.randrange(tenants)] + [pick.randrange(32_000)
                                                          for _ in range(500)]
            t0 = time.perf_counter_ns()
            h = tuple(block_hashes(tokens))
            hash_ns.append(time.perf_counter_ns() - t0)
            reqs.append(RequestInfo("m", len(tokens), prefix_hashes=h, output_tokens=256))
        it = max(200, iters)
        full: list[int] = []
        base: list[int] = []   # the same decision for a prompt no node holds, interleaved
        plain = RequestInfo("m", 4500, output_tokens=256)
        held = []
        churn = random.Random(7)
        seqs = dict.fromkeys(nodes, 1)
        credits: list[Any] = []
        gc.disable()
        try:
            for k in range(2 * it):
                info = reqs[k // 2 % len(reqs)] if k % 2 else plain
                t0 = time.perf_counter_ns()
                info = loc.annotate(info)
                d = select_from(profile, reg.candidate_source("m"), info, rng, filters,
                                cfg.routing.sample_size)
                (full if k % 2 else base).append(time.perf_counter_ns() - t0)
                if k % 2:
                    held.append(len(info.cached_tokens))
                # untimed, as in microbench: one dispatch, one finish, one heartbeat
                credits.append(reg.charge(d.node_id, 512))
                if len(credits) > 64:
                    credits.pop(0).finish()
                nid = churn.choice(nodes)
                seqs[nid] += 1
                reg.heartbeat(nid, int(nid[len("node-"):]) + 1, seqs[nid], 0, random_load(churn))
        finally:
            gc.enable()
        for c in credits:
            c.finish()
        rows.append({"nodes": n, "entries": ix.entries, "index_bytes": used,
                     "bytes_per_entry": used / max(ix.entries, 1), "iters": it,
                     "holders_per_request": sum(held) / max(len(held), 1),
                     "decision": _pcts(full), "no_prefix": _pcts(base),
                     "hash_4500_tokens": _pcts(hash_ns)})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| nodes | indexed entries | index MiB | bytes/entry | decision p50 µs | "
             "decision p99 µs | same, prompt held nowhere: p50 / p99 µs | "
             "hashing a 4,500-token prompt p50 µs |", "|" + "---|" * 8]
    for r in rows:
        d, b = r["decision"], r["no_prefix"]
        lines.append(f"| {r['nodes']} | {r['entries']:,} | {r['index_bytes'] / 2**20:.0f} | "
                     f"{r['bytes_per_entry']:.0f} | {d['p50_us']:.0f} | {d['p99_us']:.0f} | "
                     f"{b['p50_us']:.0f} / {b['p99_us']:.0f} | "
                     f"{r['hash_4500_tokens']['p50_us']:.0f} |")
    return "\n".join(lines) + "\n"

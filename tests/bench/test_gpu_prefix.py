"""The cache-aware phase of the GPU bench (gpumesh_bench.gpu.prefix.phases): tenant prompts spelled
one token per word for each engine's tokenizer, the KV sizing, the report's round-by-round
pairing, and the phase end to end on simulated engines (bookkeeping, not speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpumesh_bench.gpu.prefix.phases import PrefixWorkload
from gpumesh_bench.gpu.prefix.load import SpellSpec, requests
from gpumesh_bench.gpu.prefix.report import prefix_markdown, prefix_table
from gpumesh_bench.tenants import TenantSpec


def test_spelling_salts_every_word_per_bench() -> None:
    from gpumesh.node.engines.sim.text import SimTokenizer

    spec = TenantSpec(tenants=3, system_words=30, turn_words=6, max_turns=3)
    a = list(zip(range(12), requests(spec, SpellSpec("sim", 33, 1), "m"), strict=False))
    b = list(zip(range(12), requests(spec, SpellSpec("sim", 33, 2), "m"), strict=False))
    tok = SimTokenizer()
    systems: dict[str, set[str]] = {}
    for (_, x), (_, y) in zip(a, b, strict=True):
        wx, wy = (x.prompt_text or "").split(), (y.prompt_text or "").split()
        assert len(wx) == len(tok.encode(x.prompt_text or "")) == x.prompt_tokens  # 1 word = 1 token
        assert len(wx) == len(wy)
        # no bench inherits another's cache: not even the system prompt's first block is shared
        assert wx[:16] != wy[:16]
        assert x.routing_key == y.routing_key
        systems.setdefault(x.routing_key.split("-")[0], set()).add(" ".join(wx[:33]))
    # within a bench, a tenant's requests share one spelling of its system prompt
    assert all(len(v) == 1 for v in systems.values()) and len(systems) > 1
    dummy = next(requests(spec, SpellSpec("dummy", 33, 1), "m")).prompt_text or ""
    assert all(w.startswith("<t") and w.endswith(">") and int(w[2:-1]) < 151643
               for w in dummy.split())
    # process k of n takes index % n == k
    assert [r.index for _, r in zip(range(4), requests(spec, SpellSpec("sim", 33, 1), "m",
                                                        1, 3), strict=False)] == [1, 4, 7, 10]


def test_kv_holds_a_quarter_of_the_prefixes_beside_the_running_requests() -> None:
    w = PrefixWorkload(tenants=48, system_words=1024, turn_words=40, max_turns=6,
                       max_tokens=48, concurrency=32)
    running = 16 * (1027 + 240 + 48)
    assert w.kv_blocks() * 16 - running == pytest.approx(48 * 1027 / 4, abs=16)


def _rec(setup: str, rnd: int, p90: float) -> dict:
    return {"phase": "prefix05", "prefix": setup, "balancer": setup, "round": rnd,
            "concurrency": 32, "ttft_p50": p90 / 2, "ttft_p90": p90, "ttft_p99": p90 * 2,
            "lat_p50": 0.3, "lat_p99": 0.6, "done_qps": 100.0, "errors": 0, "requests": 500,
            "node_share": {"pa": 60, "pb": 40},
            "nodes": {"pa": {"prefix_hit_rate": 0.8}, "pb": {"prefix_hit_rate": 0.6}},
            "workload": {"tenants": 48}}


def test_report_pairs_within_the_same_round_of_the_same_run(tmp_path: Path) -> None:
    """Two runs in two files, both with a round 0: each precise round is compared with the
    least_request round of its own run, never of the other; the heading names the shape."""
    import gzip

    from gpumesh_bench.gpu import cli as gpu_cli
    from gpumesh_bench.gpu.prefix.report import main as prefix_main

    def doc(lr: float, pr: float) -> dict:
        recs = [{**_rec("least_request", 0, lr), "call": 1, "shape": "7b"},
                {**_rec("precise", 0, pr), "call": 1, "shape": "7b"}]
        return {"records": recs, "meta": {"calls": [{"phases": "prefix7"}]}}

    f1, f2 = tmp_path / "a.json.gz", tmp_path / "b.json"
    f1.write_bytes(gzip.compress(json.dumps(doc(0.4, 0.1)).encode()))
    f2.write_text(json.dumps(doc(0.1, 0.1)))
    md = tmp_path / "p.md"
    assert prefix_main([str(f1), str(f2), "--md", str(md)]) == 0
    text = md.read_text()
    row = next(x for x in text.splitlines() if x.startswith("| precise"))
    assert "0.62 (0.25–1.00)" in row    # 0.1/0.4 and 0.1/0.1; pairing on round alone: 1 pair
    assert "two 7B engines" in text and "2 runs" in text
    # the package's report takes the same files (cache-aware records have their own table)
    out = tmp_path / "all.md"
    assert gpu_cli.main(["report", str(f1), str(f2), "--md", str(out)]) == 0
    assert "0.62 (0.25–1.00)" in out.read_text()
    # warm rounds only: round 0 left out leaves nothing to report
    assert prefix_main([str(f1), "--from-round", "1"]) == 0


def test_report_pairs_p90_ttft_round_by_round() -> None:
    recs = [_rec("least_request", 0, 0.4), _rec("precise", 0, 0.1), _rec("smg", 0, 0.2),
            _rec("least_request", 1, 0.2), _rec("precise", 1, 0.1), _rec("smg", 1, 0.1)]
    md = prefix_table(recs)
    row = next(x for x in md.splitlines() if x.startswith("| precise"))
    assert "0.38 (0.25–0.50)" in row        # 0.1/0.4 and 0.1/0.2
    assert "0.75 (0.50–1.00)" in row        # 0.1/0.2 and 0.1/0.1
    assert "60% / 40%" in row and "80% / 60%" in row
    assert "Cache-aware routing" in prefix_markdown(recs)
    assert prefix_markdown([{"door": "x"}]) == ""
    assert not math.isnan(recs[0]["ttft_p90"])


def test_tenant_stickiness_counts_requests_on_their_tenants_main_node() -> None:
    from gpumesh_bench.gpu.prefix.phases import tenant_stickiness
    from gpumesh_bench.loadgen import RequestResult

    def res(i: int, node: str, status: str = "OK") -> RequestResult:
        return RequestResult(i, 1.0, 0.5, 0.1, 8, 100, status, node)

    rs = [res(0, "pa"), res(1, "pa"), res(2, "pb"), res(3, "pb"), res(4, "pa"),
          res(5, "pb", "UNAVAILABLE")]
    keys = {0: "t1-c0", 1: "t1-c0", 2: "t1-c3", 3: "t2-c1", 4: "t2-c2", 5: "t2-c2"}
    # t1: 2 of 3 on pa; t2: 1 of 2 on its main node (the failed one not counted)
    assert tenant_stickiness(rs, keys, 0.0, 10.0) == pytest.approx(3 / 5)
    assert math.isnan(tenant_stickiness(rs, keys, 5.0, 10.0))


@pytest.mark.slow
def test_prefix_phase_on_simulated_engines(tmp_path: Path) -> None:
    from gpumesh_bench.gpu import cli as gpu_cli

    out = tmp_path / "out"
    rc = gpu_cli.main(["run", "--engine", "sim", "--phases", "prefix05", "--rounds", "1",
                       "--prefix-concurrency", "4", "--prefix-tenants", "8",
                       "--prefix-system-words", "256", "--procs", "2", "--warmup", "1",
                       "--seconds", "3", "--model-root", str(tmp_path / "models"),
                       "--budget", "400", "--out", str(out)])
    doc = json.loads((out / "results.json").read_text())
    recs = [r for r in doc["records"] if r["phase"] == "prefix05"]
    gp = {r["prefix"] for r in recs if r["kind"] == "grpc"}
    assert gp == {"least_request", "precise", "approximate"}
    for r in recs:
        if r["kind"] == "grpc":
            assert r["errors"] == 0 and r["done_qps"] > 0
            assert set(r["node_share"]) <= {"pa", "pb"} and set(r["nodes"]) == {"pa", "pb"}
            assert r["shape"] == "0.5b" and r["first_done_s"] < 1 + 3
            assert r["workload"]["scheduler"]["max_num_batched_tokens"] > 0
    smg = [r for r in recs if r["prefix"] == "smg"]
    if smg:   # SMG found (.smg-venv or the kit): its cache state is named
        assert "smg_mode" in smg[0]
    else:
        assert "prefix05 smg" in doc["meta"].get("doors_failed", {})
    assert rc == (0 if not doc["meta"].get("failed") else 1)
    assert "Cache-aware routing" in (out / "summary.md").read_text()

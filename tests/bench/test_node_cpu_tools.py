"""The node-CPU tools: `gpumesh bench node-cpu` against a real simulated node on loopback, and
the coalescing cost micro-benchmark against a second implementation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gpumesh_bench.overhead import coalesce as coalesce_bench
from gpumesh_bench.cli import main as bench_main
from tests.integration.procs import free_port, node_proc, wait_serving


def test_node_cpu_measures_the_node_process(tmp_path: Path) -> None:
    port = free_port()
    node = node_proc("cpu-sim", port, [], engine="sim", model="sim-cpu")
    try:
        asyncio.run(wait_serving(f"127.0.0.1:{port}", node, timeout_s=60))
        out = tmp_path / "nc.json"
        rc = bench_main(["node-cpu", "--target", f"a=127.0.0.1:{port}", "--rounds", "2",
                         "--concurrency", "4", "--duration", "1.5", "--output", "fixed:16",
                         "--json", str(out)])
        assert rc == 0
        doc = json.loads(out.read_text())
        assert [r["round"] for r in doc["rows"]] == [0, 1]
        for r in doc["rows"]:
            assert r["errors"] == 0 and r["tokens"] >= 16
            assert r["cpu_s"] > 0 and r["us_per_token"] > 0
    finally:
        node.close()


def test_coalesce_cost_compares_two_implementations(capsys) -> None:
    from gpumesh.node.streaming import coalesce

    src = Path(coalesce.__file__)
    rc = coalesce_bench.main(["--compare", str(src), "--rounds", "2", "--streams", "4",
                             "--steps", "20", "--step-ms", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "current / compare = " in out
    assert out.count("messages") == 4

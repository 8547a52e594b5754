"""`gpumesh demo` (the README's first command runs it with vLLM nodes) end to end with
simulated nodes: router and two nodes as processes, one streamed answer, the fleet table
showing the serving node's figures from a heartbeat sent after the request."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.procs import free_port


def test_demo_answers_and_shows_the_serving_nodes_figures(tmp_path) -> None:
    env = {**os.environ, "GPUMESH_DEMO_LOGS": str(tmp_path / "logs")}
    r = subprocess.run([sys.executable, "-m", "gpumesh.cli", "demo", "--engine", "sim",
                        "--port", str(free_port())],
                       capture_output=True, text=True, timeout=180, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    served = next(line for line in r.stderr.splitlines() if "served by" in line)
    node = served.split("served by ")[1].split(":")[0]
    assert node in ("node-0", "node-1"), served
    assert "48 completion tokens" in served
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("node "))
    cols = lines[head].split()
    assert cols[cols.index("tok/s") + 1:cols.index("tok/s") + 3] == ["step", "ms"]
    row = next(line.split() for line in lines[head + 1:] if line.startswith(node))
    # node, address, state, role, model, weight, fe, running, waiting, KV%, in flight, tok/s,
    # step ms
    assert row[1].startswith("127.0.0.1:"), row
    assert row[2] == "healthy" and row[3] == "both" and row[6] == "1" and row[10] == "0/0", row
    assert float(row[11]) > 0, row           # the request's tokens, not a report from before
    assert float(row[12]) > 0, row           # its decode step, measured

"""`gpumesh demo` runs with mutual TLS on every hop, on certificates `gpumesh certs` made:
both nodes register over mutual TLS and the answer streams."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.procs import free_port


def test_demo_runs_with_tls(tmp_path) -> None:
    logs = tmp_path / "logs"
    env = {**os.environ, "GPUMESH_DEMO_LOGS": str(logs)}
    r = subprocess.run([sys.executable, "-m", "gpumesh.cli", "demo", "--engine", "sim",
                        "--port", str(free_port())],
                       capture_output=True, text=True, timeout=180, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mutual TLS on every hop" in r.stderr
    assert "48 completion tokens" in r.stderr
    assert {"ca.pem", "router.pem", "node-0.pem", "operator.pem"} <= {
        p.name for p in (logs / "certs").iterdir()}
    router_log = (logs / "router.log").read_text()
    assert "node node-0 registered" in router_log and "node node-1 registered" in router_log

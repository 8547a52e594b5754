"""The committed generated code matches protos/ (regenerated into a temp dir and compared)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", *protos], check=True, cwd=ROOT)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    for rel in generated:
        assert (ROOT / rel).read_text() == (tmp_path / rel).read_text(), (
            f"{rel} is stale: run scripts/gen_protos.sh")

"""The committed generated code matches protos/ (regenerated into a temp dir and compared).

The ``GRPC_GENERATED_VERSION`` stamp of the ``*_grpc.py`` files is the grpcio-tools release
that generated them, and the generated module refuses to import under an older grpcio; so the
committed stamp is left out of the comparison and checked apart: it must not be newer than the
grpcio installed (a newer grpcio-tools on the package index must not fail the check, and a
regeneration with it must not break an older runtime)."""

import re
import subprocess
import sys
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def test_generated_code_is_current(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", *protos], check=True, cwd=ROOT)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    for rel in generated:
        committed, fresh = (ROOT / rel).read_text(), (tmp_path / rel).read_text()
        stamp = STAMP.search(committed)
        if stamp is not None:
            assert _version(stamp.group(1)) <= _version(grpc.__version__), (
                f"{rel} was generated for grpcio {stamp.group(1)}, newer than the installed "
                f"{grpc.__version__}")
        assert STAMP.sub("", committed) == STAMP.sub("", fresh), (
            f"{rel} is stale: run scripts/gen_protos.sh")

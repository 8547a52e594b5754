"""The distribution's shape: router/ and node/ install as gpumesh.router and gpumesh.node, the
gpumesh core imports neither (only the CLI sits above both), and benchmark code stays out of
the product (its own gpumesh-bench distribution, imported only by bench/ and tests/)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("gpumesh", "router", "node")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _py_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name)


def test_core_imports_neither_router_nor_node() -> None:
    offenders = []
    for path in _py_files("gpumesh"):
        if path.name == "cli.py" and path.parent.name == "gpumesh":
            continue  # the CLI is the one module above both
        bad = {m for m in _imports(path)
               if m.split(".")[:2] in (["gpumesh", "router"], ["gpumesh", "node"])}
        if bad:
            offenders.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert not offenders, offenders


def test_no_old_top_level_imports_and_no_bench_in_the_product() -> None:
    offenders = []
    for folder in PRODUCT:
        for path in _py_files(folder):
            bad = {m for m in _imports(path)
                   if m.split(".")[0] in ("router", "node", "gpumesh_bench", "bench")}
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert not offenders, offenders


def test_wheel_holds_the_product_only(tmp_path: Path) -> None:
    # Build from a copy of the tracked files: setuptools stages into build/ beside the sources
    # and never deletes what is there, so a stale build/ would add modules to the wheel.
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                             capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(src)], check=True, timeout=600)
    wheel = next(tmp_path.glob("gpumesh-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"gpumesh"}, tops
    assert "gpumesh/router/app.py" in names and "gpumesh/node/app.py" in names
    # the built-in engine profiles ship as package data
    shipped = {n for n in names if n.startswith("gpumesh/engine_profiles/")}
    assert shipped == {f"gpumesh/engine_profiles/{p.name}"
                       for p in (ROOT / "gpumesh/engine_profiles").glob("*.toml")}, shipped
    assert not [n for n in names if "bench" in n.split("/")[-1] or "/bench/" in n], \
        [n for n in names if "bench" in n]
    # every subpackage of router/ and node/ made it into the wheel
    for folder in ("router", "node"):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder).as_posix()
            assert f"gpumesh/{folder}/{rel}" in names, rel

"""The benchmark lab's shape: one package per question, each command reachable from
``gpumesh bench``, raw results beside the benchmark that produced them, and a GPU harness
documented for any GPU host."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpumesh_bench import cli
from gpumesh_bench.commands import Command

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _commands() -> list[Command]:
    return [c for _, _, commands in cli._questions() for c in commands]


def test_help_lists_every_question_and_its_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "gpumesh_bench.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    for name, question, commands in cli._questions():
        assert f"{name}: {question}" in out
        for c in commands:
            assert re.search(rf"^  {re.escape(c.name)}\s", out, re.M), c.name
    assert "gpumesh sim --help" in out


def test_command_names_are_unique_and_each_resolves() -> None:
    names = [c.name for c in _commands()]
    assert len(names) == len(set(names))
    parser = cli.build_parser()   # every module with add_arguments is imported and fills its parser
    for c in _commands():
        assert callable(c.target()), c
        if not c.own_args:
            a = parser.parse_args([c.name, *_required(c)])
            assert a.cmd == c.name
            assert not any(callable(v) for v in vars(a).values())   # results record them


def _required(c: Command) -> list[str]:
    """Just enough arguments for a command with required ones to parse."""
    return {"run": ["--target", "x:1", "--rate", "1"], "trace": ["--out", "x", "--requests", "1"],
            "report": ["f"], "plot": ["f", "--out", "x"], "compare-report": ["f"],
            "engine-loop": ["--config", "x", "--concurrency", "1"],
            "node-cpu": ["--target", "a=x:1"]}.get(c.name, [])


@pytest.mark.parametrize("argv", [["coalesce-cost", "--help"], ["scaling-ramp", "--help"],
                                  ["gpu", "--help"], ["smg-fleet", "--help"]])
def test_commands_with_their_own_arguments_get_them_unparsed(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "gpumesh_bench.cli", *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: python -m gpumesh_bench." in r.stdout


def test_raw_results_live_beside_their_benchmark() -> None:
    assert not (BENCH / "results").exists()
    files = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if "/results/" in f:
            package = f.split("/")[1]
            assert (BENCH / package / "__init__.py").is_file(), f
            assert f.startswith(f"bench/{package}/results/"), f


# Words of one particular environment's machinery, not of a GPU host any user has.
ENVIRONMENT = [
    (re.compile(r"\bwarm (?:machine|host)s?\b|machine was not warm|stays? warm", re.I),
     "hosts that stay warm"),
    (re.compile(r"transfer limit|MiB per call|device tool|\bnot carried\b", re.I),
     "transfer limits and tools"),
    (re.compile(r"\.\./shared|/work/|shared/gpu"), "folders outside the repository"),
]


def _lab_files() -> list[Path]:
    files = subprocess.run(["git", "ls-files", "bench", "docs/benchmarks.md",
                            "docs/benchmarks-gpu.md", "tests/bench"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in files
            if "/results/" not in f and Path(f).suffix in (".py", ".md", ".sh", ".txt", ".toml")
            and not f.startswith("bench/sim/") and f != "tests/bench/test_lab_layout.py"]


def test_the_lab_speaks_of_any_gpu_host() -> None:
    found = [f"{p.relative_to(ROOT)}: {why}: {m.group(0)!r}" for p in _lab_files()
             for pattern, why in ENVIRONMENT for m in pattern.finditer(p.read_text())]
    assert not found, found

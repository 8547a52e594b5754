"""Fixtures for interop tests: the SMG gateway binary in its own virtualenv.

SMG (PyPI ``smg``, a Rust gateway in a Python wheel) pins its own dependency set, so it lives
in ``<repo>/.smg-venv`` (git-ignored), created here on first use with
``pip install smg==1.13.0``. When it cannot be installed (no index reachable, no wheel for this
platform) the tests that need it are skipped with the installer's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SMG_VERSION = "1.13.0"
SMG_VENV = Path(os.environ.get("GPUMESH_SMG_VENV", REPO_ROOT / ".smg-venv"))


def _smg_ok(exe: Path) -> bool:
    if not exe.is_file():
        return False
    r = subprocess.run([str(exe.parent / "python"), "-c",
                        "import importlib.metadata as m; print(m.version('smg'))"],
                       capture_output=True, text=True, timeout=60, check=False)
    return r.returncode == 0 and r.stdout.strip() == SMG_VERSION


@pytest.fixture(scope="session")
def smg_exe() -> Path:
    """The ``smg`` launcher of smg==1.13.0, installed into .smg-venv when missing."""
    exe = SMG_VENV / "bin" / "smg"
    if _smg_ok(exe):
        return exe
    steps = [[sys.executable, "-m", "venv", "--clear", str(SMG_VENV)],
             [str(SMG_VENV / "bin" / "pip"), "install", "--quiet", f"smg=={SMG_VERSION}"]]
    for cmd in steps:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot install smg=={SMG_VERSION} into {SMG_VENV}: {exc}")
        if r.returncode != 0:
            pytest.skip(f"cannot install smg=={SMG_VERSION} into {SMG_VENV} "
                        f"({' '.join(cmd[:3])} exited {r.returncode}): "
                        f"{(r.stderr or r.stdout).strip()[-600:]}")
    if not _smg_ok(exe):
        pytest.skip(f"smg=={SMG_VERSION} installed into {SMG_VENV} but {exe} does not run")
    return exe

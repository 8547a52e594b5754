"""gpumesh.launcher's readiness waits, on real child processes."""

from __future__ import annotations

import sys

import pytest

from gpumesh.launcher import ChildExited, ChildProcess, wait_until


def test_a_wait_that_runs_out_shows_what_the_child_said(tmp_path) -> None:
    child = ChildProcess("sleeper", [sys.executable, "-c",
                                     "print('loading the model', flush=True); "
                                     "import time; time.sleep(60)"], tmp_path / "sleeper.log")
    try:
        with pytest.raises(TimeoutError) as e:
            wait_until(lambda: False, 1.0, watch=[child],
                       what="sleeper ready")
        text = str(e.value)
        assert text.startswith("sleeper ready: not ready after 1 s")
        assert "sleeper (still running)" in text and "loading the model" in text
    finally:
        child.stop(5)


def test_a_child_that_exits_ends_the_wait_at_once(tmp_path) -> None:
    child = ChildProcess("quitter", [sys.executable, "-c",
                                     "print('bad flag'); raise SystemExit(3)"],
                         tmp_path / "quitter.log")
    with pytest.raises(ChildExited, match="quitter exited \\(3\\)") as e:
        wait_until(lambda: False, 30.0, watch=[child])
    assert "bad flag" in str(e.value)

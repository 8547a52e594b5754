"""``gpumesh.node.engines.vllm.lifetime.watch_parent`` without vLLM: a grandchild that
watches its parent ends when the parent is SIGKILLed; one that does not, survives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.chaos.orphans import alive, kill_leftovers, wait_gone

PARENT = textwrap.dedent("""
    import multiprocessing, sys, time

    def child(watch):
        if watch:
            from gpumesh.node.engines.vllm.lifetime import watch_parent
            watch_parent(0.05)
        time.sleep(120)

    if __name__ == "__main__":
        p = multiprocessing.get_context(sys.argv[2]).Process(
            target=child, args=(sys.argv[1] == "watch",), daemon=False)
        p.start()
        print(p.pid, flush=True)
        time.sleep(120)
""")


def _start(tmp_path, watch: bool, method: str) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), "watch" if watch else "plain",
                               method], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_watched_child_dies_with_its_parent(tmp_path, method):
    parent, child = _start(tmp_path, True, method)
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        left, waited = wait_gone({child}, 10)
        assert not left, f"watched child still running {waited:.1f} s after its parent died"
    finally:
        kill_leftovers({child})


def test_unwatched_child_outlives_its_parent(tmp_path):
    """The control: without the watch the orphan keeps running (what the watch is for)."""
    parent, child = _start(tmp_path, False, "fork")
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(1.0)
        assert alive({child}) == {child}
    finally:
        kill_leftovers({child})

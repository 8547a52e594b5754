"""What a killed process leaves behind: its descendants, read from /proc (Linux).

Chaos tests record a node's process tree before killing the node's own pid, then wait for
every recorded process to be gone: an engine that outlives its node keeps the device's
memory and CPU time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid``; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may hold spaces and parentheses: the fields after it follow the last ')'
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), rest[0]


def cmdline(pid: int) -> str:
    """The process title (vLLM renames its processes ``VLLM::EngineCore`` ...); "" if gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies count as gone: they hold no memory)."""
    return {p for p in pids if (st := _stat(p)) is not None and st[1] not in ("Z", "X")}


def wait_gone(pids: set[int], timeout_s: float) -> tuple[set[int], float]:
    """Poll until none of ``pids`` runs or ``timeout_s`` passed: (survivors, seconds waited)."""
    t0 = time.monotonic()
    left = alive(pids)
    while left and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
        left = alive(left)
    return left, time.monotonic() - t0


def kill_leftovers(pids: set[int]) -> None:
    """SIGKILL survivors so that a failing test does not leave them running on the machine."""
    for p in alive(pids):
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass

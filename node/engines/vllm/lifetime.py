"""The engine's processes die with the node, however the node ends (SIGKILL of its own pid too).

vLLM runs its engine core in a child process (``multiprocessing``, fork or spawn) and the
model workers in children of that one. vLLM stops them on an orderly shutdown, and a worker
notices its engine core's death (vLLM's death pipe); nothing notices the death of the
*front-end* process: killed by the OOM killer or ``kill -9``, it leaves the engine core and
its workers running, holding the GPU's memory and CPU time, and the node cannot restart in
place.

``install()`` (called in the node's process before vLLM starts an engine core) wraps the
two process entry points vLLM hands to ``multiprocessing.Process`` —
``EngineCoreProc.run_engine_core`` and ``WorkerProc.worker_main`` — so that each child
first starts a parent watchdog: a daemon thread that polls ``os.getppid()`` and SIGKILLs its
own process once the parent is gone (the kernel re-parents an orphan to init or a
subreaper, so the parent pid changes). The wrapper is a module-level function, so it reaches
the child under fork (patched class inherited) and spawn (pickled by name) alike.

Why polling and not ``prctl(PR_SET_PDEATHSIG)``: the parent-death signal fires when the
*thread* that forked the child ends, and the node builds the engine in a worker thread
(``asyncio.to_thread``); a poll of ``getppid`` sees only the process. The bound is the poll
interval (``POLL_S``) plus the kernel's teardown of the process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: seconds between two looks at the parent pid in each engine process
POLL_S = 0.25

def watch_parent(poll_s: float = POLL_S, *, expected_ppid: int | None = None) -> threading.Thread:
    """Start a daemon thread that SIGKILLs this process once its parent process is gone.

    ``expected_ppid``: the parent this process must have (default: the current one); a
    process whose parent already died before the watch began is killed at the first poll.
    Returns the thread (for tests)."""
    if expected_ppid is None:
        # multiprocessing records the parent's pid at start: a parent that died before
        # this line is then still noticed
        known = multiprocessing.parent_process()
        expected_ppid = known.pid if known is not None and known.pid else os.getppid()
    parent = expected_ppid

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                # The front end is gone: nothing will ever read this process's output.
                # SIGKILL, not an orderly exit: an orderly exit can block on peers that
                # are gone (collectives, queues), and the point is to free the device.
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="gpumesh-parent-watch", daemon=True)
    thread.start()
    return thread


def _engine_core_entry(*args: Any, **kwargs: Any) -> Any:
    """``EngineCoreProc.run_engine_core`` after ``watch_parent()`` (module level: picklable)."""
    watch_parent()
    install()
    from vllm.v1.engine.core import EngineCoreProc

    return _original(EngineCoreProc, "run_engine_core")(*args, **kwargs)


def _worker_entry(*args: Any, **kwargs: Any) -> Any:
    """``WorkerProc.worker_main`` after ``watch_parent()`` (module level: picklable)."""
    watch_parent()
    from vllm.v1.executor.multiproc_executor import WorkerProc

    return _original(WorkerProc, "worker_main")(*args, **kwargs)


_ORIGINALS: dict[tuple[type, str], Callable[..., Any]] = {}


def _original(cls: type, name: str) -> Callable[..., Any]:
    key = (cls, name)
    if key not in _ORIGINALS:  # a spawned child: its vLLM classes were never patched
        _ORIGINALS[key] = getattr(cls, name)
    return _ORIGINALS[key]


def _patch(cls: type, name: str, entry: Callable[..., Any]) -> None:
    current = cls.__dict__.get(name)
    func = current.__func__ if isinstance(current, staticmethod) else current
    if func is entry:
        return
    _original(cls, name)
    setattr(cls, name, staticmethod(entry))


def install() -> None:
    """Make the engine core and worker processes vLLM starts from now on (in this process)
    die with their parent. Idempotent; a vLLM without these entry points is left alone
    (logged once)."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError as e:  # a vLLM of another layout: its processes may outlive the node
        logger.warning("engine processes will not die with the node: %s", e)
        return
    for cls, name, entry in ((EngineCoreProc, "run_engine_core", _engine_core_entry),
                             (WorkerProc, "worker_main", _worker_entry)):
        if not callable(getattr(cls, name, None)):
            logger.warning("engine processes will not die with the node: no %s.%s",
                           cls.__name__, name)
            continue
        _patch(cls, name, entry)

"""Child processes on this machine: start, wait until ready, stop (the demo, benchmarks, tests).

A :class:`ChildProcess` runs one argv (``ChildProcess.gpumesh`` builds ``python -m gpumesh.cli
ARGS``) in a session of its own, so that its process group holds everything it forks (a vLLM
node's engine core and workers) and a Ctrl-C in the launcher's terminal reaches the launcher
alone, which then stops its children in order. Output goes to a log file; stdin is
``/dev/null``.

Readiness is a predicate polled until a deadline (:func:`wait_until`,
:func:`wait_until_async`) that fails at once, with the log's tail, when a watched child exits;
:func:`wait_serving` and :func:`wait_serving_async` are the predicate "the standard
``grpc.health.v1`` check answers SERVING". Stopping (:meth:`ChildProcess.stop`,
:func:`stop_all`) sends the child's termination signal, waits a grace period, then SIGKILLs
the whole group (what the leader left behind too).

Ports for children come from :func:`gpumesh.ports.free_port` (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Self

import grpc

from gpumesh.ports import free_port

__all__ = ["ChildExited", "ChildProcess", "free_port", "gpumesh_argv", "stop_all",
           "wait_serving", "wait_serving_async", "wait_until", "wait_until_async"]

_GPUMESH = ("-m", "gpumesh.cli")
#: Exceptions a readiness predicate may raise while its target is not up yet.
NOT_UP: tuple[type[BaseException], ...] = (grpc.RpcError, OSError)


def gpumesh_argv(*args: str) -> list[str]:
    """``python -m gpumesh.cli ARGS`` with this interpreter (the ``gpumesh`` command)."""
    return [sys.executable, *_GPUMESH, *args]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ChildExited(RuntimeError):
    """A child exited while something waited for it to become ready."""


class ChildProcess:
    """One child process in its own session (= process group), its output in ``log_path``.

    ``env`` is added to this process's environment. ``cpus``: run under ``taskset -c CPUS``.
    ``append``: add to an existing log instead of replacing it. ``die_with_parent``: the child
    gets SIGKILL when this process dies, even by SIGKILL (``PR_SET_PDEATHSIG``).
    ``term_signal``: what :meth:`stop` sends first (nginx stops gracefully on SIGQUIT);
    ``term_group``: send it to the whole group instead of the leader alone (for a leader
    that does not stop its own children).
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: str | Path, *,
                 env: Mapping[str, str] | None = None, cpus: str = "", append: bool = False,
                 die_with_parent: bool = False, term_signal: int = signal.SIGTERM,
                 term_group: bool = False) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.term_signal = term_signal
        self.term_group = term_group
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        run = ["taskset", "-c", cpus, *self.argv] if cpus else self.argv
        # The child holds its own copy of the log's descriptor; ours closes at once.
        with open(self.log_path, "ab" if append else "wb") as log:
            self.popen = subprocess.Popen(
                run, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None)  # noqa: PLW1509
        self.pid = self.popen.pid

    @classmethod
    def gpumesh(cls, name: str, args: Sequence[str], log_path: str | Path,
                **kwargs: object) -> ChildProcess:
        """A ``gpumesh ARGS`` child (``python -m gpumesh.cli`` with this interpreter)."""
        return cls(name, gpumesh_argv(*args), log_path, **kwargs)  # type: ignore[arg-type]

    # --- state --------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of the log ("" when it cannot be read)."""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def check_alive(self) -> None:
        """Raises :class:`ChildExited` (with the log's tail) when the child has exited."""
        if not self.alive():
            raise ChildExited(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")

    def command(self) -> str:
        """The command line as a person would type it: ``NAME=VALUE ... gpumesh ARGS``."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        argv = self.argv
        if argv[:3] == [sys.executable, *_GPUMESH]:
            argv = ["gpumesh", *argv[3:]]
        return (env + " " if env else "") + " ".join(argv)

    # --- signals and stopping -----------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """``sig`` to every process of the child's group (none left: nothing happens)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        """The termination signal (leader or group, see the class), if the child runs."""
        if not self.alive():
            return
        if self.term_group:
            self.signal(self.term_signal)
        else:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(self.term_signal)

    def kill(self) -> None:
        """SIGKILL to the whole group, then reap the leader."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Terminate, wait up to ``grace_s`` for the leader, then SIGKILL the group; the
        leader's exit code (None if it could not be reaped)."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        self.kill()
        return self.popen.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(children: Iterable[ChildProcess], grace_s: float = 15.0) -> None:
    """Terminate every child at once, wait for them within one shared ``grace_s``, then
    SIGKILL every group (in the order given)."""
    kids = list(children)
    for c in kids:
        c.terminate()
    deadline = time.monotonic() + grace_s
    for c in kids:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.popen.wait(max(0.05, deadline - time.monotonic()))
    for c in kids:
        c.kill()


# --- readiness ----------------------------------------------------------------------------------

Describe = str | Callable[[], str]


def _timeout(what: Describe, timeout_s: float, last: BaseException | None,
             kids: Iterable[ChildProcess] = ()) -> TimeoutError:
    """The error of a readiness wait that ran out, with the end of each watched child's log
    (they are still running: what they last said is what tells why they are not ready)."""
    text = what() if callable(what) else what
    logs = "".join(f"\n--- {c.name} (still running), the end of its log:\n{c.tail(2000)}"
                   for c in kids)
    return TimeoutError(f"{text}: not ready after {timeout_s:g} s"
                        + (f" (last: {type(last).__name__}: {last})"[:500] if last else "")
                        + logs)


class _Poll:
    """What both readiness loops share: the watched children, the deadline, the last
    "not yet" error. ``done`` / ``done_async`` run one check of the predicate."""

    def __init__(self, timeout_s: float, watch: Iterable[ChildProcess], what: Describe,
                 not_up: tuple[type[BaseException], ...]) -> None:
        self.kids = list(watch)
        self.timeout_s, self.what, self.not_up = timeout_s, what, not_up
        self.deadline = time.monotonic() + timeout_s
        self.last: BaseException | None = None

    def _alive(self) -> None:
        for c in self.kids:
            c.check_alive()

    def _expired(self) -> bool:
        """False while time is left; raises TimeoutError once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise _timeout(self.what, self.timeout_s, self.last, self.kids)
        return False

    def done(self, ready: Callable[[], bool]) -> bool:
        self._alive()
        try:
            ok = ready()
        except self.not_up as e:
            self.last, ok = e, False
        return ok or self._expired()

    async def done_async(self, ready: Callable[[], Awaitable[bool]]) -> bool:
        self._alive()
        try:
            ok = await ready()
        except self.not_up as e:
            self.last, ok = e, False
        return ok or self._expired()


def wait_until(ready: Callable[[], bool], timeout_s: float, *,
               watch: Iterable[ChildProcess] = (), what: Describe = "child",
               poll_s: float = 0.3, not_up: tuple[type[BaseException], ...] = NOT_UP) -> None:
    """Polls ``ready()`` every ``poll_s`` until it returns True. Raises
    :class:`ChildExited` as soon as a child in ``watch`` exits, TimeoutError (with the end of
    each watched child's log) after ``timeout_s``. Exceptions of the ``not_up`` types count
    as "not yet"."""
    poll = _Poll(timeout_s, watch, what, not_up)
    while not poll.done(ready):
        time.sleep(poll_s)


async def wait_until_async(ready: Callable[[], Awaitable[bool]], timeout_s: float, *,
                           watch: Iterable[ChildProcess] = (), what: Describe = "child",
                           poll_s: float = 0.3,
                           not_up: tuple[type[BaseException], ...] = NOT_UP) -> None:
    """:func:`wait_until` for a coroutine predicate, sleeping on the event loop."""
    poll = _Poll(timeout_s, watch, what, not_up)
    while not await poll.done_async(ready):
        await asyncio.sleep(poll_s)


def wait_serving(address: str, timeout_s: float, *, watch: Iterable[ChildProcess] = (),
                 poll_s: float = 0.5) -> None:
    """Until ``grpc.health.v1.Health/Check`` (service "") on ``address`` answers SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def ready() -> bool:
            h = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            return h.status == health_pb2.HealthCheckResponse.SERVING

        wait_until(ready, timeout_s, watch=watch, what=f"{address} serving", poll_s=poll_s)


async def wait_serving_async(
        address: str, timeout_s: float, *, watch: Iterable[ChildProcess] = (),
        poll_s: float = 0.3,
        then: Callable[[grpc.aio.Channel], Awaitable[object]] | None = None) -> None:
    """:func:`wait_serving` on the event loop; ``then(channel)``, when given, must also
    complete without an RPC error (e.g. a first real call) before the address counts."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def ready() -> bool:
            h = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if h.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            if then is not None:
                await then(ch)
            return True

        await wait_until_async(ready, timeout_s, watch=watch, what=f"{address} serving",
                               poll_s=poll_s)

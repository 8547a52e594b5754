"""A real SMG gateway process over loopback, and a small stdlib HTTP/SSE client for it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.integration.procs import LOG_DIR, free_port


class SmgProcess:
    """``smg launch`` in front of gRPC workers, bound to 127.0.0.1 only (its metrics port too).

    The exact command line is in :attr:`argv` (reports quote it).
    """

    def __init__(self, exe: Path, worker_addresses: Sequence[str], model_dir: Path,
                 policy: str = "cache_aware", extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.argv = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                     "--worker-urls", *[f"grpc://{a}" for a in worker_addresses],
                     "--policy", policy, "--model-path", str(model_dir),
                     "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(self.metrics_port), *extra]
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"smg-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def get_json(self, path: str, timeout_s: float = 5) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=timeout_s) as r:
            return json.load(r)

    def wait_ready(self, n_workers: int, timeout_s: float = 60) -> None:
        """Until every worker is registered, healthy and ready (blocking)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"smg exited with {self.popen.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError, ValueError):
                ws = self.get_json("/workers").get("workers", [])
                if len(ws) == n_workers and all(
                        w.get("is_healthy") and w.get("status") == "ready" for w in ws):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"smg not ready after {timeout_s}s:\n{self.log()}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        self._log.close()


@dataclass(frozen=True)
class Completion:
    text: str
    pieces: tuple[str, ...]      # the text of each SSE event, in order
    finish_reason: str | None
    usage: dict | None


def complete(base: str, body: dict, timeout_s: float = 60) -> Completion:
    """POST /v1/completions (blocking); streams when ``body["stream"]``."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
    with resp:
        if not body.get("stream"):
            data = json.load(resp)
            c = data["choices"][0]
            return Completion(c["text"], (c["text"],), c.get("finish_reason"), data.get("usage"))
        pieces: list[str] = []
        finish = None
        usage = None
        done = False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                pieces.append(c.get("text", ""))
                finish = c.get("finish_reason") or finish
        assert done, "stream ended without [DONE]"
        return Completion("".join(pieces), tuple(pieces), finish, usage)

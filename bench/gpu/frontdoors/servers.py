"""The front doors other than gpumesh's own, as child processes of a GPU bench: ``vllm serve``
(vLLM's OpenAI server, one per engine), nginx least_conn over them (HTTP) or over gpumesh nodes
(gRPC), SMG in gRPC mode over gpumesh nodes' VllmEngine service, and the bare engine
(``bare_engine``: engine and load in one process); plus the CPU seconds of process trees.

Where the programs come from: ``GPUMESH_NGINX`` (default: ``/tmp/site/.ngx/usr/sbin/nginx``,
where ``kit/run_doors.sh`` unpacks ``kit/pack_doors.sh``'s Debian package, then this checkout's
``.gpukit/build-doors`` copy, then ``/usr/sbin/nginx``), SMG as
``python -m smg`` (its wheel's package on ``PYTHONPATH``), ``vllm serve`` as
``python -m vllm.entrypoints.openai.api_server`` (the kit's vLLM)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpumesh.launcher import free_port, wait_until
from gpumesh_bench import REPO_ROOT
from gpumesh_bench.fleet import NGINX_TEMPLATE, bench_child, nginx_config

HTTP_TEMPLATE = REPO_ROOT / "bench" / "gpu" / "kit" / "nginx-http-least-conn.conf.template"
ENGINE_TITLE = "VLLM::"   # vLLM's engine-core and worker processes set this process title


def nginx_binary() -> str:
    for p in (os.environ.get("GPUMESH_NGINX", ""), "/tmp/site/.ngx/usr/sbin/nginx",
              str(REPO_ROOT / ".gpukit" / "build-doors" / "site" / ".ngx" / "usr" / "sbin" / "nginx"),
              "/usr/sbin/nginx"):
        if p and Path(p).is_file():
            return p
    raise FileNotFoundError("no nginx binary (GPUMESH_NGINX, /tmp/site/.ngx, .gpukit/build-doors)")


def _nginx_env(binary: str) -> dict[str, str]:
    """The carried package's own libraries (libpcre2) beside the binary, if any."""
    lib = Path(binary).parents[1] / "lib" / "x86_64-linux-gnu"
    if lib.is_dir():
        return {"LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":")}
    return {}


def _http_ok(url: str) -> bool:
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    return False


class Nginx:
    """One nginx, least_conn over ``upstreams`` (host:port): ``grpc`` (h2c, gpumesh nodes, the
    project's deploy template) or ``http`` (HTTP/1.1 keepalive, ``vllm serve``)."""

    def __init__(self, name: str, upstreams: Sequence[str], log_dir: Path, *, mode: str = "http",
                 workers: int = 4) -> None:
        self.name, self.mode = name, mode
        self.port = free_port()
        prefix = log_dir / f"nginx-{name}"
        shutil.rmtree(prefix, ignore_errors=True)
        for d in ("logs", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (prefix / d).mkdir(parents=True, exist_ok=True)
        ups = [(u, 1) for u in upstreams]
        if mode == "grpc":
            conf = nginx_config(self.port, ups, prefix, NGINX_TEMPLATE)
        else:
            conf = nginx_config(self.port, ups, prefix, HTTP_TEMPLATE).replace(
                "@WORKERS@", str(workers))
        (prefix / "nginx.conf").write_text(conf)
        exe = nginx_binary()
        argv = [exe, "-p", str(prefix), "-e", str(prefix / "logs" / "error.log"),
                "-c", str(prefix / "nginx.conf")]
        if mode == "grpc":
            argv += ["-g", "daemon off;"]
        self.child = bench_child(f"nginx-{name}", argv, log_dir, env=_nginx_env(exe),
                                 term_signal=signal.SIGQUIT)
        self.address = f"127.0.0.1:{self.port}"
        self.base = f"http://{self.address}"

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        import socket

        def up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
                return True
            return False

        wait_until(up, timeout_s, watch=[self.child], what=self.child.name)

    def stop(self) -> None:
        self.child.stop(5.0)


class VllmServe:
    """``vllm serve`` (vLLM's OpenAI server module) for one engine, with the engine arguments a
    gpumesh node of the same settings gets (``serve_args``)."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path,
                 child_env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.child = bench_child(f"serve-{name}", self.argv, log_dir, env=child_env)
        self.address = f"127.0.0.1:{self.port}"
        self.base = f"http://{self.address}"

    def command(self) -> str:
        return "vllm serve " + " ".join(self.argv[3:])

    def wait_ready(self, timeout_s: float) -> None:
        wait_until(lambda: _http_ok(self.base + "/v1/models"), timeout_s,
                   watch=[self.child], what=self.child.name)

    def stop(self) -> None:
        self.child.stop(20.0)


def serve_args(kw: dict[str, Any]) -> list[str]:
    """``vllm serve`` flags for a node's ``AsyncEngineArgs`` fields (``engine_kwargs``)."""
    out = ["--model", kw["model"]]
    flags = {"tokenizer": "--tokenizer", "dtype": "--dtype", "max_model_len": "--max-model-len",
             "gpu_memory_utilization": "--gpu-memory-utilization",
             "load_format": "--load-format", "num_gpu_blocks_override": "--num-gpu-blocks-override",
             "seed": "--seed", "stream_interval": "--stream-interval",
             "tensor_parallel_size": "--tensor-parallel-size",
             "max_num_seqs": "--max-num-seqs",
             "max_num_batched_tokens": "--max-num-batched-tokens"}
    for k, f in flags.items():
        if kw.get(k) is not None:
            out += [f, str(kw[k])]
    if kw.get("served_model_name"):
        out += ["--served-model-name", *kw["served_model_name"]]
    out.append("--enable-prefix-caching" if kw.get("enable_prefix_caching") else
               "--no-enable-prefix-caching")
    if kw.get("enforce_eager"):
        out.append("--enforce-eager")
    if kw.get("compilation_config"):
        out += ["--compilation-config", json.dumps(kw["compilation_config"])]
    # uvicorn's per-request access log line is left on by `vllm serve`; off here, as the
    # gpumesh router and node log no line per request either
    out.append("--disable-uvicorn-access-log")
    return out


def smg_command() -> list[str]:
    """SMG's CLI: ``python -m smg`` where this Python has it (the kit's PYTHONPATH), else
    ``.smg-venv/bin/smg`` of this checkout when there is one."""
    import importlib.util

    venv = REPO_ROOT / ".smg-venv" / "bin" / "smg"
    if importlib.util.find_spec("smg") is None and venv.is_file():
        return [str(venv)]
    return [sys.executable, "-m", "smg"]


class Smg:
    """SMG's gateway (``python -m smg launch``) in gRPC mode over ``workers`` (host:port of
    gpumesh nodes, whose VllmEngine service it speaks)."""

    def __init__(self, name: str, workers: Sequence[str], model_dir: Path, log_dir: Path,
                 policy: str = "least_load", interval_s: int = 1,
                 flags: Sequence[str] = ()) -> None:
        self.name = name
        self.port, self.metrics_port = free_port(), free_port()
        # GPUMESH_SMG: the command that runs SMG's CLI (default: this Python's ``-m smg``,
        # else this checkout's .smg-venv)
        exe = shlex.split(os.environ.get("GPUMESH_SMG", "")) or smg_command()
        self.argv = [*exe, "launch", "--host", "127.0.0.1",
                     "--port", str(self.port), "--worker-urls", *[f"grpc://{w}" for w in workers],
                     "--policy", policy, "--model-path", str(model_dir),
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                     "--load-monitor-interval", str(interval_s), "--log-level", "warn", *flags]
        self.child = bench_child(f"smg-{name}", self.argv, log_dir)
        self.base = f"http://127.0.0.1:{self.port}"
        self.n = len(workers)

    def command(self) -> str:
        return "smg " + " ".join(self.argv[self.argv.index("launch"):])

    def _ready(self) -> bool:
        self.child.check_alive()
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(self.base + "/workers", timeout=3) as r:
                ws = json.load(r).get("workers", [])
            return len(ws) == self.n and all(w.get("is_healthy") and w.get("status") == "ready"
                                             for w in ws)
        return False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        wait_until(self._ready, timeout_s, watch=[self.child], what=self.child.name)

    def stop(self) -> None:
        self.child.stop(5.0)


class BareEngine:
    """One ``bare_engine`` process (an engine and its load in one process), kept up across
    rounds; :meth:`run` sends one closed-loop command and returns its results."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path,
                 child_env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"bare-{name}.log"
        self.argv = [sys.executable, "-m", "gpumesh_bench.gpu.frontdoors.bare_engine", *args]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, **(child_env or {})})
        self.pid = self.popen.pid

    def command(self) -> str:
        return "python -m gpumesh_bench.gpu.frontdoors.bare_engine " + " ".join(self.argv[3:])

    def _lines(self) -> list[str]:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace").splitlines()
        return []

    def _check(self) -> None:
        if self.popen.poll() is not None:
            tail = "\n".join(self._lines()[-30:])
            raise RuntimeError(f"bare engine {self.name} exited ({self.popen.returncode}):\n{tail}")

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while "READY" not in self._lines():
            self._check()
            if time.monotonic() > end:
                raise TimeoutError(f"bare engine {self.name}: not ready in {timeout_s:.0f}s")
            time.sleep(0.5)

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(cmd) + "\n").encode())
        self.popen.stdin.flush()

    def collect(self, out: Path, timeout_s: float) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout_s
        while f"DONE {out}" not in self._lines():
            self._check()
            if time.monotonic() > end:
                raise TimeoutError(f"bare engine {self.name}: no result in {timeout_s:.0f}s")
            time.sleep(0.2)
        return json.loads(out.read_text())["results"]

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send({"cmd": "quit"})
            assert self.popen.stdin is not None
            self.popen.stdin.close()
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        self._log.close()


# --- CPU of process trees ---------------------------------------------------------------------

def tree_cpu(roots: Iterable[int]) -> dict[str, float]:
    """User + system CPU seconds of the process trees under ``roots``: ``front`` (every process
    but vLLM's engine processes) and ``engine`` (processes titled ``VLLM::...``)."""
    import psutil

    out = {"front": 0.0, "engine": 0.0}
    seen: set[int] = set()
    for r in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(r)
            for p in [root, *root.children(recursive=True)]:
                if p.pid in seen:
                    continue
                seen.add(p.pid)
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    cmd = p.cmdline()
                    kind = "engine" if cmd and cmd[0].startswith(ENGINE_TITLE) else "front"
                    out[kind] += t.user + t.system
    return out


def stop_all(things: Iterable[Any]) -> None:
    for t in things:
        with contextlib.suppress(Exception):
            t.stop()

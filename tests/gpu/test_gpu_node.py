"""The node on vLLM CUDA: a real router (in process) and a real node process on one GPU.

Skipped without CUDA (and without vllm). The model is Qwen2.5-0.5B-Instruct shaped with dummy
weights (``load_format="dummy"``) and the synthetic tokenizer (gpumesh_bench.gpu.dummy_model),
or the folder in ``$GPUMESH_GPU_MODEL``. ``bench/gpu/kit/run_mesh_gpu.sh`` runs this module
before the benchmarks; ``$GPUMESH_GPU_ARTIFACTS`` (optional) receives the `gpumesh status` table
seen under load. CUDA graphs on (no enforce_eager), as in the raw-vLLM reference runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from gpumesh.client import MeshClient, build_request
from gpumesh.v1 import control_pb2 as cpb
from tests.integration.procs import free_port, node_proc, wait_serving


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda_available(), reason="needs CUDA (a GPU and torch with CUDA)"),
]

SERVED = "qwen2.5-0.5b"


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    env = os.environ.get("GPUMESH_GPU_MODEL")
    if env and (Path(env) / "config.json").is_file():
        return Path(env)
    from gpumesh_bench.gpu.dummy_model import build_dummy_model

    return build_dummy_model(tmp_path_factory.mktemp("model") / "qwen-0.5b-dummy", "0.5b")


@pytest.fixture(scope="module")
async def gpu_mesh(gpu_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from gpumesh.router.app import RouterServer
    from gpumesh.router.config import RouterConfig

    tmp = tmp_path_factory.mktemp("gpu-mesh")
    rport = free_port()
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": rport,
                                                "shutdown_grace_s": 1.0},
                                       membership={"heartbeat_interval_ms": 250}))
    await router.start()
    raddr = f"127.0.0.1:{rport}"
    cfg = tmp / "node.toml"
    cfg.write_text(
        '[membership]\nheartbeat_busy_interval_s = 0.25\n[serving]\ndrain_timeout_s = 5\n'
        f'[engine]\nserved_name = "{SERVED}"\nmax_model_len = 2048\nload_format = "dummy"\n'
        f'dtype = "bfloat16"\ntokenizer = "{gpu_model_dir / "tokenizer"}"\n'
        'gpu_memory_utilization = 0.85\n'
        # As the benchmark's nodes (gpumesh_bench.gpu): vLLM's compile cache is then shared.
        '[engine.engine_args]\nenable_prefix_caching = false\nseed = 0\n')
    nport = free_port()
    node = node_proc("gpu-node", nport, [raddr], model=str(gpu_model_dir), config=cfg)
    try:
        await wait_serving(f"127.0.0.1:{nport}", node, timeout_s=280)
        deadline = time.monotonic() + 30
        async with MeshClient(raddr) as c:
            while True:
                fleet = await c.fleet()
                if any(n.node_id == "gpu-node" and n.state == cpb.NODE_STATE_HEALTHY
                       for n in fleet.nodes):
                    break
                assert time.monotonic() < deadline, f"node never registered: {fleet}"
                await asyncio.sleep(0.2)
        yield raddr, f"127.0.0.1:{nport}", node
    finally:
        node.close()
        await router.stop(0.5)


async def test_text_round_trip_through_router_and_direct(gpu_mesh) -> None:
    raddr, naddr, _ = gpu_mesh
    for target in (raddr, naddr):
        async with MeshClient(target) as c:
            resp = await c.generate(build_request("<t5> <t77> <t1000>", model=SERVED,
                                                  max_tokens=8, temperature=0.0,
                                                  ignore_eos=True), timeout=60)
        assert resp.usage.prompt_tokens == 3
        assert resp.usage.completion_tokens == 8
        assert resp.text.count("<t") == 8  # the synthetic tokenizer decodes every id


async def test_heartbeats_show_kv_throughput_and_gpu_under_load(gpu_mesh) -> None:
    raddr, _, node = gpu_mesh
    seen: list[cpb.NodeStatus] = []
    status_text = ""

    async def load() -> None:
        async with MeshClient(raddr) as c:
            async def one(i: int) -> None:
                req = build_request(" ".join(["the"] * 200) + f" {i}", model=SERVED,
                                    max_tokens=1024, ignore_eos=True)
                n = 0
                async for chunk in c.stream(req, timeout=120):
                    n += len(chunk.token_ids)
                assert n == 1024
            await asyncio.gather(*(one(i) for i in range(64)))

    async def watch() -> None:
        nonlocal status_text
        async with MeshClient(raddr) as c:
            for k in range(40):
                await asyncio.sleep(0.25)
                f = await c.fleet()
                seen.extend(n for n in f.nodes if n.node_id == "gpu-node")
                if k == 12:  # mid-run: the CLI's view of the same fleet
                    r = await asyncio.to_thread(subprocess.run, [
                        sys.executable, "-m", "gpumesh.cli", "status", "--router", raddr],
                        capture_output=True, text=True, timeout=30)
                    status_text = r.stdout + r.stderr

    await asyncio.gather(load(), watch())
    assert node.alive()
    assert seen, "the router never reported the node"
    assert max(n.load.kv_cache_usage for n in seen) > 0.0
    assert max(n.load.num_running for n in seen) > 0
    assert max(n.load.generation_tokens_per_s for n in seen) > 1000  # a GPU, not a CPU
    # The node's timed decode step: a 0.5B step on an H200 is a few ms (docs/benchmarks-gpu.md)
    assert 0 < max(n.load.decode_step_s for n in seen) < 0.2
    gpus = [g for n in seen for g in n.load.gpus]
    assert gpus, "no pynvml GPU samples in the heartbeats"
    assert max(g.utilization for g in gpus) > 0.0
    assert all(g.memory_total_bytes > 10 * 2**30 for g in gpus)
    assert max(g.memory_used_bytes for g in gpus) > 2**30
    assert "NVIDIA" in seen[-1].gpu_model
    assert "gpu-node" in status_text and "%" in status_text, status_text
    art = os.environ.get("GPUMESH_GPU_ARTIFACTS")
    if art:
        Path(art).mkdir(parents=True, exist_ok=True)
        peak = max(seen, key=lambda n: n.load.kv_cache_usage)
        (Path(art) / "gpu_status_under_load.txt").write_text(
            status_text + f"\npeak KV {peak.load.kv_cache_usage:.3f}, "
            f"running {peak.load.num_running}, gen tok/s {peak.load.generation_tokens_per_s:.0f}, "
            f"decode step {peak.load.decode_step_s * 1000:.2f} ms, "
            f"gpus {[(g.index, g.utilization, g.memory_used_bytes) for g in peak.load.gpus]}\n")


async def test_cancel_aborts_on_the_gpu(gpu_mesh) -> None:
    raddr, _, _ = gpu_mesh
    async with MeshClient(raddr) as c:
        req = build_request("the of and", model=SERVED, max_tokens=1500, ignore_eos=True)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await c.generate(req, timeout=0.5)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while True:
            f = await c.fleet()
            n = next(n for n in f.nodes if n.node_id == "gpu-node")
            if n.load.in_flight == 0 and n.load.num_running == 0:
                break
            assert time.monotonic() < deadline, f"request not aborted: {n.load}"
            await asyncio.sleep(0.25)

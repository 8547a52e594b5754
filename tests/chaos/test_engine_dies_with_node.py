"""The chaos suite's real-engine case: a vLLM CPU node continues a resumed greedy stream
(what mid-stream failover sends it), then, killed by SIGKILL of its own pid (what the OOM
killer does: one process, not its group), leaves no engine process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import grpc

from gpumesh.client import build_request
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from tests.chaos.orphans import cmdline, descendants, kill_leftovers, wait_gone
from tests.integration.procs import free_port, node_proc, wait_serving

pytestmark = [pytest.mark.vllm]

#: the engine processes must be gone within this many seconds of the node's death (the
#: watchdog polls every 0.25 s; the rest is slack for a busy machine)
GONE_WITHIN_S = 10.0


async def _continuation_matches(address: str) -> None:
    """A greedy stream, then the same request resumed after its first 8 tokens (what a
    router sends the next node): the continuation is the rest of the stream, and usage
    counts every token once."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        req = build_request("The mesh routes", model="tiny", max_tokens=24, temperature=0.0,
                            ignore_eos=True)
        full = [c async for c in stub.GenerateStream(req, timeout=120)]
        ids = [i for c in full for i in c.token_ids]
        resumed = build_request("The mesh routes", model="tiny", max_tokens=24,
                                temperature=0.0, ignore_eos=True)
        resumed.resume.ids.extend(ids[:8])
        rest = [c async for c in stub.GenerateStream(resumed, timeout=120)]
        rest_ids = [i for c in rest for i in c.token_ids]
    same = sum(a == b for a, b in zip(rest_ids, ids[8:], strict=False))
    print(f"\ncontinuation after 8 of 24 greedy tokens: {same}/{len(ids) - 8} identical")
    assert len(ids) == 24 and len(rest_ids) == 16
    assert rest[-1].usage.completion_tokens == 24
    assert rest[-1].usage.prompt_tokens == full[-1].usage.prompt_tokens
    assert rest_ids[0] == ids[8]


async def test_sigkill_of_the_node_pid_ends_its_vllm_processes(tiny_model_dir, tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[engine]\nmax_model_len = 256\nnum_gpu_blocks_override = 16\nserved_name = "tiny"\n')
    port = free_port()
    proc = node_proc("lifetime", port, [], model=str(tiny_model_dir), core=0, config=cfg)
    tree: set[int] = set()
    try:
        await wait_serving(f"127.0.0.1:{port}", proc)
        await _continuation_matches(f"127.0.0.1:{port}")
        tree = descendants(proc.pid)
        names = {p: cmdline(p) for p in tree}
        engine = {p for p, name in names.items() if name.startswith("VLLM::")}
        assert engine, f"no VLLM:: process under the node: {list(names.values())}"
        os.kill(proc.pid, signal.SIGKILL)  # its own pid only, not its group
        t0 = time.monotonic()
        left, waited = await asyncio.to_thread(wait_gone, tree, GONE_WITHIN_S)
        print(f"\nengine processes {sorted(names[p] for p in engine)} gone "
              f"{time.monotonic() - t0:.2f} s after SIGKILL of the node")
        assert not left, f"left running {waited:.1f} s after the kill: " \
                         f"{[(p, cmdline(p)) for p in left]}"
    finally:
        kill_leftovers(tree)
        proc.close()

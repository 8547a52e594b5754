"""A real vLLM CPU node killed by SIGKILL of its own pid (what the OOM killer does: one
process, not its group) leaves no engine process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.chaos.orphans import cmdline, descendants, kill_leftovers, wait_gone
from tests.integration.procs import free_port, node_proc, wait_serving

pytestmark = [pytest.mark.vllm]

#: the engine processes must be gone within this many seconds of the node's death (the
#: watchdog polls every 0.25 s; the rest is slack for a busy machine)
GONE_WITHIN_S = 10.0


async def test_sigkill_of_the_node_pid_ends_its_vllm_processes(tiny_model_dir, tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('max_model_len = 256\nnum_gpu_blocks_override = 16\nserved_name = "tiny"\n')
    port = free_port()
    proc = node_proc("lifetime", port, [], model=str(tiny_model_dir), core=0, config=cfg)
    tree: set[int] = set()
    try:
        await wait_serving(f"127.0.0.1:{port}", proc)
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

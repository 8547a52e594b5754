"""gpumesh's benchmark tooling: a gRPC load generator, workloads, statistics and reports.

``gpumesh bench`` is :func:`gpumesh_bench.cli.main`. Modules: ``workload`` (lengths, arrivals,
prompts, traces), ``loadgen`` (the asyncio driver), ``stats`` (aggregates), ``report`` (JSON,
markdown, plots).
"""

"""gpumesh's benchmark lab: shared pieces at the top, one package per question.

``gpumesh bench`` is :func:`gpumesh_bench.cli.main`; ``gpumesh bench --help`` lists the
questions and their commands.

Shared pieces: ``workload`` (lengths, arrivals, prompts, traces) and ``tenants`` (the
multi-tenant shared-prefix workload), ``loadgen`` (the asyncio driver) and ``multiproc`` (the
same stream from several processes), ``stats`` (aggregates), ``report`` (JSON, markdown,
plots), ``fleet`` and ``fleet_host`` (a local fleet of simulated nodes, routers and nginx),
``harness`` (one measured run, capacity, CPU accounting), ``load`` (``gpumesh bench run``,
``trace``, ``report``, ``plot``), ``commands`` (how a package names its commands).

Questions: ``overhead`` (what the router and the node cost), ``policies`` (which policy serves
a fleet best), ``locality`` (what cache-aware routing buys), ``peers`` (gpumesh against SMG),
``reliability`` (faults, soak, scaling), ``gpu`` (real GPUs), ``sim`` (the virtual-time fleet
simulator, ``gpumesh sim``). Each keeps the raw results it produced in its ``results/``.
"""

from pathlib import Path

#: The checkout this distribution is installed from (editable: ``bench/`` is this package), where
#: the benchmarks find deploy/nginx, models/ and .smg-venv.
REPO_ROOT = Path(__file__).resolve().parents[1]

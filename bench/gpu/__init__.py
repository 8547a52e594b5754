"""GPU measurement of the mesh: vLLM CUDA nodes direct vs through the router vs raw vLLM.

Driven by ``bench/gpu/kit/run_mesh_gpu.sh`` on a GPU host (one invocation per group of
phases, the vLLM kit of ``bench/gpu/kit`` installed); also runs on CPU with ``--engine sim``
(simulated nodes, same processes, same router, same load generator) to check the logic before
a GPU is used. ``gpumesh bench gpu ...`` is the same command.

  python -m gpumesh_bench.gpu run --phases p05,share,unequal --out DIR [--engine vllm|sim]
  python -m gpumesh_bench.gpu report DIR/results.json[.gz]... --md OUT.md --png OUT.png
      [--from-round N]   (every table: the main phases, the front doors, cache-aware routing)

Phases (each starts its own nodes and routers and stops them, GPUs freed, before the next):

- ``raw``: the raw-vLLM reference tool (``--raw-tool``: a script that runs raw vLLM in a
  closed loop) in this run, 0.5B, one GPU, concurrency 128 (for an in-run ratio).
  ``raw7``: 7B at 256, one GPU, then (two GPUs) data parallel: two engines at once, 128 each
  (the reference's method); ``rawdp05``: the same for 0.5B at 128.
- ``eng05`` / ``eng7``: the node's own engine without gRPC (``gpumesh bench engine-loop``:
  the node TOML a node of that shape gets here, engine built by the node's code, a closed loop
  on its ``generate`` in the same process) at the raw phases' concurrency: one GPU, then (two
  GPUs) two loops at once, C/2 each, as one data-parallel row (phase ``eng`` in the results).
  Raw vs engine loop = the node's engine configuration; engine loop vs the node direct = the
  node's serving path (servicer, coalescing, gRPC).
- ``p05``: 0.5B. Node A on GPU 0 and (two GPUs or more) node B on GPU 1, 0.85 of memory each;
  router R1 fronts A alone, R2 fronts A and B. Benches: A direct and R1 at concurrency 128
  (one GPU), R2 at 128 and 256 (data parallel; 256 = 128 per GPU, the equal-latency point),
  A and B direct at 256 with the client splitting its streams (data parallel without a
  router), then a sweep on A direct (concurrency 1..512; prompts up to 1900 tokens) for the
  simulator. ``p05q``: the same without the sweep.
- ``share``: 0.5B, two nodes on GPU 0 (0.42 of memory each) behind one router, 128.
- ``unequal``: 0.5B, one GPU: a normal node and a node whose KV cache is cut to
  ``--small-kv-blocks`` blocks, 512-token prompts; one router per policy, each benched.
  ``unequal2``: the same pair with a GPU each (two GPUs or more).
- ``tp05`` / ``tp7``: one node with tensor_parallel_size 2 (GPUs 0,1) behind a router.
- ``p7``: as ``p05`` with the 7B shape at concurrency 256 (512 for the equal-latency DP point).
- ``ab7`` / ``ab05``: repeats on the same nodes, interleaved: one GPU direct vs through the
  router twice (ABAB), then data parallel through the router vs the client splitting.
  ``dp05`` / ``dp7``: data parallel through the router vs the client splitting, ``--rounds``
  times interleaved, with a multi-worker router also with the load spread over its workers.
- ``vsraw05`` / ``vsraw7``: the mesh against raw vLLM on one GPU, interleaved: node A (with
  ``--node-option``s, e.g. frontends=2) and router R1 stay up on GPU 0 at 0.42 of its memory;
  each of ``--rounds`` rounds runs the raw reference tool (its own engine at 0.42, started per
  run), A direct and R1, the order reversed every other round; the report gives each node
  bench over its round's raw QPS and the medians. ``vsrawdp05`` / ``vsrawdp7`` (two GPUs):
  the same for data parallel: nodes A and B (GPUs 0, 1) behind R2 and the client's own split
  against two raw engines at C/2 each (the reference's data-parallel method). ``--vs-eng``:
  every round also runs the node's engine without gRPC (as ``eng05``) next to raw.
  ``--vs-variant NAME=VALUE``: a second set of nodes (X, Y) with those engine arguments on top,
  behind their own router, up on the same GPUs through the phase and benched in the same
  rounds (legs ``router-x``, ``direct-x``); every engine then gets 0.28 of its GPU's memory.
  ``--vs-legs`` keeps only the named legs.
- ``doors05`` / ``doors7``: the same engines behind four front doors on one GPU, interleaved
  over ``--rounds``: the bare engine (``frontdoors.bare_engine``), the gpumesh router and
  node, ``vllm serve`` behind nginx least_conn, SMG (gRPC) in front of the same nodes; one
  engine per door and two sharing the GPU (``--door-engines``, ``--doors``,
  ``--door-concurrency``); see ``frontdoors``. ``uneq05``: two nodes on one GPU, one with a
  quarter of the other's KV, under least_request, weighted least-load and nginx least_conn.
  On the GPU host: ``kit/run_doors.sh`` (packs: ``kit/pack_doors.sh``); tables: ``frontdoors.report``.
- ``prefix05`` / ``prefix7``: cache-aware routing on two engines of the shape (0.5B, 7B)
  sharing GPU 0 with prefix caching on: gpumesh least_request, precise and approximate
  locality and SMG ``cache_aware`` over the same nodes, interleaved over ``--rounds`` on a
  multi-tenant shared-prefix workload, every bench's prompts salted apart; see ``prefix``;
  tables: ``prefix.report``.
- ``msg05`` / ``msg7``: the node's stream-message budget on and off on the same nodes,
  interleaved: requests with the node's default interval (the budget widens it under load)
  vs requests asking for the base 20 ms themselves (kept as asked: the old fixed interval);
  one GPU direct at C, then (two GPUs) data parallel through the router at 2C, ``--rounds``
  times each.

Workload: the raw reference's: a closed loop of C streams,
32 prompt tokens, 256 output tokens with ignore_eos, a 4 s warm-up then a 15 s window. QPS is
computed as the reference computes it: requests that started in the window and finished
inside it, divided by the window (this undercounts the completion rate by about latency /
window; ``done_qps``, completions in the window per second, is reported beside it). Latency
and TTFT percentiles are over the same requests. Load comes from ``gpumesh bench``'s own
multi-process generator (``gpumesh_bench.multiproc.run_multi``, what ``gpumesh bench run --procs N``
runs) and routers run with ``--workers N``.

``--pin on|both`` (data-parallel and main-table phases): each node's process tree (front end,
engine core) runs on physical cores of its own near its GPU, routers and load on the rest
(``gpumesh_bench.gpu.affinity``); ``both`` runs each data-parallel setup unpinned then pinned.

Every bench also records the cores each process group used in its window (``CpuSampler``:
node front end, vLLM engine processes, router, load generator, whole machine), which says
whether a setup was GPU- or CPU-bound.

Nodes disable prefix caching: the synthetic tokenizer maps every benchmark word to one id, so
all prompts would share their prefix, while the reference's random-id prompts never hit.

Modules: ``env`` (settings, node/router specs, node TOML), ``group`` (a phase's processes),
``samplers`` and ``measure`` (one bench), ``reference`` (raw vLLM, engine loop), ``phases``
and ``vsraw`` (the phases), ``cli`` (``run``), ``records``, ``pairs``, ``report`` and ``plot``
(the report), ``affinity`` (CPU placement), ``dummy_model`` (the weightless models); the
packages ``frontdoors`` (the front-door phases) and ``prefix`` (the cache-aware phases);
``kit/`` holds the GPU host's shell harness and the kit's builders. Raw results: ``results/``.
"""

from gpumesh_bench.commands import Command

QUESTION = "what the mesh does on real GPUs (vLLM CUDA nodes, front doors, raw vLLM)"
COMMANDS = (
    Command("gpu", "the GPU phases on this host ('gpu run ...') and their report "
            "('gpu report ...')", "gpumesh_bench.gpu.cli", own_args=True),
)

"""What gpumesh costs: the router against the same node reached directly, the node's process
per output token, grpc.aio's own share, the node's engine without gRPC, stream coalescing, TLS
and the hostile-peer checks, and the routing decision alone.

Modules: ``router`` (``gpumesh bench overhead``: router vs direct, streaming modes, workers,
tracing, and the parts below), ``tls`` and ``security`` (two meshes side by side, through
``paired``), ``decision`` and ``prefix_decision`` (the scheduler alone, in memory),
``node_cpu``, ``grpc_cost``, ``engine_loop``, ``coalesce``, ``kv_transfer`` (prefill +
KV transfer between two vLLM engines). Results: ``results/``.
"""

from gpumesh_bench.commands import Command

QUESTION = "what the router, the node and gRPC cost per request and per token"
COMMANDS = (
    Command("overhead", "router vs direct, streaming modes, workers, tracing, TLS, hostile-peer "
            "checks, decision time", "gpumesh_bench.overhead.router"),
    Command("node-cpu", "node-process CPU per output token, nodes interleaved",
            "gpumesh_bench.overhead.node_cpu"),
    Command("grpc-cost", "grpc.aio's own server CPU per request and per stream message, on "
            "loopback", "gpumesh_bench.overhead.grpc_cost"),
    Command("engine-loop", "closed loop on a node's own engine, in process, no gRPC (the node's "
            "engine vs raw vLLM)", "gpumesh_bench.overhead.engine_loop"),
    Command("coalesce-cost", "CPU per engine output through the node's stream coalescing",
            "gpumesh_bench.overhead.coalesce", own_args=True),
    Command("kv-transfer", "disaggregated prefill + KV transfer against an aggregated prefill, "
            "two vLLM engines, by prompt length", "gpumesh_bench.overhead.kv_transfer",
            own_args=True),
)

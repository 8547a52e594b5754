"""gRPC metadata keys shared by clients, the router and nodes (one place, no string literals)."""

# Request metadata, router -> node: which router instance dispatched the request (proxy
# mode). The node counts the request against this router in its RouterAccount.
ROUTER_ID = "x-gpumesh-router-id"
# Request metadata, router -> node: prompt tokens the router charged for this request, so the
# node's per-router token counters match the router's credits exactly.
CHARGED_TOKENS = "x-gpumesh-charged-tokens"

# Trailing metadata, router/node -> client.
NODE_ID = "x-gpumesh-node-id"          # the node that served the request
PREFILL_NODE_ID = "x-gpumesh-prefill-node-id"  # disaggregated: the node that ran the prompt
ATTEMPTS = "x-gpumesh-attempts"        # dispatch attempts the router made (1 = no retry)
MIGRATIONS = "x-gpumesh-migrations"    # of those, continuations of a stream after output
RETRY_AFTER_MS = "x-gpumesh-retry-after-ms"  # RESOURCE_EXHAUSTED (quota, SLO): retry after
TRACE_ID = "x-gpumesh-trace-id"        # the OpenTelemetry trace id (hex), when tracing

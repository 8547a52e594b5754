"""The front doors on one GPU: the same vLLM engines behind gpumesh (router and node), ``vllm
serve`` with nginx ``least_conn``, SMG in gRPC mode over the gpumesh nodes, and the bare engine
(engine and load in one process). ``phases`` (``doors05`` / ``doors7`` and the unequal pair
``uneq05``), ``servers`` (the other doors as child processes), ``load`` (one bench through one
door), ``bare_engine``, ``report`` (their tables)."""

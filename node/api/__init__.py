"""The node's gRPC services: ``gpumesh.v1.Inference`` (:mod:`.inference`) and vLLM's native
``VllmEngine`` service (:mod:`.vllm_grpc`), both thin adapters over the same engine and ledger."""

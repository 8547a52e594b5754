"""gpumesh node: a gRPC Inference servicer around one inference engine (vLLM or the simulator)."""

"""Inference engines behind the node's ``Engine`` seam (:mod:`.base`): the simulator
(:mod:`.sim`) and vLLM (:mod:`.vllm`, the only package that imports vllm)."""

"""Node transports: the seam (``channels``), gpumesh nodes (``gpumesh_node``) and stock vLLM
gRPC workers (``vllm_grpc``)."""

from gpumesh.router.backends.channels import NodeChannels, NodeTransport
from gpumesh.router.backends.gpumesh_node import NodeClient, dispatch_metadata

__all__ = ["NodeChannels", "NodeClient", "NodeTransport", "dispatch_metadata"]

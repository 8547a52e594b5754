"""The router's gRPC servicers: thin adapters between protos and the fleet / dispatcher.
Proto types stop here: everything below works on frozen dataclasses."""

from gpumesh.router.api.control import RouterControlPlaneServicer
from gpumesh.router.api.inference import RouterInferenceServicer, inference_handler
from gpumesh.router.api.operator import RouterOperatorServicer

__all__ = ["RouterControlPlaneServicer", "RouterInferenceServicer", "RouterOperatorServicer",
           "inference_handler"]

"""Foreign nodes: stock vLLM gRPC workers (``vllm.grpc.engine.VllmEngine``) in the fleet.

A worker started with vLLM's own launcher (``python -m vllm.entrypoints.launchers.grpc_server``)
speaks no gpumesh: no Registration, no heartbeats, no ``gpumesh.v1.Inference``. The router does
both halves a gpumesh node does itself: ``membership`` registers and reports each worker
(``load`` maps vLLM's load messages), ``client`` is its node transport (``translate`` turns
gpumesh requests into vLLM's with the worker model's tokenizer from the router's
``router.tokenizers``, ``detokenizer`` turns the worker's token ids into text, ``call`` gives
the result the grpc.aio call shape the dispatcher uses).
"""

from gpumesh.router.backends.vllm_grpc.client import ForeignClient
from gpumesh.router.backends.vllm_grpc.load import (
    load_from_record,
    load_from_scheduler,
    merge_scheduler_loads,
)
from gpumesh.router.backends.vllm_grpc.membership import (
    KIND,
    ForeignFleet,
    ForeignMember,
    ForeignSpec,
)
from gpumesh.router.backends.vllm_grpc.detokenizer import Detokenizer
from gpumesh.router.tokenizers import Tokenizer

__all__ = ["KIND", "Detokenizer", "ForeignClient", "ForeignFleet", "ForeignMember",
           "ForeignSpec", "Tokenizer", "load_from_record", "load_from_scheduler",
           "merge_scheduler_loads"]

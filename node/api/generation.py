"""The node's one generation loop: admit a validated request in the node's ledger, run it in
the engine, and drop it from the engine when it ends early.

Who calls it: both front ends of a node over its one engine, the gpumesh Inference service
(``node.api.inference``) and vLLM's ``VllmEngine`` service (``node.api.vllm_grpc``). Each
validates its own message into a ``Prepared`` and turns the ``EngineOutput``s into its own
responses; what happens between (request ids, the ledger, coalescing, engine errors, abort)
is here, once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gpumesh.node.engines.base import Engine, EngineOutput, EngineRequest
from gpumesh.node.errors import RequestError, from_engine_exception
from gpumesh.node.state import ServingState
from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.streaming.coalesce import coalesce
from gpumesh.node.telemetry import NOOP, Trace

log = logging.getLogger(__name__)

# one message per engine output: what a unary call and vLLM's own service take
PER_OUTPUT = CoalescePolicy(0.0, 1)


@dataclass(frozen=True)
class Prepared:
    """A validated request as the loop runs it (each front end fills what its protocol
    carries; fields default to a direct client's)."""

    request: EngineRequest
    router_id: str = ""                 # the router that sent it; "" = a direct client
    charged_tokens: int | None = None   # prompt tokens that router charged (None: not said)
    coalescing: CoalescePolicy = PER_OUTPUT
    resumed: int = 0   # output tokens another node already delivered (GenerateRequest.resume)


class GenerationLoop:
    """``run(prepared)``: the request's engine outputs, coalesced by ``prepared.coalescing``.

    Before the first output: ALREADY_EXISTS (``RequestError``) for a request id in flight on
    this node, then the request is admitted in the ledger with the prompt tokens the engine
    still computes (less the prefix the node's cache holds, where it knows it). Engine errors
    raise as ``RequestError`` (``gpumesh.node.errors``, the node's one mapping). However the
    caller stops iterating (the last output, a cancelled call, an error, or the caller's own
    end such as a stop token), the ledger is told, and a request the engine has not finished
    is aborted in the engine.
    """

    def __init__(self, engine: Engine, state: ServingState) -> None:
        self._engine = engine
        self._state = state

    def _streams(self) -> int:
        # Past their first token: requests still queued in the engine send no messages yet.
        return self._state.ledger.streaming

    async def run(self, prep: Prepared, trace: Trace = NOOP) -> AsyncIterator[EngineOutput]:
        req = prep.request
        # pending prefill counts what the engine still computes: less the cached prefix
        # (gpumesh.node.cache) where the node knows it
        cached = self._state.cached_prefix_tokens
        prefill = len(req.prompt_token_ids) - (cached(req.prompt_token_ids) if cached else 0)
        self._state.claim_request_id(req.request_id)   # ALREADY_EXISTS for an id in flight
        admission = self._state.ledger.admit(prep.router_id, prefill, prep.charged_tokens)
        finished = False
        trace.admitted()
        try:
            outputs = self._engine.generate(req)
            if not prep.coalescing.per_token:
                outputs = coalesce(outputs, prep.coalescing, streams=self._streams)
            async for out in outputs:
                if out.token_ids:
                    admission.first_token()
                trace.output(out)
                finished = out.finish is not None
                yield out
        except RequestError:
            raise
        except Exception as exc:  # the engine's, mapped once here
            raise from_engine_exception(exc) from exc
        finally:
            admission.finish()
            if not finished:
                # Client went away, deadline passed, an error, or the caller ended it: make
                # sure the engine drops it.
                trace.engine_abort()
                try:
                    await self._engine.abort(req.request_id)
                except Exception:
                    log.debug("abort of %s failed", req.request_id, exc_info=True)
            self._state.request_ids.discard(req.request_id)

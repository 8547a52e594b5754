"""vLLM's native gRPC service (``vllm.grpc.engine.VllmEngine``) served by a gpumesh node.

The proto is published as PyPI ``smg-grpc-proto`` (imported as ``smg_grpc_proto``); vLLM's own
gRPC launcher serves it through ``smg_grpc_servicer.vllm.servicer.VllmEngineServicer`` and SMG
(Shepherd Model Gateway) routes to it. Serving it too means any client or gateway written for
vLLM's gRPC can use a gpumesh node, sim or vLLM alike, on the node's own port: this servicer
sits on the same ``grpc.aio`` server as ``gpumesh.v1.Inference`` (see ``gpumesh.node.app``) over the
same :class:`gpumesh.node.engines.base.Engine`, and counts its requests in the same
``AdmissionLedger``, so the
node's heartbeats and in-flight count include them (as a direct client: router id "").

Field semantics follow the reference servicer (smg-grpc-servicer 0.14.1), field for field:

- ``Generate`` takes ``tokenized.input_ids`` as-is or ``text`` (tokenized by the engine) and
  answers token ids only (vLLM runs with ``detokenize=False``; the caller detokenizes). Streamed:
  one ``chunk`` per engine output carrying the delta ids (``completion_tokens`` = the delta's
  count, the caller accumulates), then, when the request finishes, a ``complete`` whose
  ``output_ids`` repeat that last delta. Not streamed: one ``complete`` with every id.
  ``finish_reason`` is "stop", "length" or "abort". Unset ``max_tokens`` = the rest of the
  context window; unset temperature = 1.0; ``top_p`` 0 = 1.0.
- Supported sampling: temperature, top_p, top_k, seed, max_tokens, stop strings,
  ``stop_token_ids`` (enforced here: the stop token is kept in the output and reported as
  ``matched_token_id``; not before ``min_tokens``), ignore_eos. Refused with INVALID_ARGUMENT
  (never silently ignored): ``n`` > 1, logprobs, prompt logprobs, structured-output
  constraints, multimodal inputs, KV-transfer (PD) parameters. Penalties, ``min_p``,
  ``logit_bias`` and the detokenizer flags do not exist on the node's Engine seam and are
  ignored (the simulator would ignore them anyway).
- ``GetLoads``: one ``SchedulerLoad`` (dp_rank 0): running / waiting from the engine's
  scheduler, ``token_usage`` = KV-cache usage, ``gen_throughput`` = the engine's generation
  tokens/s, and ``num_waiting_uncached_tokens`` = the node ledger's
  ``pending_prefill_tokens`` (prompt tokens admitted with no first token yet, less the
  prefix the node's cache holds where it knows it; every client's).
  vLLM's servicer estimates the same quantity from the requests it forwarded that the engine
  has not started; the ledger's figure also holds a request whose prefill is in progress.
- ``SubscribeKvEvents`` streams the node's KV block events (``kv_stream.KvEventLog``, on a
  node with ``kv_events``: stored blocks with their token ids and parent chain, removals,
  clears, in the form SMG's event-driven ``cache_aware`` consumes; a snapshot first, numbered
  batches, resume from a kept sequence, else OUT_OF_RANGE / DATA_LOSS), each batch carrying
  the servicer's load record (``KvEventBatch.load``, the same figures as ``GetLoads``), and
  ``load_only`` batches repeating the last sequence sent (0 before any; the first one before
  anything else when the subscriber sets ``load_records_before_first_batch``), paced like the
  reference's ``LoadRecorder``: checked every 0.1 s, sent when the record moved, and as a
  heartbeat after 1 s of silence (5 s after two unchanged heartbeats).
- ``HealthCheck`` is unhealthy while the node drains (the reference: while the engine has
  errored). Embed, GetTokenizer, FlushCache and profiling stay UNIMPLEMENTED.
"""

from gpumesh.node.api.vllm_grpc.servicer import (
    VLLM_ENGINE_SERVICE,
    VllmEngineServicer,
    add_vllm_engine_service,
)

__all__ = ["VLLM_ENGINE_SERVICE", "VllmEngineServicer", "add_vllm_engine_service"]

"""vLLM's load messages -> gpumesh.types.LoadReport (a different message: mapped here, not in
gpumesh.wire).

Mapping: running / waiting as reported; ``pending_prefill_tokens`` = ``prefill_pending_tokens``
when the record carries it (prompt tokens handed to the engine with no output yet: the node
ledger's meaning), else vLLM's estimate of queued, not-yet-started prompt tokens;
``kv_cache_usage`` = ``token_usage``; ``generation_tokens_per_s`` = ``gen_throughput``; prompt
tokens/s unknown (0: the scorer uses its reference floor); ``in_flight`` = running + waiting.
The report carries no router accounts: the worker cannot know what a router sent it
(``client.ForeignClient.account`` supplies this router's).
"""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2 as smg_common

from gpumesh.types import LoadReport


def load_from_record(r: smg_common.EngineLoad) -> LoadReport:
    """A pushed ``EngineLoad`` record (SubscribeKvEvents)."""
    pending = (r.prefill_pending_tokens if r.HasField("prefill_pending_tokens")
               else r.waiting_uncached_tokens)
    return LoadReport(
        num_running=r.running_requests, num_waiting=r.waiting_requests,
        pending_prefill_tokens=pending, kv_cache_usage=r.token_usage,
        prefix_cache_hit_rate=r.cache_hit_rate if r.HasField("cache_hit_rate") else 0.0,
        generation_tokens_per_s=r.gen_throughput,
        in_flight=r.running_requests + r.waiting_requests)


def load_from_scheduler(s: vpb.SchedulerLoad) -> LoadReport:
    """One data-parallel rank's ``SchedulerLoad`` (GetLoads)."""
    return LoadReport(
        num_running=s.num_running_reqs, num_waiting=s.num_waiting_reqs,
        pending_prefill_tokens=s.num_waiting_uncached_tokens, kv_cache_usage=s.token_usage,
        prefix_cache_hit_rate=s.cache_hit_rate, generation_tokens_per_s=s.gen_throughput,
        in_flight=s.num_running_reqs + s.num_waiting_reqs)


def merge_scheduler_loads(loads: Sequence[vpb.SchedulerLoad]) -> LoadReport:
    """Data-parallel ranks summed (one node to the router); KV usage averaged."""
    parts = [load_from_scheduler(s) for s in loads]
    n = len(parts)
    return LoadReport(
        num_running=sum(p.num_running for p in parts),
        num_waiting=sum(p.num_waiting for p in parts),
        pending_prefill_tokens=sum(p.pending_prefill_tokens for p in parts),
        kv_cache_usage=sum(p.kv_cache_usage for p in parts) / n,
        prefix_cache_hit_rate=sum(p.prefix_cache_hit_rate for p in parts) / n,
        generation_tokens_per_s=sum(p.generation_tokens_per_s for p in parts),
        in_flight=sum(p.in_flight for p in parts))

"""The node's load in vLLM's shapes: ``GetLoads``' ``SchedulerLoad`` and the ``EngineLoad``
record a ``KvEventBatch`` carries, and the reference servicer's rule for when a record moved."""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2 as cpb

from gpumesh.node.api.vllm_grpc.facts import EngineLimits
from gpumesh.node.engines.base import EngineLoad

#: Load-record pacing (seconds), the reference servicer's LoadRecorder defaults.
LOAD_TICK_S = 0.1
HEARTBEAT_S = 1.0
HEARTBEAT_BACKOFF_S = 5.0


def scheduler_load(eng: EngineLoad, pending_prefill_tokens: int,
                   limits: EngineLimits) -> vpb.SchedulerLoad:
    """The node's load in vLLM's GetLoads shape (rank 0)."""
    kv = max(0.0, float(eng.kv_cache_usage))
    load = vpb.SchedulerLoad(
        dp_rank=0, num_running_reqs=eng.num_running, num_waiting_reqs=eng.num_waiting,
        num_total_reqs=eng.num_running + eng.num_waiting, token_usage=kv, utilization=kv,
        gen_throughput=float(eng.generation_tokens_per_s),
        cache_hit_rate=float(eng.prefix_cache_hit_rate),
        num_waiting_uncached_tokens=max(0, pending_prefill_tokens))
    if limits.kv_capacity_tokens:
        load.max_total_num_tokens = limits.kv_capacity_tokens
        load.num_used_tokens = round(kv * limits.kv_capacity_tokens)
    if limits.max_num_seqs:
        load.max_running_requests = limits.max_num_seqs
    return load


def load_record(s: vpb.SchedulerLoad, pending_prefill_tokens: int) -> cpb.EngineLoad:
    """The record a KvEventBatch carries: GetLoads' figures, field for field."""
    return cpb.EngineLoad(
        running_requests=s.num_running_reqs, waiting_requests=s.num_waiting_reqs,
        waiting_uncached_tokens=s.num_waiting_uncached_tokens, token_usage=s.token_usage,
        gen_throughput=s.gen_throughput, max_running_requests=s.max_running_requests,
        age_ms=0, cache_hit_rate=s.cache_hit_rate, num_used_tokens=s.num_used_tokens,
        max_total_num_tokens=s.max_total_num_tokens,
        prefill_pending_tokens=max(0, pending_prefill_tokens))


def load_changed(last: cpb.EngineLoad, cur: cpb.EngineLoad) -> bool:
    """The reference's change rule: any count, KV usage by 0.5 %, the rate by 5 % or 50 tok/s."""
    if (last.running_requests != cur.running_requests
            or last.waiting_requests != cur.waiting_requests
            or last.waiting_uncached_tokens != cur.waiting_uncached_tokens
            or last.max_running_requests != cur.max_running_requests
            or abs(last.token_usage - cur.token_usage) > 0.005):
        return True
    delta = abs(last.gen_throughput - cur.gen_throughput)
    return delta > 50.0 or delta > 0.05 * max(last.gen_throughput, cur.gen_throughput)

"""The one conversion between gpumesh's value types (:mod:`gpumesh.types`) and their protobuf
messages (``gpumesh.v1.control_pb2``, and ``ModelInfo`` of ``inference_pb2``). Node, router and CLI call these; nothing else copies a
message field by field.

``*_from_proto`` normalises what the wire leaves open (an unset tensor_parallel_size is 1, a
non-positive capacity weight is 1.0, an unset ``finished_requests`` is ``None``); it does not
validate ranges, which is the receiver's job where the message enters.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumesh.types import (
    GpuSample,
    LoadReport,
    ModelSpec,
    Registration,
    RouterAccount,
    StepModel,
)
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import inference_pb2 as pb


def model_spec_to_proto(m: ModelSpec) -> cpb.ServedModel:
    return cpb.ServedModel(name=m.name, aliases=m.aliases, max_context_length=m.max_context_length,
                           tensor_parallel_size=m.tensor_parallel_size,
                           capacity_weight=m.capacity_weight, adapters=m.adapters)


def model_spec_from_proto(m: cpb.ServedModel) -> ModelSpec:
    return ModelSpec(m.name, tuple(m.aliases), m.max_context_length, m.tensor_parallel_size or 1,
                     m.capacity_weight if m.capacity_weight > 0 else 1.0, tuple(m.adapters))


def model_info_to_proto(m: ModelSpec, node_ids: Sequence[str]) -> pb.ModelInfo:
    """``ListModels``' entry for a model and the nodes serving it (a node lists itself)."""
    return pb.ModelInfo(name=m.name, aliases=m.aliases, max_context_length=m.max_context_length,
                        tensor_parallel_size=m.tensor_parallel_size,
                        capacity_weight=m.capacity_weight, node_ids=node_ids,
                        adapters=m.adapters)


def gpu_to_proto(g: GpuSample) -> cpb.GpuStats:
    return cpb.GpuStats(index=g.index, utilization=g.utilization,
                        memory_used_bytes=g.memory_used_bytes,
                        memory_total_bytes=g.memory_total_bytes)


def gpu_from_proto(g: cpb.GpuStats) -> GpuSample:
    return GpuSample(g.index, g.utilization, g.memory_used_bytes, g.memory_total_bytes)


def account_to_proto(a: RouterAccount) -> cpb.RouterAccount:
    msg = cpb.RouterAccount(router_id=a.router_id, admitted_requests=a.admitted_requests,
                            admitted_prompt_tokens=a.admitted_prompt_tokens,
                            first_token_requests=a.first_token_requests,
                            first_token_prompt_tokens=a.first_token_prompt_tokens)
    if a.finished_requests is not None:
        msg.finished_requests = a.finished_requests
    return msg


def account_from_proto(a: cpb.RouterAccount) -> RouterAccount:
    return RouterAccount(a.router_id, a.admitted_requests, a.admitted_prompt_tokens,
                         a.first_token_requests, a.first_token_prompt_tokens,
                         a.finished_requests if a.HasField("finished_requests") else None)


def load_report_to_proto(r: LoadReport) -> cpb.LoadReport:
    return cpb.LoadReport(
        num_running=r.num_running, num_waiting=r.num_waiting,
        pending_prefill_tokens=r.pending_prefill_tokens, kv_cache_usage=r.kv_cache_usage,
        prefix_cache_hit_rate=r.prefix_cache_hit_rate,
        generation_tokens_per_s=r.generation_tokens_per_s, in_flight=r.in_flight,
        gpus=[gpu_to_proto(g) for g in r.gpus], draining=r.draining,
        router_accounts=[account_to_proto(a) for a in r.router_accounts],
        prompt_tokens_per_s=r.prompt_tokens_per_s, kv_capacity_tokens=r.kv_capacity_tokens,
        prefill_capacity_tokens_per_s=r.prefill_capacity_tokens_per_s,
        decode_step_s=r.decode_step_s, loaded_adapters=r.loaded_adapters,
        adapter_load_s=r.adapter_load_s, engine_epoch=r.engine_epoch,
        output_tokens_mean=r.output_tokens_mean,
        step_model=None if r.step_model is None else cpb.StepModel(
            a_ms=r.step_model.a_ms, b_decode_ms=r.step_model.b_decode_ms,
            b_prefill_ms=r.step_model.b_prefill_ms, spans=r.step_model.spans,
            rms_error=r.step_model.rms_error))


def load_report_from_proto(r: cpb.LoadReport) -> LoadReport:
    return LoadReport(
        num_running=r.num_running, num_waiting=r.num_waiting,
        pending_prefill_tokens=r.pending_prefill_tokens, kv_cache_usage=r.kv_cache_usage,
        prefix_cache_hit_rate=r.prefix_cache_hit_rate,
        generation_tokens_per_s=r.generation_tokens_per_s,
        prompt_tokens_per_s=r.prompt_tokens_per_s, in_flight=r.in_flight, draining=r.draining,
        kv_capacity_tokens=r.kv_capacity_tokens,
        prefill_capacity_tokens_per_s=r.prefill_capacity_tokens_per_s,
        decode_step_s=r.decode_step_s,
        loaded_adapters=tuple(r.loaded_adapters), adapter_load_s=r.adapter_load_s,
        engine_epoch=r.engine_epoch, output_tokens_mean=r.output_tokens_mean,
        step_model=StepModel(r.step_model.a_ms, r.step_model.b_decode_ms,
                             r.step_model.b_prefill_ms, r.step_model.spans,
                             r.step_model.rms_error) if r.HasField("step_model") else None,
        gpus=tuple(gpu_from_proto(g) for g in r.gpus),
        router_accounts=tuple(account_from_proto(a) for a in r.router_accounts))


def registration_to_proto(r: Registration) -> cpb.Registration:
    return cpb.Registration(
        node_id=r.node_id, address=r.address, incarnation=r.incarnation, engine=r.engine,
        gpu_model=r.gpu_model, max_concurrency=r.max_concurrency,
        frontend_addresses=r.frontend_addresses, role=r.role,
        models=[model_spec_to_proto(m) for m in r.models])


def registration_from_proto(r: cpb.Registration) -> Registration:
    return Registration(
        node_id=r.node_id, address=r.address, incarnation=r.incarnation, engine=r.engine,
        gpu_model=r.gpu_model, max_concurrency=r.max_concurrency,
        frontend_addresses=tuple(r.frontend_addresses), role=r.role or "both",
        models=tuple(model_spec_from_proto(m) for m in r.models))

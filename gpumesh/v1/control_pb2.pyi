from gpumesh.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_HEALTHY: _ClassVar[NodeState]
    NODE_STATE_STALE: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_QUARANTINED: _ClassVar[NodeState]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_HEALTHY: NodeState
NODE_STATE_STALE: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_QUARANTINED: NodeState

class ServedModel(_message.Message):
    __slots__ = ("name", "aliases", "max_context_length", "tensor_parallel_size", "capacity_weight", "adapters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    max_context_length: int
    tensor_parallel_size: int
    capacity_weight: float
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., max_context_length: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., capacity_weight: _Optional[float] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("node_id", "address", "models", "incarnation", "engine", "gpu_model", "max_concurrency", "frontend_addresses", "role")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    GPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    incarnation: str
    engine: str
    gpu_model: str
    max_concurrency: int
    frontend_addresses: _containers.RepeatedScalarFieldContainer[str]
    role: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ..., incarnation: _Optional[str] = ..., engine: _Optional[str] = ..., gpu_model: _Optional[str] = ..., max_concurrency: _Optional[int] = ..., frontend_addresses: _Optional[_Iterable[str]] = ..., role: _Optional[str] = ...) -> None: ...

class GpuStats(_message.Message):
    __slots__ = ("index", "utilization", "memory_used_bytes", "memory_total_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int
    def __init__(self, index: _Optional[int] = ..., utilization: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class RouterAccount(_message.Message):
    __slots__ = ("router_id", "admitted_requests", "admitted_prompt_tokens", "first_token_requests", "first_token_prompt_tokens", "finished_requests")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    admitted_requests: int
    admitted_prompt_tokens: int
    first_token_requests: int
    first_token_prompt_tokens: int
    finished_requests: int
    def __init__(self, router_id: _Optional[str] = ..., admitted_requests: _Optional[int] = ..., admitted_prompt_tokens: _Optional[int] = ..., first_token_requests: _Optional[int] = ..., first_token_prompt_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "pending_prefill_tokens", "kv_cache_usage", "prefix_cache_hit_rate", "generation_tokens_per_s", "in_flight", "gpus", "draining", "router_accounts", "prompt_tokens_per_s", "kv_capacity_tokens", "prefill_capacity_tokens_per_s", "decode_step_s", "loaded_adapters", "adapter_load_s", "step_model", "engine_epoch", "output_tokens_mean")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CAPACITY_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    STEP_MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_MEAN_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    pending_prefill_tokens: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    generation_tokens_per_s: float
    in_flight: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStats]
    draining: bool
    router_accounts: _containers.RepeatedCompositeFieldContainer[RouterAccount]
    prompt_tokens_per_s: float
    kv_capacity_tokens: int
    prefill_capacity_tokens_per_s: float
    decode_step_s: float
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    adapter_load_s: float
    step_model: StepModel
    engine_epoch: int
    output_tokens_mean: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., pending_prefill_tokens: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., in_flight: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuStats, _Mapping]]] = ..., draining: _Optional[bool] = ..., router_accounts: _Optional[_Iterable[_Union[RouterAccount, _Mapping]]] = ..., prompt_tokens_per_s: _Optional[float] = ..., kv_capacity_tokens: _Optional[int] = ..., prefill_capacity_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., adapter_load_s: _Optional[float] = ..., step_model: _Optional[_Union[StepModel, _Mapping]] = ..., engine_epoch: _Optional[int] = ..., output_tokens_mean: _Optional[float] = ...) -> None: ...

class StepModel(_message.Message):
    __slots__ = ("a_ms", "b_decode_ms", "b_prefill_ms", "spans", "rms_error")
    A_MS_FIELD_NUMBER: _ClassVar[int]
    B_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    B_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    RMS_ERROR_FIELD_NUMBER: _ClassVar[int]
    a_ms: float
    b_decode_ms: float
    b_prefill_ms: float
    spans: int
    rms_error: float
    def __init__(self, a_ms: _Optional[float] = ..., b_decode_ms: _Optional[float] = ..., b_prefill_ms: _Optional[float] = ..., spans: _Optional[int] = ..., rms_error: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "sent_unix_ms", "load", "router_ids")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    sent_unix_ms: int
    load: LoadReport
    router_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., sent_unix_ms: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., router_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Deregistration(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("registration", "heartbeat", "deregistration", "kv_cache")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DEREGISTRATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    registration: Registration
    heartbeat: Heartbeat
    deregistration: Deregistration
    kv_cache: KvCacheUpdate
    def __init__(self, registration: _Optional[_Union[Registration, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., deregistration: _Optional[_Union[Deregistration, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheUpdate, _Mapping]] = ...) -> None: ...

class KvCacheUpdate(_message.Message):
    __slots__ = ("model", "seq", "snapshot", "cleared", "stored", "removed", "block_size", "epoch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    seq: int
    snapshot: bool
    cleared: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    epoch: int
    def __init__(self, model: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., cleared: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class RouterHello(_message.Message):
    __slots__ = ("router_id", "peer_addresses", "heartbeat_interval_ms", "lease_ttl_ms")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    heartbeat_interval_ms: int
    lease_ttl_ms: int
    def __init__(self, router_id: _Optional[str] = ..., peer_addresses: _Optional[_Iterable[str]] = ..., heartbeat_interval_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class DrainOrder(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class UndrainOrder(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("hello", "ack", "drain", "undrain", "kv_snapshot")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    hello: RouterHello
    ack: HeartbeatAck
    drain: DrainOrder
    undrain: UndrainOrder
    kv_snapshot: KvSnapshotRequest
    def __init__(self, hello: _Optional[_Union[RouterHello, _Mapping]] = ..., ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., drain: _Optional[_Union[DrainOrder, _Mapping]] = ..., undrain: _Optional[_Union[UndrainOrder, _Mapping]] = ..., kv_snapshot: _Optional[_Union[KvSnapshotRequest, _Mapping]] = ...) -> None: ...

class KvSnapshotRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetFleetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "address", "state", "models", "load", "last_heartbeat_age_s", "router_in_flight", "engine", "gpu_model", "kind", "frontend_addresses", "quarantine_reason", "state_reason", "router_ids", "prediction_scale", "ttft_error_p50", "role")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    GPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_SCALE_FIELD_NUMBER: _ClassVar[int]
    TTFT_ERROR_P50_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: NodeState
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    load: LoadReport
    last_heartbeat_age_s: float
    router_in_flight: int
    engine: str
    gpu_model: str
    kind: str
    frontend_addresses: _containers.RepeatedScalarFieldContainer[str]
    quarantine_reason: str
    state_reason: str
    router_ids: _containers.RepeatedScalarFieldContainer[str]
    prediction_scale: float
    ttft_error_p50: float
    role: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., last_heartbeat_age_s: _Optional[float] = ..., router_in_flight: _Optional[int] = ..., engine: _Optional[str] = ..., gpu_model: _Optional[str] = ..., kind: _Optional[str] = ..., frontend_addresses: _Optional[_Iterable[str]] = ..., quarantine_reason: _Optional[str] = ..., state_reason: _Optional[str] = ..., router_ids: _Optional[_Iterable[str]] = ..., prediction_scale: _Optional[float] = ..., ttft_error_p50: _Optional[float] = ..., role: _Optional[str] = ...) -> None: ...

class GetFleetResponse(_message.Message):
    __slots__ = ("router_id", "policy", "nodes", "worker_addresses", "models")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    policy: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    worker_addresses: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedCompositeFieldContainer[ModelLoad]
    def __init__(self, router_id: _Optional[str] = ..., policy: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., worker_addresses: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("model", "nodes", "queued", "slot_utilization", "prefill_backlog_s", "saturation", "at_limit_fraction", "nodes_wanted", "kv_utilization")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    SLOT_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BACKLOG_S_FIELD_NUMBER: _ClassVar[int]
    SATURATION_FIELD_NUMBER: _ClassVar[int]
    AT_LIMIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    NODES_WANTED_FIELD_NUMBER: _ClassVar[int]
    KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    nodes: int
    queued: int
    slot_utilization: float
    prefill_backlog_s: float
    saturation: float
    at_limit_fraction: float
    nodes_wanted: int
    kv_utilization: float
    def __init__(self, model: _Optional[str] = ..., nodes: _Optional[int] = ..., queued: _Optional[int] = ..., slot_utilization: _Optional[float] = ..., prefill_backlog_s: _Optional[float] = ..., saturation: _Optional[float] = ..., at_limit_fraction: _Optional[float] = ..., nodes_wanted: _Optional[int] = ..., kv_utilization: _Optional[float] = ...) -> None: ...

class PickRequest(_message.Message):
    __slots__ = ("request", "exclude_node_ids")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.GenerateRequest
    exclude_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., exclude_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("node_id", "address", "ticket", "expires_unix_ms", "model", "predicted_ttft_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    ticket: str
    expires_unix_ms: int
    model: str
    predicted_ttft_s: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., ticket: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ..., model: _Optional[str] = ..., predicted_ttft_s: _Optional[float] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("node", "ordered")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ORDERED_FIELD_NUMBER: _ClassVar[int]
    node: NodeStatus
    ordered: bool
    def __init__(self, node: _Optional[_Union[NodeStatus, _Mapping]] = ..., ordered: _Optional[bool] = ...) -> None: ...

class UndrainNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UndrainNodeResponse(_message.Message):
    __slots__ = ("node", "ordered")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ORDERED_FIELD_NUMBER: _ClassVar[int]
    node: NodeStatus
    ordered: bool
    def __init__(self, node: _Optional[_Union[NodeStatus, _Mapping]] = ..., ordered: _Optional[bool] = ...) -> None: ...

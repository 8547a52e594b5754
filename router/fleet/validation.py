"""Validation of what nodes send the router: registrations and heartbeat load reports.

Who calls it: the ControlPlane servicer (``router.api.control``), on every message, BEFORE
anything reaches the registry, the scorers or the index. ``valid_registration`` and
``valid_load`` take the protobuf message (so that a message's size is checked before anything
is copied out of it) and return the value types of :mod:`gpumesh.types`, or raise
``InvalidNodeInput`` naming the first field that is wrong and why.

The contract, per value (``NodeLimits`` holds the configurable bounds):
- every float is finite; fractions (KV usage, hit rate, GPU utilisation) are in [0, 1];
  rates, capacities and step times are >= 0 and below physical bounds (``MAX_*`` below);
- every count is bounded (models, aliases, GPUs, router accounts, front-end addresses) and
  every integer stays below 2**53 (the scorers do float arithmetic on them);
- names (node id, model names, aliases) are non-empty, at most ``max_name_length`` characters,
  printable, without whitespace; a node id is ASCII without '.' (it rides gRPC metadata and
  tickets); a registration
  names each model once;
- an address is ``host:port`` with a port in 1..65535;
- a capacity weight is in (0, ``max_capacity_weight``] (0 or unset means 1.0 on the wire);
- an engine epoch (``LoadReport.engine_epoch``, ``KvCacheUpdate.epoch``) is below 2**53; a
  ``KvCacheUpdate`` carries at most ``MAX_KV_HASHES`` hashes per list, a model name of at
  most ``max_name_length`` characters and a block size of at most ``MAX_BLOCK_SIZE``.

Everything here is O(size of the message), with the size bounded first, so a registration of
any size costs the router bounded time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpumesh import wire
from gpumesh.types import LoadReport, Registration
from gpumesh.v1 import control_pb2 as cpb

# Physical bounds no real node reaches; beyond them a value is garbage, not load.
MAX_TOKENS_PER_S = 1e9
MAX_STEP_S = 3600.0
MAX_COUNT = 10_000_000          # requests running / waiting / in flight
MAX_TOKENS = 2**50              # token counts and cumulative counters (exact as floats)
MAX_BYTES = 2**60
MAX_TP = 4096
MAX_CONCURRENCY = 10_000_000
MAX_TEXT = 256                  # incarnation, engine, gpu model, router ids, reasons
MAX_ADAPTERS = 1024             # LoRA adapters per model (registration) or loaded (report)
MAX_ADAPTER_NAME = 128
MAX_EPOCH = 2**53               # engine epochs (wall-clock ms at an engine start)
MAX_KV_HASHES = 8192            # per list of one KvCacheUpdate (nodes send at most 4096)
MAX_BLOCK_SIZE = 1 << 20

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_:@/+=-]*")   # no '.': ticket format
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


class InvalidNodeInput(ValueError):
    """A registration or heartbeat the router will not use; ``str()`` is the reason shown to
    operators and sent to the node."""


@dataclass(frozen=True)
class NodeLimits:
    """Per-node bounds (``RouterConfig``'s ``node_max_*`` keys)."""

    max_models: int = 64
    max_aliases: int = 32           # per model
    max_name_length: int = 256
    max_gpus: int = 64
    max_router_accounts: int = 1024
    max_frontends: int = 64
    max_capacity_weight: float = 64.0


ROLES = ("", "both", "prefill", "decode")   # Registration.role


def _fail(what: str) -> InvalidNodeInput:
    return InvalidNodeInput(what)


def _text(value: str, field: str, limit: int = MAX_TEXT, *, required: bool = False) -> None:
    if required and not value:
        raise _fail(f"{field} is required")
    if len(value) > limit:
        raise _fail(f"{field} is longer than {limit} characters")
    if not value.isprintable():
        raise _fail(f"{field} has non-printable characters")


def _name(value: str, field: str, limits: NodeLimits) -> None:
    _text(value, field, limits.max_name_length, required=True)
    if any(c.isspace() for c in value):
        raise _fail(f"{field} {value[:64]!r} contains whitespace")


def _address(value: str, field: str) -> None:
    _text(value, field, required=True)
    m = _ADDRESS.fullmatch(value)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise _fail(f"{field} {value[:64]!r} is not host:port")


def _count(values: Iterable[tuple[str, int]], limit: int) -> None:
    for field, v in values:
        if not 0 <= v <= limit:
            raise _fail(f"{field} {v} is out of range [0, {limit}]")


def _real(field: str, v: float, lo: float, hi: float) -> None:
    if not math.isfinite(v):
        raise _fail(f"{field} is not finite ({v})")
    if not lo <= v <= hi:
        raise _fail(f"{field} {v:g} is out of range [{lo:g}, {hi:g}]")


def valid_registration(msg: cpb.Registration, limits: NodeLimits) -> Registration:
    """The registration as a value, or InvalidNodeInput."""
    if not msg.node_id or not msg.address or not msg.models:
        raise _fail("registration needs node_id, address and models")
    if len(msg.models) > limits.max_models:
        raise _fail(f"{len(msg.models)} models; at most {limits.max_models} per node")
    if len(msg.frontend_addresses) > limits.max_frontends:
        raise _fail(f"{len(msg.frontend_addresses)} frontend_addresses; at most "
                    f"{limits.max_frontends}")
    _name(msg.node_id, "node_id", limits)
    if not msg.node_id.isascii() or _NODE_ID.fullmatch(msg.node_id) is None:
        raise _fail(f"node_id {msg.node_id[:64]!r} must be ASCII letters, digits and _:@/+=- (no '.')")
    _address(msg.address, "address")
    for a in msg.frontend_addresses:
        _address(a, "frontend_addresses")
    _text(msg.incarnation, "incarnation")
    _text(msg.engine, "engine")
    _text(msg.gpu_model, "gpu_model")
    _count([("max_concurrency", msg.max_concurrency)], MAX_CONCURRENCY)
    if msg.role not in ROLES:   # disaggregated prefill/decode; "" = "both"
        raise _fail(f"role {msg.role[:32]!r} must be one of prefill, decode, both")
    seen: set[str] = set()
    for m in msg.models:
        _name(m.name, "model name", limits)
        if m.name in seen:
            raise _fail(f"model {m.name[:64]!r} is listed twice")
        seen.add(m.name)
        if len(m.aliases) > limits.max_aliases:
            raise _fail(f"model {m.name[:64]!r} has {len(m.aliases)} aliases; at most "
                        f"{limits.max_aliases}")
        for a in m.aliases:
            _name(a, "alias", limits)
        if len(m.adapters) > MAX_ADAPTERS:   # LoRA adapters (node.adapters' own bound)
            raise _fail(f"model {m.name[:64]!r} lists {len(m.adapters)} adapters; at most "
                        f"{MAX_ADAPTERS}")
        for a in m.adapters:
            _text(a, "adapter", MAX_ADAPTER_NAME, required=True)
        _count([("tensor_parallel_size", m.tensor_parallel_size)], MAX_TP)
        w = m.capacity_weight
        if not math.isfinite(w) or w < 0 or w > limits.max_capacity_weight:
            raise _fail(f"capacity_weight {w:g} of model {m.name[:64]!r} is out of range "
                        f"(0, {limits.max_capacity_weight:g}]")
    return wire.registration_from_proto(msg)


def valid_load(msg: cpb.LoadReport, limits: NodeLimits) -> LoadReport:
    """The heartbeat's load report as a value, or InvalidNodeInput."""
    if len(msg.gpus) > limits.max_gpus:
        raise _fail(f"{len(msg.gpus)} GPUs; at most {limits.max_gpus}")
    if len(msg.router_accounts) > limits.max_router_accounts:
        raise _fail(f"{len(msg.router_accounts)} router accounts; at most "
                    f"{limits.max_router_accounts}")
    _count([("num_running", msg.num_running), ("num_waiting", msg.num_waiting),
            ("in_flight", msg.in_flight)], MAX_COUNT)
    _count([("pending_prefill_tokens", msg.pending_prefill_tokens),
            ("kv_capacity_tokens", msg.kv_capacity_tokens)], MAX_TOKENS)
    _real("kv_cache_usage", msg.kv_cache_usage, 0.0, 1.0)
    _real("prefix_cache_hit_rate", msg.prefix_cache_hit_rate, 0.0, 1.0)
    for field in ("generation_tokens_per_s", "prompt_tokens_per_s",
                  "prefill_capacity_tokens_per_s"):
        _real(field, getattr(msg, field), 0.0, MAX_TOKENS_PER_S)
    _real("decode_step_s", msg.decode_step_s, 0.0, MAX_STEP_S)
    _real("adapter_load_s", msg.adapter_load_s, 0.0, MAX_STEP_S)
    _real("output_tokens_mean", msg.output_tokens_mean, 0.0, MAX_TOKENS)
    if msg.HasField("step_model"):
        sm = msg.step_model
        for field in ("a_ms", "b_decode_ms", "b_prefill_ms"):
            _real(f"step_model.{field}", getattr(sm, field), 0.0, MAX_STEP_S * 1000.0)
        _real("step_model.rms_error", sm.rms_error, 0.0, 1e6)
        _count([("step_model.spans", sm.spans)], MAX_COUNT)
    _count([("engine_epoch", msg.engine_epoch)], MAX_EPOCH)
    if len(msg.loaded_adapters) > MAX_ADAPTERS:
        raise _fail(f"{len(msg.loaded_adapters)} loaded adapters; at most {MAX_ADAPTERS}")
    for a in msg.loaded_adapters:
        _text(a, "loaded adapter", MAX_ADAPTER_NAME, required=True)
    for g in msg.gpus:
        _real("gpu utilization", g.utilization, 0.0, 1.0)
        _count([("gpu index", g.index)], limits.max_gpus * 64)
        _count([("gpu memory_used_bytes", g.memory_used_bytes),
                ("gpu memory_total_bytes", g.memory_total_bytes)], MAX_BYTES)
    for a in msg.router_accounts:
        _text(a.router_id, "router_account router_id", required=True)
        _count([("admitted_requests", a.admitted_requests),
                ("admitted_prompt_tokens", a.admitted_prompt_tokens),
                ("first_token_requests", a.first_token_requests),
                ("first_token_prompt_tokens", a.first_token_prompt_tokens),
                ("finished_requests", a.finished_requests)], MAX_TOKENS)
    return wire.load_report_from_proto(msg)


def valid_kv_update(msg: cpb.KvCacheUpdate, limits: NodeLimits) -> cpb.KvCacheUpdate:
    """A prefix-cache update's sizes and numbers checked (the hashes themselves are opaque
    64-bit values); returned as is, or InvalidNodeInput."""
    if len(msg.stored) > MAX_KV_HASHES or len(msg.removed) > MAX_KV_HASHES:
        raise _fail(f"KvCacheUpdate carries more than {MAX_KV_HASHES} hashes")
    _text(msg.model, "KvCacheUpdate model", limits.max_name_length)
    _count([("KvCacheUpdate seq", msg.seq), ("KvCacheUpdate epoch", msg.epoch)], MAX_EPOCH)
    _count([("KvCacheUpdate block_size", msg.block_size)], MAX_BLOCK_SIZE)
    return msg


def valid_heartbeat(msg: cpb.Heartbeat, limits: NodeLimits) -> LoadReport:
    """A heartbeat's sequence and time checked, its load as ``valid_load``."""
    _count([("seq", msg.seq)], MAX_TOKENS)
    if abs(msg.sent_unix_ms) > MAX_TOKENS:
        raise _fail(f"sent_unix_ms {msg.sent_unix_ms} is out of range")
    return valid_load(msg.load, limits)

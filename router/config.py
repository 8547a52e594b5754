"""The router's one typed configuration: defaults < TOML file < environment < CLI flags.

Who calls it: ``gpumesh.cli`` (``add_arguments`` + ``from_args``), tests (``RouterConfig(...)``
or ``dataclasses.replace``), and ``router.app`` which only reads it.

- TOML: top-level keys are the field names below; scorer weights live in a ``[scorer_weights]``
  table (``expected_wait = 1.0``). An optional ``[router]`` table is read the same way.
- Environment: ``GPUMESH_ROUTER_<FIELD>`` (upper case), e.g. ``GPUMESH_ROUTER_POLICY``;
  ``GPUMESH_ROUTER_SCORER_WEIGHTS="expected_wait=1,kv_headroom=0.2"``. The ticket secret is also
  read from ``GPUMESH_TICKET_SECRET`` (shared with nodes, see ``gpumesh.tickets``).
- Flags: ``--<field-with-dashes>``; ``--scorer-weight NAME=W`` may repeat.

Units are in the field names (``_s`` seconds, ``_ms`` milliseconds).
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gpumesh.config import ConfigError, add_flags, flag_overrides, load_config

POLICIES = ("weighted_least_load", "least_request", "power_of_two", "round_robin")

DEFAULT_SCORER_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"expected_wait": 1.0, "kv_headroom": 0.0, "least_request": 8.0}
)

ENV_PREFIX = "GPUMESH_ROUTER_"


def _new_router_id() -> str:
    return f"router-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class RouterConfig:
    # --- serving
    # Loopback by default: a non-loopback host needs TLS (tls_cert_file) or insecure.
    host: str = "127.0.0.1"
    port: int = 50050  # 0 = any free port (tests)
    router_id: str = field(default_factory=_new_router_id)  # no '.' (ticket format)
    # Control-plane addresses of this router's sibling processes (multi-worker), sent in hello.
    peer_addresses: tuple[str, ...] = ()
    # A second, private port of this process alone (multi-worker: the public port is shared
    # through SO_REUSEPORT, so nodes reach each worker through its control port). 0 = none.
    control_port: int = 0
    shutdown_grace_s: float = 5.0

    # --- routing policy
    policy: str = "weighted_least_load"
    scorer_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SCORER_WEIGHTS))
    # Expected-wait model (router.scheduling.scorers): throughput floor per unit of capacity
    # weight when a node reports none (or a tiny one), prompt tokens per second.
    reference_prompt_tokens_per_s: float = 8000.0
    # Measure the expected wait in each node's own seconds when it reports its prefill
    # capacity: prompt tokens / that capacity (instead of max(observed rate, the floor above))
    # and the decode term in its measured step time (below). Off: the floor and the constants.
    prefill_from_capacity: bool = True
    # With prefill_from_capacity: a running request costs this many of the node's measured
    # decode steps (average running / generation tokens/s, scorers.py) in place of
    # decode_s_per_request / weight; 0 = keep the constant. Dimensionless: no time scaling.
    decode_steps_per_request: float = 1.0
    # weighted_least_load adds the request's own expected service time on each node (its
    # prompt / the node's prefill capacity + its output tokens x the node's decode step) to
    # the wait, times this (docs/routing.md); 0 = the wait alone. Dimensionless.
    service_weight: float = 1.0
    # Output tokens (max_tokens) counted at most per request in that service time.
    output_tokens_cap: int = 1024
    # weighted_least_load adds, times this, the wait for a running slot on a node whose last
    # report had requests waiting: (waiting + unreported + 1) x the request's output tokens x
    # the node's decode step / its running count (docs/routing.md); 0 = none.
    admission_weight: float = 2.0
    # The output term of that service time at decode_s_per_request / weight per token (the
    # node's declared speed) instead of its measured decode step, which moves with its load.
    service_step_from_weight: bool = True
    # Weight of the output term (output tokens x decode step) within that service time,
    # relative to the prompt's prefill (part of the first token's wait).
    output_weight: float = 0.6
    # weighted_least_load adds, times this, the price of a prefix miss: on a node that lacks
    # part of the longest prompt prefix some node holds, that part's prefill x (1 + the
    # requests running there), the batch it stalls (docs/routing.md); 0 = none.
    miss_weight: float = 1.0
    # The decode step: the node's own measurement (LoadReport.decode_step_s, timed between the
    # engine's steps) where it reports one; off, or from a node without it: inferred as
    # average running / generation tokens/s.
    step_from_report: bool = True
    # c in c * k / (1 - k) (docs/routing.md): a larger c sends bursts onto the node with the
    # lowest KV usage (docs/benchmarks.md, "Which routing policy balances best").
    kv_penalty_s: float = 0.2
    kv_usage_cap: float = 0.98      # k is capped here so the penalty stays finite
    # KV tokens each of this router's unreported requests is expected to add beyond its prompt
    # (its output), when the node reports its KV capacity: k moves by (C + U * this) / K.
    kv_output_allowance_tokens: float = 512.0
    # The decode term per running request, per unit of weight, where no step time is measured
    # (no capacity reported, prefill_from_capacity off, or a node never busy yet).
    decode_s_per_request: float = 0.002
    wait_scale_s: float = 0.5       # expected wait that scores 0.5
    kv_hard_threshold: float = 0.92  # filter: avoid nodes at or above while some are below
    # Score a random sample of this many candidates per decision (power-of-d choices) when a
    # model has more nodes; exact (every node scored) up to it. 0 = always score every node.
    decision_sample_size: int = 32
    chars_per_token: float = 4.0    # prompt-size estimate for text/chat prompts

    # --- routing-key affinity (GenerateRequest.routing_key; scheduling.scorers.affinity)
    # Weight of the session_affinity score (1 on the node that served the key last, while it
    # is within its bounded load) added to weighted_least_load's total; >= 1: within the bound
    # the session node always wins; 0 = off.
    affinity_weight: float = 1.0
    # Bounded load: affinity never puts a node above ceil((1 + epsilon) x its fair share of
    # this router's in-flight requests (by capacity weight).
    affinity_epsilon: float = 0.25
    affinity_max_keys: int = 100_000  # routing keys remembered (LRU, fixed-size entries); 0 = off
    affinity_ttl_s: float = 600.0     # a key unused this long is forgotten
    # --- LoRA adapters (GenerateRequest.adapter; scheduling.scorers.adapter)
    # Weight of the adapter score (1 where the adapter is loaded, less where it must be
    # loaded first) added to weighted_least_load's total; 0 = ignore where adapters are loaded.
    adapter_weight: float = 1.0
    # Seconds an adapter load is assumed to take on a node that has measured none yet.
    adapter_load_s: float = 1.0

    # --- membership
    heartbeat_interval_ms: int = 250  # asked of nodes in RouterHello
    lease_ttl_s: float = 3.0          # no heartbeat for this long -> removed
    freshness_s: float = 0.5          # report older than this -> STALE: no new work while a
    #                                   fresh node serves the model; 2 node heartbeat intervals
    known_model_retention_s: float = 60.0  # a model whose nodes all left answers UNAVAILABLE
    # After start, an unknown model answers UNAVAILABLE (retry hint), not NOT_FOUND, for this
    # long: a restarted router's nodes are still re-registering. < 0: one lease_ttl_s; 0: off.
    fleet_rebuild_s: float = -1.0
    # Half-life of this router's estimated share of all routers' dispatches (registry.PeerShare;
    # the expected-wait model scales its unreported requests by 1 / share). 0 = ignore peers.
    peer_share_half_life_s: float = 10.0
    # Per-node bounds on what a node may declare (router.fleet.validation): a registration or
    # heartbeat beyond them quarantines the node for quarantine_s (GetFleet shows the reason).
    node_max_models: int = 64
    node_max_aliases: int = 32          # per model
    node_max_name_length: int = 256     # node id, model names, aliases
    node_max_capacity_weight: float = 64.0
    node_max_heartbeats_per_s: float = 50.0  # beyond: heartbeats dropped unapplied; 0 = no limit
    quarantine_s: float = 30.0

    # --- dispatch
    max_concurrency_default: int = 0  # per node, when the node declares 0 (0 = unlimited)
    queue_bound: int = 256            # waiting requests per model; beyond -> RESOURCE_EXHAUSTED
    request_timeout_s: float = 600.0  # per-attempt deadline when the client sets none
    first_token_timeout_s: float = 120.0  # no first message by then -> attempt failed (retryable)
    max_attempts: int = 2             # 2 = one transparent retry on another node
    # --- failover (router.dispatch: migration, watch, ejection; docs/reliability.md)
    max_migrations: int = 2           # a stream continues on another node at most this often
    first_token_min_s: float = 10.0   # first-token wait = this + factor x the node's expected
    first_token_wait_factor: float = 4.0  # wait, capped by first_token_timeout_s
    stall_check_interval_s: float = 0.1   # how often stalled calls on STALE nodes are looked for
    stall_s: float = 1.0               # a stream whose node reported nothing and that moved
    #                                   nothing for this long fails over (>= freshness_s)
    outlier_consecutive_failures: int = 3  # node faults in a row -> ejected (0 = off)
    outlier_latency_factor: float = 5.0    # first-response EWMA > this x peers' median -> ejected
    outlier_base_ejection_s: float = 1.0   # k-th ejection in a row lasts base x 2^(k-1) ...
    outlier_max_ejection_s: float = 30.0   # ... at most this
    lookaside_credit_max_s: float = 30.0  # lookaside/unary credits expire after this at most

    # --- lookaside tickets
    ticket_secret: str = field(default="", repr=False)  # empty -> Pick: FAILED_PRECONDITION
    ticket_ttl_s: float = 10.0

    # --- prefix locality (router.fleet.locality; docs/routing.md#prefix-cache-locality)
    # auto: nodes' KV events where they stream them, else the router's own record of what it
    # sent where; precise: events only; approximate: records only; off: no locality term.
    prefix_locality: str = "auto"
    # Bound on the prefix index: (node, block) entries per model; past it a node's oldest
    # blocks go first. About 110 bytes each (docs/routing.md).
    prefix_index_max_entries: int = 4_000_000
    # Approximate mode: a prefix the router sent to a node counts as cached there this long.
    prefix_approx_ttl_s: float = 120.0
    # A prefix the router just sent to a node that streams KV events counts as held there
    # until the events confirm it, at most this long (a burst of one prefix then stays on the
    # node that is prefilling it instead of scattering before any event arrives).
    prefix_pending_ttl_s: float = 5.0
    # Tokenizer per model for hashing text / chat prompts, "MODEL=SPEC" (SPEC: "sim", or an
    # HF tokenizer path or name). Simulated nodes' models need none; token-id prompts none.
    prefix_tokenizers: tuple[str, ...] = ()

    # --- node channels
    keepalive_time_ms: int = 30_000

    # --- security (docs/security.md). TLS on the public port when tls_cert_file is set (the
    # files are re-read when they change); the router then dials nodes over mutual TLS with
    # the same certificate. Plaintext on a non-loopback host refuses to start unless insecure.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""             # verifies client and node certificates
    tls_require_client_cert: bool = False  # public port: every client presents a certificate
    insecure: bool = False            # allow plaintext on a non-loopback host
    # Shared secret nodes without a certificate present to register (x-gpumesh-join-token);
    # empty: membership needs a node certificate when TLS is on, and is open otherwise.
    join_token: str = field(default="", repr=False)
    # API keys (router.auth.keys): with a file, Inference calls need "authorization: Bearer
    # KEY" and the operator API (GetFleet, Pick) an operator key or certificate. "" = open.
    api_keys_file: str = ""

    # --- foreign nodes: stock vLLM gRPC workers (gpumesh.router.backends.vllm_grpc), each
    # "host:port[?weight=W&node_id=ID&tokenizer=PATH&max_concurrency=N]"
    foreign_nodes: tuple[str, ...] = ()
    foreign_poll_interval_s: float = 0.25  # GetLoads while no pushed load record arrives

    # --- scaling signal (router.fleet.saturation): the SLO and target it is measured against
    saturation_slo_ttft_s: float = 2.0   # queued prefill worth this much wait = saturated
    saturation_target: float = 0.8       # nodes_wanted keeps saturation at or below this
    saturation_default_slots: int = 256  # a node's slots when neither it nor the router caps
    saturation_half_life_s: float = 30.0  # of the at-limit fraction

    def __post_init__(self) -> None:
        if (not self.saturation_slo_ttft_s > 0 or not 0 < self.saturation_target <= 1
                or self.saturation_default_slots < 1 or not self.saturation_half_life_s > 0):
            raise ValueError("saturation_slo_ttft_s > 0, 0 < saturation_target <= 1, "
                             "saturation_default_slots >= 1, saturation_half_life_s > 0")
        if "." in self.router_id or not self.router_id:
            raise ValueError(f"router_id must be non-empty and contain no '.': {self.router_id!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        weights = dict(DEFAULT_SCORER_WEIGHTS)
        weights.update({k: float(v) for k, v in dict(self.scorer_weights).items()})
        unknown = set(weights) - set(DEFAULT_SCORER_WEIGHTS)
        if unknown:
            raise ValueError(f"unknown scorer(s) {sorted(unknown)}; known {list(DEFAULT_SCORER_WEIGHTS)}")
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise ValueError("scorer weights must be >= 0 with at least one > 0")
        object.__setattr__(self, "scorer_weights", MappingProxyType(weights))
        object.__setattr__(self, "peer_addresses", tuple(self.peer_addresses))
        object.__setattr__(self, "foreign_nodes", tuple(self.foreign_nodes))
        object.__setattr__(self, "prefix_tokenizers", tuple(self.prefix_tokenizers))
        if self.prefix_locality not in ("auto", "precise", "approximate", "off"):
            raise ValueError("prefix_locality must be auto, precise, approximate or off")
        if (self.prefix_index_max_entries < 0 or self.prefix_approx_ttl_s < 0
                or self.prefix_pending_ttl_s < 0):
            raise ValueError("prefix_index_max_entries, prefix_approx_ttl_s and "
                             "prefix_pending_ttl_s must be >= 0")
        if any("=" not in t for t in self.prefix_tokenizers):
            raise ValueError("prefix_tokenizers entries are MODEL=SPEC")
        for name in ("lease_ttl_s", "freshness_s", "reference_prompt_tokens_per_s",
                     "wait_scale_s", "request_timeout_s", "first_token_timeout_s", "ticket_ttl_s",
                     "foreign_poll_interval_s", "first_token_min_s", "stall_check_interval_s",
                     "stall_s",
                     "outlier_base_ejection_s", "outlier_max_ejection_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.kv_hard_threshold <= 1 or not 0 < self.kv_usage_cap < 1:
            raise ValueError("kv_hard_threshold must be in (0, 1] and kv_usage_cap in (0, 1)")
        if self.peer_share_half_life_s < 0:
            raise ValueError("peer_share_half_life_s must be >= 0 (0 = ignore peers)")
        if (self.service_weight < 0 or self.output_tokens_cap < 0 or self.admission_weight < 0
                or self.output_weight < 0 or self.miss_weight < 0):
            raise ValueError("service_weight, output_tokens_cap, admission_weight, "
                             "output_weight and miss_weight must be >= 0")
        if (self.affinity_weight < 0 or self.affinity_epsilon < 0
                or self.affinity_max_keys < 0 or self.affinity_ttl_s <= 0
                or self.adapter_weight < 0 or self.adapter_load_s < 0):
            raise ValueError("affinity_weight, affinity_epsilon, affinity_max_keys, "
                             "adapter_weight, adapter_load_s must be >= 0 and affinity_ttl_s > 0")
        if self.decode_steps_per_request < 0:
            raise ValueError("decode_steps_per_request must be >= 0 (0 = the constant)")
        if self.decision_sample_size < 0 or self.kv_output_allowance_tokens < 0:
            raise ValueError("decision_sample_size and kv_output_allowance_tokens must be >= 0")
        if (self.node_max_models < 1 or self.node_max_aliases < 0
                or self.node_max_name_length < 1 or not self.node_max_capacity_weight > 0
                or self.node_max_heartbeats_per_s < 0 or self.quarantine_s < 0):
            raise ValueError("node_max_models/_name_length >= 1, node_max_aliases >= 0, "
                             "node_max_capacity_weight > 0, node_max_heartbeats_per_s >= 0, "
                             "quarantine_s >= 0")
        if (self.max_migrations < 0 or self.first_token_wait_factor < 0
                or self.outlier_consecutive_failures < 0 or self.outlier_latency_factor < 0):
            raise ValueError("max_migrations, first_token_wait_factor, "
                             "outlier_consecutive_failures, outlier_latency_factor must be >= 0")
        if self.max_attempts < 1 or self.queue_bound < 0 or self.max_concurrency_default < 0:
            raise ValueError("max_attempts >= 1, queue_bound >= 0, max_concurrency_default >= 0")

    @property
    def ticket_secret_bytes(self) -> bytes:
        return self.ticket_secret.encode()

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> RouterConfig:
        """defaults < TOML file at ``path`` (top level, or a ``[router]`` table) < ``env``
        < ``overrides`` (see :mod:`gpumesh.config`)."""
        return load_config(cls, file=path, env_prefix=ENV_PREFIX, environ=env,
                           overrides=overrides, table="router",
                           env_aliases={"ticket_secret": "GPUMESH_TICKET_SECRET",
                                        "join_token": "GPUMESH_JOIN_TOKEN"})

    def with_(self, **changes: Any) -> RouterConfig:
        return replace(self, **changes)


def _parse_weights(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        for part in (p for p in item.split(",") if p.strip()):
            name, sep, weight = part.partition("=")
            if not sep:
                raise ConfigError(f"scorer weight must be NAME=W, got {part!r}")
            out[name.strip()] = float(weight)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config`` and one flag per field (all default to None = not given)."""
    parser.add_argument("--config", help="router TOML config file")
    add_flags(parser, RouterConfig, skip=("scorer_weights", "ticket_secret", "router_id",
                                          "join_token"),
              what="router")
    # secrets do not belong on a command line; weights have their own flag
    parser.add_argument("--router-id", dest="router_id", default=None,
                        help="router router_id (default: random per process)")
    parser.add_argument("--scorer-weight", dest="scorer_weight", action="append", default=None,
                        metavar="NAME=W", help="scorer weight, may repeat")


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RouterConfig:
    """The config for parsed CLI args (see ``add_arguments``)."""
    ns = vars(args)
    overrides = flag_overrides(args, RouterConfig)
    if ns.get("scorer_weight"):
        env_or_file = RouterConfig.load(ns.get("config"), env)
        weights = dict(env_or_file.scorer_weights)
        weights.update(_parse_weights(ns["scorer_weight"]))
        overrides["scorer_weights"] = weights
    return RouterConfig.load(ns.get("config"), env, overrides)

"""The router's one typed configuration: defaults < TOML file < environment < CLI flags.

Who calls it: ``gpumesh.cli`` (``add_arguments`` + ``from_args``), tests (``RouterConfig(...)``
or ``dataclasses.replace``), and ``router.app`` which only reads it.

- TOML: top-level keys are the field names below; the routing settings live in a
  ``[routing]`` table (``policy = "least_request"``). An optional ``[router]`` table is read
  the same way.
- Environment: ``GPUMESH_ROUTER_<FIELD>`` (upper case), e.g. ``GPUMESH_ROUTER_PORT``;
  ``GPUMESH_ROUTER_ROUTING="policy=least_request,sample_size=16"``. The ticket secret is also
  read from ``GPUMESH_TICKET_SECRET`` (shared with nodes, see ``gpumesh.tickets``).
- Flags: ``--<field-with-dashes>``; ``--routing policy=least_request,objective=min_ttft``.

Units are in the field names (``_s`` seconds, ``_ms`` milliseconds).
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpumesh.config import add_flags, flag_overrides, load_config
from gpumesh.router.scheduling.settings import POLICIES as SCHEDULING_POLICIES
from gpumesh.router.scheduling.settings import RoutingSettings

POLICIES = SCHEDULING_POLICIES

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

    # --- routing (router.scheduling.settings: the policy, its objective, sample size and
    # defaults; a [routing] table, GPUMESH_ROUTER_ROUTING="k=v,...", --routing k=v,...)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    # The node's decode step: its own measurement (LoadReport.decode_step_s, timed between
    # the engine's steps) where it reports one; off, or from a node without it: inferred as
    # average running / generation tokens/s (router.fleet.speed).
    step_from_report: bool = True
    kv_hard_threshold: float = 0.92  # filter: avoid nodes at or above while some are below
    chars_per_token: float = 4.0    # prompt-size estimate for text/chat prompts
    # Prompt tokens per second per unit of weight the scaling signal assumes for a node that
    # reports no prefill capacity (router.fleet.saturation).
    reference_prompt_tokens_per_s: float = 8000.0
    # --- routing-key affinity (GenerateRequest.routing_key; fleet.sessions): the node a key
    # went to last, which the prediction counts as an expected prefix hit
    affinity_max_keys: int = 100_000  # routing keys remembered (LRU, fixed-size entries); 0 = off
    affinity_ttl_s: float = 600.0     # a key unused this long is forgotten

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
    # --- disaggregated prefill/decode (router.dispatch.disagg; docs/disaggregation.md)
    disagg_min_prompt_tokens: int = 512   # shorter prompts are served whole while a
    #                                       "both" node serves the model
    disagg_leg_timeout_s: float = 10.0    # bound on the prefill leg, and on the decode leg's
    #                                       first token (the KV transfer); past it: served whole
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

    # --- service-level objectives (router.dispatch.slo): per model, "MODEL=MS" (a request's
    # own ttft_slo_ms / tpot_slo_ms, else its API key's, else these); what admission does with
    # a request no node is predicted to meet: "queue" (wait while its TTFT budget lasts, then
    # RESOURCE_EXHAUSTED with a retry-after), "reject" (at once) or "off"
    slo_ttft_ms: tuple[str, ...] = ()
    slo_tpot_ms: tuple[str, ...] = ()
    slo_admission: str = "queue"

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
        if isinstance(self.routing, Mapping):
            object.__setattr__(self, "routing", RoutingSettings(**self.routing))
        if not isinstance(self.routing, RoutingSettings):
            raise ValueError("routing must be RoutingSettings or a mapping of its keys")
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
        from gpumesh.router.dispatch.slo import MODES, model_slos
        object.__setattr__(self, "slo_ttft_ms", tuple(self.slo_ttft_ms))
        object.__setattr__(self, "slo_tpot_ms", tuple(self.slo_tpot_ms))
        model_slos(self.slo_ttft_ms, self.slo_tpot_ms)   # ValueError naming a bad entry
        if self.slo_admission not in MODES:
            raise ValueError(f"slo_admission must be one of {', '.join(MODES)}")
        for name in ("lease_ttl_s", "freshness_s", "reference_prompt_tokens_per_s",
                     "request_timeout_s", "first_token_timeout_s", "ticket_ttl_s",
                     "foreign_poll_interval_s", "first_token_min_s", "stall_check_interval_s",
                     "stall_s", "disagg_leg_timeout_s",
                     "outlier_base_ejection_s", "outlier_max_ejection_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.kv_hard_threshold <= 1:
            raise ValueError("kv_hard_threshold must be in (0, 1]")
        if self.peer_share_half_life_s < 0:
            raise ValueError("peer_share_half_life_s must be >= 0 (0 = ignore peers)")
        if self.affinity_max_keys < 0 or self.affinity_ttl_s <= 0:
            raise ValueError("affinity_max_keys must be >= 0 and affinity_ttl_s > 0")
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
    def policy(self) -> str:
        """The routing policy's name (``routing.policy``)."""
        return self.routing.policy

    @property
    def decision_sample_size(self) -> int:
        """Candidates predicted per decision on a large fleet (``routing.sample_size``)."""
        return self.routing.sample_size

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config`` and one flag per field (all default to None = not given)."""
    parser.add_argument("--config", help="router TOML config file")
    add_flags(parser, RouterConfig, skip=("ticket_secret", "router_id", "join_token"),
              what="router")
    # secrets do not belong on a command line
    parser.add_argument("--router-id", dest="router_id", default=None,
                        help="router router_id (default: random per process)")
    parser.add_argument("--policy", dest="routing_policy", default=None, choices=POLICIES,
                        help="the routing policy: --routing policy=P in short")


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RouterConfig:
    """The config for parsed CLI args (see ``add_arguments``)."""
    ns = vars(args)
    overrides = flag_overrides(args, RouterConfig)
    if ns.get("routing_policy"):
        routing = RouterConfig.load(ns.get("config"), env, overrides).routing
        overrides["routing"] = routing.model_copy(update={"policy": ns["routing_policy"]})
    return RouterConfig.load(ns.get("config"), env, overrides)

"""The node's one typed configuration: defaults < TOML file < environment < CLI flags.

Environment variables are ``GPUMESH_NODE_<FIELD>`` (upper case), e.g. GPUMESH_NODE_PORT=50051,
GPUMESH_NODE_ROUTERS=host1:50050,host2:50050. The ticket secret also reads
GPUMESH_TICKET_SECRET (shared with routers).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumesh.config import load_config

ENV_PREFIX = "GPUMESH_NODE_"
ROLES = ("both", "prefill", "decode")   # NodeConfig.role (docs/disaggregation.md)


@dataclass(frozen=True)
class NodeConfig:
    node_id: str = ""                     # "" -> <hostname>-<port>
    host: str = "127.0.0.1"
    port: int = 50051                     # 0 -> any free port
    advertise_address: str = ""          # "" -> host:bound_port
    routers: tuple[str, ...] = ()         # control-plane addresses (host:port)
    # dns:///NAME:PORT router targets (gpumesh.node.discovery): re-resolved this often, and
    # soon after a heartbeat stream breaks.
    router_resolve_interval_s: float = 10.0

    engine: str = "vllm"                  # "vllm" | "sim"
    model: str = ""                       # model folder (vllm) or name (sim)
    served_name: str = ""                 # "" -> model folder's name
    aliases: tuple[str, ...] = ()
    weight: float = 1.0                   # capacity weight (TP=2 or a faster GPU: more)
    tensor_parallel_size: int = 1
    max_model_len: int = 0                # 0 -> the model's own
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.85
    load_format: str = "auto"             # "dummy" -> random weights from config.json
    tokenizer: str = ""
    enforce_eager: bool = False
    num_gpu_blocks_override: int = 0
    # vLLM emits a request's output every N tokens (the first and the last at once): less
    # front-end CPU per token, which is what limits a busy GPU node. Per-token streams then
    # get N-token chunks.
    stream_interval: int = 1
    # Front-end processes over the one engine (vLLM only), as `vllm serve --api-server-count`:
    # each serves gRPC on the port (SO_REUSEPORT) and processes its own requests' outputs, so
    # the node's per-token work is no longer capped by one process's core
    # (gpumesh.node.frontends).
    frontends: int = 1
    # Disaggregated prefill/decode (docs/disaggregation.md): "both" serves whole requests;
    # "prefill" runs prompts and hands their KV to decode nodes; "decode" continues from a
    # prefill node's KV (and serves whole requests too). prefill/decode start vLLM with a KV
    # connector (NIXL; an engine_args kv_transfer_config replaces it); kv_port is its side
    # channel's TCP port (0: a free one), reached at the advertised host.
    role: str = "both"
    kv_port: int = 0
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # extra AsyncEngineArgs
    sim: Mapping[str, Any] = field(default_factory=dict)          # SimEngineConfig fields
    # LoRA adapters (gpumesh.node.adapters), served by name on GenerateRequest.adapter and
    # loaded on demand: name -> adapter folder (PEFT format), and/or a folder whose
    # subfolders are adapters named after them. Either turns LoRA on in the engine.
    adapters: Mapping[str, str] = field(default_factory=dict)
    adapter_dir: str = ""
    max_loras: int = 2                    # adapters in one batch (vLLM); held at once (sim)
    max_lora_rank: int = 16               # largest adapter rank served
    max_cpu_loras: int = 0                # adapters vLLM keeps loaded; 0 = max_loras

    max_concurrency: int = 0              # advertised to routers; 0 = unlimited
    heartbeat_busy_interval_s: float = 0.25
    heartbeat_idle_interval_s: float = 0.25   # = busy: a hung idle node is STALE in 0.5 s
    reconnect_max_backoff_s: float = 1.0   # a restarted router has its fleet back within ~1 s
    # Stream the engine's prefix-cache block events (stored / evicted KV blocks) to routers
    # for precise prefix-locality routing (gpumesh.node.cache); off: routers fall back to
    # approximating this node's cache from what they sent it.
    kv_events: bool = True
    flush_interval_ms: int = 20           # coalescing default (0 = per token)
    # The node's budget of stream messages per second over all its streams: with more streams
    # sending (past their first token) than budget x interval, the default interval widens to
    # streams / budget (128 streams at 2000/s: 64 ms; at most 250 ms). A message costs the
    # node's process far more than a token (docs/benchmarks.md, "What does the node's
    # stream-message budget save?").
    # With several front ends each has budget / frontends over its own streams. 0 = fixed.
    stream_messages_per_s: float = 2000.0
    max_tokens_per_chunk: int = 64
    drain_timeout_s: float = 30.0
    ticket_secret: str = ""               # lookaside tickets; "" -> tickets refused
    require_ticket: bool = False          # refuse requests without a router ticket/metadata
    # --- security (docs/security.md): TLS on the node's port when tls_cert_file is set (files
    # re-read when they change); with tls_ca_file the node dials routers over TLS, presenting
    # its certificate (mutual TLS: the router binds the node id to the certificate's CN).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_require_client_cert: bool = False  # callers must present a certificate of the CA
    # Inference calls only from routers: a caller certificate with OU=router, or a valid
    # lookaside ticket; anything else PERMISSION_DENIED. Off: anyone who reaches the port.
    router_only: bool = False
    insecure: bool = False                # allow plaintext on a non-loopback host
    join_token: str = field(default="", repr=False)  # sent to routers without certificates

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "sim"):
            raise ValueError(f"engine must be 'vllm' or 'sim', got {self.engine!r}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.frontends < 1:
            raise ValueError(f"frontends must be >= 1, got {self.frontends}")
        if self.frontends > 1 and self.engine != "vllm":
            raise ValueError("frontends > 1 needs engine = 'vllm' (the simulator has one process)")
        if self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < 0:
            raise ValueError("max_loras and max_lora_rank must be >= 1, max_cpu_loras >= 0")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role != "both" and self.engine != "vllm":
            raise ValueError(f"role {self.role!r} needs engine = 'vllm' (the KV transfer is "
                             "vLLM's; the simulator models pools in gpumesh sim)")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port (0 = any free one), got {self.kv_port}")
        if not self.stream_messages_per_s >= 0:
            raise ValueError(f"stream_messages_per_s must be >= 0, got {self.stream_messages_per_s}")

    def resolved_node_id(self, bound_port: int) -> str:
        return self.node_id or f"{socket.gethostname()}-{bound_port}".replace(".", "-")

    def advertised_host(self) -> str:
        """The host other nodes and routers reach this node at: the advertised address's,
        else the bound host (the machine's name when bound to every interface)."""
        host = self.advertise_address.rsplit(":", 1)[0] if self.advertise_address else self.host
        host = host.strip("[]")
        return socket.gethostname() if host in ("", "0.0.0.0", "::") else host

    def resolved_served_name(self) -> str:
        if self.served_name:
            return self.served_name
        return Path(self.model).name if self.model else "model"


def load_node_config(file: str | Path | None = None,
                     overrides: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> NodeConfig:
    """defaults < TOML ``file`` (top level, or a ``[node]`` table) < ``GPUMESH_NODE_<FIELD>``
    (and ``GPUMESH_TICKET_SECRET``) < ``overrides`` (see :mod:`gpumesh.config`)."""
    return load_config(NodeConfig, file=file, env_prefix=ENV_PREFIX, environ=environ,
                       overrides=overrides, table="node",
                       env_aliases={"ticket_secret": "GPUMESH_TICKET_SECRET",
                                    "join_token": "GPUMESH_JOIN_TOKEN"})


def new_incarnation() -> str:
    return uuid.uuid4().hex[:16]

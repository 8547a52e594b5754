"""The node's one typed configuration, by section: defaults < TOML file < environment < flags.

Sections, each declared by the package that uses it (docs/configuration.md lists every key):
``[serving]`` this process (below), ``[membership]`` the routers it joins
(gpumesh.node.heartbeat), ``[engine]`` engine and model (gpumesh.node.engines.settings),
``[lora]`` adapters (gpumesh.node.adapters), ``[streaming]`` coalescing
(gpumesh.node.streaming.settings), ``[security]`` TLS, tokens, tickets (gpumesh.node.access).

Loading (:mod:`gpumesh.config`): a TOML file with those tables (or all under ``[node]``),
``GPUMESH_NODE_<SECTION>__<KEY>`` (``GPUMESH_TICKET_SECRET`` and ``GPUMESH_JOIN_TOKEN`` too),
flags ``--<section>.<key>`` and the short ones in ``SHORT_FLAGS`` (``--model``, ``--router``).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from gpumesh.config import SECTION, Settings
from gpumesh.node.access import NodeSecuritySettings
from gpumesh.node.adapters import LoraSettings
from gpumesh.node.engines.settings import EngineSettings
from gpumesh.node.heartbeat import NodeMembershipSettings
from gpumesh.node.streaming.settings import StreamingSettings
from gpumesh.security.settings import TLS_SHORT_FLAGS

ROLES = ("both", "prefill", "decode")   # NodeServingSettings.role (docs/disaggregation.md)


class NodeServingSettings(BaseModel):
    """The node process: identity, address, role, capacity it declares, drain."""

    model_config = SECTION

    node_id: str = Field("", description="This node's id; empty: <hostname>-<port>.")
    host: str = Field("127.0.0.1", description="Address to bind. A non-loopback address needs "
                                               "TLS (security.tls_cert_file) or "
                                               "security.insecure.")
    port: int = Field(50051, ge=0, le=65535, description="Port; 0 = any free port.")
    advertise_address: str = Field(
        "", description="host:port routers and other nodes reach this node at; empty: "
                        "host:bound port.")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="Disaggregated prefill/decode (docs/disaggregation.md): both "
                            "serves whole requests; prefill runs prompts and hands their KV to "
                            "decode nodes; decode continues from a prefill node's KV (and "
                            "serves whole requests too). prefill/decode need engine.kind = vllm.")
    kv_port: int = Field(0, ge=0, le=65535,
                         description="TCP port of the KV connector's side channel (prefill/"
                                     "decode roles), reached at the advertised host; 0 = a "
                                     "free one.")
    frontends: int = Field(
        1, ge=1, description="Front-end processes over the one engine (vLLM only), as vllm "
                             "serve --api-server-count: each serves gRPC on the port and "
                             "processes its own requests' outputs.")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False,
                          description="Capacity weight declared to routers (TP=2 or a faster "
                                      "GPU: more).")
    max_concurrency: int = Field(0, ge=0, description="Concurrent requests declared to "
                                                      "routers; 0 = unlimited.")
    drain_timeout_s: float = Field(30.0, ge=0, allow_inf_nan=False,
                                   description="On drain, how long in-flight requests may "
                                               "finish.")

    def resolved_node_id(self, bound_port: int) -> str:
        return self.node_id or f"{socket.gethostname()}-{bound_port}".replace(".", "-")

    def advertised_host(self) -> str:
        """The host other nodes and routers reach this node at: the advertised address's,
        else the bound host (the machine's name when bound to every interface)."""
        host = self.advertise_address.rsplit(":", 1)[0] if self.advertise_address else self.host
        host = host.strip("[]")
        return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


class NodeConfig(Settings):
    """Every section of the node's configuration; frozen."""

    ENV_PREFIX: ClassVar[str] = "GPUMESH_NODE_"
    TOML_TABLE: ClassVar[str] = "node"
    OTHER_TABLES: ClassVar[tuple[str, ...]] = ("router",)
    ENV_ALIASES: ClassVar[dict[str, str]] = {"security.ticket_secret": "GPUMESH_TICKET_SECRET",
                                             "security.join_token": "GPUMESH_JOIN_TOKEN"}
    RENAMED: ClassVar[dict[str, str]] = {"engine": "engine.kind"}
    SHORT_FLAGS: ClassVar[dict[str, str | list[str]]] = {
        "serving.node_id": "node-id", "serving.host": "host", "serving.port": "port",
        "serving.advertise_address": "advertise", "serving.role": "role",
        "serving.weight": "weight",
        "membership.routers": ["router", "routers"],
        "engine.kind": "engine", "engine.model": "model", "engine.served_name": "served-name",
        "engine.aliases": "alias", "engine.tokenizer": "tokenizer", "engine.dtype": "dtype",
        "engine.tensor_parallel_size": "tensor-parallel-size",
        "engine.max_model_len": "max-model-len", "engine.load_format": "load-format",
        "engine.gpu_memory_utilization": "gpu-memory-utilization",
        "engine.enforce_eager": "enforce-eager",
        "engine.num_gpu_blocks_override": "num-gpu-blocks-override",
        **TLS_SHORT_FLAGS,
        "security.insecure": "insecure", "security.router_only": "router-only"}

    serving: NodeServingSettings = Field(default_factory=NodeServingSettings,
                                         description="This process: identity, address, role.")
    membership: NodeMembershipSettings = Field(default_factory=NodeMembershipSettings,
                                               description="The routers and heartbeats.")
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   description="The engine and the model it serves.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapters.")
    streaming: StreamingSettings = Field(default_factory=StreamingSettings,
                                         description="Token coalescing into stream messages.")
    security: NodeSecuritySettings = Field(default_factory=NodeSecuritySettings,
                                           description="TLS, tokens, tickets, who may call.")

    @model_validator(mode="after")
    def _needs_vllm(self) -> NodeConfig:
        if self.serving.frontends > 1 and self.engine.kind != "vllm":
            raise ValueError("serving.frontends > 1 needs engine.kind = 'vllm' (the simulator "
                             "has one process)")
        if self.serving.role != "both" and self.engine.kind != "vllm":
            raise ValueError(f"serving.role {self.serving.role!r} needs engine.kind = 'vllm' "
                             "(the KV transfer is vLLM's; the simulator models pools in "
                             "gpumesh sim)")
        return self

    def resolved_served_name(self) -> str:
        if self.engine.served_name:
            return self.engine.served_name
        return Path(self.engine.model).name if self.engine.model else "model"


def load_node_config(file: str | Path | None = None,
                     cli: Mapping[str, object] | None = None,
                     environ: Mapping[str, str] | None = None) -> NodeConfig:
    """defaults < TOML ``file`` (sections as tables, or all in a ``[node]`` table) <
    ``GPUMESH_NODE_<SECTION>__<KEY>`` (and the aliases) < ``cli`` (nested by section)."""
    return NodeConfig.load(file, environ, cli)


def new_incarnation() -> str:
    return uuid.uuid4().hex[:16]

"""The router's one typed configuration, by section: defaults < TOML file < environment < flags.

Sections, each declared by the package that uses it (docs/configuration.md lists every key):

========================  ====================================================================
``[serving]``             this process: address, identity, sibling workers, shutdown, channels
``[routing]``             the policy and its prediction inputs (router.scheduling.settings)
``[locality]``            prompt size, the prefix index, routing-key affinity (router.fleet.
                          settings)
``[membership]``          leases, freshness, reading reports (KV filter, decode step), node
                          bounds, foreign nodes (router.fleet.settings)
``[dispatch]``            queue, deadlines, attempts, failover, ejection, disaggregation, SLO
                          admission (router.dispatch.settings)
``[security]``            TLS, join token, API keys, tickets (router.auth.settings)
``[scaling]``             the saturation signal (router.fleet.settings)
========================  ====================================================================

Loading (:mod:`gpumesh.config`): a TOML file with those tables (or all under ``[router]``),
``GPUMESH_ROUTER_<SECTION>__<KEY>`` (``GPUMESH_TICKET_SECRET`` and ``GPUMESH_JOIN_TOKEN`` too),
flags ``--<section>.<key>`` and the short ones in ``SHORT_FLAGS``. Who calls it:
``gpumesh.cli`` (:func:`add_arguments` + :func:`from_args`), tests (``RouterConfig(dispatch=
{"max_attempts": 3})``), and ``router.app``, which only reads it.
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import CliSettingsSource

from gpumesh.config import SECTION, Settings, StrList, add_cli, cli_values
from gpumesh.router.auth.settings import RouterSecuritySettings
from gpumesh.router.dispatch.settings import DispatchSettings
from gpumesh.router.fleet.settings import LocalitySettings, MembershipSettings, ScalingSettings
from gpumesh.router.scheduling.settings import POLICIES, RoutingSettings
from gpumesh.security.settings import TLS_SHORT_FLAGS

__all__ = ["POLICIES", "RouterConfig", "ServingSettings", "add_arguments", "from_args"]


def random_router_id() -> str:
    return f"router-{secrets.token_hex(4)}"


class ServingSettings(BaseModel):
    """The router process itself (router.app, router.workers)."""

    model_config = SECTION

    host: str = Field(
        "127.0.0.1", description="Address to bind. A non-loopback address needs TLS "
                                 "(security.tls_cert_file) or security.insecure.")
    port: int = Field(50050, ge=0, le=65535,
                      description="Public port: Inference, ControlPlane, Router, gRPC health "
                                  "and reflection. 0 = any free port.")
    router_id: str = Field(
        default_factory=random_router_id,
        description="This router's identity in the nodes' per-router accounts and in lookaside "
                    "tickets; no '.'. Default: router-<8 hex>, random per process.")
    peer_addresses: StrList = Field(
        (), description="Control addresses of this router's sibling processes, sent to nodes "
                        "in RouterHello so they heartbeat to each (--workers sets it).")
    control_port: int = Field(
        0, ge=0, le=65535,
        description="A second, private port of this process alone (with --workers the public "
                    "port is shared). 0 = none (--workers sets it).")
    shutdown_grace_s: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="On shutdown, how long in-flight requests may run on before the server "
                    "stops.")
    keepalive_time_ms: int = Field(30_000, ge=1,
                                   description="gRPC keepalive of the channels to nodes.")

    @field_validator("router_id")
    @classmethod
    def _no_dot(cls, value: str) -> str:
        if not value or "." in value:
            raise ValueError(f"must be non-empty and contain no '.' (ticket format), got {value!r}")
        return value


class RouterConfig(Settings):
    """Every section of the router's configuration; frozen."""

    ENV_PREFIX: ClassVar[str] = "GPUMESH_ROUTER_"
    TOML_TABLE: ClassVar[str] = "router"
    OTHER_TABLES: ClassVar[tuple[str, ...]] = ("node",)
    ENV_ALIASES: ClassVar[dict[str, str]] = {"security.ticket_secret": "GPUMESH_TICKET_SECRET",
                                             "security.join_token": "GPUMESH_JOIN_TOKEN"}
    # keys that moved between sections: refused with their new place (gpumesh.config)
    RENAMED: ClassVar[dict[str, str]] = {
        "routing.step_from_report": "membership.step_from_report",
        "routing.kv_hard_threshold": "membership.kv_hard_threshold",
        "routing.chars_per_token": "locality.chars_per_token"}
    # deploy/compose.yaml's host side of the routers' port, read by Compose, not the router
    ENV_NOT_SETTINGS: ClassVar[tuple[str, ...]] = ("GPUMESH_ROUTER_PUBLISH",)
    SHORT_FLAGS: ClassVar[dict[str, str | list[str]]] = {
        "serving.host": "host", "serving.port": "port", "serving.router_id": "router-id",
        "routing.policy": "policy",
        **TLS_SHORT_FLAGS,
        "security.insecure": "insecure", "security.api_keys_file": "api-keys-file"}

    serving: ServingSettings = Field(default_factory=ServingSettings,
                                     description="This process: address, identity, workers.")
    routing: RoutingSettings = Field(default_factory=RoutingSettings,
                                     description="The routing policy and its inputs.")
    locality: LocalitySettings = Field(
        default_factory=LocalitySettings,
        description="Prefix-cache locality and routing-key affinity.")
    membership: MembershipSettings = Field(default_factory=MembershipSettings,
                                           description="Leases, freshness, node bounds.")
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings,
                                       description="Queue, deadlines, retries, failover, SLOs.")
    security: RouterSecuritySettings = Field(default_factory=RouterSecuritySettings,
                                             description="TLS, join token, API keys, tickets.")
    scaling: ScalingSettings = Field(default_factory=ScalingSettings,
                                     description="The saturation signal for autoscalers.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config`` and one flag per key to the ``gpumesh router`` parser."""
    parser.set_defaults(router_cli=add_cli(parser, RouterConfig))


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RouterConfig:
    """The config for parsed CLI args (see :func:`add_arguments`)."""
    source: CliSettingsSource = args.router_cli
    return RouterConfig.load(args.config, env, cli_values(source, args))

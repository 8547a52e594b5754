"""The fleet's sections of the router's configuration: ``[membership]`` (leases, freshness,
how a node's reports are read, what a node may declare, foreign nodes), ``[locality]`` (prompt
size, the prefix index and routing-key affinity) and ``[scaling]`` (the saturation signal)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from gpumesh.config import SECTION, StrList


class MembershipSettings(BaseModel):
    """How nodes join, stay and leave, and how their reports are read (router.fleet.registry,
    .validation, .quarantine; the KV filter of router.scheduling.pipeline)."""

    model_config = SECTION

    heartbeat_interval_ms: int = Field(
        250, ge=1, description="Heartbeat interval asked of nodes (RouterHello).")
    lease_ttl_s: float = Field(3.0, gt=0, allow_inf_nan=False,
                               description="A node with no heartbeat for this long is removed.")
    freshness_s: float = Field(
        0.5, gt=0, allow_inf_nan=False,
        description="A node whose last report is older is STALE: no new work while a fresh "
                    "node serves the model (2 node heartbeat intervals).")
    known_model_retention_s: float = Field(
        60.0, ge=0, allow_inf_nan=False,
        description="A model whose nodes all left answers UNAVAILABLE (not NOT_FOUND) this long.")
    fleet_rebuild_s: float = Field(
        -1.0, allow_inf_nan=False,
        description="After start, an unknown model answers UNAVAILABLE (retry hint) for this "
                    "long while a restarted router's nodes re-register; < 0: one lease_ttl_s; "
                    "0: off.")
    step_from_report: bool = Field(
        True,
        description="Take a node's decode step time from its report (decode_step_s, timed "
                    "between the engine's steps); off, or for a node that does not report it: "
                    "inferred as average running requests / generation tokens per second.")
    kv_hard_threshold: float = Field(
        0.92, gt=0.0, le=1.0, allow_inf_nan=False,
        description="Filter: skip nodes whose fresh report shows KV usage at or above this, "
                    "while some candidate is below it.")
    peer_share_half_life_s: float = Field(
        10.0, ge=0, allow_inf_nan=False,
        description="Half-life of this router's estimated share of all routers' dispatches "
                    "(its unreported requests scale by 1 / share); 0 = ignore peers.")
    node_max_models: int = Field(64, ge=1, description="Models one node may declare.")
    node_max_aliases: int = Field(32, ge=0, description="Aliases per model a node may declare.")
    node_max_name_length: int = Field(
        256, ge=1, description="Longest node id, model name or alias a node may declare.")
    node_max_capacity_weight: float = Field(
        64.0, gt=0, allow_inf_nan=False,
        description="Largest capacity weight a node may declare.")
    node_max_heartbeats_per_s: float = Field(
        50.0, ge=0, allow_inf_nan=False,
        description="Heartbeats per second a node may send; beyond: dropped unapplied. "
                    "0 = no limit.")
    quarantine_s: float = Field(
        30.0, ge=0, allow_inf_nan=False,
        description="A node that declares beyond the node_max_* bounds is quarantined this "
                    "long (GetFleet shows the reason).")
    foreign_nodes: StrList = Field(
        (), description="Stock vLLM gRPC workers the router polls (router.backends.vllm_grpc): "
                        "host:port[?weight=W&node_id=ID&tokenizer=PATH&max_concurrency=N].")
    foreign_poll_interval_s: float = Field(
        0.25, gt=0, allow_inf_nan=False,
        description="GetLoads interval for a foreign node while no pushed load arrives.")


class LocalitySettings(BaseModel):
    """A request's prompt: its size estimate (router.dispatch.context), where its prefix is
    cached (router.fleet.locality; docs/routing.md#prefix-cache-locality) and which node its
    routing key went to last (router.fleet.sessions)."""

    model_config = SECTION

    chars_per_token: float = Field(
        4.0, gt=0.0, allow_inf_nan=False,
        description="Prompt-size estimate for text and chat prompts, UTF-8 bytes per token "
                    "(token-id prompts are exact); the prediction's prompt tokens and API-key "
                    "token quotas use it.")
    prefix_locality: Literal["auto", "precise", "approximate", "off"] = Field(
        "auto", description="auto: nodes' KV events where they stream them, else the router's "
                            "record of what it sent where; precise: events only; approximate: "
                            "records only; off: no locality term.")
    prefix_index_max_entries: int = Field(
        4_000_000, ge=0,
        description="(node, block) entries per model in the prefix index, about 110 bytes "
                    "each; past it a node's oldest blocks go first.")
    prefix_approx_ttl_s: float = Field(
        120.0, ge=0, allow_inf_nan=False,
        description="Approximate mode: a prefix sent to a node counts as cached there this long.")
    prefix_pending_ttl_s: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="A prefix just sent to a node that streams KV events counts as held there "
                    "until its events confirm it, at most this long.")
    prefix_tokenizers: StrList = Field(
        (), description="Tokenizer per model for hashing text and chat prompts, MODEL=SPEC "
                        "(SPEC: sim, or an HF tokenizer path or name).")
    affinity_max_keys: int = Field(
        100_000, ge=0,
        description="Routing keys (GenerateRequest.routing_key) remembered with the node they "
                    "went to last, counted as an expected prefix hit there (LRU); 0 = off.")
    affinity_ttl_s: float = Field(600.0, gt=0, allow_inf_nan=False,
                                  description="A routing key unused this long is forgotten.")

    @field_validator("prefix_tokenizers")
    @classmethod
    def _model_equals_spec(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in value if "=" not in t]
        if bad:
            raise ValueError(f"entries are MODEL=SPEC, got {bad[0]!r}")
        return value


class ScalingSettings(BaseModel):
    """The scaling signal (router.fleet.saturation): the SLO and target it is measured against."""

    model_config = SECTION

    saturation_slo_ttft_s: float = Field(
        2.0, gt=0, allow_inf_nan=False,
        description="Queued prefill worth this much wait counts as saturated.")
    saturation_target: float = Field(0.8, gt=0, le=1, allow_inf_nan=False,
                                     description="nodes_wanted keeps saturation at or below this.")
    saturation_default_slots: int = Field(
        256, ge=1, description="A node's slots when neither it nor the router caps them.")
    saturation_half_life_s: float = Field(30.0, gt=0, allow_inf_nan=False,
                                          description="Half-life of the at-limit fraction.")
    reference_prompt_tokens_per_s: float = Field(
        8000.0, gt=0, allow_inf_nan=False,
        description="Prompt tokens per second per unit of weight assumed for a node that "
                    "reports no prefill capacity.")

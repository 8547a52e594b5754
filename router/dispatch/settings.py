"""The router's ``[dispatch]`` section: queueing, deadlines, attempts and failover, outlier
ejection, disaggregated prefill/decode legs and SLO admission (router.dispatch;
docs/reliability.md, docs/disaggregation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from gpumesh.config import SECTION, StrList


class DispatchSettings(BaseModel):
    """What happens to a request between the router's choice of node and its answer."""

    model_config = SECTION

    max_concurrency_default: int = Field(
        0, ge=0, description="Per-node concurrency cap when the node declares 0 (0 = unlimited).")
    queue_bound: int = Field(
        256, ge=0, description="Waiting requests per model; beyond: RESOURCE_EXHAUSTED.")
    request_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False,
                                     description="Per-attempt deadline when the client sets none.")
    first_token_timeout_s: float = Field(
        120.0, gt=0, allow_inf_nan=False,
        description="No first message by then: the attempt failed (retryable).")
    max_attempts: int = Field(2, ge=1,
                              description="Attempts per request; 2 = one transparent retry on "
                                          "another node.")
    max_migrations: int = Field(
        2, ge=0, description="A stream continues on another node at most this often.")
    first_token_min_s: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="First-token wait = this + first_token_wait_factor x the node's expected "
                    "wait, capped by first_token_timeout_s.")
    first_token_wait_factor: float = Field(4.0, ge=0, allow_inf_nan=False,
                                           description="See first_token_min_s.")
    stall_check_interval_s: float = Field(
        0.1, gt=0, allow_inf_nan=False,
        description="How often stalled calls on STALE nodes are looked for.")
    stall_s: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="A stream whose node reported nothing and that moved nothing for this "
                    "long fails over (>= membership.freshness_s).")
    disagg_min_prompt_tokens: int = Field(
        512, ge=0, description="Shorter prompts are served whole while a \"both\" node serves "
                               "the model (docs/disaggregation.md).")
    disagg_leg_timeout_s: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="Bound on the prefill leg, and on the decode leg's first token (the KV "
                    "transfer); past it the request is served whole.")
    outlier_consecutive_failures: int = Field(
        3, ge=0, description="Node faults in a row that eject the node (0 = off).")
    outlier_latency_factor: float = Field(
        5.0, ge=0, allow_inf_nan=False,
        description="A node whose first-response EWMA exceeds this x its peers' median is "
                    "ejected.")
    outlier_base_ejection_s: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="The k-th ejection in a row lasts this x 2^(k-1) ...")
    outlier_max_ejection_s: float = Field(30.0, gt=0, allow_inf_nan=False,
                                          description="... at most this.")
    lookaside_credit_max_s: float = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="Lookaside and unary in-flight credits expire after this at most.")
    slo_ttft_ms: StrList = Field(
        (), description="Time-to-first-token objective per model, MODEL=MS (a request's own "
                        "ttft_slo_ms, else its API key's, else this).")
    slo_tpot_ms: StrList = Field(
        (), description="Time-per-output-token objective per model, MODEL=MS.")
    slo_admission: Literal["queue", "reject", "off"] = Field(
        "queue", description="A request no node is predicted to meet its SLO: queue (wait "
                             "while its TTFT budget lasts, then RESOURCE_EXHAUSTED with a "
                             "retry-after), reject (at once) or off.")

    @model_validator(mode="after")
    def _slo_entries(self) -> DispatchSettings:
        from gpumesh.router.dispatch.slo import model_slos

        model_slos(self.slo_ttft_ms, self.slo_tpot_ms)   # ValueError naming a bad entry
        return self

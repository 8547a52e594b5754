"""The routing section of the router's configuration (``RouterConfig.routing``).

What an operator decides about routing, and nothing the engines can tell the router: which
policy, which objective, how many candidates a decision looks at on a large fleet, and the
guesses the prediction needs where a request or a node says nothing (a request's output
length, an adapter's load time). Every other quantity the prediction uses comes from the
nodes' engine profiles and load reports (docs/routing.md); how those reports are read (the KV
filter, the decode step's source) is ``[membership]``, a text prompt's size estimate
``[locality]`` (router.fleet.settings).

Loaded like the rest of the configuration (gpumesh.config): a ``[routing]`` TOML table,
``GPUMESH_ROUTER_ROUTING__POLICY=least_request``, or ``--routing.policy least_request``
(``--policy`` in short).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gpumesh.config import SECTION

POLICIES = ("predicted_latency", "least_request", "power_of_two", "round_robin")
OBJECTIVES = ("slo_then_completion", "min_ttft", "max_slo_attainment")


class RoutingSettings(BaseModel):
    """The routing policy's settings (docs/configuration.md, "Routing policy")."""

    model_config = SECTION

    policy: Literal["predicted_latency", "least_request", "power_of_two", "round_robin"] = Field(
        "predicted_latency",
        description="predicted_latency: each candidate's predicted time to first token and "
                    "completion from its engine profile, chosen by the objective; the three "
                    "others are plain baselines that predict nothing.")
    objective: Literal["slo_then_completion", "min_ttft", "max_slo_attainment"] = Field(
        "max_slo_attainment",
        description="What predicted_latency minimises: slo_then_completion (among the nodes "
                    "predicted to meet the request's TTFT SLO, the least predicted completion "
                    "time plus the delay imposed on the node's running requests); min_ttft "
                    "(the least predicted time to first token); max_slo_attainment (among the "
                    "nodes that meet the SLO, the one whose choice delays others least).")
    ttft_slo_s: float = Field(
        0.0, ge=0.0, allow_inf_nan=False,
        description="Time-to-first-token objective in seconds for requests that carry none "
                    "of their own (RequestInfo.ttft_slo_s: per request, API key or model); "
                    "0 = none (slo_then_completion then minimises completion alone).")
    sample_size: int = Field(
        32, ge=0,
        description="Candidates predicted per decision on a model with more nodes (a sample "
                    "of this many, plus the nodes holding the request's prefix and its "
                    "session's node); every node up to it; 0 = every node always.")
    output_tokens_default: int = Field(
        256, ge=1,
        description="Output tokens assumed for a request that sets no max_tokens, and for "
                    "the requests already running on a node that has not reported the mean "
                    "output of its finished requests yet.")
    output_tokens_cap: int = Field(
        2048, ge=1,
        description="A request's max_tokens counts at most this much in its predicted "
                    "completion (a generous max_tokens is an upper bound, rarely reached).")
    adapter_load_s: float = Field(
        1.0, ge=0.0, allow_inf_nan=False,
        description="Seconds a LoRA adapter load is predicted to take on a node that has not "
                    "measured one yet (a node reports its own mean once it has).")

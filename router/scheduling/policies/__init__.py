"""Routing policies, one per module behind one interface (``base.Policy``):
``predicted_latency`` (the default; ``predicted``), and the baselines ``least_request``,
``power_of_two`` and ``round_robin``. ``build_policy`` makes the configured one."""

from gpumesh.router.scheduling.policies.base import Policy
from gpumesh.router.scheduling.policies.least_request import LeastRequest
from gpumesh.router.scheduling.policies.power_of_two import PowerOfTwo
from gpumesh.router.scheduling.policies.predicted import PredictedLatency
from gpumesh.router.scheduling.policies.round_robin import RoundRobin
from gpumesh.router.scheduling.settings import RoutingSettings


def build_policy(settings: RoutingSettings) -> Policy:
    """The policy ``settings.policy`` names, configured by ``settings``."""
    if settings.policy == "predicted_latency":
        return PredictedLatency(settings)
    if settings.policy == "least_request":
        return LeastRequest()
    if settings.policy == "power_of_two":
        return PowerOfTwo()
    if settings.policy == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown policy {settings.policy!r}")


__all__ = ["LeastRequest", "Policy", "PowerOfTwo", "PredictedLatency", "RoundRobin",
           "build_policy"]

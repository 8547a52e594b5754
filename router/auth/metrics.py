"""The auth counters as OpenTelemetry metrics (read on the exporter's thread from plain
counters): ``gpumesh.router.auth_rejections`` by ``kind`` (client, operator, node) and
``status``; ``gpumesh.router.key_requests`` by API-key ``key`` name and ``status``."""

from __future__ import annotations

from gpumesh.router.auth.interceptor import AuthCounters
from gpumesh.telemetry import Metrics


def register_auth_metrics(metrics: Metrics, counters: AuthCounters) -> None:
    metrics.counter_from(
        "gpumesh.router.auth_rejections",
        lambda: [(n, {"kind": k, "status": s}) for (k, s), n in
                 list(counters.rejections.items())],
        unit="{call}", description="Calls and registrations refused for want of a credential")
    metrics.counter_from(
        "gpumesh.router.key_requests",
        lambda: [(n, {"key": k, "status": s}) for (k, s), n in
                 list(counters.key_requests.items())],
        unit="{request}", description="Requests per API key name, by outcome")

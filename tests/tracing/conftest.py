"""Fixtures for tracing tests: one OTLP receiver per session; real gpumesh processes export
to it (short batch delay so spans arrive within a fraction of a second)."""

from __future__ import annotations

import os
import secrets

import pytest

from tests.tracing.otlp_receiver import Receiver

SIM_MODEL = "sim-trace"


@pytest.fixture(scope="session")
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def otel_env(receiver: Receiver) -> dict[str, str]:
    """The only configuration the processes get: standard OTEL_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
        "GPUMESH_LOG_LEVEL": "info",
    })
    env.pop("GPUMESH_PROMETHEUS_PORT", None)
    return env


def new_traceparent() -> tuple[str, str, str]:
    """(traceparent, trace id, parent span id) for a client-started, sampled trace."""
    tid, sid = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{tid}-{sid}-01", tid, sid

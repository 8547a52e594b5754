"""RouterConfig: defaults < TOML < env < flags, validation."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpumesh.config import ConfigError
from gpumesh.router.config import RouterConfig, add_arguments, from_args
from gpumesh.router.scheduling.settings import RoutingSettings


def test_defaults_are_valid_and_router_ids_unique() -> None:
    a, b = RouterConfig(), RouterConfig()
    assert a.policy == "predicted_latency" and a.router_id != b.router_id
    assert "." not in a.router_id and a.routing == RoutingSettings()
    assert a.decision_sample_size == a.routing.sample_size == 32


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('queue_bound = 7\nlease_ttl_s = 4.5\n'
                 '[routing]\npolicy = "least_request"\nsample_size = 8\n')
    env = {"GPUMESH_ROUTER_QUEUE_BOUND": "9", "GPUMESH_TICKET_SECRET": "s3cret"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(f), "--policy", "power_of_two", "--port", "0"])
    cfg = from_args(args, env=env)
    assert cfg.policy == "power_of_two"          # flag beats file
    assert cfg.queue_bound == 9                  # env beats file
    assert cfg.lease_ttl_s == 4.5 and cfg.port == 0
    assert cfg.routing.sample_size == 8          # the file's other routing keys stay
    args = parser.parse_args(["--config", str(f), "--routing", "objective=min_ttft"])
    assert from_args(args, env=env).routing == RoutingSettings(objective="min_ttft")
    assert cfg.ticket_secret == "s3cret" and "s3cret" not in repr(cfg)


def test_env_routing_and_peers() -> None:
    cfg = RouterConfig.load(env={"GPUMESH_ROUTER_ROUTING": "policy=round_robin,ttft_slo_s=0.5",
                                 "GPUMESH_ROUTER_PEER_ADDRESSES": "h:1, h:2"})
    assert cfg.routing == RoutingSettings(policy="round_robin", ttft_slo_s=0.5)
    assert cfg.policy == "round_robin" and cfg.peer_addresses == ("h:1", "h:2")
    with pytest.raises(ConfigError, match="routing.objective"):
        RouterConfig.load(env={"GPUMESH_ROUTER_ROUTING": "objective=fastest"})


@pytest.mark.parametrize("bad", [
    {"routing": {"policy": "random"}}, {"router_id": "a.b"}, {"routing": {"nope": 1.0}},
    {"routing": {"sample_size": -1}}, {"routing": {"adapter_load_s": float("nan")}},
    {"lease_ttl_s": 0}, {"kv_hard_threshold": 1.5},
    {"max_attempts": 0},
])
def test_invalid_values_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**bad)


def test_unknown_key_rejected(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("polcy = 'x'\n")
    with pytest.raises(ValueError, match="polcy"):
        RouterConfig.load(f, env={})


def test_bool_fields_from_env_and_flags() -> None:
    for text, want in (("1", True), ("true", True), ("off", False), ("false", False)):
        cfg = RouterConfig.load(env={"GPUMESH_ROUTER_STEP_FROM_REPORT": text})
        assert cfg.step_from_report is want, text
    assert RouterConfig.load().step_from_report is True
    with pytest.raises(ValueError, match="step_from_report must be true or false"):
        RouterConfig.load(env={"GPUMESH_ROUTER_STEP_FROM_REPORT": "maybe"})

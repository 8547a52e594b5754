"""RouterConfig: defaults < TOML < env < flags, validation."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpumesh.router.config import RouterConfig, add_arguments, from_args


def test_defaults_are_valid_and_router_ids_unique() -> None:
    a, b = RouterConfig(), RouterConfig()
    assert a.policy == "weighted_least_load" and a.router_id != b.router_id
    assert "." not in a.router_id and a.scorer_weights["expected_wait"] == 1.0


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('policy = "least_request"\nqueue_bound = 7\nlease_ttl_s = 4.5\n'
                 '[scorer_weights]\nkv_headroom = 0.25\n')
    env = {"GPUMESH_ROUTER_QUEUE_BOUND": "9", "GPUMESH_TICKET_SECRET": "s3cret"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(f), "--policy", "power_of_two",
                              "--scorer-weight", "least_request=0.5", "--port", "0"])
    cfg = from_args(args, env=env)
    assert cfg.policy == "power_of_two"          # flag beats file
    assert cfg.queue_bound == 9                  # env beats file
    assert cfg.lease_ttl_s == 4.5 and cfg.port == 0
    assert dict(cfg.scorer_weights) == {"expected_wait": 1.0, "kv_headroom": 0.25,
                                        "least_request": 0.5}
    assert cfg.ticket_secret == "s3cret" and "s3cret" not in repr(cfg)


def test_env_weights_and_peers() -> None:
    cfg = RouterConfig.load(env={"GPUMESH_ROUTER_SCORER_WEIGHTS": "expected_wait=2,kv_headroom=1",
                                 "GPUMESH_ROUTER_PEER_ADDRESSES": "h:1, h:2"})
    assert cfg.scorer_weights["expected_wait"] == 2.0 and cfg.peer_addresses == ("h:1", "h:2")


@pytest.mark.parametrize("bad", [
    {"policy": "random"}, {"router_id": "a.b"}, {"scorer_weights": {"nope": 1.0}},
    {"scorer_weights": {"expected_wait": 0.0, "least_request": 0.0}},
    {"admission_weight": -1.0}, {"output_weight": -0.1}, {"lease_ttl_s": 0}, {"kv_hard_threshold": 1.5},
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
        cfg = RouterConfig.load(env={"GPUMESH_ROUTER_PREFILL_FROM_CAPACITY": text})
        assert cfg.prefill_from_capacity is want, text
    assert RouterConfig.load().prefill_from_capacity is True
    with pytest.raises(ValueError, match="prefill_from_capacity must be true or false"):
        RouterConfig.load(env={"GPUMESH_ROUTER_PREFILL_FROM_CAPACITY": "maybe"})

"""RouterConfig: sections, defaults < TOML < env < flags, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.cli import build_parser
from gpumesh.config import ConfigError
from gpumesh.router.config import RouterConfig, from_args
from gpumesh.router.scheduling.settings import RoutingSettings


def test_defaults_are_valid_and_router_ids_unique() -> None:
    a, b = RouterConfig(), RouterConfig()
    assert a.routing.policy == "predicted_latency"
    assert a.serving.router_id != b.serving.router_id
    assert "." not in a.serving.router_id and a.routing == RoutingSettings()
    assert a.routing.sample_size == 32


def test_the_routing_section_holds_at_most_eight_keys() -> None:
    """[routing] is what an operator decides (policy, objective, SLO, sample size, the
    prediction's guesses); how reports are read and prompts sized live in other sections."""
    assert len(RoutingSettings.model_fields) <= 8


def _args(*argv: str):
    return build_parser().parse_args(["router", *argv])


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('[dispatch]\nqueue_bound = 7\n[membership]\nlease_ttl_s = 4.5\n'
                 '[routing]\npolicy = "least_request"\nsample_size = 8\n')
    env = {"GPUMESH_ROUTER_DISPATCH__QUEUE_BOUND": "9", "GPUMESH_TICKET_SECRET": "s3cret"}
    cfg = from_args(_args("--config", str(f), "--policy", "power_of_two", "--port", "0"), env)
    assert cfg.routing.policy == "power_of_two"      # flag beats file
    assert cfg.dispatch.queue_bound == 9             # env beats file
    assert cfg.membership.lease_ttl_s == 4.5 and cfg.serving.port == 0
    assert cfg.routing.sample_size == 8              # the file's other routing keys stay
    cfg2 = from_args(_args("--config", str(f), "--routing.objective", "min_ttft",
                           "--dispatch.max-attempts", "3"), env)
    assert cfg2.routing == RoutingSettings(policy="least_request", sample_size=8,
                                           objective="min_ttft")
    assert cfg2.dispatch.max_attempts == 3
    assert cfg.security.ticket_secret == "s3cret" and "s3cret" not in repr(cfg)


def test_env_routing_and_peers() -> None:
    cfg = RouterConfig.load(env={"GPUMESH_ROUTER_ROUTING__POLICY": "round_robin",
                                 "GPUMESH_ROUTER_ROUTING__TTFT_SLO_S": "0.5",
                                 "GPUMESH_ROUTER_SERVING__PEER_ADDRESSES": "h:1, h:2"})
    assert cfg.routing == RoutingSettings(policy="round_robin", ttft_slo_s=0.5)
    assert cfg.serving.peer_addresses == ("h:1", "h:2")
    with pytest.raises(ConfigError, match="routing.objective"):
        RouterConfig.load(env={"GPUMESH_ROUTER_ROUTING__OBJECTIVE": "fastest"})
    with pytest.raises(ConfigError, match="GPUMESH_ROUTER_ROUTING__<KEY>"):
        RouterConfig.load(env={"GPUMESH_ROUTER_ROUTING": "policy=round_robin"})


@pytest.mark.parametrize(("bad", "named"), [
    ({"routing": {"policy": "random"}}, "routing.policy"),
    ({"serving": {"router_id": "a.b"}}, "serving.router_id"),
    ({"routing": {"nope": 1.0}}, "routing.nope"),
    ({"routing": {"sample_size": -1}}, "routing.sample_size"),
    ({"routing": {"adapter_load_s": float("nan")}}, "routing.adapter_load_s"),
    ({"membership": {"lease_ttl_s": 0}}, "membership.lease_ttl_s"),
    ({"membership": {"kv_hard_threshold": 1.5}}, "membership.kv_hard_threshold"),
    ({"dispatch": {"max_attempts": 0}}, "dispatch.max_attempts"),
    ({"scaling": {"saturation_target": 0}}, "scaling.saturation_target"),
    ({"locality": {"prefix_tokenizers": ["m"]}}, "locality.prefix_tokenizers"),
    ({"locality": {"prefix_locality": "sometimes"}}, "locality.prefix_locality"),
    ({"dispatch": {"slo_ttft_ms": ["m=abc"]}}, "dispatch"),
    ({"dispatch": {"slo_admission": "maybe"}}, "dispatch.slo_admission"),
    ({"serving": {"port": 70000}}, "serving.port"),
])
def test_invalid_values_rejected_naming_the_key(bad: dict, named: str) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**bad)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        RouterConfig.build(bad)


def test_unknown_key_rejected(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("[routing]\npolcy = 'x'\n")
    with pytest.raises(ValueError, match="polcy"):
        RouterConfig.load(f, env={})


def test_bool_keys_from_env_and_flags() -> None:
    for text, want in (("1", True), ("true", True), ("off", False), ("false", False)):
        cfg = RouterConfig.load(env={"GPUMESH_ROUTER_MEMBERSHIP__STEP_FROM_REPORT": text})
        assert cfg.membership.step_from_report is want, text
    assert RouterConfig.load(env={}).membership.step_from_report is True
    with pytest.raises(ValueError, match="membership.step_from_report"):
        RouterConfig.load(env={"GPUMESH_ROUTER_MEMBERSHIP__STEP_FROM_REPORT": "maybe"})
    cfg = from_args(_args("--no-membership.step-from-report", "--insecure"), {})
    assert cfg.membership.step_from_report is False and cfg.security.insecure is True


def test_replace_revalidates() -> None:
    cfg = RouterConfig()
    assert cfg.replace(serving={"router_id": "r1"}).serving.router_id == "r1"
    with pytest.raises(ConfigError, match="serving.router_id"):
        cfg.replace(serving={"router_id": "r.1"})

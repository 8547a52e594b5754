"""gpumesh.config: one loader for router and node, the same rules for both."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpumesh.config import ConfigError, add_flags, flag_overrides
from gpumesh.node.config import NodeConfig, load_node_config
from gpumesh.router.config import RouterConfig


def _router(path: Path | None = None, env: dict[str, str] | None = None, **over: object):
    return RouterConfig.load(path, env or {}, over)


def _node(path: Path | None = None, env: dict[str, str] | None = None, **over: object):
    return load_node_config(path, over, env or {})


LOADERS = [(_router, "GPUMESH_ROUTER_", "step_from_report", "lease_ttl_s"),
           (_node, "GPUMESH_NODE_", "enforce_eager", "drain_timeout_s")]


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_layers_defaults_file_env_flags(tmp_path: Path, load, prefix: str, flag: str,
                                        seconds: str) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(f"{seconds} = 7.0\n")
    assert getattr(load(toml), seconds) == 7.0
    assert getattr(load(toml, {prefix + seconds.upper(): "8"}), seconds) == 8.0
    assert getattr(load(toml, {prefix + seconds.upper(): "8"}, **{seconds: 9.0}), seconds) == 9.0


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
@pytest.mark.parametrize(("text", "want"), [("true", True), ("On", True), ("1", True),
                                            ("no", False), ("0", False), ("FALSE", False)])
def test_booleans_parse_the_same_everywhere(load, prefix: str, flag: str, seconds: str,
                                            text: str, want: bool) -> None:
    assert getattr(load(None, {prefix + flag.upper(): text}), flag) is want


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_an_unknown_boolean_is_an_error_that_names_the_key(load, prefix: str, flag: str,
                                                           seconds: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        load(None, {prefix + flag.upper(): "maybe"})


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_an_unknown_key_is_an_error_that_names_it(tmp_path: Path, load, prefix: str, flag: str,
                                                  seconds: str) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("no_such_setting = 1\n")
    with pytest.raises(ConfigError, match="no_such_setting"):
        load(toml)
    with pytest.raises(ConfigError, match="no_such_setting"):
        load(None, None, no_such_setting=1)


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_a_number_that_does_not_convert_names_the_key(load, prefix: str, flag: str,
                                                      seconds: str) -> None:
    with pytest.raises(ConfigError, match=seconds):
        load(None, {prefix + seconds.upper(): "soon"})


def test_component_tables_and_lists(tmp_path: Path) -> None:
    toml = tmp_path / "both.toml"
    toml.write_text('[router]\nlease_ttl_s = 4.0\n')
    assert _router(toml).lease_ttl_s == 4.0
    toml.write_text('[node]\nrouters = ["a:1", "b:2"]\n[node.engine_args]\nseed = 3\n')
    cfg = _node(toml)
    assert cfg.routers == ("a:1", "b:2") and dict(cfg.engine_args) == {"seed": 3}
    assert _node(None, {"GPUMESH_NODE_ROUTERS": "a:1, b:2"}).routers == ("a:1", "b:2")
    env = {"GPUMESH_NODE_ENGINE_ARGS": '{"seed": 4}'}
    assert dict(_node(None, env).engine_args) == {"seed": 4}


def test_ticket_secret_from_the_shared_variable_below_the_prefixed_one() -> None:
    assert _node(None, {"GPUMESH_TICKET_SECRET": "s"}).ticket_secret == "s"
    env = {"GPUMESH_TICKET_SECRET": "s", "GPUMESH_ROUTER_TICKET_SECRET": "r"}
    assert _router(None, env).ticket_secret == "r"


def test_flags_from_the_dataclass_repeat_for_lists() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, NodeConfig, skip=("engine_args", "sim"), aliases={"routers": ("--router",)})
    args = p.parse_args(["--router", "a:1", "--routers", "b:2,c:3", "--port", "9"])
    cfg = load_node_config(None, flag_overrides(args, NodeConfig), {})
    assert cfg.routers == ("a:1", "b:2", "c:3") and cfg.port == 9

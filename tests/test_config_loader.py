"""gpumesh.config: one loader for router and node, the same rules for both."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.cli import build_parser
from gpumesh.config import ConfigError, cli_values, nest, section_of
from gpumesh.node.config import NodeConfig, load_node_config
from gpumesh.router.config import RouterConfig


def _router(path: Path | None = None, env: dict[str, str] | None = None,
            cli: dict | None = None) -> RouterConfig:
    return RouterConfig.load(path, env or {}, cli)


def _node(path: Path | None = None, env: dict[str, str] | None = None,
          cli: dict | None = None) -> NodeConfig:
    return load_node_config(path, cli, env or {})


# (loader, env prefix, a boolean key, a seconds key), keys as "section.key"
LOADERS = [(_router, "GPUMESH_ROUTER_", "membership.step_from_report", "membership.lease_ttl_s"),
           (_node, "GPUMESH_NODE_", "engine.enforce_eager", "serving.drain_timeout_s")]


def _get(cfg: object, where: str) -> object:
    section, key = where.split(".")
    return getattr(getattr(cfg, section), key)


def _var(prefix: str, where: str) -> str:
    return prefix + where.upper().replace(".", "__")


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_layers_defaults_file_env_flags(tmp_path: Path, load, prefix: str, flag: str,
                                        seconds: str) -> None:
    section, key = seconds.split(".")
    toml = tmp_path / "c.toml"
    toml.write_text(f"[{section}]\n{key} = 7.0\n")
    assert _get(load(), seconds) != 7.0
    assert _get(load(toml), seconds) == 7.0
    env = {_var(prefix, seconds): "8"}
    assert _get(load(toml, env), seconds) == 8.0
    assert _get(load(toml, env, {section: {key: "9"}}), seconds) == 9.0


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
@pytest.mark.parametrize(("text", "want"), [("true", True), ("On", True), ("1", True),
                                            ("no", False), ("0", False), ("FALSE", False)])
def test_booleans_parse_the_same_everywhere(load, prefix: str, flag: str, seconds: str,
                                            text: str, want: bool) -> None:
    assert _get(load(None, {_var(prefix, flag): text}), flag) is want


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_a_bad_value_is_an_error_that_names_section_and_key(load, prefix: str, flag: str,
                                                            seconds: str) -> None:
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
        load(None, {_var(prefix, flag): "maybe"})
    with pytest.raises(ConfigError, match=seconds.replace(".", r"\.") + ".*soon"):
        load(None, {_var(prefix, seconds): "soon"})


def test_a_range_error_says_the_bound() -> None:
    with pytest.raises(ConfigError, match=r"dispatch\.max_attempts: must be >= 1, got 0"):
        RouterConfig.build({"dispatch": {"max_attempts": 0}})
    with pytest.raises(ConfigError, match=r"serving\.frontends: must be >= 1"):
        NodeConfig.build({"serving": {"frontends": 0}})


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_an_unknown_key_is_an_error_that_names_it(tmp_path: Path, load, prefix: str, flag: str,
                                                  seconds: str) -> None:
    section = seconds.split(".")[0]
    toml = tmp_path / "c.toml"
    for text in ("no_such_setting = 1\n", f"[{section}]\nno_such_setting = 1\n",
                 "[no_such_setting]\nx = 1\n"):
        toml.write_text(text)
        with pytest.raises(ConfigError, match="no_such_setting"):
            load(toml)
    with pytest.raises(ConfigError, match="NO_SUCH_SETTING: unknown setting"):
        load(None, {f"{prefix}{section.upper()}__NO_SUCH_SETTING": "1"})
    with pytest.raises(ConfigError, match="no_such_setting"):
        load(None, None, {section: {"no_such_setting": 1}})


@pytest.mark.parametrize(("load", "prefix", "flag", "seconds"), LOADERS)
def test_a_flat_key_of_the_old_layout_names_its_section(tmp_path: Path, load, prefix: str,
                                                        flag: str, seconds: str) -> None:
    section, key = seconds.split(".")
    toml = tmp_path / "c.toml"
    toml.write_text(f"{key} = 1.0\n")
    with pytest.raises(ConfigError, match=rf"{key} moved to \[{section}\] {key}"):
        load(toml)
    with pytest.raises(ConfigError, match=_var(prefix, seconds)):
        load(None, {prefix + key.upper(): "1"})


def test_a_key_in_the_wrong_section_names_the_right_one(tmp_path: Path) -> None:
    toml = tmp_path / "r.toml"
    toml.write_text("[dispatch]\nlease_ttl_s = 1.0\n")
    with pytest.raises(ConfigError, match=r"\[dispatch\] lease_ttl_s: belongs in \[membership\]"):
        _router(toml)


def test_the_node_engine_key_is_engine_kind(tmp_path: Path) -> None:
    toml = tmp_path / "n.toml"
    toml.write_text('engine = "sim"\n')
    with pytest.raises(ConfigError, match=r"engine moved to \[engine\] kind"):
        _node(toml)
    with pytest.raises(ConfigError, match="GPUMESH_NODE_ENGINE__KIND"):
        _node(None, {"GPUMESH_NODE_ENGINE": "sim"})
    assert _node(None, {"GPUMESH_NODE_ENGINE__KIND": "sim"}).engine.kind == "sim"


@pytest.mark.parametrize(("old", "new"), sorted(
    (old, new) for old, new in RouterConfig.RENAMED.items() if "." in old))
def test_a_key_moved_between_sections_is_refused_with_its_place_in_every_layer(
        tmp_path: Path, old: str, new: str) -> None:
    (old_section, key), (new_section, new_key) = old.split("."), new.split(".")
    default = getattr(getattr(RouterConfig(), new_section), new_key)
    value = {bool: "false", float: "0.5"}[type(default)]
    told = rf"\[{old_section}\] {key} moved to \[{new_section}\] {new_key}"
    toml = tmp_path / "r.toml"
    for text in (f"[{old_section}]\n{key} = {value}\n",
                 f"[router.{old_section}]\n{key} = {value}\n"):
        toml.write_text(text)
        with pytest.raises(ConfigError, match=told):
            _router(toml)
    with pytest.raises(ConfigError, match=told + ": set " + _var("GPUMESH_ROUTER_", new)):
        _router(None, {_var("GPUMESH_ROUTER_", old): value})
    with pytest.raises(ConfigError, match=rf"{old}: moved to \[{new_section}\] {new_key}"):
        RouterConfig.build({old_section: {key: value}})
    flag, new_flag = (f"--{w.replace('_', '-')}" for w in (old, new))
    for argv in ([flag, value], [f"--no-{flag[2:]}"]):
        args = build_parser().parse_args(["router", *argv])
        with pytest.raises(ConfigError, match=f"{flag} moved to {new_flag}"):
            cli_values(args.router_cli, args)
    # the new place takes it in every layer
    toml.write_text(f"[{new_section}]\n{new_key} = {value}\n")
    want = _get(RouterConfig.build({new_section: {new_key: value}}), new)
    assert want != default
    assert _get(_router(toml), new) == want
    assert _get(_router(None, {_var("GPUMESH_ROUTER_", new): value}), new) == want
    argv = [f"--no-{new_flag[2:]}"] if isinstance(default, bool) else [new_flag, value]
    args = build_parser().parse_args(["router", *argv])
    assert _get(RouterConfig.load(None, {}, cli_values(args.router_cli, args)), new) == want


def test_component_tables_and_lists(tmp_path: Path) -> None:
    toml = tmp_path / "both.toml"
    toml.write_text('[router.membership]\nlease_ttl_s = 4.0\n'
                    '[node.membership]\nrouters = ["a:1", "b:2"]\n'
                    '[node.engine.engine_args]\nseed = 3\n')
    assert _router(toml).membership.lease_ttl_s == 4.0
    cfg = _node(toml)
    assert cfg.membership.routers == ("a:1", "b:2") and cfg.engine.engine_args == {"seed": 3}
    env = {"GPUMESH_NODE_MEMBERSHIP__ROUTERS": "a:1, b:2"}
    assert _node(None, env).membership.routers == ("a:1", "b:2")
    env = {"GPUMESH_NODE_ENGINE__ENGINE_ARGS": '{"seed": 4}',
           "GPUMESH_NODE_LORA__ADAPTERS": "a=/x,b=/y"}
    assert _node(None, env).engine.engine_args == {"seed": 4}
    assert _node(None, env).lora.adapters == {"a": "/x", "b": "/y"}


def test_secrets_from_the_shared_variables_below_the_prefixed_one() -> None:
    assert _node(None, {"GPUMESH_TICKET_SECRET": "s"}).security.ticket_secret == "s"
    assert _node(None, {"GPUMESH_JOIN_TOKEN": "j"}).security.join_token == "j"
    env = {"GPUMESH_TICKET_SECRET": "s", "GPUMESH_ROUTER_SECURITY__TICKET_SECRET": "r"}
    cfg = _router(None, env)
    assert cfg.security.ticket_secret == "r" and "'r'" not in repr(cfg)


def test_flags_short_and_sectioned_repeat_for_lists() -> None:
    args = build_parser().parse_args(
        ["node", "--router", "a:1", "--membership.routers", "b:2,c:3", "--port", "9",
         "--engine", "sim", "--serving.frontends", "1", "--enforce-eager"])
    cfg = load_node_config(None, cli_values(args.node_cli, args), {})
    assert cfg.membership.routers == ("a:1", "b:2", "c:3") and cfg.serving.port == 9
    assert cfg.engine.kind == "sim" and cfg.engine.enforce_eager is True


def test_secrets_are_not_flags() -> None:
    args = build_parser().parse_args(["node", "--security.join-token", "x"])
    with pytest.raises(ConfigError, match="security.join_token: not accepted as a flag"):
        cli_values(args.node_cli, args)


@pytest.mark.parametrize("cls", [RouterConfig, NodeConfig])
def test_key_names_are_unique_across_sections(cls) -> None:
    keys = [k for section in cls.model_fields.values()
            for k in section.annotation.model_fields]
    assert len(keys) == len(set(keys))
    assert nest(cls, {keys[0]: None, keys[-1]: None}).keys() <= cls.model_fields.keys()
    assert set(section_of(cls)) >= set(keys)


def test_compose_variables_with_the_prefix_are_not_settings() -> None:
    cfg = _router(None, {"GPUMESH_ROUTER_PUBLISH": "127.0.0.1:"})
    assert cfg.model_dump(exclude={"serving": {"router_id"}}) == \
        RouterConfig().model_dump(exclude={"serving": {"router_id"}})

"""The one configuration loader for the router and the node, on pydantic-settings.

A configuration is a frozen :class:`Settings` (``RouterConfig``, ``NodeConfig``) made of
sections: frozen pydantic models, each declared by the package that uses it, whose fields carry
their defaults, ranges (``Field(gt=0)``) and descriptions. Layers, each over the one before:

1. the declared defaults;
2. a TOML file (``--config``): sections as tables, ``[dispatch]``; the whole configuration may
   also sit in a ``[router]`` / ``[node]`` table (``[router.dispatch]``), so one file can hold
   both;
3. the environment: ``<PREFIX><SECTION>__<KEY>`` (``GPUMESH_ROUTER_DISPATCH__MAX_ATTEMPTS=3``),
   plus a few named aliases (``GPUMESH_TICKET_SECRET``);
4. command-line flags: ``--<section>.<key-with-dashes>`` (``--dispatch.max-attempts 3``), plus
   the short flags a configuration declares (``--port``).

The same rules hold in every layer: an unknown key is an error that names it (a key of the old
flat layout names its section: "max_attempts moved to [dispatch] max_attempts"; a key that moved
between sections, declared in ``RENAMED``, names its new place: "[routing] kv_hard_threshold
moved to [membership] kv_hard_threshold"); a value out of
range or of the wrong type is an error that names ``section.key``; booleans read true/false,
1/0, yes/no, on/off; lists are TOML arrays, or comma-separated (``a:1,b:2``) in the environment
and on the command line, where a flag may also repeat; tables (``engine_args``) are TOML
tables, or a JSON object / ``k=v,k=v`` in the environment and on the command line.

Who calls it: ``gpumesh.router.config`` and ``gpumesh.node.config`` (their ``load`` helpers),
``gpumesh.cli`` (:func:`add_cli`), and tests/test_docs.py (:func:`documented_keys`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_settings import (BaseSettings, CliSettingsSource, EnvSettingsSource, NoDecode,
                               PydanticBaseSettingsSource, SettingsConfigDict, SettingsError,
                               TomlConfigSettingsSource)
from pydantic_settings.sources.utils import parse_env_vars

SECTION = ConfigDict(frozen=True, extra="forbid")
"""The model_config of every section: immutable, and an unknown key is an error."""


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names it."""


def _comma_list(value: Any) -> Any:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        return tuple(p.strip() for item in value for p in str(item).split(",") if p.strip())
    return value


def key_values(value: Any) -> Any:
    """A table from a JSON object or ``k=v,k=v`` text; anything else as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        return json.loads(text)
    out: dict[str, str] = {}
    for item in (p for p in text.split(",") if p.strip()):
        name, sep, val = item.partition("=")
        if not sep:
            raise ValueError(f"entries must be NAME=VALUE, got {item!r}")
        out[name.strip()] = val.strip()
    return out


StrList = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_comma_list)]
"""A list of strings: a TOML array, or comma-separated (a flag may also repeat)."""

KeyValues = Annotated[dict[str, Any], NoDecode, BeforeValidator(key_values)]
"""A table: a TOML table, or a JSON object / ``k=v,k=v``."""


class Settings(BaseSettings):
    """Base of ``RouterConfig`` and ``NodeConfig``: every field is a section (a frozen model).

    Building one directly (``RouterConfig(dispatch={"max_attempts": 3})``, as tests do) reads
    nothing else; :meth:`load` adds the file, the environment and the flags."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", env_nested_delimiter="__",
                                      cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_hide_none_type=True, cli_avoid_json=True)

    ENV_PREFIX: ClassVar[str] = ""
    TOML_TABLE: ClassVar[str] = ""
    OTHER_TABLES: ClassVar[tuple[str, ...]] = ()   # tables for the other component, skipped
    ENV_ALIASES: ClassVar[dict[str, str]] = {}     # "section.key" -> extra variable, below ours
    SHORT_FLAGS: ClassVar[dict[str, str | list[str]]] = {}   # "section.key" -> --short name(s)
    # a key's former name -> "section.key": a name outside any section (node: "engine"), or a
    # former "section.key" (a key moved between sections), refused with its new place
    RENAMED: ClassVar[dict[str, str]] = {}
    ENV_NOT_SETTINGS: ClassVar[tuple[str, ...]] = ()   # variables with the prefix that are not

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)   # the layers come from load(), explicitly

    @classmethod
    def load(cls, file: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None,
             cli: Mapping[str, Any] | None = None) -> Self:
        """defaults < TOML ``file`` < ``env`` (default: the process's environment) < ``cli``
        (the nested values :func:`cli_values` returns). ConfigError names the key that fails."""
        environ = os.environ if env is None else env
        values: dict[str, Any] = {}
        if file:
            _merge(values, _toml_values(cls, Path(file)))
        _merge(values, _env_values(cls, environ))
        _merge(values, dict(cli or {}))
        return cls.build(values)

    @classmethod
    def build(cls, values: Mapping[str, Any]) -> Self:
        """``values`` (nested by section) validated; ConfigError names each bad key."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            raise ConfigError(describe(exc, cls)) from None

    def replace(self, **sections: Mapping[str, Any]) -> Self:
        """A copy with some keys of some sections changed, validated again:
        ``cfg.replace(serving={"router_id": "r1"})``."""
        values = self.model_dump()
        for name, changes in sections.items():
            if name not in type(self).model_fields:
                raise ConfigError(f"{name}: unknown section")
            values[name] = {**values[name], **changes}
        return type(self).build(values)


def sections(cls: type[Settings]) -> dict[str, type[BaseModel]]:
    """Section name -> its model, in declaration order."""
    return {name: f.annotation for name, f in cls.model_fields.items()}  # type: ignore[misc]


def section_of(cls: type[Settings]) -> dict[str, str]:
    """A key's own name -> "section.key" (key names are unique across a configuration's
    sections), plus the names in ``cls.RENAMED`` that a key had outside any section."""
    out = {key: f"{name}.{key}" for name, model in sections(cls).items()
           for key in model.model_fields}
    out.update((old, new) for old, new in cls.RENAMED.items() if "." not in old)
    return out


def nest(cls: type[Settings], flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Keys named by their own names (unique across a configuration's sections) grouped by
    section: ``{"max_attempts": 3}`` -> ``{"dispatch": {"max_attempts": 3}}``; a section's name
    takes a table (a mapping, JSON object or ``k=v,k=v``). For tools that take loose
    ``KEY=VALUE`` settings (the benchmark's fleet files, test helpers)."""
    where = section_of(cls)
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key in cls.model_fields and key not in where:
            out.setdefault(key, {}).update(key_values(value))
            continue
        if key not in where:
            raise ConfigError(f"{key}: unknown key")
        section, name = where[key].split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def documented_keys(cls: type[Settings]) -> list[tuple[str, str, Any]]:
    """Every configuration key as ("section.key", description, default), in declaration order
    (docs/configuration.md lists every one; tests/test_docs.py compares the two)."""
    out = []
    for name, model in sections(cls).items():
        for key, f in model.model_fields.items():
            default = (f.default_factory() if f.default_factory   # type: ignore[call-arg]
                       else f.default)
            out.append((f"{name}.{key}", f.description or "", default))
    return out


def describe(exc: ValidationError, cls: type[Settings] | None = None) -> str:
    """One line per problem, each naming ``section.key``; an unknown key that ``cls`` declares
    moved (``RENAMED``) names its new place."""
    lines = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"] if not isinstance(p, int)) or "config"
        ctx = e.get("ctx") or {}
        kind = e["type"]
        if kind == "extra_forbidden":
            new = _new_place(cls, where) if cls else None
            msg = f"moved to [{new.replace('.', '] ', 1)}" if new else "unknown key"
        elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
                  "less_than": "<"}[kind]
            bound = next(iter(ctx.values()))
            msg = f"must be {op} {bound}, got {e['input']!r}"
        elif kind == "value_error":
            msg = str(ctx.get("error", e["msg"]))
        else:
            msg = f"{e['msg']}, got {e['input']!r}" if "input" in e else e["msg"]
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def _merge(into: dict[str, Any], more: Mapping[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _new_place(cls: type[Settings], key: str) -> str | None:
    """The "section.key" of a key given by a former name: a name outside any section (a key's
    own name, or one in ``cls.RENAMED``), or a former "section.key" declared in RENAMED."""
    return cls.RENAMED.get(key) if "." in key else section_of(cls).get(key)


def _moved(cls: type[Settings], key: str) -> str | None:
    where = _new_place(cls, key)
    if where is None:
        return None
    section, new = where.split(".", 1)
    old = "[{}] {}".format(*key.split(".", 1)) if "." in key else key
    return f"{old} moved to [{section}] {new}"


def _toml_values(cls: type[Settings], path: Path) -> dict[str, Any]:
    data = dict(TomlConfigSettingsSource(cls, toml_file=path)())   # startup only
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    names = sections(cls)
    for table in cls.OTHER_TABLES:
        if isinstance(data.get(table), dict):
            data.pop(table)
    if isinstance(data.get(cls.TOML_TABLE), dict) and cls.TOML_TABLE not in names:
        inner = data.pop(cls.TOML_TABLE)
        _merge(data, inner)
    problems = []
    for key, value in data.items():
        if key in names:
            if not isinstance(value, dict):
                problems.append(f"{key} must be a table ([{key}])" if key not in section_of(cls)
                                else _moved(cls, key))
                continue
            for inner_key in value:
                if inner_key not in names[key].model_fields:
                    where = section_of(cls).get(inner_key)
                    problems.append(_moved(cls, f"{key}.{inner_key}") or (
                        f"[{key}] {inner_key}: unknown key" if where is None else
                        f"[{key}] {inner_key}: belongs in [{where.split('.')[0]}]"))
        else:
            problems.append(_moved(cls, key) or f"{key}: unknown key")
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(str(p) for p in problems))
    return data


class _Environ(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (tests pass their own)."""

    def __init__(self, cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(cls, env_prefix=cls.ENV_PREFIX, env_nested_delimiter="__",
                         case_sensitive=False)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, False, False, None)


def _env_values(cls: type[Settings], environ: Mapping[str, str]) -> dict[str, Any]:
    names = sections(cls)
    prefix = cls.ENV_PREFIX
    problems = []
    for var in environ:
        if not var.upper().startswith(prefix) or var.upper() in cls.ENV_NOT_SETTINGS:
            continue
        name = var[len(prefix):].lower()
        parts = name.split("__")
        if len(parts) == 2 and parts[0] in names and parts[1] in names[parts[0]].model_fields:
            continue
        old = ".".join(parts) if len(parts) == 2 else name
        moved, where = _moved(cls, old), _new_place(cls, old)
        if moved and where:
            section, key = where.split(".", 1)
            problems.append(f"{var}: {moved}: set {prefix}{section.upper()}__{key.upper()}")
        elif name in names:
            problems.append(f"{var}: one variable per key: {var}__<KEY>")
        else:
            problems.append(f"{var}: unknown setting")
    if problems:
        raise ConfigError("; ".join(problems))
    values: dict[str, Any] = {}
    for where, var in cls.ENV_ALIASES.items():
        if environ.get(var):
            section, key = where.split(".", 1)
            values.setdefault(section, {})[key] = environ[var]
    try:
        _merge(values, _Environ(cls, environ)())
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    return values


def add_cli(parser: argparse.ArgumentParser, cls: type[Settings]) -> CliSettingsSource:
    """Adds ``--config`` and one ``--section.key`` flag per key (plus ``cls.SHORT_FLAGS``) to
    ``parser``, through pydantic-settings' CLI source; pass the parsed arguments to
    :func:`cli_values`."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file "
                        "(docs/configuration.md); the environment and flags override it")
    shortcuts = {where.replace("_", "-"): names for where, names in cls.SHORT_FLAGS.items()}
    source = CliSettingsSource(cls, root_parser=parser, cli_shortcuts=shortcuts)
    for old in (old for old in cls.RENAMED if "." in old):   # refused in cli_values
        flag = old.replace("_", "-")
        parser.add_argument(f"--{flag}", f"--no-{flag}", dest=old, nargs="?", const="",
                            help=argparse.SUPPRESS)
    return source


def cli_values(source: CliSettingsSource, args: argparse.Namespace) -> dict[str, Any]:
    """The keys given on the command line, nested by section (for :meth:`Settings.load`)."""
    cls: type[Settings] = source.settings_cls   # type: ignore[assignment]
    given = vars(args)
    moved = {old: new for old, new in cls.RENAMED.items() if "." in old}
    given_moved = [f"--{old.replace('_', '-')} moved to --{new.replace('_', '-')}"
                   for old, new in moved.items() if given.get(old) is not None]
    if given_moved:
        raise ConfigError("; ".join(given_moved))
    ns = {k: v for k, v in given.items()
          if ("." in k or k in cls.model_fields) and k not in moved}
    for old, where in cls.RENAMED.items():
        # a short flag named like its section (node --engine sim): the section's own flag
        # (a JSON object) owns the name, so a plain value goes to the renamed key
        if isinstance(given.get(old), str) and not given[old].lstrip().startswith("{"):
            ns[where] = ns.pop(old)
    try:
        values = dict(source(parsed_args=ns)())
    except SettingsError as exc:   # e.g. a section flag (--routing) given no JSON object
        raise ConfigError(f"{exc} (a section flag takes a JSON object; one key: "
                          "--SECTION.KEY VALUE)") from None
    for section, keys in values.items():
        for key in keys:
            if key in _SECRETS:
                raise ConfigError(f"{section}.{key}: not accepted as a flag (a command line is "
                                  "visible to every user of the machine); set it in the file or "
                                  "the environment")
    return values


_SECRETS = ("join_token", "ticket_secret")

"""The one configuration loader for the router and the node.

Layers, each over the one before: the dataclass's defaults < a TOML file < the environment
(``<PREFIX><FIELD>``, upper case) < command-line flags (``--field-name``). The same parsing
rules apply to every layer:

- an unknown key (in the file or in ``overrides``) is an error that names it;
- booleans: true/false, 1/0, yes/no, on/off (any case); anything else is an error;
- int / float / str: Python's own conversion; a value that does not convert is an error that
  names the key;
- ``tuple[str, ...]``: a TOML array, or a comma-separated string (``a:1,b:2``); a flag may be
  repeated and each value may itself be comma-separated;
- mappings and settings sections (pydantic models such as ``RouterConfig.routing``): a TOML
  table, or in the environment and on the command line a JSON object or ``k=v,k=v``.

Who calls it: ``gpumesh.router.config`` and ``gpumesh.node.config`` (their ``load`` helpers)
and the CLI through :func:`add_flags` / :func:`flag_overrides`.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ValidationError

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names it."""


def load_config(cls: type[T], *, file: str | os.PathLike[str] | None = None, env_prefix: str,
                environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, table: str | None = None,
                env_aliases: Mapping[str, str] | None = None) -> T:
    """An instance of the frozen dataclass ``cls`` from the layers above.

    ``table``: an optional TOML table of that name is read like the top level (so one file can
    hold ``[router]`` and ``[node]``); ``env_aliases``: extra environment variables per field
    name (e.g. ``{"ticket_secret": "GPUMESH_TICKET_SECRET"}``), below the prefixed variable.
    ``overrides`` entries that are None are ignored (argparse's "not given")."""
    environ = os.environ if environ is None else environ
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if file:
        values.update(_read_toml(Path(file), names, table))
    for name, var in (env_aliases or {}).items():
        if environ.get(var):
            values[name] = environ[var]
    for name in names:
        var = f"{env_prefix}{name.upper()}"
        if var in environ:
            values[name] = environ[var]
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(given) - names
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s): {', '.join(sorted(unknown))}")
    values.update(given)
    return cls(**{k: coerce(hints[k], k, v) for k, v in values.items()})


def _read_toml(path: Path, names: set[str], table: str | None) -> dict[str, Any]:
    with open(path, "rb") as fh:  # startup only, before any event loop serves
        data = tomllib.load(fh)
    if table and table not in names and isinstance(data.get(table), dict):
        inner = data.pop(table)
        data.update(inner)
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(sorted(unknown))}")
    return data


def coerce(tp: Any, key: str, value: Any) -> Any:
    """``value`` (from TOML, the environment or a flag) as type ``tp``; ConfigError names
    ``key`` when it does not convert."""
    origin = get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        if tp in (int, float, str):
            if tp is not str and isinstance(value, bool):
                raise ConfigError(f"{key} must be a number, got {value!r}")
            return tp(value)
        if origin is tuple:
            items = [value] if isinstance(value, str) else list(value)
            return tuple(p.strip() for item in items for p in str(item).split(",") if p.strip())
        if origin is Mapping or origin is dict:
            return _mapping(key, value)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            # a settings section (e.g. RouterConfig.routing): a TOML table, or k=v,... / JSON
            return tp.model_validate(value if isinstance(value, tp) else _mapping(key, value))
        if (args := get_args(tp)) and type(None) in args:  # Optional[X]
            inner = [a for a in args if a is not type(None)][0]
            return None if value is None else coerce(inner, key, value)
    except ValidationError as exc:
        problems = "; ".join(f"{key}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigError(problems) from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{key}: cannot read {value!r} as {getattr(tp, '__name__', tp)}") from exc
    return value


def _mapping(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    text = str(value).strip()
    if text.startswith("{"):
        parsed = json.loads(text)
        if not isinstance(parsed, dict):
            raise ConfigError(f"{key} must be a JSON object, got {value!r}")
        return parsed
    out: dict[str, Any] = {}
    for item in (p for p in text.split(",") if p.strip()):
        name, sep, val = item.partition("=")
        if not sep:
            raise ConfigError(f"{key} entries must be NAME=VALUE, got {item!r}")
        out[name.strip()] = val.strip()
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
              aliases: Mapping[str, tuple[str, ...]] | None = None, what: str = "") -> None:
    """One ``--field-name`` flag per field of ``cls`` (default None = not given), except
    ``skip``; ``aliases`` adds more option strings for a field (``{"routers": ("--router",)}``).
    Tuple fields may repeat."""
    hints = get_type_hints(cls)
    aliases = aliases or {}
    for f in fields(cls):
        if f.name in skip:
            continue
        tp = hints[f.name]
        default = f.default if f.default is not MISSING else "computed"
        opts = ["--" + f.name.replace("_", "-"), *aliases.get(f.name, ())]
        kwargs: dict[str, Any] = {"dest": f.name, "default": None,
                                  "help": f"{what} {f.name} (default {default!r})".strip()}
        if get_origin(tp) is tuple:
            kwargs["action"] = "append"
        elif tp is bool:   # "--insecure" alone means true; "--insecure false" still works
            kwargs.update(nargs="?", const="true")
        parser.add_argument(*opts, **kwargs)


def flag_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (see :func:`add_flags`)."""
    ns = vars(args)
    return {f.name: ns[f.name] for f in fields(cls) if ns.get(f.name) is not None}


def documented_keys(cls: type) -> list[str]:
    """The configuration keys of ``cls``, in declaration order (docs/configuration.md lists
    every one; a test compares the two)."""
    return [f.name for f in fields(cls)]

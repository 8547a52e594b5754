"""Fleets for the simulator: built-in ones and the TOML format.

A fleet is a list of nodes, each a ``SimEngineConfig`` (speed, KV capacity, batch limits,
calibrated shape) plus the capacity weight it declares, and the routers' settings.

TOML (every key optional except ``[[group]]``)::

    name = "my-fleet"
    shape = "0.5b-h200"        # SimEngineConfig.for_shape: 0.5b, 7b, 0.5b-h200, 7b-h200
    routers = 1                # routers, each request to one of them (round robin)
    heartbeat_interval_s = 0.25
    network_delay_s = 0.0005   # one way, router <-> node, every message

    [engine]                   # SimEngineConfig fields for every node
    max_num_seqs = 32
    kv_capacity_tokens = 8192

    [router]                   # RouterConfig fields (routing as a table)
    kv_hard_threshold = 0.9

    [pd]                       # disaggregated serving (pools.py): the KV link and the rule
    link_gbytes_per_s = 25.0   # link bandwidth, GB/s (1e9 bytes)
    link_latency_ms = 1.0      # fixed cost of one transfer
    min_prompt_tokens = 256    # shorter prompts are served whole
    stall_weight = 0.1

    [[group]]
    count = 4
    role = "both"              # "both" (whole requests), "prefill" or "decode"
    speed = 1.0                # GPU speed factor
    weight = 1.0               # declared capacity weight (default: speed)
    kv_capacity_tokens = 8192  # any SimEngineConfig field overrides [engine] for the group

Inline (``parse_inline``): ``COUNTxROLE:SHAPE[:FIELD=VALUE...]`` groups joined by commas, e.g.
``2xprefill:7b-h200,2xdecode:7b-h200`` or ``4x7b-h200`` (role ``both``); each node runs its
shape's profile as it is (its own KV, batch limits and context), ``FIELD=VALUE`` overriding
a SimEngineConfig field (``max_context_length=33792``).

Built-in fleets (``BUILTIN``): ``homo`` (8 x speed 1), ``hetero-speed`` (speeds
1,1,1,1,2,2,0.5,0.5, equal KV), ``hetero-kv`` (8 x speed 1, KV 0.5x/1x/2x), ``hetero-kvspeed``
(the hetero-speed speeds, KV in proportion to speed), ``large`` (1,024 nodes, the
hetero-speed mix x 128). Engine defaults: the ``0.5b-h200`` shape, ``max_num_seqs`` 32,
8,192 KV tokens per speed-1 node, context 4,096 (the live policy comparison's nodes).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh_bench.sim.pools import ROLES, KvLink, PdRule
from gpumesh_bench.sim.serving import ServingCosts

HETERO_SPEEDS = (1, 1, 1, 1, 2, 2, 0.5, 0.5)
ENGINE_DEFAULTS: dict[str, Any] = {"max_num_seqs": 32, "kv_capacity_tokens": 8192,
                                   "max_context_length": 4096}


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    engine: SimEngineConfig
    weight: float
    role: str = "both"   # "both", "prefill", "decode" (pools.py)


@dataclass(frozen=True)
class FleetSpec:
    name: str
    nodes: tuple[NodeSpec, ...]
    routers: int = 1
    heartbeat_interval_s: float = 0.25
    network_delay_s: float = 0.0005
    router: dict[str, Any] = field(default_factory=dict)   # RouterConfig overrides
    link: KvLink = KvLink()      # prefill -> decode KV transfers
    pd_rule: PdRule = PdRule()   # when a request is disaggregated
    serving: ServingCosts | None = None   # the router and node front ends as queues

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a fleet needs at least one node")
        if self.routers < 1 or self.heartbeat_interval_s <= 0 or self.network_delay_s < 0:
            raise ValueError("routers >= 1, heartbeat_interval_s > 0, network_delay_s >= 0")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids must be unique")
        roles = {n.role for n in self.nodes}
        if roles - set(ROLES):
            raise ValueError(f"unknown role(s) {sorted(roles - set(ROLES))}; roles: {ROLES}")
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("a fleet with prefill nodes needs decode nodes and vice versa")
        if "prefill" in roles and any(n.engine.kv_bytes_per_token <= 0 for n in self.nodes
                                      if n.role != "both"):
            raise ValueError("prefill and decode nodes need kv_bytes_per_token > 0 (the "
                             "engine profile's kv.bytes_per_token)")

    @property
    def disaggregated(self) -> bool:
        """True when the fleet has prefill and decode pools."""
        return any(n.role == "prefill" for n in self.nodes)

    @property
    def fastest(self) -> str:
        return max(self.nodes, key=lambda n: n.engine.speed).node_id


_ENGINE_FIELDS = {f.name for f in fields(SimEngineConfig)}


def _engine(shape: str, base: dict[str, Any], group: dict[str, Any]) -> SimEngineConfig:
    merged = {**base, **{k: v for k, v in group.items() if k in _ENGINE_FIELDS}}
    unknown = set(base) - _ENGINE_FIELDS
    if unknown:
        raise ValueError(f"unknown engine setting(s) {sorted(unknown)}")
    # time_scale 1: the simulator's clock is the engine's simulated clock
    return SimEngineConfig.for_shape(shape, **{**merged, "time_scale": 1.0,
                                               "prefix_caching": merged.get("prefix_caching",
                                                                            True)})


def from_dict(d: dict[str, Any], name: str = "fleet") -> FleetSpec:
    """A fleet from the TOML format's dict (module docstring)."""
    shape = str(d.get("shape", "0.5b-h200"))
    base = {**ENGINE_DEFAULTS, **dict(d.get("engine", {}))}
    groups = d.get("group")
    if not isinstance(groups, list) or not groups:
        raise ValueError("a fleet needs [[group]] tables")
    nodes: list[NodeSpec] = []
    for gi, g in enumerate(groups):
        g = dict(g)
        count = int(g.pop("count", 1))
        role = str(g.pop("role", "both"))
        weight = g.pop("weight", None)
        prefix = str(g.pop("prefix", f"g{gi}"))
        extra = set(g) - _ENGINE_FIELDS
        if extra:
            raise ValueError(f"unknown group setting(s) {sorted(extra)}")
        if count < 1:
            raise ValueError("group count must be >= 1")
        eng = _engine(shape, base, g)
        w = float(weight) if weight is not None else eng.speed
        for i in range(count):
            nodes.append(NodeSpec(f"{prefix}-{i:04d}-x{eng.speed:g}".replace(".", "p"), eng, w,
                                  role))
    router = dict(d.get("router", {}))
    link, rule = pd_settings(dict(d.get("pd", {})))
    return FleetSpec(str(d.get("name", name)), tuple(nodes), int(d.get("routers", 1)),
                     float(d.get("heartbeat_interval_s", 0.25)),
                     float(d.get("network_delay_s", 0.0005)), router, link, rule)


def pd_settings(pd: dict[str, Any]) -> tuple[KvLink, PdRule]:
    """The ``[pd]`` table (module docstring) as the link and the rule."""
    unknown = set(pd) - {"link_gbytes_per_s", "link_latency_ms", "min_prompt_tokens",
                         "stall_weight"}
    if unknown:
        raise ValueError(f"unknown [pd] setting(s) {sorted(unknown)}")
    link = KvLink(float(pd.get("link_gbytes_per_s", 25.0)) * 1e9,
                  float(pd.get("link_latency_ms", 1.0)) / 1000)
    return link, PdRule(int(pd.get("min_prompt_tokens", 256)),
                        float(pd.get("stall_weight", 0.1)))


_INLINE = re.compile(r"^(\d+)x(?:(both|prefill|decode):)?([A-Za-z0-9_.\-]+)((?::[a-z_]+=[^:,]+)*)$")


def parse_inline(spec: str) -> FleetSpec:
    """A fleet written inline (module docstring), e.g. ``2xprefill:7b-h200,2xdecode:7b-h200``;
    ValueError naming the bad part."""
    groups = []
    for gi, part in enumerate(x.strip() for x in spec.split(",")):
        m = _INLINE.match(part)
        if m is None:
            raise ValueError(f"fleet group {part!r}: expected COUNTxROLE:SHAPE[:FIELD=VALUE...]"
                             f" (roles {', '.join(ROLES)})")
        count, role, shape, extra = int(m[1]), m[2] or "both", m[3], m[4]
        over: dict[str, Any] = {}
        for item in filter(None, extra.split(":")):
            k, _, v = item.partition("=")
            if k not in _ENGINE_FIELDS:
                raise ValueError(f"fleet group {part!r}: unknown engine field {k!r}")
            try:
                over[k] = json.loads(v)
            except ValueError:
                over[k] = v
        eng = SimEngineConfig.for_shape(shape, **{**over, "time_scale": 1.0})
        groups += [NodeSpec(f"{role[0]}{gi}-{i:04d}", eng, eng.speed, role)
                   for i in range(count)]
    if not groups:
        raise ValueError("an inline fleet needs at least one group")
    return FleetSpec(spec, tuple(groups))


def load(path: str | Path) -> FleetSpec:
    p = Path(path)
    with open(p, "rb") as f:
        return from_dict(tomllib.load(f), p.stem)


def _speeds(name: str, speeds: tuple[float, ...], kv_grows: bool = False,
            kvs: tuple[float, ...] = ()) -> FleetSpec:
    groups = []
    for i, s in enumerate(speeds):
        kv_factor = kvs[i] if kvs else (s if kv_grows else 1.0)
        groups.append({"count": 1, "speed": float(s), "prefix": f"n{i:02d}",
                       "kv_capacity_tokens": int(ENGINE_DEFAULTS["kv_capacity_tokens"]
                                                 * kv_factor) // 16 * 16})
    return from_dict({"name": name, "group": groups})


def builtin(name: str) -> FleetSpec:
    if name == "homo":
        return _speeds(name, (1,) * 8)
    if name == "hetero-speed":
        return _speeds(name, HETERO_SPEEDS)
    if name == "hetero-kvspeed":
        return _speeds(name, HETERO_SPEEDS, kv_grows=True)
    if name == "hetero-kv":
        return _speeds(name, (1,) * 8, kvs=(0.5, 0.5, 1, 1, 1, 1, 2, 2))
    if name == "large":
        groups = [{"count": 128 * HETERO_SPEEDS.count(s), "speed": float(s),
                   "prefix": f"s{s:g}"} for s in sorted(set(HETERO_SPEEDS))]
        return from_dict({"name": name, "group": groups})
    raise ValueError(f"unknown fleet {name!r}; built in: {', '.join(BUILTIN)} (or a .toml)")


BUILTIN = ("homo", "hetero-speed", "hetero-kv", "hetero-kvspeed", "large")
HETEROGENEOUS = ("hetero-speed", "hetero-kv", "hetero-kvspeed", "large")


def resolve(name_or_path: str) -> FleetSpec:
    """A built-in fleet's name, a TOML file's path or an inline fleet (``parse_inline``)."""
    if name_or_path.endswith(".toml") or Path(name_or_path).is_file():
        return load(name_or_path)
    if _INLINE.match(name_or_path.split(",")[0].strip()):
        return parse_inline(name_or_path)
    return builtin(name_or_path)


def with_pd(f: FleetSpec, link: KvLink | None = None, rule: PdRule | None = None) -> FleetSpec:
    """``f`` with another KV link and / or disaggregation rule."""
    return replace(f, link=link or f.link, pd_rule=rule or f.pd_rule)


def with_router(f: FleetSpec, **overrides: Any) -> FleetSpec:
    return replace(f, router={**f.router, **overrides})


def router_settings(items: list[str]) -> dict[str, Any]:
    """``--router KEY=VALUE`` items (``gpumesh sim grid``, ``gpumesh bench prefix-sim``) as
    RouterConfig overrides; values read as JSON where they parse (numbers, true/false), else
    as strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--router wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out

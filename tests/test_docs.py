"""The user documentation stays true to the code: every configuration key is documented, the
example configs load through the real loaders, relative links resolve, and the docs speak of
the product, not of how it was measured into shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpumesh.config import documented_keys
from gpumesh.node.config import NodeConfig, load_node_config
from gpumesh.router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG_DOC = DOCS / "configuration.md"
EXAMPLES = ROOT / "deploy" / "examples"

# The documents this test holds to the product-only wording (the benchmark documents are
# measurement records by design).
USER_DOCS = ("README.md", "docs/architecture.md", "docs/configuration.md",
             "docs/operations.md", "docs/routing.md", "docs/tracing.md")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    """The text of the level-2 section ``## heading`` up to the next level-2 heading."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/configuration.md has no '## {heading}' section"
    return m.group(1)


def _rows(section: str) -> dict[str, list[str]]:
    """The section's table rows that start with | `section.key` |: key -> its cells."""
    out = {}
    for m in re.finditer(r"^\|\s*`([a-z0-9_]+\.[a-z0-9_]+)`\s*\|(.*)\|\s*$", section, re.M):
        out[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return out


def _shown(default: object) -> str:
    """A default as the Default column writes it."""
    if isinstance(default, bool):
        return "`true`" if default else "`false`"
    if isinstance(default, str):
        return f'`"{default}"`'
    if isinstance(default, (tuple, list, dict)):
        return f"`{json.dumps(list(default) if isinstance(default, tuple) else default)}`"
    return f"`{default}`"


CASES = [(RouterConfig, "Router", "GPUMESH_ROUTER_", "router"),
         (NodeConfig, "Node", "GPUMESH_NODE_", "node")]


@pytest.mark.parametrize(("cls", "heading", "prefix", "command"), CASES)
def test_every_config_key_is_documented_with_its_default(cls, heading: str, prefix: str,
                                                         command: str) -> None:
    rows = _rows(_section(CONFIG_DOC.read_text(encoding="utf-8"), heading))
    declared = documented_keys(cls)
    missing = [k for k, _, _ in declared if k not in rows]
    assert not missing, f"{cls.__name__} keys missing from docs/configuration.md: {missing}"
    stale = sorted(set(rows) - {k for k, _, _ in declared})
    assert not stale, f"docs/configuration.md documents {cls.__name__} keys that do not exist: {stale}"
    for key, _, default in declared:
        if key == "serving.router_id":
            continue   # random per process: the row says so
        assert rows[key][0] == _shown(default), f"{key}: documented default {rows[key][0]}"


@pytest.mark.parametrize(("cls", "heading", "prefix", "command"), CASES)
def test_documented_env_vars_and_flags_follow_the_rule(cls, heading: str, prefix: str,
                                                       command: str) -> None:
    rows = _rows(_section(CONFIG_DOC.read_text(encoding="utf-8"), heading))
    flags = _subcommand_flags(command)
    for key, _, _ in documented_keys(cls):
        section, name = key.split(".")
        env, flag = rows[key][-2], rows[key][-1]
        assert f"`{prefix}{section.upper()}__{name.upper()}`" in env, f"{key}: env var"
        if name in ("ticket_secret", "join_token"):
            assert f"`GPUMESH_{name.upper()}`" in env and "--" not in flag, key
            continue
        shown = re.findall(r"`(--[a-z][a-z0-9.-]*)`", flag)
        assert f"--{section}.{name.replace('_', '-')}" in shown, f"{key}: flag"
        assert set(shown) <= flags, f"{key}: gpumesh {command} has no flag {set(shown) - flags}"


def _subcommand_flags(name: str) -> set[str]:
    from gpumesh.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    return {o for a in sub.choices[name]._actions for o in a.option_strings}


def test_router_example_loads() -> None:
    cfg = RouterConfig.load(EXAMPLES / "router.toml", env={})
    assert cfg.routing.policy == "predicted_latency"
    assert cfg.routing.objective == "max_slo_attainment"
    assert cfg.serving.port == 50050
    assert cfg.serving.router_id == "router-eu1-a"
    assert cfg.dispatch.queue_bound == 512
    assert cfg.dispatch.max_attempts == 2
    assert cfg.routing.sample_size == 32 and cfg.routing.output_tokens_default == 256
    assert cfg.membership.foreign_nodes == ()


def test_node_example_loads() -> None:
    cfg = load_node_config(EXAMPLES / "node.toml", environ={})
    assert cfg.engine.kind == "vllm"
    assert cfg.serving.node_id == "gpu-node-0"
    assert cfg.membership.routers == ("10.0.0.2:50050", "10.0.0.3:50050")
    assert cfg.engine.aliases == ("qwen-7b",)
    assert cfg.engine.max_model_len == 8192
    assert cfg.engine.enforce_eager is False
    assert cfg.engine.engine_args["enable_prefix_caching"] is True
    assert cfg.resolved_served_name() == "qwen2.5-7b"


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _without_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = _without_code(doc.read_text(encoding="utf-8"))
    broken = []
    for target in [*LINK.findall(text), *IMAGE.findall(text)]:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue   # absolute URL, mailto:, or an anchor in the same document
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
            "twelfth|\\d+(?:st|nd|rd|th)")
FORBIDDEN = [
    (re.compile(r"\bsessions?\b", re.I), "development sessions"),
    (re.compile(r"\bissues?\s*#?\d+", re.I), "issue numbers"),
    (re.compile(rf"\b(?:{ORDINALS})\s+(?:GPU\s+)?(?:round|run|call)s?\b", re.I),
     "numbered measurement rounds"),
    (re.compile(r"\b(?:round|run)\s+#?\d+\b", re.I), "numbered measurement rounds"),
    (re.compile(r"/work/|/home/\w+|/tmp/"), "development machine paths"),
]


@pytest.mark.parametrize("name", USER_DOCS)
def test_user_docs_speak_of_the_product(name: str) -> None:
    text = (ROOT / name).read_text(encoding="utf-8")
    found = [f"{why}: {m.group(0)!r}" for pattern, why in FORBIDDEN
             for m in pattern.finditer(text)]
    assert not found, f"{name} mentions {found}"

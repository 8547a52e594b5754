"""deploy/compose.yaml (+ compose.tls.yaml) and deploy/docker/Dockerfile, checked without a
container engine: the compose files validate against the Compose Specification's JSON schema
(compose-spec.json beside this test: compose-spec/compose-spec schema/compose-spec.json at
commit 170098b, Apache-2.0) and agree with the configuration files they mount; the Dockerfile
builds one image for routers and nodes from the package's wheel with the classic builder as
well as BuildKit, and the wheel builds from exactly what its .dockerignore lets into the build
context. test_smoke.py brings the stack up for real where a container engine runs."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMA = json.loads((Path(__file__).with_name("compose-spec.json")).read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)   # the schema's own draft
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


def merged() -> dict[str, Any]:
    """compose.yaml with compose.tls.yaml on top (Compose's merge: mappings merge, the
    override's scalars and sequences win, ``volumes`` / ``ports`` lists append)."""
    def merge(a: Any, b: Any, key: str = "") -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(a[k], v, k) if k in a else v
            return out
        if isinstance(a, list) and isinstance(b, list) and key in ("volumes", "ports"):
            return a + b
        return copy.deepcopy(b)
    return merge(load("compose.yaml"), load("compose.tls.yaml"))


@pytest.mark.parametrize("doc", ["compose.yaml", "compose.tls.yaml", "merged"])
def test_compose_files_follow_the_compose_specification(doc: str) -> None:
    data = merged() if doc == "merged" else load(doc)
    VALIDATOR.validate(data)


def test_the_schema_catches_a_broken_service() -> None:
    data = load("compose.yaml")
    data["services"]["router"]["comand"] = ["router"]   # a typo'd key
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(data)


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in svc.get("environment", {}).items()}


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host file of a service's bind mounts (relative to deploy/)."""
    out = {}
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = (DEPLOY / src).resolve()
    return out


def test_compose_runs_the_image_and_configs_of_the_manifests() -> None:
    c = load("compose.yaml")
    svcs = c["services"]
    # bind mounts, not `configs:` (Swarm-only in docker-compose 1.x) nor top-level `name:`
    # (docker-compose 1.x rejects it)
    assert "configs" not in c and "name" not in c
    router_mounts = _mounts(svcs["router"])
    assert router_mounts["/etc/gpumesh/router.toml"] == DEPLOY / "kubernetes/base/router.toml"
    router_cfg = tomllib.loads(router_mounts["/etc/gpumesh/router.toml"].read_text())["serving"]
    node_cfg = tomllib.loads((DEPLOY / "kubernetes/base/node.toml").read_text())["serving"]
    nodes = [n for n in svcs if n.startswith("node-")]
    assert len(nodes) >= 2 and svcs["router"]["deploy"]["replicas"] >= 2
    for name in ("router", *nodes):
        s = svcs[name]
        assert s["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert s["command"][0] == ("router" if name == "router" else "node")
        config = s["command"][2]
        assert s["command"][1] == "--config" and _mounts(s)[config].is_file()
        if name != "router":
            assert _mounts(s)[config] == DEPLOY / "kubernetes/base/node.toml"
        assert s["build"]["args"]["BASE_IMAGE"].startswith("${GPUMESH_BASE_IMAGE:-")
    # the router's port is what clients and nodes use
    port = router_cfg["port"]
    assert any(p.endswith(f":{port}") for p in svcs["router"]["ports"])
    assert svcs["router"]["healthcheck"]["test"][1:4] == ["gpumesh", "health",
                                                         f"127.0.0.1:{port}"]
    for name in nodes:
        e = _env(svcs[name])
        # every router replica through the service name, as through the headless Service
        assert e["GPUMESH_NODE_MEMBERSHIP__ROUTERS"] == f"dns:///router:{port}"
        assert e["GPUMESH_NODE_SERVING__NODE_ID"] == name
        assert e["GPUMESH_NODE_SERVING__ADVERTISE_ADDRESS"] == f"{name}:{node_cfg['port']}"
        assert svcs[name]["healthcheck"]["test"][1:4] == ["gpumesh", "health",
                                                         f"127.0.0.1:{node_cfg['port']}"]
        grace = int(svcs[name]["stop_grace_period"].rstrip("s"))
        assert grace > node_cfg["drain_timeout_s"]


def test_tls_profile_uses_gpumesh_certs_for_every_service() -> None:
    m = merged()
    svcs = m["services"]
    certs = " ".join(svcs["certs"]["command"])
    nodes = [n for n in svcs if n.startswith("node-")]
    assert certs.startswith("gpumesh certs /certs")
    for name in nodes:
        assert f"--node {name}" in certs and f"--host {name}" in certs
        e = _env(svcs[name])
        assert e["GPUMESH_NODE_SECURITY__TLS_CERT_FILE"] == f"/certs/{name}.pem"
        assert e["GPUMESH_NODE_SECURITY__INSECURE"] == "false"
        assert e["GPUMESH_NODE_SECURITY__TLS_CA_FILE"]
        control = _env(svcs["router"])["GPUMESH_ROUTER_SERVING__CONTROL_PORT"]
        assert e["GPUMESH_NODE_MEMBERSHIP__ROUTERS"] == f"dns:///router:{control}"
        assert "--tls-ca" in svcs[name]["healthcheck"]["test"]
    assert "--host router" in certs
    e = _env(svcs["router"])
    assert e["GPUMESH_ROUTER_SECURITY__TLS_CERT_FILE"] == "/certs/router.pem"
    assert e["GPUMESH_ROUTER_SECURITY__INSECURE"] == "false"
    for name in ("router", *nodes):
        assert "certs:/certs:ro" in svcs[name]["volumes"]
    assert svcs["router"]["depends_on"]["certs"]["condition"] == "service_completed_successfully"


def _stages(text: str) -> dict[str, str]:
    """Stage name -> its instructions (a FROM line starts one)."""
    out: dict[str, str] = {}
    name = ""
    for line in text.splitlines():
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line)
        if m:
            name = m.group(2) or "final"
            out[name] = ""
        elif name:
            out[name] += line + "\n"
    return out


def test_one_dockerfile_with_cpu_and_cuda_variants_installs_the_wheel() -> None:
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert {"build", "base-sim", "base-cpu", "base-cuda", "final"} <= set(stages)
    assert re.search(r"^FROM base-\$\{VARIANT\}\s*$", text, re.M)
    assert "pip wheel --no-deps" in stages["build"]
    assert 'cpu) extras="[cpu]"' in stages["build"] and 'cuda) extras="[gpu]"' in stages["build"]
    # the classic builder builds every stage: the variant stages only set the environment
    for v in ("sim", "cpu", "cuda"):
        assert "RUN" not in stages[f"base-{v}"]
    final = stages["final"]
    # the runtime stage gets the built environment, never the sources or the wheelhouse
    copies = [ln for ln in final.splitlines() if ln.startswith("COPY")]
    assert copies == ["COPY --from=build /opt/gpumesh /opt/gpumesh"]
    assert "USER 10001" in final and 'ENTRYPOINT ["gpumesh"]' in final
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {"cpu", "gpu"} <= set(extras)


def test_dockerfile_builds_without_buildkit_and_pulls_only_its_base() -> None:
    """Debian's docker.io has no buildx: no BuildKit-only syntax (a `# syntax=` frontend
    image, RUN --mount, heredocs, COPY --chmod/--link), and the only image from outside is
    the BASE_IMAGE build argument (default the official Python image)."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert not re.search(r"--mount|<<\s*[A-Z]|--chmod|--link", text)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.1[1-9][\w.-]*\s*$", text, re.M)
    for stage_from in re.findall(r"^FROM\s+(\S+)", text, re.M):
        assert stage_from in ("${BASE_IMAGE}", "base-${VARIANT}"), stage_from
    build = _stages(text)["build"]
    # OFFLINE=1: pip never contacts an index; the wheelhouse is a folder in the context
    assert "PIP_NO_INDEX=1" in build and "--find-links /wheelhouse" in build
    assert "ARG WHEELHOUSE=deploy/docker/wheelhouse" in build
    assert "sys.version_info" in build and "(3, 11)" in build


def test_dockerfile_copies_only_what_its_build_context_admits() -> None:
    files = _context_files()
    text = DOCKERFILE.read_text()
    sources: list[str] = []
    for line in text.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            sources += line.split()[1:-1]
    sources = [s.replace("${WHEELHOUSE}", "deploy/docker/wheelhouse") for s in sources]
    assert {"pyproject.toml", "gpumesh", "router", "node", "deploy/docker/wheelhouse"} <= set(
        sources)
    for src in sources:
        assert any(f == src or f.startswith(src.rstrip("/") + "/") for f in files), src


def test_registry_images_sit_in_a_profile_off_by_default() -> None:
    """Every service but the mesh's own image (built locally) is in a Compose profile, so a
    plain `up` pulls nothing; nothing the default services need depends on one of them, and
    tracing is off unless its endpoint is given."""
    for doc in (load("compose.yaml"), merged()):
        svcs = doc["services"]
        own = {n for n, s in svcs.items() if s["image"].startswith("${GPUMESH_IMAGE:-gpumesh}")}
        assert {"router", "node-a", "node-b"} <= own
        profiled = {n for n, s in svcs.items() if s.get("profiles")}
        assert set(svcs) - own == profiled and "jaeger" in profiled
        for name in own:
            deps = svcs[name].get("depends_on", [])
            assert not set(deps) & profiled, name
    env = _env(load("compose.yaml")["services"]["router"])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${GPUMESH_OTLP_ENDPOINT:-}"


def _context_files() -> list[str]:
    """Tracked files the Dockerfile's .dockerignore lets into the build context."""
    rules = [ln.strip() for ln in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text()
             .splitlines() if ln.strip() and not ln.startswith("#")]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    keep = []
    for f in files:
        included = True
        for rule in rules:
            neg = rule.startswith("!")
            pat = rule[1:] if neg else rule
            hit = (fnmatch.fnmatch(f, pat) or f.startswith(pat.rstrip("/") + "/")
                   if pat != "**" else True)
            if pat.startswith("**/"):
                hit = fnmatch.fnmatch(f, pat[3:]) or fnmatch.fnmatch(f, pat)
            if hit:
                included = neg
        if included:
            keep.append(f)
    return keep


@pytest.mark.slow
def test_the_wheel_builds_from_the_docker_build_context(tmp_path: Path) -> None:
    files = _context_files()
    assert "pyproject.toml" in files and not any(f.startswith(("tests/", "bench/", "docs/"))
                                                 for f in files)
    ctx = tmp_path / "ctx"
    for f in files:
        (ctx / f).parent.mkdir(parents=True, exist_ok=True)
        (ctx / f).write_bytes((ROOT / f).read_bytes())
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"),
                          str(ctx)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob("gpumesh-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for module in ("gpumesh/cli.py", "gpumesh/router/app.py", "gpumesh/node/app.py",
                   "gpumesh/node/discovery.py", "gpumesh/router/fleet/saturation.py",
                   "gpumesh/v1/control_pb2.py"):
        assert module in names

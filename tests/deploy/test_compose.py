"""deploy/compose.yaml (+ compose.tls.yaml) and deploy/docker/Dockerfile, checked without a
container engine: the compose files validate against the Compose Specification's JSON schema
(compose-spec.json beside this test: compose-spec/compose-spec schema/compose-spec.json at
commit 170098b, Apache-2.0) and agree with the configuration files they mount; the Dockerfile
builds one image for routers and nodes from the package's wheel, and the wheel builds from
exactly what its .dockerignore lets into the build context."""

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


def test_compose_runs_the_image_and_configs_of_the_manifests() -> None:
    c = load("compose.yaml")
    svcs = c["services"]
    configs = {name: (DEPLOY / spec["file"]).resolve() for name, spec in c["configs"].items()}
    assert configs["router-toml"] == (DEPLOY / "kubernetes/base/router.toml").resolve()
    assert configs["node-toml"] == (DEPLOY / "kubernetes/base/node.toml").resolve()
    router_cfg = tomllib.loads(configs["router-toml"].read_text())
    node_cfg = tomllib.loads(configs["node-toml"].read_text())
    nodes = [n for n in svcs if n.startswith("node-")]
    assert len(nodes) >= 2 and svcs["router"]["deploy"]["replicas"] >= 2
    for name in ("router", *nodes):
        s = svcs[name]
        assert s["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert s["command"][0] == ("router" if name == "router" else "node")
        assert s["command"][1:] == ["--config", s["configs"][0]["target"]]
    # the router's port is what clients and nodes use
    port = router_cfg["port"]
    assert any(p.endswith(f":{port}") for p in svcs["router"]["ports"])
    assert svcs["router"]["healthcheck"]["test"][1:4] == ["gpumesh", "health",
                                                         f"127.0.0.1:{port}"]
    for name in nodes:
        e = _env(svcs[name])
        # every router replica through the service name, as through the headless Service
        assert e["GPUMESH_NODE_ROUTERS"] == f"dns:///router:{port}"
        assert e["GPUMESH_NODE_NODE_ID"] == name
        assert e["GPUMESH_NODE_ADVERTISE_ADDRESS"] == f"{name}:{node_cfg['port']}"
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
        assert e["GPUMESH_NODE_TLS_CERT_FILE"] == f"/certs/{name}.pem"
        assert e["GPUMESH_NODE_INSECURE"] == "false" and e["GPUMESH_NODE_TLS_CA_FILE"]
        control = _env(svcs["router"])["GPUMESH_ROUTER_CONTROL_PORT"]
        assert e["GPUMESH_NODE_ROUTERS"] == f"dns:///router:{control}"
        assert "--tls-ca" in svcs[name]["healthcheck"]["test"]
    assert "--host router" in certs
    e = _env(svcs["router"])
    assert e["GPUMESH_ROUTER_TLS_CERT_FILE"] == "/certs/router.pem"
    assert e["GPUMESH_ROUTER_INSECURE"] == "false"
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
    assert {"wheel", "base-sim", "base-cpu", "base-cuda", "final"} <= set(stages)
    assert re.search(r"^FROM base-\$\{VARIANT\}\s*$", text, re.M)
    assert "pip wheel --no-deps" in stages["wheel"]
    assert '"[cpu]"' in stages["base-cpu"] and '"[gpu]"' in stages["base-cuda"]
    final = stages["final"]
    # the runtime stage gets the wheel, never the source folders
    assert "COPY" not in final and "from=wheel" in final and "gpumesh-*.whl" in final
    assert "USER 10001" in final and 'ENTRYPOINT ["gpumesh"]' in final
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {"cpu", "gpu"} <= set(extras)


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

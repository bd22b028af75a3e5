"""The deployment files: Kubernetes overlays render (`kubectl kustomize` where installed, else the
YAML is checked as written) with probes, the GPU request and every ConfigMap/Secret they reference;
the compose file's services, files and scrape targets hang together; the images run as non-root with
a health check; and the configs shipped for both load with the loaders the programs use."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodes.__main__ import load_config as load_node
from router.config import load_config as load_router
from telemetry.process.configfile import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
KUBECTL = shutil.which("kubectl")


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects: rendered by kubectl, or (without it) the base's files as written plus
    the overlay's patches applied by hand to the Deployment they name."""
    if KUBECTL:
        out = subprocess.run(
            [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs = [d for f in base["resources"] for d in yaml.safe_load_all((K8S / "base" / f).read_text()) if d]
    for gen in base.get("configMapGenerator", []):
        docs.append({"kind": "ConfigMap", "metadata": {"name": gen["name"]}})
    for gen in base.get("secretGenerator", []):
        docs.append({"kind": "Secret", "metadata": {"name": gen["name"]}})
    kust = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    for patch in kust.get("patches", []):
        p = yaml.safe_load((K8S / "overlays" / overlay / patch["path"]).read_text())
        target = next(d for d in docs if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"])
        pod = target["spec"]["template"]["spec"]
        for key, val in p["spec"]["template"]["spec"].items():
            if key != "containers":
                pod[key] = val
        for c in p["spec"]["template"]["spec"].get("containers", []):
            mine = next(x for x in pod["containers"] if x["name"] == c["name"])
            mine["image"] = c.get("image", mine["image"])
            mine["env"] = mine.get("env", []) + c.get("env", [])
            mine["resources"] = c.get("resources", mine.get("resources"))
    return docs


def _named(docs: list[dict[str, Any]], kind: str) -> set[str]:
    return {d["metadata"]["name"] for d in docs if d["kind"] == kind}


def _refs(obj: Any, key: str) -> list[str]:
    """Every `name` under a `key` (configMapKeyRef, secretKeyRef, configMap, secret) anywhere in obj."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key and isinstance(v, dict) and "name" in v:
                out.append(v["name"])
            out += _refs(v, key)
    elif isinstance(obj, list):
        for v in obj:
            out += _refs(v, key)
    return out


def _deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_overlay_renders_with_probes_and_references(overlay: str) -> None:
    docs = render(overlay)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {
        "edgeroute-router",
        "edgeroute-router-edge-a",
        "edgeroute-node-edge",
        "edgeroute-node-cloud",
    }
    for d in deployments:
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live", d["metadata"]["name"]
            assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready", d["metadata"]["name"]
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    configmaps, secrets = _named(docs, "ConfigMap"), _named(docs, "Secret")
    for ref in _refs(docs, "configMapKeyRef") + _refs(docs, "configMap"):
        assert ref in configmaps, (ref, configmaps)
    for ref in _refs(docs, "secretKeyRef") + _refs(docs, "secret"):
        assert ref in secrets, (ref, secrets)
    assert _refs(docs, "secretKeyRef"), "telemetry keys come from a Secret"
    # routers: a Service, a PodDisruptionBudget and an HPA on CPU, all on the router pods
    router = _deployment(docs, "edgeroute-router")
    labels = router["spec"]["template"]["metadata"]["labels"]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "edgeroute-router")
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "edgeroute-router"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    # nodes advertise their pod IP
    for pool in ("edge", "cloud"):
        env = {
            e["name"]: e
            for e in _deployment(docs, f"edgeroute-node-{pool}")["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["EDGEROUTE_ENDPOINT"]["value"] == "http://$(POD_IP):8001"
    cloud = _deployment(docs, "edgeroute-node-cloud")["spec"]["template"]["spec"]
    gpu = cloud["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if overlay == "gpu":
        assert gpu == 1 and cloud["containers"][0]["image"].startswith("edgeroute-node-cuda")
        assert any(t["key"] == "nvidia.com/gpu" for t in cloud["tolerations"])
    else:
        assert gpu is None and "nvidia.com/gpu" not in str(docs)
    edge = _deployment(docs, "edgeroute-node-edge")["spec"]["template"]["spec"]
    assert edge["nodeSelector"] and edge["tolerations"], "edge pods go to edge boxes by label and taint"
    # a router per site: on the site's own pool, its clients' site set, its Service keeping them in the site
    site = _deployment(docs, "edgeroute-router-edge-a")["spec"]["template"]["spec"]
    assert site["nodeSelector"] == edge["nodeSelector"], "the site's router stands on the site's boxes"
    env = {e["name"]: e for e in site["containers"][0]["env"]}
    assert env["EDGEROUTE_SITE"]["value"] == "edge-a"
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "edgeroute-router-edge-a")
    assert svc["spec"]["trafficDistribution"] == "PreferClose" and svc["spec"]["externalTrafficPolicy"] == "Local"
    assert (
        svc["spec"]["selector"].items()
        <= _deployment(docs, "edgeroute-router-edge-a")["spec"]["template"]["metadata"]["labels"].items()
    )


def test_shipped_configs_load_as_deployed(tmp_path: Path) -> None:
    secrets = dict(
        line.split("=", 1) for line in (K8S / "base" / "config" / "secrets.env").read_text().split() if "=" in line
    )
    pod_env = {
        "EDGEROUTE_NODE_ID": "edgeroute-node-edge-7d9f-abc12",
        "EDGEROUTE_ENDPOINT": "http://10.0.0.7:8001",
        "EDGEROUTE_ADMIN_TOKEN": secrets["node-admin-token"],
        "EDGEROUTE_INFER_TOKEN": secrets["node-token"],
    }
    for name in ("node-edge.yaml", "node-cloud.yaml"):
        cfg = load_node(str(K8S / "base" / "config" / name), environ={**pod_env, "EDGEROUTE_KAFKA": "k:9092"})
        assert cfg.node_id == pod_env["EDGEROUTE_NODE_ID"] and cfg.kafka == "k:9092" and cfg.admin_token
        assert cfg.infer_token == secrets["node-token"]
        with pytest.raises(ConfigError, match="admin_token is required"):  # listening on 0.0.0.0 unlocked
            load_node(str(K8S / "base" / "config" / name), environ={})
        with pytest.raises(ConfigError, match="infer_token is required"):  # inference open to the network
            load_node(str(K8S / "base" / "config" / name), environ={"EDGEROUTE_ADMIN_TOKEN": "x" * 24})
        load_node(str(DOCKER / name), environ={"EDGEROUTE_ADMIN_TOKEN": "x" * 24, "EDGEROUTE_INFER_TOKEN": "y" * 24})
    env = {
        "EDGEROUTE_KAFKA": "k:9092",
        "EDGEROUTE_TELEMETRY_KEYS": secrets["telemetry-key"],
        "EDGEROUTE_NODE_ADMIN_TOKEN": secrets["node-admin-token"],
        "EDGEROUTE_NODE_TOKEN": secrets["node-token"],
        "EDGEROUTE_AUTH__TOKENS__APP": secrets["client-token"],
        "EDGEROUTE_AUTH__TOKENS__OPS": secrets["admin-token"],
        "EDGEROUTE_PEERS__ROUTER_ID": "r-1",
    }
    cfg = load_router(K8S / "base" / "config" / "router.yaml", environ=env)
    assert cfg.peers.enabled and cfg.peers.router_id == "r-1" and cfg.telemetry_keys and cfg.node_admin_token
    assert cfg.auth is not None and set(cfg.auth.tokens) == {"app", "ops"} and cfg.auth.admin_clients == ["ops"]
    assert cfg.node_token == secrets["node-token"]
    site = load_router(K8S / "base" / "config" / "router-site.yaml", environ={**env, "EDGEROUTE_SITE": "edge-a"})
    assert site.site == "edge-a" and site.policy.preset == "edge_first"
    compose = {"EDGEROUTE_AUTH__TOKENS__APP": "c" * 24, "EDGEROUTE_AUTH__TOKENS__OPS": "o" * 24}
    load_router(DOCKER / "router.yaml", environ=compose)
    compose_site = load_router(DOCKER / "router-site.yaml", environ=compose)
    assert compose_site.site == "edge-b" and len(compose_site.telemetry_sources or []) == 2
    for name in ("router.yaml", "router-site.yaml"):  # listening on 0.0.0.0: no tokens, no router
        with pytest.raises(ConfigError, match="auth"):
            load_router(DOCKER / name, environ={})


def _compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.skipif(_compose() is None, reason="needs docker compose (or docker-compose)")
def test_compose_validates_offline() -> None:
    compose = _compose()
    assert compose is not None
    for profiles in ([], ["--profile", "gpu", "--profile", "loadgen", "--profile", "sites"]):
        out = subprocess.run(
            [*compose, "-f", str(DOCKER / "compose.yaml"), *profiles, "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr


def test_compose_file_hangs_together() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            assert (ROOT / svc["build"]["dockerfile"]).is_file(), name
        for dep in svc.get("depends_on", {}):
            assert dep in services, (name, dep)
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists() or src == "./reports", (name, src)
            else:
                assert src in compose.get("volumes", {}), (name, src)
    gpu = services["node-cloud-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["loadgen"]["command"][1:3] == ["--router", "http://router:8000"]
    # the two-site profile: site edge-b's own cluster, node (publishing there) and router
    sites = {n for n, svc in services.items() if svc.get("profiles") == ["sites"]}
    assert sites == {"kafka-edge-b", "node-edge-b", "router-edge-b"}
    assert services["node-edge-b"]["environment"]["EDGEROUTE_KAFKA"] == "kafka-edge-b:9092"
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets <= set(services) and {"router", "node-edge", "node-cloud"} <= targets


@pytest.mark.parametrize("name", ["Dockerfile.router", "Dockerfile.node", "Dockerfile.node-cuda", "Dockerfile.loadgen"])
def test_images_run_as_non_root(name: str) -> None:
    text = (DOCKER / name).read_text()
    assert "\nUSER 10001" in text
    if name != "Dockerfile.loadgen":
        assert "HEALTHCHECK" in text
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


def test_the_router_runs_from_the_router_images_tree_alone(tmp_path: Path) -> None:
    """What docker/Dockerfile.router copies (router/, telemetry/, policies/) is all `python -m router`
    needs: in a tree of those alone, with the installed dependencies but no other edgeroute package,
    the router's entry point loads and answers --help."""
    for package in ("router", "telemetry", "policies"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    site = sysconfig.get_paths()["purelib"]
    # -S: no site module, so the editable install's path hook (which would find the whole checkout) is
    # not loaded; the dependencies' folder is put on the path by hand instead
    code = (
        f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {site!r}]; sys.argv = ['router', '--help'];"
        "import runpy; runpy.run_module('router', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "run the inference router" in out.stdout


def test_each_node_pool_scales_on_the_routers_signal_for_its_own_site_and_tier() -> None:
    """docker/k8s/keda: a KEDA ScaledObject per node pool, aimed at the pool's Deployment, reading the
    routers' `edgeroute_pool_nodes_needed` for the site and tier its nodes' config gives them."""
    import re

    docs = [d for d in yaml.safe_load_all((K8S / "keda" / "scaledobjects.yaml").read_text()) if d]
    assert yaml.safe_load((K8S / "keda" / "kustomization.yaml").read_text())["resources"] == ["scaledobjects.yaml"]
    deployments = {d["metadata"]["name"] for d in render("cpu") if d["kind"] == "Deployment"}
    pools = {"edgeroute-node-edge": "node-edge.yaml", "edgeroute-node-cloud": "node-cloud.yaml"}
    assert {d["spec"]["scaleTargetRef"]["name"] for d in docs} == set(pools)
    for d in docs:
        target = d["spec"]["scaleTargetRef"]["name"]
        assert d["kind"] == "ScaledObject" and target in deployments
        node = yaml.safe_load((K8S / "base" / "config" / pools[target]).read_text())
        (trigger,) = d["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', query))
        assert query.startswith("max(edgeroute_pool_nodes_needed{") and labels["model"] == "*"
        assert labels["site"] == node["partition"] and labels["tier"] == node.get("tier", "edge")
        assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"

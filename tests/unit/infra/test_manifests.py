"""Deployment artefacts: Kubernetes and Compose files are schema-valid, entrypoints match."""

from __future__ import annotations

import json
import re
from pathlib import Path

import check_jsonschema
import jsonschema
import kubernetes_validate
import pytest
import yaml

from droidmesh.shared.metrics import Metrics

INFRA = Path(__file__).resolve().parents[3] / "infra"
SERVICES = ("sender", "receiver", "cache_broker", "profiler", "gateway")
K8S_VERSION = "1.37.0"


def _k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for f in sorted((INFRA / "k8s").glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        docs += [(f"{f.name}:{d['kind']}/{d['metadata']['name']}", d) for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


@pytest.mark.parametrize("name,doc", _k8s_docs(), ids=lambda v: v if isinstance(v, str) else "")
def test_kubernetes_manifests_validate_strictly(name, doc):
    """Every manifest validates against the Kubernetes schemas (strict: no unknown fields)."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    """kustomize applies exactly the manifests in the folder (the example Secret aside)."""
    listed = set(yaml.safe_load((INFRA / "k8s" / "kustomization.yaml").read_text())["resources"])
    present = {f.name for f in (INFRA / "k8s").glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == present


def test_compose_file_matches_the_compose_spec():
    """infra/compose.yaml validates against the Compose specification's JSON schema."""
    schema_path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(yaml.safe_load((INFRA / "compose.yaml").read_text()), schema)


def test_entrypoints_are_the_service_modules():
    """Each image's ENTRYPOINT and each Deployment's command is `python -m droidmesh.services.<name>`,
    the same command the system tests run."""
    dockerfile = (INFRA / "docker" / "Dockerfile").read_text()
    targets = dict(re.findall(r"FROM base AS (\w+)\s*\n(?:#.*\n|EXPOSE.*\n|ENV.*\n)*ENTRYPOINT (\[.*\])", dockerfile))
    assert set(targets) == set(SERVICES)
    for name, entry in targets.items():
        assert json.loads(entry) == ["python", "-m", f"droidmesh.services.{name}"]
        assert (Path(__file__).resolve().parents[3] / "services" / name / "__main__.py").is_file()
    deployments = [d for _, d in _k8s_docs() if d["kind"] == "Deployment"]
    assert len(deployments) == len(SERVICES)
    for d in deployments:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["command"][:2] == ["python", "-m"] and c["command"][2].removeprefix("droidmesh.services.") in SERVICES
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert "requests" in c["resources"]


def test_model_hosts_have_a_generous_startup_probe():
    """Sender, receiver and profiler Deployments gate liveness behind a startup probe on /readyz
    that allows at least 10 minutes (a large model's load is not restart-looped)."""
    deployments = {d["metadata"]["name"]: d for _, d in _k8s_docs() if d["kind"] == "Deployment"}
    for name in ("sender", "receiver", "profiler"):
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        probe = c["startupProbe"]
        assert probe["httpGet"]["path"] == "/readyz", name
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 600, name


def test_nats_configmap_is_the_repo_config():
    """The NATS ConfigMap carries infra/nats/nats-auth.conf verbatim."""
    cm = next(d for _, d in _k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")
    assert cm["data"]["nats-auth.conf"].strip() == (INFRA / "nats" / "nats-auth.conf").read_text().strip()


def test_grafana_dashboard_queries_exported_metrics():
    """Every metric the dashboard queries is one the services export."""
    exported = {m.name for m in Metrics("x").registry.collect()}
    dash = json.loads((INFRA / "grafana" / "droidmesh.json").read_text())
    used = {name for p in dash["panels"] for t in p["targets"] for name in re.findall(r"\bdm_\w+", t["expr"])}
    base = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in used}
    assert base and base <= exported, base - exported


def test_every_nats_role_has_a_password_everywhere():
    """Each role nats-auth.conf reads a password for is generated, in the example Secret, and passed to Compose's nats."""
    roles = set(re.findall(r"\$DM_NATS_PASSWORD_(\w+)", (INFRA / "nats" / "nats-auth.conf").read_text()))
    generated = set(re.search(r"for role in ([\w ]+); do", (INFRA / "secrets" / "generate.sh").read_text()).group(1).split())
    secret = next(d for _, d in _k8s_docs() if d["kind"] == "Secret")
    compose_env = yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]["nats"]["environment"]
    assert "GATEWAY" in roles
    assert roles == generated == {k.removeprefix("DM_NATS_PASSWORD_") for k in secret["stringData"]} \
        == {k.removeprefix("DM_NATS_PASSWORD_") for k in compose_env}


def test_gateway_is_reachable_only_where_meant():
    """Compose publishes the gateway's API on loopback only; the k8s Service and HPA point at its Deployment."""
    gw = yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]["gateway"]
    assert gw["ports"] and all(p.startswith("127.0.0.1:") for p in gw["ports"])
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    (c,) = docs[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"]
    (port,) = docs[("Service", "gateway")]["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in c["ports"]}
    for (kind, _), d in docs.items():
        if kind == "HorizontalPodAutoscaler":
            assert ("Deployment", d["spec"]["scaleTargetRef"]["name"]) in docs

"""Deployment artefacts: Kubernetes and Compose files are schema-valid, entrypoints match, and
secure by default (TLS, per-role passwords from secrets, nothing published beyond loopback / the cluster)."""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import check_jsonschema
import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from droidmesh.shared.mesh.nats_auth import DEFAULT_ROSTER, receiver_user, sender_user
from droidmesh.shared.service.metrics import Metrics

INFRA = Path(__file__).resolve().parents[3] / "infra"
SERVICES = ("sender", "receiver", "cache_broker", "profiler", "gateway")  # images
# compose runs the receiver image as two services, each holding under its own holder id
COMPOSE_SERVICES = ("sender", "receiver-0", "receiver-1", "cache_broker", "profiler", "gateway")
WORKLOADS = ("Deployment", "StatefulSet")  # kinds that run the services (the receivers: a StatefulSet)
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
    deployments = [d for _, d in _k8s_docs() if d["kind"] in WORKLOADS and d["metadata"]["name"] != "nats"]
    assert len(deployments) == len(SERVICES)
    for d in deployments:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["command"][:2] == ["python", "-m"] and c["command"][2].removeprefix("droidmesh.services.") in SERVICES
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert "requests" in c["resources"]


def test_model_hosts_have_a_generous_startup_probe():
    """Sender, receiver and profiler Deployments gate liveness behind a startup probe on /readyz
    that allows at least 10 minutes (a large model's load is not restart-looped)."""
    deployments = {d["metadata"]["name"]: d for _, d in _k8s_docs() if d["kind"] in WORKLOADS}
    for name in ("sender", "receiver", "profiler"):
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        probe = c["startupProbe"]
        assert probe["httpGet"]["path"] == "/readyz", name
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 600, name


def test_nats_configmap_is_the_repo_config():
    """The NATS ConfigMap carries infra/nats/nats-auth.conf and nats-tls.conf verbatim."""
    cm = next(d for _, d in _k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")
    for name in ("nats-auth.conf", "nats-tls.conf"):
        assert cm["data"][name].strip() == (INFRA / "nats" / name).read_text().strip(), name


def test_grafana_dashboard_queries_exported_metrics():
    """Every metric the dashboard queries is one the services export."""
    exported = {m.name for m in Metrics("x").registry.collect()}
    dash = json.loads((INFRA / "grafana" / "droidmesh.json").read_text())
    used = {name for p in dash["panels"] for t in p["targets"] for name in re.findall(r"\bdm_\w+", t["expr"])}
    base = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in used}
    assert base and base <= exported, base - exported


def test_every_nats_role_has_a_password_everywhere(generated):
    """Each role nats-auth.conf reads a password for is generated (env line and password file), is in the
    example Secret, and Compose's nats reads the generated env file."""
    roles = set(_auth_users().values())
    generated_env = {line.split("=", 1)[0] for line in (generated / "nats.env").read_text().splitlines() if line}
    secret = _docs_by_name()[("Secret", "droidmesh-nats")]
    assert "DM_NATS_PASSWORD_GATEWAY" in roles
    assert roles == generated_env == set(secret["stringData"])
    for user in _auth_users():
        assert len((generated / "passwords" / user).read_text().strip()) >= 24, user
    nats = _compose()["services"]["nats"]
    assert nats["env_file"] == ["./secrets/local/nats.env"] and not nats.get("environment")


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
            assert (d["spec"]["scaleTargetRef"]["kind"], d["spec"]["scaleTargetRef"]["name"]) in docs


# --- secure by default: TLS, per-role passwords from secrets, nothing published beyond loopback ---

NATS_TLS_CONF = INFRA / "nats" / "nats-tls.conf"
COMPOSE_SECRETS_DIR = "./secrets/local/"  # generate.sh's default DIR, as compose.yaml (in infra/) names it
LOOPBACK = ("127.0.0.1", "::1", "[::1]", "localhost")


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _workload(name: str) -> dict:
    """The Deployment or StatefulSet that runs `name`."""
    docs = _docs_by_name()
    (d,) = [docs[(k, name)] for k in WORKLOADS if (k, name) in docs]
    return d


def _docs_by_name() -> dict[tuple[str, str], dict]:
    docs = list(_k8s_docs())
    docs += [(f"secret.example.yaml:{d['kind']}/{d['metadata']['name']}", d)
             for d in yaml.safe_load_all((INFRA / "k8s" / "secret.example.yaml").read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for _, d in docs}


def _auth_users() -> dict[str, str]:
    """user -> the env variable nats-auth.conf reads its password from."""
    pairs = re.findall(r"user:\s*([\w-]+),\s*password:\s*\$(\w+)", (INFRA / "nats" / "nats-auth.conf").read_text())
    assert pairs
    return dict(pairs)


def _tls_files() -> dict[str, str]:
    """cert_file / key_file / ca_file -> the path nats-tls.conf reads it from."""
    block = re.search(r"^tls\s*\{(.*?)^\}", NATS_TLS_CONF.read_text(), re.S | re.M).group(1)
    return dict(re.findall(r"^\s*(cert_file|key_file|ca_file):\s*\"([^\"]+)\"", block, re.M))


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """infra/secrets/generate.sh run into a temporary directory."""
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")
    out = tmp_path_factory.mktemp("secrets") / "local"
    subprocess.run(["bash", str(INFRA / "secrets" / "generate.sh"), str(out)], check=True, capture_output=True, timeout=60)
    return out


def _sans(cert: Path) -> set[str]:
    ext = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return set(ext.value.get_values_for_type(x509.DNSName)) | {str(ip) for ip in ext.value.get_values_for_type(x509.IPAddress)}


def _host_named_by(url: str, sans: set[str]) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return str(ipaddress.ip_address(host)) in sans
    except ValueError:
        return host in sans


def test_generate_sh_makes_a_ca_a_server_certificate_and_every_role_password(generated):
    """generate.sh writes a CA and a NATS server certificate that `openssl verify` accepts, naming the hosts
    compose, Kubernetes and local clients connect to; a password file per nats-auth.conf user (gateway
    included); keys private; a second run keeps everything."""
    tls = generated / "tls"
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(tls / "ca.pem"), "-purpose", "sslserver", str(tls / "server.pem")],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(": OK"), ok.stdout + ok.stderr
    other_ca = subprocess.run(["openssl", "verify", "-CAfile", str(tls / "server.pem"), str(tls / "server.pem")],
                              capture_output=True, timeout=30)
    assert other_ca.returncode != 0  # the leaf is not its own CA: verify above really checked the chain
    assert {"nats", "nats.droidmesh.svc", "nats.droidmesh.svc.cluster.local", "localhost", "127.0.0.1"} <= _sans(tls / "server.pem")
    users = _auth_users()
    assert "gateway" in users
    passwords = {u: (generated / "passwords" / u).read_text().strip() for u in users}
    assert len(set(passwords.values())) == len(users) and all(len(p) >= 24 for p in passwords.values())
    env = dict(line.split("=", 1) for line in (generated / "nats.env").read_text().splitlines() if line)
    assert env == {var: passwords[u] for u, var in users.items()}
    for key in (tls / "server-key.pem", tls / "ca-key.pem", generated / "nats.env"):
        assert key.stat().st_mode & 0o077 == 0, key
    assert generated.stat().st_mode & 0o077 == 0
    before = {f: f.read_bytes() for f in generated.rglob("*") if f.is_file()}
    subprocess.run(["bash", str(INFRA / "secrets" / "generate.sh"), str(generated)], check=True, capture_output=True, timeout=60)
    assert {f: f.read_bytes() for f in generated.rglob("*") if f.is_file()} == before


def test_nats_runs_the_tls_conf_with_its_certificates_mounted():
    """Compose and Kubernetes start nats-server with nats-tls.conf (which includes nats-auth.conf), and
    the certificate, key and CA it names are mounted from secrets at those paths."""
    text = NATS_TLS_CONF.read_text()
    assert re.search(r"^include \./nats-auth\.conf$", text, re.M)
    files = _tls_files()
    assert set(files) == {"cert_file", "key_file", "ca_file"}
    assert re.search(r"^\s*verify:\s*(true|false)\s*$", text, re.M)  # TLS on for every client; no allow_non_tls
    assert "allow_non_tls" not in text

    compose = _compose()
    nats = compose["services"]["nats"]
    assert nats["command"][:2] == ["-c", "/etc/nats/nats-tls.conf"]
    assert "./nats:/etc/nats:ro" in nats["volumes"]
    mounted = {s["target"]: compose["secrets"][s["source"]]["file"] for s in nats["secrets"]}
    assert mounted == {files["cert_file"]: COMPOSE_SECRETS_DIR + "tls/server.pem",
                       files["key_file"]: COMPOSE_SECRETS_DIR + "tls/server-key.pem",
                       files["ca_file"]: COMPOSE_SECRETS_DIR + "tls/ca.pem"}

    sts = _docs_by_name()[("StatefulSet", "nats")]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["args"][:2] == ["-c", "/etc/nats/nats-tls.conf"]
    paths = _k8s_mounted_files(sts["spec"]["template"]["spec"], c)
    assert paths[files["cert_file"]] == ("droidmesh-nats-tls", "tls.crt")
    assert paths[files["key_file"]] == ("droidmesh-nats-tls", "tls.key")
    assert paths[files["ca_file"]] == ("droidmesh-nats-tls", "ca.crt")
    assert {"tls.crt", "tls.key", "ca.crt"} <= set(_docs_by_name()[("Secret", "droidmesh-nats-tls")]["stringData"])


def _k8s_mounted_files(pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key) for every file a Secret volume puts there."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        secret = volumes.get(m["name"], {}).get("secret")  # not in volumes: a StatefulSet's volumeClaimTemplates
        if secret is None:
            continue
        assert m.get("readOnly") is True, m
        assert secret.get("items"), f"{m['name']}: mount named keys only, never a whole Secret"
        for item in secret["items"]:
            out[str(PurePosixPath(m["mountPath"]) / item["path"])] = (secret["secretName"], item["key"])
    return out


def _compose_service_env(name: str) -> tuple[dict, dict[str, str]]:
    """A compose service's environment and its secrets as container path -> file on the host."""
    compose = _compose()
    svc = compose["services"][name]
    files = {}
    for s in svc.get("secrets", []):
        s = {"source": s, "target": s} if isinstance(s, str) else s
        target = s.get("target", s["source"])
        files[target if target.startswith("/") else f"/run/secrets/{target}"] = compose["secrets"][s["source"]]["file"]
    return svc["environment"], files


@pytest.mark.parametrize("service", COMPOSE_SERVICES)
def test_compose_services_connect_with_tls_and_their_own_role_password(service, generated):
    """Each compose service connects to a tls:// URL whose host the generated certificate names, verifies
    it with the CA (a secret), and logs in as a nats-auth.conf user with that user's password file (a secret)."""
    env, secret_files = _compose_service_env(service)
    users = _auth_users()
    assert env["DM_NATS_URL"].startswith("tls://")
    assert _host_named_by(env["DM_NATS_URL"], _sans(generated / "tls" / "server.pem"))
    assert env["DM_NATS_USER"] in users
    assert "DM_NATS_PASSWORD" not in env and "DM_NATS_CREDS" not in env
    assert secret_files[env["DM_NATS_TLS_CA"]] == COMPOSE_SECRETS_DIR + "tls/ca.pem"
    assert secret_files[env["DM_NATS_PASSWORD_FILE"]] == COMPOSE_SECRETS_DIR + f"passwords/{env['DM_NATS_USER']}"
    for f in secret_files.values():  # every secret compose mounts is one generate.sh makes
        assert (generated / f.removeprefix(COMPOSE_SECRETS_DIR)).is_file(), f


def _k8s_container_env(d: dict) -> dict[str, str]:
    """A Deployment's effective env: its ConfigMaps (envFrom), then its own literal values."""
    docs = _docs_by_name()
    (c,) = d["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        assert "secretRef" not in src, "services read secrets from files, not env"
        env.update(docs[("ConfigMap", src["configMapRef"]["name"])]["data"])
    for e in c.get("env", []):
        assert "secretKeyRef" not in e.get("valueFrom", {}), f"{e['name']}: secrets as files, not env"
        if "value" in e:
            env[e["name"]] = e["value"]
    return env


@pytest.mark.parametrize("deployment", ["cache-broker", "sender", "receiver", "profiler", "gateway"])
def test_k8s_services_connect_with_tls_and_their_own_role_password(deployment, generated):
    """Each Deployment connects to a tls:// URL whose host the generated certificate names, verifies it with
    the CA from droidmesh-nats-tls, and logs in as a nats-auth.conf user with a file holding only that
    user's key of droidmesh-nats."""
    d = _workload(deployment)
    (c,) = d["spec"]["template"]["spec"]["containers"]
    env = _k8s_container_env(d)
    files = _k8s_mounted_files(d["spec"]["template"]["spec"], c)
    users = _auth_users()
    assert env["DM_NATS_URL"].startswith("tls://")
    assert _host_named_by(env["DM_NATS_URL"], _sans(generated / "tls" / "server.pem"))
    assert env["DM_NATS_USER"] in users
    assert "DM_NATS_PASSWORD" not in env and "DM_NATS_CREDS" not in env
    assert files[env["DM_NATS_TLS_CA"]] == ("droidmesh-nats-tls", "ca.crt")
    assert files[env["DM_NATS_PASSWORD_FILE"]] == ("droidmesh-nats", users[env["DM_NATS_USER"]])
    keys = {("droidmesh-gateway-keys", "keys.toml")} if deployment == "gateway" else set()
    assert set(files.values()) == {("droidmesh-nats-tls", "ca.crt"), ("droidmesh-nats", users[env["DM_NATS_USER"]])} | keys


def test_the_gateway_reads_its_api_keys_from_a_secret_file(generated):
    """Compose and the k8s Deployment give the gateway a key file (it would refuse to listen on the pod's or
    container's address without one): generate.sh's hashed file in compose, a Secret's key in k8s."""
    from droidmesh.shared.auth import keys

    env, secret_files = _compose_service_env("gateway")
    assert secret_files[env["DM_GATEWAY_API_KEYS"]] == COMPOSE_SECRETS_DIR + "gateway/keys.toml"
    ring = keys.KeyRing(keys.load(generated / "gateway" / "keys.toml"))
    assert ring.authenticate("Bearer " + (generated / "gateway" / "key").read_text().strip()).tenant == "local"
    d = _docs_by_name()[("Deployment", "gateway")]
    (c,) = d["spec"]["template"]["spec"]["containers"]
    files = _k8s_mounted_files(d["spec"]["template"]["spec"], c)
    assert files[_k8s_container_env(d)["DM_GATEWAY_API_KEYS"]] == ("droidmesh-gateway-keys", "keys.toml")


def test_model_hosts_log_in_as_the_user_pinned_to_their_id_and_model():
    """Compose and Kubernetes run the sender as sender-<its DM_SENDER_SENDER_ID> and receivers as
    receiver-<the model id their path gives>: the users nats-auth.conf pins to those subjects."""
    k8s = _docs_by_name()
    envs = [_compose_service_env("sender")[0], _k8s_container_env(k8s[("Deployment", "sender")]),
            _compose_service_env("receiver-0")[0], _compose_service_env("receiver-1")[0],
            _k8s_container_env(_workload("receiver"))]
    for env in envs[:2]:
        assert env["DM_NATS_USER"] == sender_user(env["DM_SENDER_SENDER_ID"])
        assert (env["DM_SENDER_SENDER_ID"], PurePosixPath(env["DM_SENDER_MODEL_PATH"]).name) in DEFAULT_ROSTER.senders
    for env in envs[2:]:
        model = PurePosixPath(env["DM_RECEIVER_MODEL_PATH"]).name  # the receiver's default model id
        assert env["DM_NATS_USER"] == receiver_user(model) and model in DEFAULT_ROSTER.receivers
    assert k8s[("Deployment", "sender")]["spec"]["replicas"] == 1  # one process per sender id


def test_every_receiver_copy_holds_under_an_id_of_its_own_the_roster_names():
    """Compose's receivers each name a holder id of their own; k8s' take their pod's name, and the
    roster names one for every pod its autoscaler may run; each copy is reached at its own address."""
    holders = [h for m, h in DEFAULT_ROSTER.holders if m == "qa"]
    compose = [_compose_service_env(f"receiver-{i}")[0] for i in range(2)]
    assert [e["DM_RECEIVER_HOLDER_ID"] for e in compose] == holders[:2]
    assert [e["DM_RECEIVER_UCX_HOST"] for e in compose] == ["receiver-0", "receiver-1"]  # their service names
    sts = _workload("receiver")
    assert sts["kind"] == "StatefulSet"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["DM_RECEIVER_HOLDER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["DM_RECEIVER_UCX_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    hpa = _docs_by_name()[("HorizontalPodAutoscaler", "receiver")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "receiver"}
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(max(hpa["spec"]["maxReplicas"], sts["spec"]["replicas"]))]
    assert pods == holders


def test_no_compose_port_is_published_on_all_interfaces():
    """Every port compose publishes binds loopback only (short or long syntax); no service uses the host network."""
    published = 0
    for name, svc in _compose()["services"].items():
        assert svc.get("network_mode") != "host", name
        for p in svc.get("ports", []):
            published += 1
            if isinstance(p, dict):
                assert p.get("host_ip") in LOOPBACK, (name, p)
            else:
                host = str(p).rsplit(":", 2)[0] if str(p).count(":") >= 2 else ""
                assert host in LOOPBACK, (name, p)
    assert published  # NATS and the gateway are reachable from the host, on loopback


def test_no_kubernetes_service_or_pod_is_reachable_from_outside_the_cluster():
    """Every Service is ClusterIP (no NodePort / LoadBalancer / externalIPs); no pod uses hostPort or the host network."""
    docs = _docs_by_name()
    services = [d for (kind, _), d in docs.items() if kind == "Service"]
    assert {d["metadata"]["name"] for d in services} >= {"nats", "gateway"}
    for d in services:
        assert d["spec"].get("type", "ClusterIP") == "ClusterIP", d["metadata"]["name"]
        assert not d["spec"].get("externalIPs"), d["metadata"]["name"]
        assert all("nodePort" not in p for p in d["spec"]["ports"]), d["metadata"]["name"]
    for (kind, name), d in docs.items():
        if kind in ("Deployment", "StatefulSet"):
            pod = d["spec"]["template"]["spec"]
            assert not pod.get("hostNetwork"), name
            assert all("hostPort" not in p for c in pod["containers"] for p in c.get("ports", [])), name


def test_composes_vllm_service_logs_in_as_its_models_receiver_with_its_own_secrets(tmp_path, generated):
    """The vLLM service's connector (its JSON in the command) logs in over TLS as the roster's
    receiver of the model it serves, with that user's password file and the CA, both mounted from
    the compose secrets generate.sh makes; the settings are ones the connector accepts."""
    from droidmesh.shared.engines.settings import EngineSettings

    svc = _compose()["services"]["vllm-qa"]
    args = [str(a) for a in svc["command"]]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "droidmesh.shared.engines.vllm.connector"
    assert config["kv_role"] == "kv_consumer" and config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    served = args[args.index("--served-model-name") + 1]
    assert extra["base_model"] == served and extra["models"][served] == args[args.index("serve") + 1]
    assert extra["nats_user"] == receiver_user(served) and served in DEFAULT_ROSTER.receivers
    assert _host_named_by(extra["nats_url"], _sans(generated / "tls" / "server.pem"))
    _, files = _compose_service_env("vllm-qa")
    assert files[extra["nats_tls_ca"]] == COMPOSE_SECRETS_DIR + "tls/ca.pem"
    assert files[extra["nats_password_file"]] == COMPOSE_SECRETS_DIR + f"passwords/{extra['nats_user']}"
    # what the connector makes of it, with the container's files at their paths here
    here = {p: tmp_path / Path(p).name for p in (extra["nats_tls_ca"], extra["nats_password_file"])}
    for path in here.values():
        path.write_text("x")
    model = tmp_path / "qa"
    (model).mkdir()
    (model / "config.json").write_text("{}")
    local = {**extra, "nats_tls_ca": str(here[extra["nats_tls_ca"]]),
             "nats_password_file": str(here[extra["nats_password_file"]]), "models": {served: str(model)}}
    settings = EngineSettings.from_mapping(local)
    assert settings.nats_user == receiver_user(served) and settings.transport == "ucx" and not settings.hold
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])

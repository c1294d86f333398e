"""deploy/k8s/ (issue 28): every kustomization renders with `kubectl kustomize`, every object of a
built-in kind validates against the latest Kubernetes schema kubernetes-validate ships (strict:
an unknown field fails), and the manifests say what the rest of the repository says (the
connector flags of docs/integrations.md and docker-compose.yml, rules.yml, the daemon config).

kubectl comes from scripts/system-deps.sh (Debian: kubernetes-client); a missing one fails.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lmcache_server.config import load_config

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "monitoring", "vllm", "overlays/pd", "overlays/curve"]
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator CRDs: no schema here
DAEMON_CONFIG = "/etc/lmcache/server.yaml"


@functools.cache
def render(name: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed; run `make system-deps` (Debian: apt-get install kubernetes-client)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def kv_config(deployment: dict[str, Any]) -> dict[str, Any]:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


def documented(marker: str) -> dict[str, Any]:
    """The --kv-transfer-config of a command in docs/integrations.md (a marked block or the first)."""
    text = (REPO / "docs" / "integrations.md").read_text()
    if marker:
        text = text[text.index(f"<!-- {marker}") :]
    config: dict[str, Any] = json.loads(re.search(r"--kv-transfer-config '(\{.*?\})'", text)[1])  # type: ignore[index]
    return config


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders_and_validates(name: str) -> None:
    version = kubernetes_validate.latest_version()
    docs = render(name)
    assert docs
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the failing field
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "lmcache", doc["metadata"]


def test_strict_validation_catches_a_wrong_field() -> None:
    """The check above can fail: a misspelt field does not validate."""
    daemonset = one(render("base"), "DaemonSet", "lmcache-server")
    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_daemon_is_one_per_node_behind_a_node_local_service(tmp_path: Path) -> None:
    docs = render("base")
    service = one(docs, "Service", "lmcache-server")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert {p["port"] for p in service["spec"]["ports"]} == {65432, 9464}
    pod = one(docs, "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"  # shared with the vLLM pods
    assert "hostPath" in volumes[mounts["/var/cache/lmcache"]]  # the disk tier on the node
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The config the image reads: mounted from the generated ConfigMap, and it loads.
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert volumes[mounts[str(Path(DAEMON_CONFIG).parent)]]["configMap"]["name"] == config_map["metadata"]["name"]
    path = tmp_path / "server.yaml"
    path.write_text(config_map["data"]["server.yaml"])
    config = load_config(str(path), environ={})
    assert config.metrics_port == 9464 and list(config.listen) == ["tcp://0.0.0.0:65432"]
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s


def test_vllm_pods_share_the_daemon_pool_and_use_the_documented_flags() -> None:
    base_pod = one(render("base"), "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]
    deployment = one(render("vllm"), "Deployment", "vllm")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in pod["volumes"] if v["name"] == shm["name"])["hostPath"]["path"] == "/dev/shm"
    assert pod["securityContext"]["runAsUser"] == base_pod["securityContext"]["runAsUser"]  # the pool is 0600
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LMCACHE_SERVER_ADDRESS"] == "tcp://lmcache-server.lmcache:65432"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    compose_args = compose["services"]["vllm-a"]["command"]
    from_compose = json.loads(compose_args[compose_args.index("--kv-transfer-config") + 1])
    assert kv_config(deployment) == documented("") == from_compose


def test_pd_overlay_uses_the_documented_producer_and_consumer_flags() -> None:
    docs = render("overlays/pd")
    assert kv_config(one(docs, "Deployment", "vllm-prefill")) == documented("vllm-pd-producer-command")
    assert kv_config(one(docs, "Deployment", "vllm-decode")) == documented("vllm-pd-consumer-command")
    services = {d["metadata"]["name"]: d["spec"]["selector"] for d in docs if d["kind"] == "Service"}
    assert services["vllm-prefill"] != services["vllm-decode"]  # each Service reaches its own pods


def test_curve_overlay_turns_auth_on_for_the_daemon_and_vllm() -> None:
    docs = render("overlays/curve")
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    settings = yaml.safe_load(config_map["data"]["server.yaml"])
    assert settings["auth"] == "curve" and "allow_insecure" not in settings
    daemon = one(docs, "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]
    keys_dir = next(m["mountPath"] for m in daemon["containers"][0]["volumeMounts"] if m["name"] == "keys")
    assert Path(settings["server_secret_key_file"]).parent == Path(keys_dir)
    extra = kv_config(one(docs, "Deployment", "vllm"))["kv_connector_extra_config"]
    assert Path(extra["client_secret_key"]).parent == Path(keys_dir)
    # The rest of the daemon's settings are the base's.
    base = yaml.safe_load(next(d for d in render("base") if d["kind"] == "ConfigMap")["data"]["server.yaml"])
    changed = {k for k in base.keys() | settings.keys() if base.get(k) != settings.get(k)}
    assert changed == {"auth", "allow_insecure", "server_secret_key_file", "client_keys_file"}


def test_prometheus_rule_holds_rules_yml_and_is_generated() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("prometheusrule", K8S / "monitoring" / "prometheusrule.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (K8S / "monitoring" / "prometheusrule.yaml").read_text() == module.render()
    docs = render("monitoring")
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())["groups"]
    assert one(docs, "PrometheusRule", "lmcache-server")["spec"]["groups"] == rules
    monitor = one(docs, "ServiceMonitor", "lmcache-server")["spec"]
    service = one(render("base"), "Service", "lmcache-server")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    # rules.yml's alerts select job="lmcache-server": the job label is the Service's name label.
    assert service["metadata"]["labels"][monitor["jobLabel"]] == "lmcache-server"

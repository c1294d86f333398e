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

from lmcache_server.config import is_mooncake, load_config

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "monitoring", "vllm", "overlays/pd", "overlays/curve", "overlays/mooncake"]
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
    assert service["metadata"]["labels"][monitor["jobLabel"]] == "lmcache-server"
    # rules.yml's up/absent alerts select lmcache_role="server" (no job name): every target gets it.
    [endpoint] = monitor["endpoints"]
    assert {"action": "replace", "targetLabel": "lmcache_role", "replacement": "server"} in endpoint["relabelings"]


POD_KINDS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}
READ_PREFIXES = ("VLLM_", "LMCACHE_")  # variables vLLM and our daemon/connector read as settings


def pods(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in POD_KINDS]


def service_link_variables(docs: list[dict[str, Any]], pod: dict[str, Any]) -> set[str]:
    """The variables the kubelet injects into ``pod`` for the Services of its namespace
    (``{NAME}_SERVICE_HOST``, ``{NAME}_PORT``, ...) unless ``enableServiceLinks: false``."""
    if pod.get("enableServiceLinks") is False:
        return set()
    names = [d["metadata"]["name"].upper().replace("-", "_") for d in docs if d["kind"] == "Service"]
    return {f"{name}_{suffix}" for name in names for suffix in ("SERVICE_HOST", "SERVICE_PORT", "PORT")}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_no_pod_gets_service_variables_that_vllm_or_the_daemon_read(name: str) -> None:
    """A Service named vllm injects VLLM_PORT=tcp://...:8000 and vLLM refuses to start on it
    (envs.get_vllm_port: "appears to be a URI"): every pod turns service links off."""
    docs = render(name) + (render("vllm") if name == "base" else render("base"))  # one namespace
    for pod_name, pod in pods(render(name)):
        leaked = sorted(v for v in service_link_variables(docs, pod) if v.startswith(READ_PREFIXES))
        assert not leaked, f"{name}: pod {pod_name} would get {leaked}"
        assert pod["enableServiceLinks"] is False, pod_name


def test_the_service_link_check_can_fail() -> None:
    deployment = one(render("vllm"), "Deployment", "vllm")
    pod = json.loads(json.dumps(deployment["spec"]["template"]["spec"]))
    del pod["enableServiceLinks"]
    assert "VLLM_PORT" in service_link_variables(render("vllm"), pod)


def quantity(value: str | int) -> float:
    """A Kubernetes quantity ("18Gi", "500M", "2", "100m") as a number."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def daemon_config(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and "server.yaml" in d["data"])
    path = tmp_path / "server.yaml"
    path.write_text(config_map["data"]["server.yaml"])
    return load_config(str(path), environ={})


def process_overhead(config: Any) -> int:
    """Memory the daemon holds besides its pool, at most: bytes in flight, the spill and remote
    queues, Mooncake's segment and transfer buffer, and ~0.5 GiB for the interpreter, ZeroMQ
    and the indexes."""
    queues = (config.max_spill_queue_size if config.local_disk else 0) + (
        config.max_remote_queue_size if config.remote_url else 0
    )
    mooncake = config.mooncake_segment_size + config.mooncake_buffer_size if is_mooncake(config.remote_url) else 0
    return int(config.max_inflight_bytes + queues + mooncake + 0.5 * 2**30)


@pytest.mark.parametrize("name", ["base", "overlays/curve", "overlays/mooncake"])
def test_the_daemon_memory_limit_holds_its_pool(name: str, tmp_path: Path) -> None:
    """tmpfs pages are charged to the memory cgroup of the process that allocates them, and the
    daemon commits its pool's pages (posix_fallocate): a limit below the pool is an OOM kill
    once the pool fills.  limit = request >= pool + overhead, for cpu too (Guaranteed QoS)."""
    docs = render(name)
    config = daemon_config(docs, tmp_path)
    pod = one(docs, "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert quantity(limits["memory"]) >= config.max_local_cpu_size + process_overhead(config), (
        limits["memory"],
        config.max_local_cpu_size,
    )
    assert requests == limits  # Guaranteed QoS: evicted last under node pressure
    for init in pod.get("initContainers", []):  # Guaranteed needs every container's requests = limits
        assert init["resources"]["requests"] == init["resources"]["limits"], init["name"]
        assert init["resources"]["limits"].keys() >= {"cpu", "memory"}, init["name"]


def test_mooncake_overlay_runs_one_master_and_names_each_node_by_its_pod_ip(tmp_path: Path) -> None:
    docs = render("overlays/mooncake")
    config = daemon_config(docs, tmp_path)
    assert is_mooncake(config.remote_url) and config.remote_url.startswith("mooncake://mooncake-master.")
    master = one(docs, "Deployment", "mooncake-master")
    assert master["spec"]["replicas"] == 1
    service = one(docs, "Service", "mooncake-master")
    assert {p["port"] for p in service["spec"]["ports"]} >= {50051, 8080}
    [container] = one(docs, "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["LMCACHE_MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_disk_tier_directory_is_handed_to_the_daemon_user() -> None:
    """A hostPath directory is created root:0755 (fsGroup does not apply to it), which uid 10001
    cannot write: an init container chowns it, and it is the only one that runs as root."""
    pod = one(render("base"), "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    disk = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/cache/lmcache")["name"]
    user = pod["securityContext"]["runAsUser"]
    [init] = [c for c in pod["initContainers"] if any(m["name"] == disk for m in c["volumeMounts"])]
    script = " ".join(init["command"] + init.get("args", []))
    assert f"chown {user}:{pod['securityContext']['runAsGroup']} /var/cache/lmcache" in script
    assert init["securityContext"]["runAsUser"] == 0
    assert set(init["securityContext"]["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}
    assert "securityContext" not in container or container["securityContext"].get("runAsUser") in (None, user)


def test_the_daemon_runs_where_gpu_replicas_run_and_its_probes_fit_a_crash_scan() -> None:
    pod = one(render("base"), "DaemonSet", "lmcache-server")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    probe = pod["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800  # a million records' scan


def test_the_namespace_admits_the_hostpath_pods() -> None:
    """hostPath volumes are outside the Pod Security Standards' baseline: the namespace says so."""
    docs = render("base")
    namespace = one(docs, "Namespace", "lmcache")
    uses_host_path = any("hostPath" in v for _, pod in pods(docs) for v in pod["volumes"])
    assert uses_host_path
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_network_policy_admits_the_vllm_pods_to_the_daemon_port_only() -> None:
    docs = render("base")
    policy = one(docs, "NetworkPolicy", "lmcache-server")["spec"]
    daemon = one(docs, "DaemonSet", "lmcache-server")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= daemon["metadata"]["labels"].items()
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in policy["ingress"]}
    assert set(by_port) == {p["name"] for p in daemon["spec"]["containers"][0]["ports"]}
    [zmq_from] = by_port["zmq"]
    for deployment in ("vllm", "overlays/pd"):  # every example vLLM pod carries the label it admits
        for d in render(deployment):
            if d["kind"] == "Deployment":
                labels = d["spec"]["template"]["metadata"]["labels"]
                assert zmq_from["podSelector"]["matchLabels"].items() <= labels.items(), d["metadata"]["name"]

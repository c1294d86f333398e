"""The deployment files: alert rules (promtool), Grafana dashboard, compose file, Dockerfile, systemd unit.

promtool and docker-compose are required (``make test`` installs them, see
scripts/system-deps.sh): a missing one fails these tests instead of skipping.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_server.config import ServerConfig, disk_path, load_config

from .conftest import Daemon, free_port
from .metrics.test_metrics import exported_names, metric_names, scrape

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"

REQUIRED_ALERTS = {
    "LMCacheLowHitRate",  # low hit rate
    "LMCacheHighEvictionRate",  # high eviction rate
    "LMCacheUplinkDown",  # uplink down
    "LMCacheDaemonDown",  # daemon down
    "LMCacheMemoryPoolFull",  # memory pool nearly full with evictions
    "LMCacheBusyRejections",  # BUSY rejections
}
# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def program(name: str) -> str:
    path = shutil.which(name)
    if path is None:  # fail loudly: make test installs it (scripts/system-deps.sh)
        pytest.fail(
            f"{name} is not installed; run `make system-deps` (Debian: apt-get install prometheus docker-compose)"
        )
    return path


def run(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def exported(module_daemon_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every series name a daemon with memory and disk tiers exports (redis families have no samples)."""
    spill = tmp_path_factory.mktemp("spill")
    daemon = module_daemon_factory(local_disk=f"file://{spill}", max_local_disk_size="64MiB")
    return exported_names(scrape(daemon.metrics_port))


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def recorded() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


# -- Prometheus rules ----------------------------------------------------------------------
def test_promtool_checks_rules_and_config() -> None:
    promtool = program("promtool")
    out = run(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    out = run(promtool, "check", "config", "prometheus.yml", cwd=DEPLOY / "prometheus")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout


def test_promtool_unit_tests_make_every_alert_fire() -> None:
    out = run(program("promtool"), "test", "rules", "rules_test.yml", cwd=DEPLOY / "prometheus")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts >= REQUIRED_ALERTS
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules_test.yml").read_text())["tests"]
    fired = {
        case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")
    }  # fmt: skip
    assert fired == alerts, f"alerts without a test that fires them: {alerts - fired}"


# Recording rules are named level:metric:operations after the daemon's own families; never
# `lmcache:...`, the prefix of LMCache's engine-side metrics (it exports lmcache:lookup_hit_rate).
RECORD_NAME = re.compile(r"[a-z_]+:lmcache_[a-z0-9_]+:[a-z0-9_]+")
RUNBOOK = "file:///usr/share/doc/lmcache-server/operations.md#"


def test_rules_read_only_exported_metrics(exported: set[str]) -> None:
    known = exported | recorded() | PROMETHEUS_SERIES
    for group in rule_groups():
        for rule in group["rules"]:
            unknown = metric_names(rule["expr"]) - known
            assert not unknown, f"{rule.get('record') or rule.get('alert')} reads {unknown}"
    for name in recorded():
        assert RECORD_NAME.fullmatch(name) and not name.startswith("lmcache:"), name
    assert {"instance:lmcache_chunk_hits:ratio_rate5m", "instance:lmcache_lookup_hit_chunks:ratio_rate5m"} <= recorded()


def test_rules_name_no_job_and_find_the_daemons_by_lmcache_role() -> None:
    for group in rule_groups():
        for rule in group["rules"]:
            assert not re.search(r"\bjob\s*=", rule["expr"]), rule  # any scrape job name works
            if "up" in metric_names(rule["expr"]):
                # Prometheus's own series: every target has one, so select the daemons' targets.
                assert re.search(r'\bup\{lmcache_role="server"\}', rule["expr"]), rule
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    [static] = jobs["lmcache-server"]["static_configs"]
    assert static["targets"] == ["lmcache-server:9464"]  # the compose service and its metrics_port
    assert static["labels"] == {"lmcache_role": "server"}


def github_anchors(markdown: str) -> dict[str, str]:
    """Heading anchors as GitHub makes them -> the section's text up to the next heading."""
    sections: dict[str, str] = {}
    anchor = None
    for line in markdown.splitlines():
        heading = re.match(r"#+ (.*)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            sections[anchor] = ""
        elif anchor is not None:
            sections[anchor] += line + "\n"
    return sections


def test_every_alert_links_its_runbook_section() -> None:
    sections = github_anchors((REPO / "docs" / "operations.md").read_text())
    for group in rule_groups():
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            url = rule["annotations"].get("runbook_url", "")
            assert url == RUNBOOK + rule["alert"].lower(), rule["alert"]
            section = sections.get(url.removeprefix(RUNBOOK))
            assert section is not None, f"docs/operations.md has no section {rule['alert']}"
            assert "**What it means.**" in section and "**What to do.**" in section, rule["alert"]


# -- Grafana --------------------------------------------------------------------------------
def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows nest theirs


def test_dashboard_queries_name_exported_metrics(exported: set[str]) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "lmcache.json").read_text())
    # Raw metrics only (the dashboard works without rules.yml loaded): the daemon's, and the
    # vLLM connector's on the replicas' /metrics (lmcache_client/integrations/vllm/stats.py).
    from lmcache_client.integrations.vllm.stats import COUNTERS

    connector = {f"vllm:lmcache_server_{name}_total" for name in [*COUNTERS, "prompt_tokens"]}
    known = exported | connector
    ids = []
    titles = set()
    for panel in panels(dashboard):
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        titles.add(panel["title"])
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"{panel['title']!r}: {target['expr']!r} names no metric"
            assert names <= known, f"{panel['title']!r} reads {names - known}"
            if any(not n.startswith("lmcache_") for n in names - connector):  # process_*: every exporter has them
                assert "and on (job, instance) lmcache_build_info" in target["expr"], panel["title"]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r}"
            cells[cell] = panel["title"]
    # What the issue asks the dashboard to show.
    for title in ("Hit rate per tier", "Throughput", "Latency p50 by op", "Latency p99 by op", "Evictions",
                  "Pool and disk usage", "Uplink state", "Would a bigger pool help?",
                  "Where prompt tokens came from"):  # fmt: skip
        assert title in titles
    variable = {v["name"]: v for v in dashboard["templating"]["list"]}["instance"]
    match = re.fullmatch(r"label_values\((\w+), *instance\)", variable["query"]["query"])
    assert match and match.group(1) in known


def test_grafana_provisioning_matches_compose() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    dashboards = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "lmcache.yml").read_text())
    path = dashboards["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/lmcache.json:{path}/lmcache.json:ro" in mounts
    sources = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert sources["datasources"][0]["url"] == "http://prometheus:9090"


# -- docker-compose ------------------------------------------------------------------------
def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and run(docker, "compose", "version").returncode == 0:
        return [docker, "compose"]
    return [program("docker-compose")]  # fails with the install hint


def test_compose_file_is_valid() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "HF_TOKEN")}
    out = run(*compose_command(), "-f", "docker-compose.yml", "config", "-q", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.strip() == "", out.stderr  # no warnings either (e.g. unset variables)


def test_compose_wiring() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"lmcache-server", "redis", "vllm-a", "vllm-b", "prometheus", "grafana"}
    server = services["lmcache-server"]
    assert server["build"]["dockerfile"] == "deploy/Dockerfile"
    assert "lmcache-disk:/var/cache/lmcache" in server["volumes"]
    assert "ports" not in server and "ports" not in services["redis"]  # no auth yet: never published
    assert compose["networks"]["cache"]["internal"] is True
    assert server["environment"]["LMCACHE_REMOTE_URL"] == "redis://redis:6379/0"
    drain = load_config(str(DEPLOY / "server.docker.yaml"), environ={}).drain_timeout_s
    assert int(server["stop_grace_period"].rstrip("s")) > drain
    for name, gpu in (("vllm-a", "0"), ("vllm-b", "1")):
        vllm = services[name]
        assert vllm["ipc"] == "host" and vllm["shm_size"]
        devices = vllm["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
        command = vllm["command"]
        kv = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert kv == {
            "kv_connector": "LMCacheServerConnectorV1",
            "kv_connector_module_path": "lmcache_client.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
        }
        # The same flags as the command line docs/integrations.md gives (and the tests run).
        doc = (REPO / "docs" / "integrations.md").read_text()
        assert command[command.index("--kv-transfer-config") + 1] in doc
        # The connector itself accepts that config, its address from the environment.
        from lmcache_client.integrations.vllm.settings import ADDRESS_ENV, ConnectorSettings

        assert vllm["environment"][ADDRESS_ENV] == "tcp://lmcache-server:65432"
        old_env = os.environ.get(ADDRESS_ENV)
        os.environ[ADDRESS_ENV] = vllm["environment"][ADDRESS_ENV]
        try:
            settings = ConnectorSettings.from_extra_config(kv.get("kv_connector_extra_config"))
        finally:
            if old_env is None:
                del os.environ[ADDRESS_ENV]
            else:
                os.environ[ADDRESS_ENV] = old_env
        assert settings.address == "tcp://lmcache-server:65432"
        assert settings.chunk_size == load_config(str(DEPLOY / "server.docker.yaml"), environ={}).chunk_size
        assert vllm["depends_on"]["lmcache-server"]["condition"] == "service_healthy"
        assert (REPO / vllm["build"]["dockerfile"]).is_file()
    # Every file the stack bind-mounts exists.
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), volume


def test_pd_compose_file_is_valid_and_runs_the_documented_roles() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "HF_TOKEN")}
    out = run(*compose_command(), "-f", "deploy/compose.pd.yml", "config", "-q", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.strip() == "", out.stderr
    services = yaml.safe_load((DEPLOY / "compose.pd.yml").read_text())["services"]
    assert set(services) == {"lmcache-server", "vllm-prefill", "vllm-decode"}
    doc = (REPO / "docs" / "integrations.md").read_text()
    roles = {}
    for name in ("vllm-prefill", "vllm-decode"):
        command = services[name]["command"]
        flags = command[command.index("--kv-transfer-config") + 1]
        assert flags in doc  # the flags of the documented commands, which tests/integrations/vllm/test_vllm_pd.py runs
        roles[name] = json.loads(flags)["kv_role"]
        assert services[name]["environment"]["LMCACHE_SERVER_ADDRESS"] == "tcp://lmcache-server:65432"
    assert roles == {"vllm-prefill": "kv_producer", "vllm-decode": "kv_consumer"}


def test_mooncake_compose_file_is_valid_and_shares_only_mooncake() -> None:
    out = run(*compose_command(), "-f", "deploy/compose.mooncake.yml", "config", "-q")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.strip() == "", out.stderr
    services = yaml.safe_load((DEPLOY / "compose.mooncake.yml").read_text())["services"]
    assert {"mooncake-master", "node-a", "node-b"} <= set(services)
    assert not any("redis" in name for name in services)
    config = load_config(str(DEPLOY / "server.mooncake.yaml"), environ={})
    assert config.remote_url is not None and config.remote_url.startswith("mooncake://mooncake-master:")
    for node in ("node-a", "node-b"):
        environment = services[node].get("environment", {})
        assert environment.get("LMCACHE_MOONCAKE_LOCAL_HOSTNAME") == node, environment


def test_container_config_is_valid_with_compose_environment() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    env = {
        k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v))
        for k, v in compose["services"]["lmcache-server"]["environment"].items()
    }
    config: ServerConfig = load_config(str(DEPLOY / "server.docker.yaml"), environ=env)
    assert config.listen == ("tcp://0.0.0.0:65432",)
    assert config.metrics_host == "0.0.0.0" and config.metrics_port == 9464
    assert config.local_disk == "file:///var/cache/lmcache"
    assert config.remote_url == "redis://redis:6379/0"
    assert config.max_local_cpu_size == 16 << 30


# -- Dockerfile and systemd ---------------------------------------------------------------
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_is_slim_non_root_with_healthcheck() -> None:
    steps = dockerfile_instructions(DEPLOY / "Dockerfile")
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    bases = [args.get(rest.split()[0].strip("${}"), rest.split()[0]) for kind, rest in steps if kind == "FROM"]
    assert all(re.fullmatch(r"python:3\.11-slim(-\w+)?", b) for b in bases), bases
    runtime = steps[max(i for i, (kind, _) in enumerate(steps) if kind == "FROM") :]
    users = [rest for kind, rest in runtime if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert ("EXPOSE", "65432 9464") in runtime
    assert ("ENTRYPOINT", '["lmcache-server"]') in runtime
    assert any(kind == "VOLUME" and "/var/cache/lmcache" in rest for kind, rest in runtime)
    for kind, rest in steps:
        if kind == "COPY" and "--from" not in rest:
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), source
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert "!deploy/server.docker.yaml" in ignore and "!lmcache_server/" in ignore


def healthcheck_argv() -> list[str]:
    steps = dockerfile_instructions(DEPLOY / "Dockerfile")
    check = next(rest for kind, rest in steps if kind == "HEALTHCHECK")
    argv: list[str] = json.loads(check[check.index("CMD") + 3 :].strip())
    return argv


def test_image_healthcheck_probes_readyz(module_daemon_factory: Callable[..., Daemon]) -> None:
    """The HEALTHCHECK command itself, run against a real daemon and against nothing."""
    daemon = module_daemon_factory()
    argv = healthcheck_argv()
    assert argv[0] == "python" and "/readyz" in argv[-1]
    env = {**os.environ, "LMCACHE_METRICS_PORT": str(daemon.metrics_port)}
    assert run(sys.executable, *argv[1:], env=env).returncode == 0
    env["LMCACHE_METRICS_PORT"] = str(free_port())
    assert run(sys.executable, *argv[1:], env=env).returncode != 0


def test_systemd_unit(tmp_path: Path) -> None:
    unit = DEPLOY / "lmcache-server.service"
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(unit)
    service = parser["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/lmcache-server") and argv[1:] == ["--config", "/etc/lmcache/server.yaml", "--keep-warm"]
    # systemd restarts it (the pool is kept); `systemctl stop` frees the pool with cleanup.
    assert f"{argv[0]} cleanup --config /etc/lmcache/server.yaml" in service["ExecStopPost"]
    assert service["User"] not in ("root", "0")
    assert service["RestartPreventExitStatus"] == "2"  # a refused config is not retried
    assert int(service["TimeoutStopSec"]) > ServerConfig().drain_timeout_s
    assert service["CacheDirectory"] == "lmcache"
    assert parser["Install"]["WantedBy"] == "multi-user.target"
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: the unit was only parsed")
    # verify needs ExecStart to exist: point it at this environment's entry point.
    entry = Path(sys.executable).with_name("lmcache-server")
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace(argv[0], str(entry)))
    out = run(analyze, "verify", str(local))
    assert out.returncode == 0, out.stdout + out.stderr


# -- docs --------------------------------------------------------------------------------
def test_deploy_doc_covers_the_stack() -> None:
    doc = (REPO / "docs" / "deploy.md").read_text()
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for service in compose["services"]:
        assert f"`{service}`" in doc, service
    for needle in ("docker-compose config -q", "docs/integrations.md", "issue #7", "/healthz", "/readyz",
                   "instance:lmcache_chunk_hits:ratio_rate5m", "lmcache-server admin"):  # fmt: skip
        assert needle in doc, needle
    ops = (REPO / "docs" / "operations.md").read_text()
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    for alert in alerts:
        assert f"`{alert}`" in ops, alert


def test_events_compose_file_is_valid_and_turns_events_on() -> None:
    """deploy/compose.events.yml (docs/events.md): a valid override whose environment
    gives the container config an events endpoint the tap subscribes to."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODEL", "HF_TOKEN", "LMCACHE_"))}
    files = ["-f", "docker-compose.yml", "-f", "deploy/compose.events.yml"]
    out = run(*compose_command(), *files, "config", "-q", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    base = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["lmcache-server"]["environment"]
    override = yaml.safe_load((DEPLOY / "compose.events.yml").read_text())["services"]
    merged = {**base, **override["lmcache-server"]["environment"]}
    environ = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in merged.items()}
    config: ServerConfig = load_config(str(DEPLOY / "server.docker.yaml"), environ=environ)
    assert config.events_endpoint == "tcp://0.0.0.0:5557"
    assert config.events_replay_endpoint == "tcp://0.0.0.0:5558"
    assert config.events_block_size == 16 and config.allow_insecure
    assert config.events_topic == "kv@{node}@{model}"
    tap = override["kv-events-tap"]["command"][0]
    assert "tcp://lmcache-server:5557" in tap and "tcp://lmcache-server:5558" in tap
    assert {"5557", "5558"} <= set(override["lmcache-server"]["expose"])


def unit_service() -> tuple[configparser.ConfigParser, str]:
    unit = DEPLOY / "lmcache-server.service"
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(unit)
    return parser, unit.read_text()


def test_the_example_config_lives_where_the_systemd_unit_lets_it_write() -> None:
    """The unit runs with PrivateTmp=yes and ProtectSystem=strict: a /tmp path is private to the
    daemon (engines cannot reach an ipc socket there) and wiped at every stop, and anything
    outside the unit's own directories is read-only.  The example config the unit's install
    lines copy keeps its disk tier and its ipc endpoint in the unit's directories."""
    parser, _ = unit_service()
    service = parser["Service"]
    assert service["PrivateTmp"] == "yes" and service["ProtectSystem"] == "strict"
    writable = [Path("/var/cache") / service["CacheDirectory"], Path("/run") / service["RuntimeDirectory"]]
    config = load_config(str(DEPLOY / "server.yaml"), {})
    paths = [Path(disk_path(config.local_disk))] if config.local_disk else []
    paths += [Path(e.removeprefix("ipc://")) for e in config.listen if e.startswith("ipc://")]
    paths += [Path(config.state_dir)] if config.state_dir else []
    assert paths
    for path in paths:
        assert not path.is_relative_to("/tmp"), path
        assert any(path.is_relative_to(w) for w in writable), (path, writable)


def test_the_systemd_unit_waits_for_readiness_and_documents_itself() -> None:
    parser, text = unit_service()
    service = parser["Service"]
    assert service["Type"] == "notify"  # lmcache_server/sdnotify.py: READY=1 when /readyz turns 200
    timeout = service["TimeoutStartSec"]
    assert timeout == "infinity" or int(timeout.removesuffix("min")) * 60 >= 1800  # a crash scan
    documentation = Path(parser["Unit"]["Documentation"].removeprefix("file://"))
    assert (REPO / "docs" / documentation.name).is_file()
    install = f"-t {documentation.parent} docs/*.md"
    assert install in text and install in (REPO / "docs" / "deploy.md").read_text()


def test_the_daemon_tells_systemd_it_is_ready_and_when_it_drains(daemon_factory: Callable[..., Daemon]) -> None:
    """Type=notify, through the real daemon: READY=1 when it serves (with /readyz 200), STOPPING=1
    when SIGTERM starts the drain; each with a STATUS line for `systemctl status`."""
    import socket
    import tempfile
    import urllib.request

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        path = os.path.join(tmp, "notify")
        sock.bind(path)
        sock.settimeout(20)
        daemon = daemon_factory(env={"NOTIFY_SOCKET": path})
        ready = sock.recv(4096).decode().split("\n")
        assert ready[0] == "READY=1" and ready[1].startswith("STATUS=serving on tcp://"), ready
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/readyz", timeout=5) as reply:
            assert reply.status == 200
        assert daemon.stop() == 0
        assert sock.recv(4096).decode().split("\n") == ["STOPPING=1", "STATUS=draining"]


def test_notify_reaches_an_abstract_socket_and_never_fails_the_daemon(tmp_path: Path) -> None:
    import socket

    from lmcache_server.sdnotify import notify

    name = f"lmcache-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert notify("READY=1", "STATUS=a\nb", environ={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(100) == b"READY=1\nSTATUS=a b"  # one field per line: a newline cannot split one
    assert not notify("READY=1", environ={})  # not under systemd: nothing sent
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": "relative"})
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})

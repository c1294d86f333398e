"""Configuration: sizes, precedence file < env < flags, and refusals with clear messages."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_server.config import ConfigError, ServerConfig, load_config, parse_size, summary

from .conftest import free_port

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (40, 40 * GiB),
        (2.5, int(2.5 * GiB)),
        ("40GiB", 40 * GiB),
        ("40", 40 * GiB),
        ("512MiB", 512 << 20),
        ("1GB", 10**9),
        ("1048576B", 1 << 20),
        ("4 KiB", 4096),
        ("0", 0),
    ],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", [-1, "-1GiB", "lots", "1XB", True, None, float("nan")])
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


def test_defaults_are_valid() -> None:
    c = ServerConfig()
    assert c.chunk_size == 256 and c.local_cpu and c.max_local_cpu_size == 5 * GiB
    assert c.listen == ("tcp://127.0.0.1:65432",)


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 128, "max_local_cpu_size": 2, "metrics_port": 9000}))
    env = {"LMCACHE_MAX_LOCAL_CPU_SIZE": "3GiB", "LMCACHE_METRICS_PORT": "9001", "PATH": "/bin"}
    c = load_config(str(path), env, {"metrics_port": 9002})
    assert c.chunk_size == 128  # file
    assert c.max_local_cpu_size == 3 * GiB  # env beats file
    assert c.metrics_port == 9002  # flag beats env
    # LMCACHE_CONFIG names the file when --config is not given.
    assert load_config(None, {"LMCACHE_CONFIG": str(path)}).chunk_size == 128


def test_env_values_are_typed() -> None:
    env = {"LMCACHE_SAVE_DECODE_CACHE": "true", "LMCACHE_LISTEN": "tcp://127.0.0.1:1,ipc:///tmp/x.sock"}
    c = load_config(None, env)
    assert c.save_decode_cache is True
    assert c.listen == ("tcp://127.0.0.1:1", "ipc:///tmp/x.sock")


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        ({"max_local_cpu_size": -1}, "max_local_cpu_size", "expected a size"),
        ({"max_local_cpu_size": "12 bananas"}, "max_local_cpu_size", "40GiB"),
        ({"chunk_size": 0}, "chunk_size", "1..1048576"),
        ({"chunk_size": "256"}, "chunk_size", "integer"),
        ({"listen": ["tcp://localhost"]}, "listen", "tcp://HOST:PORT"),
        ({"listen": ["http://127.0.0.1:80"]}, "listen", "ipc:///PATH"),
        ({"metrics_port": 70000}, "metrics_port", "1..65535"),
        ({"remote_url": "mysql://db"}, "remote_url", "redis://"),
        ({"local_disk": "var/cache"}, "local_disk", "file://"),
        ({"log_level": "loud"}, "log_level", "DEBUG"),
        ({"shm_dir": "dev/shm"}, "shm_dir", "absolute directory"),
        ({"shm_lease_timeout_s": 0}, "shm_lease_timeout_s", "0.1..3600"),
        ({"shared_memory": "yes"}, "shared_memory", "true or false"),
        ({"chunksize": 256}, "chunksize", "a known key"),
        ({"local_disk": "file:///var/cache/lmcache"}, "max_local_disk_size", "when local_disk is set"),
        ({"disk_fsync": "sometimes"}, "disk_fsync", "none, data or full"),
        ({"remote_ttl_s": -1}, "remote_ttl_s", "seconds"),
        ({"remote_key_prefix": "a b"}, "remote_key_prefix", "without spaces"),
        ({"kv_codec": "zstd"}, "kv_codec", "none, lossless, int8, cachegen"),
        ({"kv_codec": "int8:grp=3"}, "kv_codec", "valid parameters: group, bits"),
        ({"kv_codec": "int8", "kv_codec_params": {"group": 7}}, "kv_codec_params", "8, 16, 32"),
        ({"kv_codec_params": {"bits": 4}}, "kv_codec_params", "unless kv_codec is set"),
        ({"kv_codec_params": [4]}, "kv_codec_params", "a map of codec parameter"),
        ({"kv_codec": "int8:group=64", "kv_codec_params": {"bits": 4}}, "kv_codec_params", "kv_codec gives"),
        ({"kv_codec": "int8", "remote_serde": "cachegen"}, "kv_codec", "when remote_serde is cachegen"),
        ({"kv_codec": "none", "remote_serde": "cachegen"}, "kv_codec", "when remote_serde is cachegen"),
        ({"local_cpu": False}, "local_cpu", "passes through the memory tier"),
        ({"max_message_size": "2GiB", "max_inflight_bytes": "1GiB"}, "max_message_size", "max_inflight_bytes"),
    ],
)
def test_bad_values_name_key_value_and_expectation(overrides: dict[str, object], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, overrides)
    assert info.value.key == key
    assert f"'{key}'" in str(info.value) and fragment in str(info.value)


def test_codec_settings() -> None:
    assert load_config(None, {}).codec is None  # raw chunks by default
    # remote_serde keeps LMCache's meaning: cachegen is what the engine side stores.
    assert load_config(None, {}, {"remote_serde": "cachegen"}).codec.to_dict() == {
        "mode": "cachegen",
        "params": {"anchor": 16, "bits": 4},
    }
    assert load_config(None, {}, {"remote_serde": "cachegen", "kv_codec": "cachegen:bits=3"}).codec.get("bits") == 3
    env = {"LMCACHE_KV_CODEC": "int8", "LMCACHE_KV_CODEC_PARAMS": "{group: 64}"}
    c = load_config(None, env)
    assert c.codec.tag == load_config(None, {}, {"kv_codec": "int8:group=64"}).codec.tag == "int8.v1-g64"
    assert "kv_codec=int8.v1-g64" in summary(c)
    # naive + an explicit codec: the codec; kv_codec none is raw chunks.
    assert load_config(None, {}, {"remote_serde": "naive", "kv_codec": "lossless"}).codec.mode == "lossless"
    assert load_config(None, {}, {"kv_codec": "none"}).codec is None


def test_unknown_keys_in_file_and_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("max_local_cpu_size: 1\nmax_local_cpu_sizee: 2\n")
    with pytest.raises(ConfigError, match="max_local_cpu_sizee.*from file.*did you mean 'max_local_cpu_size'"):
        load_config(str(path), {})
    with pytest.raises(ConfigError, match="chunk_sise.*from command line.*did you mean 'chunk_size'") as info:
        load_config(None, {}, {"chunk_sise": 4})
    assert "max_inflight_bytes" not in str(info.value)  # the likely key, not every key
    with pytest.raises(ConfigError, match="did you mean 'save_unfull_chunk'.*LMCache engine-side key"):
        load_config(None, {}, {"save_unfull_chunks": True})
    with pytest.raises(ConfigError, match="docs/configuration.md") as info:
        load_config(None, {}, {"frobnicate": 1})
    assert "did you mean" not in str(info.value) and "chunk_size" not in str(info.value)


def test_cli_names_the_likely_key_of_a_typo(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("chunk_size: 128\nmax_local_cpu_szie: 1\n")
    for args in (["--config", str(path)], ["--set", "max_local_cpu_szie=1"]):
        out = run_cli(*args, "--print-config")
        assert out.returncode == 2
        [line] = out.stderr.strip().splitlines()
        assert "'max_local_cpu_szie'" in line and "did you mean 'max_local_cpu_size'?" in line, line
        assert len(line) < 300  # one line, not a dump of every key


# What a Kubernetes Service named ``lmcache`` injects into every pod, plus an
# engine-side LMCache variable from a shared environment.
K8S_ENV = {
    "LMCACHE_PORT": "tcp://10.96.0.12:65432",
    "LMCACHE_PORT_65432_TCP": "tcp://10.96.0.12:65432",
    "LMCACHE_SERVICE_HOST": "10.96.0.12",
    "LMCACHE_USE_EXPERIMENTAL": "True",
}


def test_unknown_env_vars_are_one_warning_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_server.config"):
        c = load_config(None, {**K8S_ENV, "LMCACHE_CHUNK_SIZE": "64"})
    assert c.chunk_size == 64  # known variables still apply
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for name in K8S_ENV:
        assert name in warnings[0].getMessage()
    # A known key with a bad value in the environment is still refused.
    with pytest.raises(ConfigError, match="chunk_size.*env LMCACHE_CHUNK_SIZE"):
        load_config(None, {**K8S_ENV, "LMCACHE_CHUNK_SIZE": "many"})


def test_the_clients_address_variable_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The README exports LMCACHE_SERVER_ADDRESS for the engines and the admin CLI on the
    daemon's host: the daemon neither reads it as config nor warns about it."""
    with caplog.at_level(logging.WARNING, logger="lmcache_server.config"):
        load_config(None, {"LMCACHE_SERVER_ADDRESS": "tcp://127.0.0.1:65432"})
        assert not caplog.records
        load_config(
            None, {"LMCACHE_SERVER_ADDRESS": "tcp://127.0.0.1:65432", "LMCACHE_SERVER_PORT": "tcp://1.2.3.4:65432"}
        )
    [record] = caplog.records
    assert "LMCACHE_SERVER_PORT" in record.getMessage() and "LMCACHE_SERVER_ADDRESS" not in record.getMessage()


def test_a_misspelt_env_var_is_named_with_its_likely_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_server.config"):
        load_config(None, {"LMCACHE_CHUNK_SISE": "4"})
    [record] = caplog.records
    assert "LMCACHE_CHUNK_SISE" in record.getMessage() and "chunk_size" in record.getMessage()


def test_lmcache_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("chunk_size: 128\n")
    assert load_config(None, {"LMCACHE_CONFIG_FILE": str(path)}).chunk_size == 128
    assert load_config(None, {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CONFIG": str(path)}).chunk_size == 128
    other = tmp_path / "t.yaml"
    other.write_text("chunk_size: 64\n")
    with pytest.raises(ConfigError, match="LMCACHE_CONFIG_FILE"):
        load_config(None, {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CONFIG": str(other)})
    # --config still wins over both.
    assert load_config(str(other), {"LMCACHE_CONFIG_FILE": str(path)}).chunk_size == 64


def test_daemon_starts_in_a_kubernetes_pod_environment(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "extra.yaml"
    path.write_text("chunk_size: 128\n")
    daemon = daemon_factory(env={**K8S_ENV, "LMCACHE_CONFIG_FILE": str(path)})
    with daemon.client() as c:
        c.ping()
        assert c.stats()["server"]["chunk_size"] != 128  # the fixture's --config wins over LMCACHE_CONFIG_FILE
    warnings = [line for line in daemon.log().splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and all(name in warnings[0] for name in K8S_ENV), warnings
    assert "LMCACHE_CONFIG_FILE" not in warnings[0]


def test_file_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(path), {})
    with pytest.raises(ConfigError, match="readable"):
        load_config(str(tmp_path / "missing.yaml"), {})


def test_shipped_example_config_is_valid() -> None:
    c = load_config(str(REPO / "deploy" / "server.yaml"), {})
    assert c.local_cpu


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH passed on: the CLI runs the code under test (a worktree's), not an installed copy.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "lmcache_server", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_cli_refuses_bad_value_with_exit_code_2() -> None:
    out = run_cli("--set", "max_local_cpu_size=-5")
    assert out.returncode == 2
    assert "max_local_cpu_size" in out.stderr and "-5" in out.stderr and "expected" in out.stderr


def test_cli_refuses_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_cli("--listen", f"tcp://127.0.0.1:{port}", "--metrics-port", "0", "--max-local-cpu-size", "16MiB")
        assert out.returncode == 2
        assert "'listen'" in out.stderr and "in use" in out.stderr
        out = run_cli(
            "--listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(port), "--max-local-cpu-size", "16MiB"
        )
        assert out.returncode == 2
        assert "'metrics_port'" in out.stderr


def test_cli_print_config_shows_effective_values() -> None:
    out = run_cli("--print-config", "--max-local-cpu-size", "3GiB", "--set", "chunk_size=64")
    assert out.returncode == 0, out.stderr
    assert "max_local_cpu_size: 3GiB" in out.stdout
    assert "chunk_size: 64" in out.stdout


def test_codec_setting_is_checked_without_torch() -> None:
    # `make setup` installs the daemon without torch; the codec setting is still validated.
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from lmcache_server.config import ConfigError, load_config\n"
        "print(load_config(None, {}, {'kv_codec': 'cachegen:bits=3'}).codec.tag)\n"
        "try:\n    load_config(None, {}, {'kv_codec': 'int8:group=7'})\nexcept ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "cachegen.v1-a16b3"
    assert "kv_codec" in out.splitlines()[1] and "one of 8, 16" in out.splitlines()[1]

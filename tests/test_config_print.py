"""``--print-config``: YAML that loads back as the same config, secrets redacted
(and refused if fed back), and quiet when its reader goes away (``| head``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_server.config import ConfigError, load_config
from lmcache_server.configprint import config_yaml

# Keys set away from their defaults, of every shape: sizes that are and are not whole
# GiB, lists, maps, a bare disk path, a codec with parameters, floats, choices.
SETTINGS = {
    "chunk_size": 128,
    "max_local_cpu_size": "96MiB",
    "local_disk": "/var/cache/lmcache server",
    "max_local_disk_size": 1234567,  # bytes as a string below; a bare number is GB
    "remote_url": "redis://cache.internal:6380/2",
    "remote_ttl_s": 3600,
    "listen": ["tcp://127.0.0.1:7000", "ipc:///run/lmcache/lmcache.sock"],
    "tenant_quotas": {"acme": {"memory": "8MiB", "disk": "1GiB"}, "beta": {"disk": "3000B"}},
    "kv_codec": "int8",
    "kv_codec_params": {"group": 64},
    "cache_policy": "lfuda",
    "log_level": "debug",
    "events_endpoint": "tcp://*:5557",
    "events_topic": "kv@{node}@{model}",
    "max_key_inflight_bytes": 0,
}


def run_cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "lmcache_server", *args],
        text=True,
        timeout=60,
        env=env,
        **kwargs,  # type: ignore[call-overload]
    )


def test_printed_config_loads_back_as_the_same_config(tmp_path: Path) -> None:
    settings = {**SETTINGS, "max_local_disk_size": "1234567B"}
    source = tmp_path / "in.yaml"
    source.write_text(yaml.safe_dump(settings))
    out = run_cli("--config", str(source), "--print-config", capture_output=True)
    assert out.returncode == 0, out.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(out.stdout)
    again = load_config(str(printed), {})
    assert again == load_config(str(source), {})
    assert again.max_local_disk_size == 1234567 and again.max_local_cpu_size == 96 << 20
    # and a second round prints the same text
    assert config_yaml(again) == out.stdout


def test_defaults_round_trip() -> None:
    c = load_config(None, {})
    assert load_config(None, {}, yaml.safe_load(config_yaml(c))) == c


def test_secrets_are_redacted_and_refused_when_fed_back(tmp_path: Path) -> None:
    c = load_config(
        None,
        {"LMCACHE_REMOTE_PASSWORD": "hunter2"},
        {"remote_url": "rediss://app:s3cret@cache:6380/0?password=qwerty&ssl_cert_reqs=none", "remote_username": "app"},
    )
    text = config_yaml(c)
    assert "hunter2" not in text and "s3cret" not in text and "qwerty" not in text
    assert text.startswith("#") and "redacted" in text.splitlines()[1].lower()
    printed = yaml.safe_load(text)
    assert printed["remote_password"] == "<redacted>" and "app:<redacted>@cache:6380" in printed["remote_url"]
    assert "ssl_cert_reqs=none" in printed["remote_url"]
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="remote_url.*redacted by --print-config"):
        load_config(str(path), {})
    # with the URL's secrets put back, the password key is the one named
    printed["remote_url"] = "rediss://app@cache:6380/0"
    path.write_text(yaml.safe_dump(printed))
    with pytest.raises(ConfigError, match="'remote_password'.*redacted by --print-config") as info:
        load_config(str(path), {})
    assert "\n" not in str(info.value)
    # the environment's secret wins over the file's redacted value, as for any key
    assert load_config(str(path), {"LMCACHE_REMOTE_PASSWORD": "hunter2"}).remote_password == "hunter2"


def test_print_config_survives_a_reader_that_went_away(tmp_path: Path) -> None:
    """``lmcache-server --print-config | head -0``: the pipe's reader is closed before
    the CLI writes, so the write fails with EPIPE; no traceback, exit 0."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = run_cli("--print-config", stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr

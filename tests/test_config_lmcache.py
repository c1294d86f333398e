"""An LMCache engine config loads: shared keys apply, engine-side keys are one
warning and ignored (file, env, --set alike), a bare ``local_disk`` path is a
directory, and LMCache remote URLs this daemon cannot serve are refused saying
what to use instead."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_server.config import ConfigError, is_mooncake, load_config
from lmcache_server.configvalues import disk_path

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3

# A typical LMCache v1 engine config, written from LMCache's documented keys: the
# shared keys, and the engine side's (blending, layerwise, P2P, PD/NIXL, controller,
# internal API server, extra_config, an encoder-cache override).
ENGINE_SIDE = {
    "save_unfull_chunk": False,
    "use_layerwise": False,
    "enable_async_loading": False,
    "pre_caching_hash_algorithm": "sha256_cbor_64bit",
    "blocking_timeout_secs": 10,
    "lookup_timeout_ms": 3000,
    "enable_blending": False,
    "blend_recompute_ratios": [0.15],
    "blend_special_str": " # # ",
    "enable_p2p": False,
    "p2p_host": "10.0.0.7",
    "p2p_init_ports": [8200],
    "p2p_lookup_ports": [8201],
    "enable_controller": False,
    "lmcache_instance_id": "vllm-0",
    "controller_pull_url": "10.0.0.2:8300",
    "enable_pd": False,
    "pd_role": "sender",
    "pd_buffer_size": 1073741824,
    "pd_buffer_device": "cuda",
    "pd_proxy_host": "10.0.0.3",
    "pd_proxy_port": 7500,
    "transfer_channel": "nixl",
    "nixl_backends": ["UCX"],
    "internal_api_server_enabled": False,
    "extra_config": {"enable_nixl_storage": False},
    "ec_max_local_cpu_size": 1,
}


def lmcache_config(disk: Path) -> dict[str, object]:
    return {
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": 0.0625,  # GB, as LMCache counts them (64 MiB)
        "local_disk": str(disk),  # a bare path, as LMCache accepts
        "max_local_disk_size": 0.125,
        "remote_url": None,
        "remote_serde": "naive",
        "save_decode_cache": False,
        "cache_policy": "LRU",
        **ENGINE_SIDE,
    }


def write(path: Path, data: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lmcache_server", *args], capture_output=True, text=True, timeout=60, env=full
    )


def test_an_lmcache_config_file_loads_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "lmcache.yaml", lmcache_config(tmp_path / "disk"))
    with caplog.at_level(logging.WARNING, logger="lmcache_server.config"):
        c = load_config(str(path), {})
    assert c.chunk_size == 256 and c.max_local_cpu_size == GiB // 16 and c.max_local_disk_size == GiB // 8
    assert c.cache_policy == "lru" and c.remote_url is None
    assert disk_path(c.local_disk or "") == str(tmp_path / "disk")
    [warning] = [r.getMessage() for r in caplog.records]
    assert "LMCache engine-side" in warning and "\n" not in warning
    for key in ENGINE_SIDE:
        assert key in warning


def test_engine_side_keys_are_ignored_alike_from_env_and_command_line(caplog: pytest.LogCaptureFixture) -> None:
    env = {"LMCACHE_SAVE_UNFULL_CHUNK": "True", "LMCACHE_ENABLE_BLENDING": "False", "LMCACHE_CHUNK_SIZE": "128"}
    with caplog.at_level(logging.WARNING, logger="lmcache_server.config"):
        c = load_config(None, env, {"use_layerwise": True, "pd_role": "receiver"})
    assert c.chunk_size == 128
    [warning] = [r.getMessage() for r in caplog.records]  # one line; not the unknown-variable warning
    for name in ("save_unfull_chunk (env LMCACHE_SAVE_UNFULL_CHUNK)", "enable_blending", "use_layerwise (command line)",
                 "pd_role"):  # fmt: skip
        assert name in warning


@pytest.mark.parametrize("path", ["/mnt/nvme/lmcache", "/mnt/nvme/lmcache/", "file:///mnt/nvme/lmcache/"])
def test_local_disk_takes_a_bare_path_or_a_file_url(path: str) -> None:
    c = load_config(None, {}, {"local_disk": path, "max_local_disk_size": 1})
    assert disk_path(c.local_disk or "").rstrip("/") == "/mnt/nvme/lmcache"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("mnt/nvme", "an absolute directory path or a file:// URL"), ("/mnt/a,/mnt/b", "not a comma-separated list")],
)
def test_local_disk_refusals_say_what_to_write(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="local_disk") as info:
        load_config(None, {}, {"local_disk": value, "max_local_disk_size": 1})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("lm://localhost:65432", "point the engines at this daemon"),
        ("infinistore://127.0.0.1:12345?device=mlx5_0", "engine-side connector"),
        ("infinistore://10.0.0.1:12345", "engine-side connector"),
        ("blackhole://", "engine-side connector"),
        ("redis-sentinel://s1:26379,s2:26379/mymaster", "Sentinel is not supported"),
        ("valkey://cache:6379", "speaks the Redis protocol"),
        ("fs:///shared/lmcache", "set local_disk"),
    ],
)
def test_lmcache_remote_urls_are_refused_with_what_to_use(url: str, fragment: str, tmp_path: Path) -> None:
    path = write(tmp_path / "lmcache.yaml", {"remote_url": url})
    for source, args in (
        ("file", (str(path), {})),
        ("env", (None, {"LMCACHE_REMOTE_URL": url})),
        ("command line", (None, {}, {"remote_url": url})),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(*args)  # type: ignore[arg-type]
        message = str(info.value)
        assert f"from {source}" in message
        assert info.value.key == "remote_url" and fragment in message, message
        assert "redis://" in message and "\n" not in message


def test_the_cli_loads_an_lmcache_config_and_prints_it(tmp_path: Path) -> None:
    path = write(tmp_path / "lmcache.yaml", lmcache_config(tmp_path / "disk"))
    for args, env in (
        (["--config", str(path)], {}),
        ([], {"LMCACHE_CONFIG_FILE": str(path)}),
    ):
        out = run_cli(*args, "--print-config", env=env)
        assert out.returncode == 0, out.stderr
        printed = yaml.safe_load(out.stdout)
        assert printed["local_disk"] == str(tmp_path / "disk") and printed["max_local_cpu_size"] == "64MiB"
        assert "save_unfull_chunk" not in printed
        warnings = [line for line in out.stderr.splitlines() if " WARNING " in line]
        assert len(warnings) == 1 and "save_unfull_chunk" in warnings[0], out.stderr
        assert "Traceback" not in out.stderr


def test_the_cli_refuses_lm_url_with_exit_2_and_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "lmcache.yaml", {"chunk_size": 256, "remote_url": "lm://localhost:65432"})
    out = run_cli("--print-config", env={"LMCACHE_CONFIG_FILE": str(path)})
    assert out.returncode == 2 and out.stdout == ""
    [line] = out.stderr.strip().splitlines()
    assert "'remote_url'" in line and "lm://" in line and "redis://" in line and "Traceback" not in line


def test_the_daemon_starts_on_an_lmcache_config(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The fixture writes these keys into the daemon's config file with its own listen
    # addresses and shm_dir, and starts the daemon on it.
    daemon = daemon_factory(**lmcache_config(tmp_path / "disk"))
    with daemon.client() as c:
        c.ping()
        stats = c.stats()
    assert stats["server"]["chunk_size"] == 256
    assert (tmp_path / "disk").is_dir()  # the bare path is the disk tier's directory
    warnings = [line for line in daemon.log().splitlines() if " WARNING " in line]
    assert any("LMCache engine-side" in line and "enable_pd" in line for line in warnings), warnings


def test_an_lmcache_mooncake_config_is_read_with_its_extra_config(tmp_path: Path) -> None:
    """LMCache's own Mooncake setup: ``mooncakestore://`` and the settings in extra_config."""
    path = write(
        tmp_path / "lmcache.yaml",
        {
            "chunk_size": 256,
            "remote_url": "mooncakestore://10.0.0.5:50051/",
            "remote_serde": "naive",
            "extra_config": {
                "local_hostname": "10.0.0.7",
                "metadata_server": "http://10.0.0.5:8080/metadata",
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": "10.0.0.5:50051",
                "global_segment_size": 3355443200,
                "local_buffer_size": 1073741824,
            },
        },
    )
    config = load_config(str(path), {})
    assert is_mooncake(config.remote_url)
    assert config.mooncake_metadata_server == "http://10.0.0.5:8080/metadata"
    assert config.mooncake_local_hostname == "10.0.0.7" and config.mooncake_protocol == "tcp"
    assert config.mooncake_segment_size == 3355443200 and config.mooncake_buffer_size == 1 << 30
    assert config.mooncake_device_name is None
    # A key set directly wins over extra_config; without mooncake:// extra_config stays ignored.
    assert load_config(str(path), {"LMCACHE_MOONCAKE_SEGMENT_SIZE": "2GiB"}).mooncake_segment_size == 2 << 30
    redis = write(tmp_path / "redis.yaml", {"remote_url": "redis://r:6379", "extra_config": {"protocol": "rdma"}})
    assert load_config(str(redis), {}).mooncake_protocol == "tcp"
    # A bad value in extra_config is refused naming the key it stands for.
    bad = write(tmp_path / "bad.yaml", {"remote_url": "mooncakestore://m:50051", "extra_config": {"protocol": "udp"}})
    with pytest.raises(ConfigError) as info:
        load_config(str(bad), {})
    assert info.value.key == "mooncake_protocol" and "extra_config.protocol" in str(info.value)

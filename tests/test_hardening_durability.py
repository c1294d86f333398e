"""Issue 29 item 10 and item 13 (durability and minor hardening).

- A request's ``lmcache_load_wait_s`` never exceeds the configured ``load_wait_s``.
- A spill directory serves one daemon: a second one on it refuses to start.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_client.integrations.vllm_scheduler import SchedulerSide

from .conftest import Daemon


def _request(params: object) -> object:
    return types.SimpleNamespace(request_id="r1", kv_transfer_params=params)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(1e9, 3.0), (float("inf"), 3.0), (float("nan"), 3.0), (1.5, 1.5), (-4, 0.0), ("x", 3.0), (None, 3.0)],
)
def test_a_requests_load_wait_is_capped_at_the_configured_load_wait_s(asked: object, expected: float) -> None:
    scheduler = SchedulerSide([], 256, load_wait_s=3.0)
    assert scheduler._wait_s(_request({"lmcache_load_wait_s": asked})) == expected
    assert scheduler._wait_s(_request({})) == 3.0


def test_a_second_daemon_on_the_same_spill_directory_refuses_to_start(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    root = tmp_path / "spill"
    config = {"local_disk": f"file://{root}", "max_local_disk_size": "64MiB"}
    first = daemon_factory(**config)
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        daemon_factory(**config)
    assert str(root) in str(err.value) and "another daemon" in str(err.value)
    # The first one still serves, its spill directory untouched.
    with first.client() as c:
        c.ping()
    assert first.stop() == 0
    # Once it stopped, the directory is free again.
    daemon_factory(**config).stop()

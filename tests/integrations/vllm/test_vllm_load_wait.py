"""A request's ``lmcache_load_wait_s`` (kv_transfer_params) never exceeds the operator's
``load_wait_s`` (issue 29 item 13): the scheduler side caps it, and a value it cannot read
is the setting."""

from __future__ import annotations

import types

import pytest

from lmcache_client.integrations.vllm.scheduler import SchedulerSide


def _request(params: object) -> object:
    return types.SimpleNamespace(request_id="r1", kv_transfer_params=params)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(1e9, 3.0), (float("inf"), 3.0), (float("nan"), 3.0), (1.5, 1.5), (-4, 0.0), ("x", 3.0), (None, 3.0)],
)
def test_a_requests_load_wait_is_capped_at_the_configured_load_wait_s(asked: object, expected: float) -> None:
    scheduler = SchedulerSide([], 256, load_wait_s=3.0)
    assert scheduler._matcher.wait_s(_request({"lmcache_load_wait_s": asked})) == expected
    assert scheduler._matcher.wait_s(_request({})) == 3.0

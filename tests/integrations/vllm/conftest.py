"""Fixtures of the vLLM connector's tests.

Stand-in tests: engines (tests/integrations/vllm/vllm_harness/engine.py) on one daemon per
module, each test in a tenant of its own.  Real-vLLM tests (vllm_harness/fixtures.py, here
for every module of this folder): ``vllm_python`` (vLLM's venv), ``forkserver`` (vLLM
imported once per session, each harness process forked from it), ``checkpoints`` and
``models`` (the test checkpoints, each built once per session)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ...conftest import Daemon
from .vllm_harness.engine import Engine
from .vllm_harness.fixtures import checkpoints, forkserver, models, vllm_python  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def shared_daemon(module_daemon_factory: Callable[..., Daemon]) -> Daemon:
    return module_daemon_factory()


@pytest.fixture
def address(shared_daemon: Daemon) -> str:
    return shared_daemon.address


@pytest.fixture
def engines(address: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., Engine]]:
    """Engines on the module's daemon, in a tenant of the test's own."""
    made: list[Engine] = []
    tenant = "".join(c if c.isalnum() else "-" for c in request.node.name)

    def make(**kwargs: Any) -> Engine:
        kwargs.setdefault("address", address)
        kwargs.setdefault("tenant", tenant)
        made.append(Engine(**kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.scheduler.shutdown()
        engine.worker.shutdown()

"""Fixtures of the Dynamo tests: Dynamo's python and one indexer process per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .indexer import DYNAMO_PYTHON, DynamoIndexer


@pytest.fixture(scope="session")
def dynamo_python() -> Path:
    if not DYNAMO_PYTHON.exists():
        pytest.fail(
            f"Dynamo's venv is missing ({DYNAMO_PYTHON}): build it with `make setup-dynamo` "
            "(ai-dynamo-runtime in .venv-dynamo, CPU-only)"
        )
    return DYNAMO_PYTHON


@pytest.fixture(scope="module")
def dynamo_indexer(dynamo_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoIndexer]:
    indexer = DynamoIndexer(dynamo_python, tmp_path_factory.mktemp("dynamo"))
    try:
        yield indexer
    finally:
        indexer.stop()

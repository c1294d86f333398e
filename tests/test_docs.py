"""Docs match the code: every config key, op and error code is documented."""

from __future__ import annotations

import re
from pathlib import Path

from lmcache_client.protocol import ErrorCode, Op, PutStatus
from lmcache_server.config import FIELDS

REPO = Path(__file__).resolve().parents[1]


def test_readme_documents_every_config_key() -> None:
    readme = (REPO / "README.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_0-9]+)` \|", readme, flags=re.M))
    assert documented == set(FIELDS)


def test_example_config_mentions_every_key() -> None:
    text = (REPO / "deploy" / "server.yaml").read_text()
    missing = [k for k in FIELDS if not re.search(rf"^#? ?{k}:", text, flags=re.M)]
    assert not missing


def test_protocol_doc_covers_ops_and_codes() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    for op in Op:
        assert f"`{op.value}`" in doc, op
    for code in ErrorCode:
        assert code.name in doc and str(int(code)) in doc, code
    for status in PutStatus:
        assert status.name in doc, status


def test_readme_commands_match_ci() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in ci

"""Docs match the code: every config key (its type and default), op and error code is
documented; the README's commands are the Makefile's, CI's and the tested engine
command lines; every link of the README and docs/ leads somewhere."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from lmcache_client.protocol import ErrorCode, Op, PutStatus
from lmcache_server.config import FIELDS, load_config

REPO = Path(__file__).resolve().parents[1]


def config_table() -> dict[str, tuple[str, str, str]]:
    """docs/configuration.md's key table: key -> (type, default, meaning)."""
    text = (REPO / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_0-9]+)` \| (.*?) \| (.*?) \| (.*) \|$", text, flags=re.M)
    table = {key: (kind, default, meaning) for key, kind, default, meaning in rows}
    assert len(table) == len(rows), "a key is documented twice"
    return table


def test_configuration_doc_documents_every_config_key() -> None:
    table = config_table()
    assert set(table) == set(FIELDS)
    assert all(meaning.strip() for _, _, meaning in table.values())


def test_configuration_doc_gives_each_keys_default() -> None:
    """A documented default, read as YAML and parsed by the key's own parser, is the
    code's default; "unset" is None."""
    for key, (_, default, _) in config_table().items():
        field = FIELDS[key]
        code = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        if default == "unset":
            assert code is None, key
            continue
        written = re.match(r"`([^`]*)`", default)
        assert written, f"{key}: default {default!r} is neither `value` nor unset"
        parsed = field.metadata["parse"](yaml.safe_load(written.group(1)))
        # a string default may be spelled as the parser normalises it (log_level INFO -> info)
        assert parsed == code or (isinstance(code, str) and parsed == field.metadata["parse"](code)), key


def test_configuration_doc_gives_each_keys_type() -> None:
    """The type column says what the key's parser takes: sizes, integers, seconds,
    numbers, booleans by their parser; a choice's values exactly as the daemon's
    refusal names them."""
    families = {"size": "size", "int_in": "integer", "float_in": "number", "boolean": "bool", "choice": "one of"}
    for key, (kind, _, _) in config_table().items():
        field = FIELDS[key]
        family = families.get(getattr(field.metadata["parse"], "__qualname__", "").split(".")[0])
        if family == "number" and key.endswith("_s"):
            family = "seconds"
        if family is None:
            assert kind and kind.split()[0] not in families.values(), key
        elif family == "one of":
            options = re.findall(r"`([^`]+)`", kind)
            assert kind.startswith("one of ") and options, key
            assert set(options) == set(re.split(r", | or ", field.metadata["expected"])), key
            for option in options:
                field.metadata["parse"](option)  # accepted (ValueError otherwise)
        else:
            assert kind == family, key


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


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.M | re.S)


def test_readme_commands_match_ci() -> None:
    """The two commands: blocks of their own in the README, targets of the Makefile
    (`make test` printing its slowest tests), and `make test` is what CI runs."""
    blocks = [block.strip() for block in readme_blocks("sh")]
    assert "make run" in blocks and "make test" in blocks
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, flags=re.M)
    test_recipe = re.search(r"^test: .*\n\t(.*)\n", makefile, flags=re.M)
    assert test_recipe and "pytest" in test_recipe.group(1) and "--durations=20" in test_recipe.group(1)
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)


def test_readme_is_a_front_door() -> None:
    """At most ~200 lines; the issue tracker's history lives in docs/status.md."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert not re.search(r"issues? #\d", readme, flags=re.I)


def test_readme_engine_commands_are_the_tested_ones() -> None:
    """The README's vLLM block is docs/integrations.md's vllm-replica-command block, which
    tests/integrations/vllm/test_vllm_server.py runs verbatim; its SGLang command is the
    SGLang section's, whose extra config tests/integrations/sglang/test_sglang_real.py
    has SGLang's own factory build the backend from."""
    docs = (REPO / "docs" / "integrations.md").read_text()
    vllm = re.search(r"<!-- vllm-replica-command[: ].*?-->\s*```sh\n(.*?)```", docs, flags=re.S)
    sglang = re.search(r"^## SGLang.*?```sh\n(.*?)```", docs, flags=re.M | re.S)
    assert vllm and sglang
    blocks = readme_blocks("sh")
    assert vllm.group(1) in blocks
    assert sglang.group(1) in blocks


def test_readme_minimal_config_loads(tmp_path: Path) -> None:
    (block,) = readme_blocks("yaml")
    path = tmp_path / "server.yaml"
    path.write_text(block)
    config = load_config(str(path), environ={})
    assert config.max_local_cpu_size == 40 << 30 and config.local_disk is not None


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    found = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", text, flags=re.M):
        slug = _slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_links_of_the_readme_and_docs_lead_somewhere() -> None:
    """Every relative link of README.md, client/README.md and docs/*.md names a file of
    the repository and, with a #fragment into a markdown file, one of its headings."""
    pages = [REPO / "README.md", REPO / "client" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken


def test_one_vllm_command_line_everywhere() -> None:
    """Every vLLM command line the docs show loads our connector with
    kv_load_failure_policy recompute (a chunk evicted between lookup and load is
    recomputed, never a failed request), none uses the old ``vllm serve --model``
    form, and the canonical line and its CPU-build variant differ only in how vLLM is
    started (tests/integrations/vllm/test_vllm_server.py runs both verbatim)."""
    import json

    texts = {p.name: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    configs = []
    for name, text in texts.items():
        assert "vllm serve --model" not in text, name
        for raw in re.findall(r"--kv-transfer-config '(\{.*?\})'", text):
            config = json.loads(raw)
            if config.get("kv_connector") == "LMCacheServerConnectorV1":
                assert config.get("kv_load_failure_policy") == "recompute", (name, raw)
                configs.append(config)
    assert len(configs) >= 4
    docs = texts["integrations.md"]
    blocks = {
        marker: re.search(rf"<!-- {marker}[: ].*?-->\s*```sh\n(.*?)```", docs, flags=re.S)
        for marker in ("vllm-replica-command", "vllm-replica-command-cpu")
    }
    canonical, cpu = (b.group(1) for b in blocks.values() if b)
    assert 'vllm serve "$MODEL"' in canonical and "api_server --model" in cpu
    config_of = re.compile(r"--kv-transfer-config '(\{.*?\})'")
    assert config_of.findall(canonical) == config_of.findall(cpu)

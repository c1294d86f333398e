"""The admin CLI's cache commands (``lmcache-server admin pin|unpin|delete|prefetch|namespace``):
the keys are the vLLM connector's (its own key_root / request_params / prompt_keys code,
no vLLM needed), and the commands run end to end as a real process against a real daemon."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmcache_client import PutStatus
from lmcache_client.integrations.vllm.params import request_params
from lmcache_client.integrations.vllm.scheduler import key_root
from lmcache_client.integrations.vllm.scheduler.matcher import Matcher
from lmcache_server.admincache import prompt_keys

from .conftest import NAMESPACE, Daemon
from .security.test_security import NS_A, Keys, start_daemon, stop
from .test_admin import admin

CHUNK = 16
WORDS = 200
SPECIALS = ["<unk>", "<s>", "</s>"]


def connector_keys(prompt: list[int], chunk_size: int, salt: str | None, tags: list[str] | None) -> list[bytes]:
    """What the vLLM connector stores ``prompt``'s KV under (scheduler/matcher.py), for a request
    with that ``cache_salt`` and ``lmcache_tags``."""
    params = {"lmcache_tags": tags} if tags is not None else {}
    request = SimpleNamespace(
        prompt_token_ids=prompt,
        cache_salt=salt,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
        kv_transfer_params=params,
    )
    root = key_root(request, request_params(request).tags)
    assert root is not None
    keys, tail = Matcher.prompt_keys(SimpleNamespace(chunk_size=chunk_size), prompt, root)  # type: ignore[arg-type]
    return keys + ([tail] if tail is not None else [])


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 64])
@pytest.mark.parametrize(
    ("salt", "tags", "cli_tags"),
    [(None, None, None), ("s3cret", None, None), (None, ["b", "a", "b"], "b,a,b"), ("s", ["t"], "t")],
)
def test_the_cli_keys_are_the_connectors(
    length: int, salt: str | None, tags: list[str] | None, cli_tags: str | None
) -> None:
    prompt = [(7 * i + 3) % 5000 for i in range(length)]
    assert prompt_keys(prompt, CHUNK, salt, cli_tags) == connector_keys(prompt, CHUNK, salt, tags)


def test_salt_and_tags_change_the_keys() -> None:
    prompt = list(range(40))
    plain = prompt_keys(prompt, CHUNK)
    assert len(plain) == 3  # two full chunks and a tail of 8
    assert prompt_keys(prompt, CHUNK, salt="x")[0] != plain[0]
    assert prompt_keys(prompt, CHUNK, tags="a")[0] != plain[0]
    assert prompt_keys(prompt, CHUNK, tags="a,b") == prompt_keys(prompt, CHUNK, tags="b,a")


def tokenizer_dir(folder: Path) -> Path:
    """A word-level tokenizer.json built here (``w0`` .. ``w199``, BOS ``<s>`` added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    table = {name: i for i, name in enumerate(SPECIALS)}
    table.update({f"w{i}": i + len(SPECIALS) for i in range(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def run(daemon: Daemon, *args: str) -> dict[str, int]:
    out = admin(*args, "--address", daemon.address, "--json")
    assert out.returncode == 0, out.stderr
    result: dict[str, int] = json.loads(out.stdout)
    return result


def test_pin_unpin_prefetch_delete_by_token_ids(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = daemon_factory()
    prompt = list(range(100, 150))  # 3 chunks of 16 and a tail of 2
    keys = connector_keys(prompt, CHUNK, "s", ["team"])
    with daemon.client() as c:
        assert c.put(keys, [os.urandom(4096) for _ in keys]) == [PutStatus.STORED] * 4
    ids = ",".join(map(str, prompt))
    target = ["--namespace", NAMESPACE, "--chunk-size", str(CHUNK), "--salt", "s", "--tags", "team"]
    assert run(daemon, "pin", "--tokens", ids, *target)["pinned"] == 4
    listing = run(daemon, "namespace", NAMESPACE)
    assert (listing["chunks"], listing["pinned_chunks"], listing["pinned_bytes"]) == (4, 4, 4 * 4096)
    text = admin("namespace", NAMESPACE, "--address", daemon.address)
    assert text.returncode == 0 and "pinned: 4 chunks, 16.00 KiB" in text.stdout, text.stdout
    # the same prompt without its tags names other keys: nothing to act on
    untagged = run(daemon, "unpin", "--tokens", ids, "--namespace", NAMESPACE, "--chunk-size", str(CHUNK))
    assert (untagged["unpinned"], untagged["not_acted"]) == (0, 4)
    (tmp_path / "prompt.txt").write_text(" ".join(map(str, prompt)) + "\n")
    assert run(daemon, "unpin", "--tokens-file", str(tmp_path / "prompt.txt"), *target)["unpinned"] == 4
    prefetched = run(daemon, "prefetch", "--tokens", ids, *target)
    assert (prefetched["in_memory"], prefetched["was_in_memory"], prefetched["not_found"]) == (4, 4, 0)
    (tmp_path / "prompt.json").write_text(json.dumps(prompt[:40]))  # 2 chunks and a tail of 8: a new tail key
    deleted = run(daemon, "delete", "--tokens-file", str(tmp_path / "prompt.json"), *target)
    assert (deleted["deleted"], deleted["not_acted"]) == (2, 1)
    out = admin("delete", "--tokens", ids, *target, "--address", daemon.address)
    assert out.returncode == 0 and out.stdout.strip() == f"deleted 2 of 4 chunks in {NAMESPACE}; 2 not found"


def test_prefetch_and_pin_by_text_with_a_tokenizer(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = daemon_factory()
    words = [f"w{i % WORDS}" for i in range(37)]
    prompt = [1] + [i % WORDS + len(SPECIALS) for i in range(37)]  # BOS, then the words' ids
    keys = connector_keys(prompt, CHUNK, None, None)
    assert len(keys) == 3
    with daemon.client() as c:
        assert c.put(keys[:2], [os.urandom(1000)] * 2) == [PutStatus.STORED] * 2
    folder = tokenizer_dir(tmp_path / "tok")
    target = ["--namespace", NAMESPACE, "--chunk-size", str(CHUNK), "--text", " ".join(words)]
    for tokenizer in (str(folder), str(folder / "tokenizer.json")):
        pinned = run(daemon, "pin", *target, "--tokenizer", tokenizer)
        assert (pinned["pinned"], pinned["not_acted"]) == (2, 1)
    # without BOS the prompt, and so every key, differs
    other = run(daemon, "prefetch", *target, "--tokenizer", str(folder), "--no-special-tokens")
    assert (other["in_memory"], other["not_found"]) == (0, 3)


def test_bad_input_gets_a_clear_error(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = daemon_factory(max_keys_per_request=8)
    base = ["--address", daemon.address, "--namespace", NAMESPACE, "--chunk-size", str(CHUNK)]
    cases = {
        ("--tokens", "1,2,x"): "token 2 is 'x', not an integer",
        ("--tokens", "1,-2"): "token 1 is -2, outside 0..4294967295",
        ("--tokens", str(2**32)): "outside 0..4294967295",
        ("--tokens", ","): "no token ids",
        ("--tokens-file", str(tmp_path / "missing")): "cannot read tokens file",
        ("--tokens", ",".join(["1"] * (CHUNK * 9))): "the daemon takes at most 8 keys per request",
        ("--tokens", ",".join(["1"] * 500)): "the daemon takes at most 8 keys per request",
        ("--text", "w1 w2"): "--text needs --tokenizer",
        ("--text", "w1", "--tokenizer", str(tmp_path / "nothing")): "no such file or folder",
        ("--tokens", "1,2", "--tags", "a,,b"): "--tags: at most 16 non-empty tags",
        ("--tokens", "1,2", "--chunk-size", "0"): "--chunk-size must be positive",
    }
    (tmp_path / "bad.json").write_text("[1, 2")
    cases[("--tokens-file", str(tmp_path / "bad.json"))] = "not a JSON array of token ids"
    for args, message in cases.items():
        out = admin("pin", *base, *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = admin("pin", *base, "--tokens", "1", "--text", "w1")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


def test_with_curve_a_tenant_key_acts_on_its_own_namespace_only(tmp_path: Path) -> None:
    keys = Keys(tmp_path / "keys")
    daemon = start_daemon(tmp_path / "daemon", keys.config(), **keys.options("admin"))
    try:
        prompt = list(range(40))
        stored = connector_keys(prompt, CHUNK, None, None)
        with daemon.client(**keys.options("tenant-a")) as a:
            assert a.put(stored, [b"x" * 100] * 3, namespace=NS_A) == [PutStatus.STORED] * 3
        target = ["--namespace", NS_A, "--chunk-size", str(CHUNK), "--tokens", ",".join(map(str, prompt))]
        target += ["--address", daemon.address, "--server-public-key", keys.server_public]
        for command in ("pin", "delete", "prefetch"):
            out = admin(command, *target, "--client-secret-key", keys.secret("tenant-b"))
            assert out.returncode == 1 and "FORBIDDEN" in out.stderr, (command, out.stderr)
        out = admin("namespace", NS_A, "--address", daemon.address, "--server-public-key", keys.server_public,
                    "--client-secret-key", keys.secret("tenant-b"))  # fmt: skip
        assert out.returncode == 1 and "FORBIDDEN" in out.stderr
        out = admin("pin", *target, "--client-secret-key", keys.secret("tenant-a"))
        assert out.returncode == 0 and out.stdout.startswith("pinned 3 of 3 chunks"), out.stderr
        out = admin("namespace", NS_A, "--address", daemon.address, "--server-public-key", keys.server_public,
                    "--client-secret-key", keys.secret("tenant-a"), "--json")  # fmt: skip
        assert out.returncode == 0 and json.loads(out.stdout)["pinned_chunks"] == 3, out.stderr
    finally:
        stop(daemon)


NS32 = NAMESPACE.replace("|c16", "|c32")
OTHER_MODEL = NAMESPACE.replace("test-model", "other-model")


def test_model_names_every_namespace_of_that_model(daemon_factory: Callable[..., Daemon]) -> None:
    """``--model`` as ``who-has --model``: every namespace whose model id it is, each keyed at its
    own ``c<N>`` chunk size; other models' namespaces untouched."""
    daemon = daemon_factory()
    prompt = list(range(300, 370))  # 70 tokens: 4 chunks of 16 and a tail, or 2 of 32 and a tail
    k16, k32 = connector_keys(prompt, 16, None, None), connector_keys(prompt, 32, None, None)
    with daemon.client() as c:
        assert c.put(k16, [b"a" * 4096] * 5) == [PutStatus.STORED] * 5
        assert c.put(k32, [b"b" * 4096] * 3, namespace=NS32) == [PutStatus.STORED] * 3
        assert c.put(k16, [b"c" * 4096] * 5, namespace=OTHER_MODEL) == [PutStatus.STORED] * 5
    ids = ",".join(map(str, prompt))
    pinned = run(daemon, "pin", "--model", "test-model", "--tokens", ids)  # no --chunk-size
    assert pinned["model"] == "test-model"
    assert [(r["namespace"], r["chunks"], r["pinned"]) for r in pinned["namespaces"]] == [
        (NAMESPACE, 5, 5),
        (NS32, 3, 3),
    ]
    listed = run(daemon, "namespace", "--model", "test-model")
    assert [(r["name"], r["pinned_chunks"]) for r in listed["namespaces"]] == [(NAMESPACE, 5), (NS32, 3)]
    # one form for every command: --namespace NS; the bare NS of `namespace` is still taken
    assert run(daemon, "namespace", "--namespace", OTHER_MODEL) == run(daemon, "namespace", OTHER_MODEL)
    assert run(daemon, "namespace", "--namespace", OTHER_MODEL)["pinned_chunks"] == 0
    out = admin("delete", "--model", "test-model", "--tokens", ids, "--address", daemon.address)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"deleted 5 of 5 chunks in {NAMESPACE}; 0 not found",
                                       f"deleted 3 of 3 chunks in {NS32}; 0 not found"]  # fmt: skip
    with daemon.client() as c:
        assert c.exists(k16) == [False] * 5 and c.exists(k16, namespace=OTHER_MODEL) == [True] * 5


def test_model_and_namespace_usage_errors(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory()
    with daemon.client() as c:
        c.put(connector_keys(list(range(16)), CHUNK, None, None), [b"x" * 100])
    at = ("--address", daemon.address)
    out = admin("pin", "--model", "no-such-model", "--tokens", "1,2,3", *at)
    assert out.returncode == 1, out
    assert out.stderr.strip() == (
        "pin: the daemon holds no namespace of model 'no-such-model' (admin namespaces lists them)"
    )
    out = admin("namespace", NAMESPACE, "--namespace", NAMESPACE, *at)
    assert out.returncode == 2 and "name the namespace once" in out.stderr, out
    out = admin("namespace", *at)
    assert out.returncode == 2 and "give --namespace NS or --model MODEL" in out.stderr, out
    out = admin("pin", "--namespace", NAMESPACE, "--model", "test-model", "--tokens", "1", *at)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr, out
    for command in ("pin", "unpin", "delete", "prefetch"):
        out = admin(command, "--tokens", "1", *at)  # neither given
        assert out.returncode == 2 and "one of the arguments --namespace --model is required" in out.stderr, out

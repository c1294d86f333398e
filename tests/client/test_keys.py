"""Canonical chunk keys: documented algorithm, deterministic across processes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from lmcache_client import ChunkHasher, Namespace, chain_key, chunk_keys
from lmcache_client.keys import KEY_DOMAIN, ROOT_KEY, prompt_keys, request_root, tail_key

SCRIPT = "import sys; from lmcache_client import chunk_keys; print(chunk_keys(list(range(1000)), 256)[-1].hex())"


def test_matches_documented_algorithm() -> None:
    tokens = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    keys = chunk_keys(tokens, 4)
    assert len(keys) == 2  # the 1-token tail gets no key
    k0 = hashlib.sha256(KEY_DOMAIN + ROOT_KEY + struct.pack("<4I", 7, 8, 9, 10)).digest()
    k1 = hashlib.sha256(KEY_DOMAIN + k0 + struct.pack("<4I", 11, 12, 13, 14)).digest()
    assert keys == [k0, k1]
    assert chain_key(k0, [11, 12, 13, 14]) == k1


@pytest.mark.parametrize(
    ("length", "full", "tail"), [(1, 0, False), (2, 0, True), (8, 2, False), (9, 2, False), (10, 2, True)]
)
def test_prompt_keys_store_a_tail_of_two_tokens_or_more(length: int, full: int, tail: bool) -> None:
    """A prompt's stored keys: its full chunks', then its tail's unless that is one token
    (the prompt's last, which the engine always computes) or none."""
    prompt = list(range(100, 100 + length))
    root = request_root(None, "salt")
    keys, tail_k = prompt_keys(prompt, 4, root)
    assert keys == chunk_keys(prompt, 4, root) and len(keys) == full
    assert tail_k == (tail_key(keys[-1] if keys else root, prompt[full * 4 :]) if tail else None)


def test_prefix_dependence() -> None:
    a = chunk_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second chunk, different prefix -> different key
    assert chunk_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a


def test_same_keys_in_other_processes_and_hash_seeds() -> None:
    mine = chunk_keys(list(range(1000)), 256)[-1].hex()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == mine


def test_accepts_tensors_and_iterables() -> None:
    torch = pytest.importorskip("torch")
    tokens = list(range(40))
    expected = ChunkHasher(16).keys(tokens)
    assert chunk_keys(torch.tensor(tokens), 16) == expected
    assert chunk_keys(iter(tokens), 16) == expected


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_rejects_bad_token_ids(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        chunk_keys(bad, 1)  # type: ignore[arg-type]


def test_namespace_wire_format() -> None:
    ns = Namespace("meta-llama/Llama-3.1-8B", "bfloat16", 32, 8, 128, 256, tp_rank=1, tp_size=2, tenant="acme")
    assert ns.wire() == "meta-llama/Llama-3.1-8B|bfloat16|L32|KV8|D128|tp1of2|c256|tenant=acme"
    assert ns.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    with pytest.raises(ValueError):
        Namespace("m", "float16", 1, 1, 1, 16, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        Namespace("a|b", "float16", 1, 1, 1, 16)


def test_namespace_dtype_spellings_share_one_namespace() -> None:
    torch = pytest.importorskip("torch")
    a = Namespace("m", torch.bfloat16, 2, 2, 64, 16)  # type: ignore[arg-type]
    b = Namespace("m", "bf16", 2, 2, 64, 16)
    c = Namespace("m", "bfloat16", 2, 2, 64, 16)
    assert a.wire() == b.wire() == c.wire() == "m|bfloat16|L2|KV2|D64|tp0of1|c16"
    with pytest.raises(ValueError, match="unknown dtype"):
        Namespace("m", "float128", 2, 2, 64, 16)


def test_namespace_codec_field() -> None:
    raw = Namespace("m", "bf16", 2, 2, 64, 16, layout="L2THD", tenant="acme")
    coded = Namespace("m", "bf16", 2, 2, 64, 16, layout="L2THD", tenant="acme", codec="int8.v1-g32")
    # the codec goes before the tenant: the daemon reads the tenant as the last field
    assert coded.wire() == "m|bfloat16|L2|KV2|D64|tp0of1|c16|layout=L2THD|codec=int8.v1-g32|tenant=acme"
    assert raw.wire() != coded.wire()
    assert (
        Namespace("m", "bf16", 2, 2, 64, 16, codec="int8.v1-g64").wire()
        != Namespace("m", "bf16", 2, 2, 64, 16, codec="int8.v1-g32").wire()
    )
    for bad in ("a|b", "int8 g32", ""):
        if bad:
            with pytest.raises(ValueError, match="codec"):
                Namespace("m", "bf16", 2, 2, 64, 16, codec=bad)

"""The KV codec wired through real daemons: hello, namespaces, corrupt frames, the HF adapter.

Each daemon is started with a ``kv_codec`` setting and announces it in
``hello``; the adapters encode with it under the codec's namespace.  The
model is the 4-layer GQA Llama of test_hf_adapter (seeded, no download),
chunks of 16 tokens.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zstandard")

from lmcache_client import CacheClient, chunk_keys  # noqa: E402
from lmcache_client.integrations.chunklayout import ChunkLayout  # noqa: E402
from lmcache_client.integrations.hf import CachedPrefill  # noqa: E402
from lmcache_client.integrations.transfer import ChunkTransfer  # noqa: E402

from ..conftest import Daemon, RedisServer, wait_for  # noqa: E402
from ._hf_replica import VOCAB, build_model  # noqa: E402

CHUNK = 16
MODEL_ID = "test/llama-4L-256-gqa"
MODES = {"none": "none", "lossless": "lossless", "int8": "int8", "cachegen": "cachegen"}


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, VOCAB, (n,), generator=g)]  # no 0: generate() masks pad_token_id 0


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model()


@pytest.fixture(scope="module")
def daemons(module_daemon_factory: Callable[..., Daemon]) -> dict[str, Daemon]:
    """One daemon per codec mode (the codec is a daemon setting)."""
    return {mode: module_daemon_factory(kv_codec=spec) for mode, spec in MODES.items()}


def adapter(model: Any, client: CacheClient, tenant: str) -> CachedPrefill:
    return CachedPrefill(model, client, model_id=MODEL_ID, chunk_size=CHUNK, tenant=tenant)


def tenant_of(request: pytest.FixtureRequest) -> str:
    return request.node.name.replace("[", "-").replace("]", "")


def test_hello_announces_the_codec(daemons: dict[str, Daemon]) -> None:
    with daemons["none"].client() as c:
        assert c.hello()["codec"] is None
    with daemons["int8"].client() as c:
        assert c.hello()["codec"] == {"mode": "int8", "params": {"bits": 8, "group": 32}}
    with daemons["cachegen"].client() as c:
        assert c.hello()["codec"]["mode"] == "cachegen"


E2E_CHUNK = 128
"""Chunks of the end-to-end test: cachegen's per-channel side information is 32 bits per
channel, 2 bits per element of a 16-token chunk; at 128 tokens it is a quarter bit."""
# Bounds on the largest logit error of a warm prefill, relative to the largest logit.
# Measured on the test model (seeded random weights, which amplify KV error: int8's KV
# is within 0.5% rms): none and lossless 0, int8 0.048, cachegen 0.28-0.50 (as its bit
# allocation changed); greedy tokens: all 8 equal for int8, for cachegen the first 1-3
# (random-weight logits are nearly flat, so greedy decoding diverges after the first
# difference: only the first token is held to it).  The quality on a trained model is
# benchmarks/codec_quality.py's (docs/codec.md).
LOGIT_ERROR_BOUND = {"none": 1e-4, "lossless": 1e-4, "int8": 0.1, "cachegen": 1.0}
MIN_AGREEMENT = {"int8": 0.75, "cachegen": 0.0}


@pytest.mark.parametrize("mode", list(MODES))
def test_hf_adapter_end_to_end_with_each_mode(
    model: Any, daemons: dict[str, Daemon], mode: str, request: pytest.FixtureRequest
) -> None:
    prompt = tokens(400, seed=3)
    reused = 3 * E2E_CHUNK
    ids = torch.tensor([prompt])
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
    with torch.inference_mode():
        full = model(ids).logits[0, reused:]
    with daemons[mode].client() as client:
        a = CachedPrefill(model, client, model_id=MODEL_ID, chunk_size=E2E_CHUNK, tenant=tenant_of(request))
        cold = a.generate(prompt, 8)
        assert cold.prefill.saved_chunks == 3
        ns = a.transfer.namespace
        assert ("codec=" in ns) == (mode != "none") and (mode == "none" or f"codec={mode}." in ns)
        warm = a.prefill(prompt, all_logits=True, save=False)
        assert warm.reused_tokens == reused and a.transfer.codec_errors == 0
        stored = [bytes(b) for b in client.get(warm.keys[:3], namespace=ns)]
        raw = a.layout.nbytes
        sizes = [len(b) for b in stored]
        again = a.generate(prompt, 8)
    error = float((warm.logits[0].float() - full.float()).abs().max()) / float(full.float().abs().max())
    agree = sum(x == y for x, y in zip(again.tokens, plain)) / len(plain)
    print(f"codec {mode}: frames {sizes} of {raw} raw bytes; max logit error / max logit {error:.4g}; agree {agree}")
    assert error <= LOGIT_ERROR_BOUND[mode], error
    if mode in ("none", "lossless"):
        assert again.tokens == plain  # bit-identical KV: the output of no cache
        assert all(s < raw for s in sizes) if mode == "lossless" else sizes == [raw] * 3
    else:
        assert all(s <= raw // 3 for s in sizes), (sizes, raw)
        assert again.tokens[0] == plain[0] and agree >= MIN_AGREEMENT[mode], (again.tokens, plain)


def test_raw_and_encoded_chunks_never_mix(model: Any, daemons: dict[str, Daemon]) -> None:
    """On one daemon: what the codec adapter stores is invisible to a raw transfer of the
    same model and layout, and raw chunks under the raw namespace are invisible to it."""
    prompt = tokens(80, seed=5)
    with daemons["lossless"].client() as client:
        coded = adapter(model, client, "mix")
        layout = coded.layout
        raw = ChunkTransfer(client, layout.namespace(MODEL_ID, tenant="mix"), layout.nbytes)  # no codec_layout
        assert coded.prefill(prompt).saved_chunks == 5
        keys = chunk_keys(prompt, CHUNK)
        assert coded.transfer.lookup(keys) == 5
        assert raw.lookup(keys) == 0 and raw.namespace != coded.transfer.namespace
        # raw chunks under the raw namespace: the codec adapter never reads them
        other = tokens(80, seed=6)
        other_keys = chunk_keys(other, CHUNK)
        assert raw.put(other_keys, [os.urandom(layout.nbytes) for _ in other_keys]) == 5
        result = coded.prefill(other, save=False)
        assert result.reused_tokens == 0 and coded.transfer.codec_errors == 0


def test_two_codec_settings_never_mix_across_a_shared_redis(
    model: Any, daemon_factory: Callable[..., Daemon], redis_server: RedisServer
) -> None:
    """Daemons sharing one Redis with int8 group 32, int8 group 64 and no codec: only the
    daemon with the same setting reads what the first stored."""
    settings = {"g32": "int8:group=32", "g64": "int8:group=64", "raw": "none", "g32b": "int8"}
    nodes = {name: daemon_factory(remote_url=redis_server.url, kv_codec=s) for name, s in settings.items()}
    prompt = tokens(80, seed=7)
    keys = chunk_keys(prompt, CHUNK)
    with nodes["g32"].client() as c:
        assert adapter(model, c, "fleet").prefill(prompt).saved_chunks == 5
        wait_for(lambda: c.stats()["tiers"]["redis"]["queued_writes"] == 0)
    hits = {}
    for name in ("g64", "raw", "g32b"):
        with nodes[name].client() as c:
            a = adapter(model, c, "fleet")
            hits[name] = (a.transfer.lookup(keys), a.prefill(prompt, save=False).reused_tokens)
    assert hits == {"g64": (0, 0), "raw": (0, 0), "g32b": (5, 64)}


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_corrupt_or_truncated_frame_is_a_miss(
    model: Any, daemons: dict[str, Daemon], shared_memory: bool, request: pytest.FixtureRequest
) -> None:
    """Garbage stored under a codec namespace key, or a frame cut short, ends the prefix
    there: the adapter recomputes and its output is the uncached one."""
    prompt = tokens(100, seed=8)
    ids = torch.tensor([prompt])
    plain = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
    with daemons["lossless"].client(shared_memory=shared_memory) as client:
        a = adapter(model, client, tenant_of(request))
        keys = chunk_keys(prompt, CHUNK)
        # chunk 0 valid, chunk 1 truncated, chunk 2 garbage, the rest valid
        assert a.prefill(prompt).saved_chunks == 6
        ns = a.transfer.namespace
        assert "codec=lossless" in ns
        frames = [bytes(f) for f in client.get(keys, namespace=ns)]
        client.delete(keys[1:3], namespace=ns)
        client.put([keys[1]], [frames[1][: len(frames[1]) // 2]], namespace=ns)
        client.put([keys[2]], [os.urandom(len(frames[2]))], namespace=ns)
        assert a.transfer.lookup(keys) == 6  # the daemon holds them all: it cannot tell
        result = a.generate(prompt, 4, save=False)
        assert result.prefill.reused_tokens == CHUNK and result.tokens == plain
        assert a.transfer.codec_errors == 1
        # the zero-copy callback path (the vLLM and SGLang adapters') stops there too
        used: list[int] = []
        assert a.transfer.get_prefix_with(keys, lambda i, view: used.append(i)) == 1 and used == [0]
        assert a.transfer.codec_errors == 2


NO_ZSTD_CLIENT = """
import sys
sys.modules["zstandard"] = None  # the package is missing: import zstandard fails
import os, torch
from lmcache_client import CacheClient
from lmcache_client.integrations.chunklayout import ChunkLayout
from lmcache_client.integrations.transfer import ChunkTransfer
layout = ChunkLayout(2, 2, 64, 16, "float32")
keys = [bytes.fromhex(k) for k in sys.argv[2].split(",")]
with CacheClient(sys.argv[1], timeout_s=10.0, fail_open=False) as c:
    t = ChunkTransfer(c, layout.namespace("nozstd"), layout.nbytes, codec_layout=layout)
    stored = t.put(keys, [os.urandom(layout.nbytes) for _ in keys])
    print(stored, t.lookup(keys), t.binding().namespace)
"""


def test_a_codec_the_client_cannot_build_caches_nothing(daemons: dict[str, Daemon]) -> None:
    """zstandard missing on the engine side of a lossless daemon: the transfer neither
    reads nor writes that codec's namespace, nor the raw one."""
    layout = ChunkLayout(2, 2, 64, CHUNK, "float32")
    keys = [os.urandom(32) for _ in range(3)]
    address = daemons["lossless"].address
    run = subprocess.run(
        [sys.executable, "-c", NO_ZSTD_CLIENT, address, ",".join(k.hex() for k in keys)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "0", "None"]
    assert "cannot build the KV codec" in run.stderr and "zstandard" in run.stderr
    with daemons["lossless"].client() as client:
        raw_ns = layout.namespace("nozstd")
        t = ChunkTransfer(client, raw_ns, layout.nbytes, codec_layout=layout)  # this one has zstandard
        assert client.exists(keys, namespace=raw_ns) == [False] * 3
        assert client.exists(keys, namespace=dataclasses.replace(raw_ns, codec="lossless.v1")) == [False] * 3
        assert t.put(keys, [os.urandom(layout.nbytes) for _ in keys]) == 3 and t.lookup(keys) == 3


def test_tails_go_through_the_codec(daemons: dict[str, Daemon]) -> None:
    """A partial last chunk (the vLLM adapter's tails) is encoded and decoded at its size."""
    layout = ChunkLayout(2, 2, 64, CHUNK, "float32")
    with daemons["lossless"].client() as client:
        t = ChunkTransfer(client, layout.namespace("tails"), layout.nbytes, codec_layout=layout)
        tail = torch.randn(2, 2, 5, 2, 64)
        raw = tail.numpy().tobytes()
        key = os.urandom(32)
        assert t.put_one_with(key, len(raw), lambda _, view: view.__setitem__(slice(None), raw))
        assert len(bytes(client.get([key], namespace=t.namespace)[0])) < len(raw)
        got: list[bytes] = []
        assert t.get_one_with(key, len(raw), lambda _, view: got.append(bytes(view)))
        assert got == [raw]
        assert not t.get_one_with(key, len(raw) // 5 * 4, lambda _, view: None)  # another size: a miss


@pytest.fixture
def unreachable_client() -> Iterator[CacheClient]:
    from ..conftest import free_port

    with CacheClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as c:
        yield c


def test_no_daemon_no_codec_yet_every_op_a_miss(unreachable_client: CacheClient) -> None:
    layout = ChunkLayout(2, 2, 64, CHUNK, "float32")
    t = ChunkTransfer(unreachable_client, layout.namespace("down"), layout.nbytes, codec_layout=layout)
    key = os.urandom(32)
    assert t.lookup([key]) == 0 and t.put([key], [bytes(layout.nbytes)]) == 0
    assert t.binding() is None  # asked again once the daemon answers


def test_a_daemon_started_after_the_engine_binds_its_codec(daemon_factory: Callable[..., Daemon]) -> None:
    """The first ops find no daemon: the breaker opens and nothing is bound.  The
    binding's own probe (a data op) lets the breaker find the daemon once it is
    up; a hello then binds the codec (real vLLM servers start before the daemon)."""
    daemon = daemon_factory(kv_codec="lossless")
    daemon.stop()
    layout = ChunkLayout(2, 2, 64, CHUNK, "float32")
    with CacheClient(daemon.address, timeout_s=0.3, backoff_s=0.2, max_backoff_s=0.4) as client:
        t = ChunkTransfer(client, layout.namespace("late"), layout.nbytes, codec_layout=layout)
        key, payload = os.urandom(32), torch.randn(layout.shape).numpy().tobytes()
        assert t.put([key], [payload]) == 0 and t.binding() is None
        daemon.start()
        wait_for(lambda: t.put([key], [payload]) == 1, 20)
        binding = t.binding()
        assert binding is not None and binding.coded is not None and "codec=lossless" in t.namespace
        got: list[bytes] = []
        assert t.get_prefix_with([key], lambda _, view: got.append(bytes(view))) == 1 and got == [payload]


@pytest.mark.parametrize("mode", ["lossless", "int8"])
def test_sglang_backend_with_a_codec(daemons: dict[str, Daemon], mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's host pages: lossless encodes them as they are; a lossy codec is refused
    (pages not in the L2THD layout) with one log line, and pages are stored raw."""
    from .sglang.test_sglang_backend import MHAHostPool, Replica, page_hashes

    address = daemons[mode].address
    a = Replica(address, extra={"tenant": f"sgl-{mode}"})
    b = Replica(address, pool=MHAHostPool(64), extra={"tenant": f"sgl-{mode}"})
    try:
        a.fill(seed=11)
        keys = page_hashes(list(range(24)))
        with caplog.at_level("WARNING", logger="lmcache_client.integrations.coded"):
            assert a.backup(keys, first_slot=8)
        assert b.prefetch(keys, first_slot=20) == 6
        assert torch.equal(b.pool.kv_buffer[:, :, 20:44], a.pool.kv_buffer[:, :, 8:32])  # bit-exact either way
        ns = a.backend._transfer().namespace
        refused = [r for r in caplog.records if "lossy KV codec" in r.getMessage()]
        if mode == "lossless":
            assert "codec=lossless" in ns and not refused
        else:
            assert ns == a.backend.namespace and refused  # once per transfer (one per SGLang thread)
        with daemons[mode].client() as c:
            from lmcache_client.integrations.sglang.hicache import page_key

            frame = bytes(c.get([page_key(keys[0])], namespace=ns)[0])
        assert (len(frame) != a.backend.page_bytes) == (mode == "lossless")
    finally:
        a.backend.close()
        b.backend.close()


def test_an_engine_side_codec_overrides_the_daemons(daemons: dict[str, Daemon]) -> None:
    """The vLLM connector's ``codec`` extra config: this transfer's own codec, whatever
    the daemon announces, in that codec's namespace."""
    from lmcache_client.integrations.vllm.settings import ConnectorSettings

    assert ConnectorSettings.from_extra_config({"codec": "int8:group=64"}).codec == "int8:group=64"
    with pytest.raises(ValueError, match="codec='int8:group=7'"):
        ConnectorSettings.from_extra_config({"codec": "int8:group=7"})
    layout = ChunkLayout(2, 2, 64, CHUNK, "float32")
    keys = [os.urandom(32) for _ in range(2)]
    chunks = [torch.randn(layout.shape).numpy().tobytes() for _ in keys]
    with daemons["lossless"].client() as client:
        t = ChunkTransfer(client, layout.namespace("override"), layout.nbytes, codec_layout=layout, codec="int8")
        assert "codec=int8.v1-g32" in t.namespace and t.put(keys, chunks) == 2
        got = t.get_prefix(keys)
        assert len(got) == 2 and all(len(bytes(g)) == layout.nbytes and bytes(g) != c for g, c in zip(got, chunks))
        followers = ChunkTransfer(client, layout.namespace("override"), layout.nbytes, codec_layout=layout)
        assert followers.lookup(keys) == 0 and "codec=lossless" in followers.namespace  # the daemon's codec
        raw = ChunkTransfer(client, layout.namespace("override"), layout.nbytes, codec_layout=layout, codec="none")
        assert raw.namespace == layout.namespace("override").wire() and raw.lookup(keys) == 0

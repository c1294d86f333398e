"""The KV codec (client/lmcache_client/codec): specs and tags, exact round trips
of ``lossless``, the error bounds of the lossy modes, partial chunks, and every
kind of damage to a frame raising CodecError (a miss), never garbage, nor an allocation
the frame only declares (a zstd bomb, issue 29 item 4)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lmcache_client.codec import CodecError, CodecSpec, make_codec
from lmcache_client.codec.frame import DTYPE_CODES, MAGIC

SHAPE = (3, 2, 48, 2, 64)  # layers, K/V, tokens, kv heads, head dim
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ALL_SPECS = ["none", "lossless", "int8", "int8:bits=4", "int8:bits=2", "cachegen", "cachegen:bits=2"]


def kv_like(shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Structured KV-like data: smooth along tokens, outlier channels in K, per-layer scale."""
    g = torch.Generator().manual_seed(seed)
    layers, _, tokens, heads, dim = shape
    base = torch.randn(layers, 2, 1, heads, dim, generator=g)
    walk = torch.randn(layers, 2, tokens, heads, dim, generator=g).cumsum(2) * 0.1
    noise = torch.randn(layers, 2, tokens, heads, dim, generator=g) * 0.3
    x = base + walk + noise
    x[:, 0, :, :, :4] *= 8.0  # outlier channels in K
    x *= torch.linspace(0.5, 3.0, layers).view(-1, 1, 1, 1, 1)
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())
    )


# -- specs -----------------------------------------------------------------------


def test_spec_defaults_make_spellings_equal() -> None:
    assert CodecSpec.parse("int8") == CodecSpec.parse("int8:group=32") == CodecSpec.parse(" INT8 : bits=8 , group=32 ")
    assert CodecSpec.parse("cachegen") == CodecSpec.parse("cachegen:bits=4,anchor=16")
    assert CodecSpec.parse("int8:group=64") != CodecSpec.parse("int8")


@pytest.mark.parametrize("text", ALL_SPECS + ["int8:group=64", "lossless:level=3", "cachegen:bits=3,anchor=8"])
def test_spec_round_trips(text: str) -> None:
    spec = CodecSpec.parse(text)
    assert CodecSpec.from_dict(spec.to_dict()) == spec
    assert CodecSpec.parse(str(spec)) == spec
    assert "|" not in spec.tag and " " not in spec.tag
    assert (spec.tag == "") == (spec.mode == "none")
    if spec.tag:
        assert ".v1" in spec.tag  # the format version is in every tag
    assert spec.lossy == (spec.mode in ("int8", "cachegen"))


def test_tags_differ_where_decoding_differs() -> None:
    tags = {
        CodecSpec.parse(t).tag
        for t in ["lossless", "int8", "int8:group=64", "int8:bits=4", "cachegen", "cachegen:bits=3"]
    }
    assert len(tags) == 6
    assert CodecSpec.parse("int8").tag == "int8.v1-g32"
    assert CodecSpec.parse("cachegen").tag == "cachegen.v1-a16b4"
    # the zstd level changes the bytes but not what they decode to
    assert CodecSpec.parse("lossless:level=5").tag == CodecSpec.parse("lossless").tag == "lossless.v1"


@pytest.mark.parametrize(
    "text, words",
    [
        ("zip", "valid modes: none, lossless, int8, cachegen"),
        ("int8:group=33", "expected one of 8, 16"),
        ("int8:grp=32", "valid parameters: group, bits"),
        ("int8:bits", "not name=value"),
        ("none:level=1", "valid parameters: none"),
        ("cachegen:bits=four", "expected one of 2, 3, 4"),
        ("", "non-empty"),
        ("int8:group=32,group=64", "given twice"),
    ],
)
def test_bad_specs_name_the_choices(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        CodecSpec.parse(text)


def test_bad_dicts() -> None:
    with pytest.raises(ValueError):
        CodecSpec.from_dict({"params": {}})
    with pytest.raises(ValueError, match="unknown keys"):
        CodecSpec.from_dict({"mode": "int8", "level": 3})
    with pytest.raises(ValueError, match="invalid"):
        CodecSpec.from_dict({"mode": "int8", "params": {"group": True}})


# -- lossless ----------------------------------------------------------------------


def special_values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """Random bit patterns (NaNs with payloads, infs, subnormals) plus -0.0, +-inf, NaN."""
    width = torch.empty((), dtype=dtype).element_size()
    int_type = {2: torch.int16, 4: torch.int32}[width]
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1, (n,), generator=g, dtype=torch.int64)
    x = bits.to(int_type).view(dtype).clone()
    x[:6] = torch.tensor([-0.0, 0.0, math.inf, -math.inf, math.nan, 1.0], dtype=dtype)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_exact_on_any_bit_pattern(dtype: torch.dtype) -> None:
    codec = make_codec("lossless", SHAPE, dtype)
    x = special_values(dtype, math.prod(SHAPE)).view(SHAPE)
    y = codec.decode_tensor(codec.encode(x))
    assert same_bits(x, y)
    assert len(codec.encode(x)) <= codec.max_encoded_bytes(SHAPE[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_exact_and_smaller_on_structured_data(dtype: torch.dtype) -> None:
    codec = make_codec("lossless:level=3", SHAPE, dtype)
    x = kv_like(dtype=dtype)
    frame = codec.encode(x)
    out = torch.empty_like(x)
    codec.decode(frame, out)
    assert same_bits(x, out)
    assert len(frame) < codec.raw_bytes(SHAPE[2])


def test_none_is_the_raw_bytes() -> None:
    codec = make_codec("none", SHAPE, torch.bfloat16)
    x = kv_like()
    frame = codec.encode(x)
    assert frame == bytes(x.view(torch.uint8).numpy())
    assert same_bits(codec.decode_tensor(frame), x)
    with pytest.raises(CodecError):
        codec.decode(frame[:-2], torch.empty_like(x))


# -- partial chunks, shapes ------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("tokens", [1, 5, 17, 47, 48])
def test_partial_chunks(spec: str, tokens: int) -> None:
    codec = make_codec(spec, SHAPE, torch.bfloat16)
    x = kv_like()[:, :, :tokens].contiguous()
    frame = codec.encode(x)
    assert len(frame) <= codec.max_encoded_bytes(tokens)
    out = torch.full_like(x, 12345.0)
    codec.decode(frame, out)
    assert out.shape == x.shape
    assert codec.decode_tensor(frame).shape == x.shape
    if not CodecSpec.parse(spec).lossy:
        assert same_bits(out, x)
    else:
        assert torch.isfinite(out).all()
        assert (out.float() - x.float()).abs().max() < x.float().abs().max()


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_wrong_shapes_and_dtypes_are_refused(spec: str) -> None:
    codec = make_codec(spec, SHAPE, torch.bfloat16)
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(3, 2, 49, 2, 64, dtype=torch.bfloat16))  # more tokens than a chunk
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(3, 2, 8, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(SHAPE, dtype=torch.float16))
    frame = codec.encode(kv_like())
    with pytest.raises(CodecError):
        codec.decode(frame, torch.empty(3, 2, 20, 2, 64, dtype=torch.bfloat16))  # out of another token count


# -- corruption -----------------------------------------------------------------------------


ENCODED_SPECS = [s for s in ALL_SPECS if s != "none"]


@pytest.mark.parametrize("spec", ENCODED_SPECS)
def test_any_flipped_byte_is_an_error(spec: str) -> None:
    codec = make_codec(spec, (2, 2, 16, 1, 32), torch.bfloat16)
    frame = codec.encode(kv_like((2, 2, 16, 1, 32)))
    out = torch.zeros(2, 2, 16, 1, 32, dtype=torch.bfloat16)
    for pos in range(len(frame)):
        for flip in (0x01, 0x80):
            bad = bytearray(frame)
            bad[pos] ^= flip
            with pytest.raises(CodecError):
                codec.decode(bytes(bad), out)
    assert not out.any(), "a failed decode wrote into out"


@pytest.mark.parametrize("spec", ENCODED_SPECS)
def test_truncated_or_padded_frames_are_errors(spec: str) -> None:
    codec = make_codec(spec, SHAPE, torch.bfloat16)
    frame = codec.encode(kv_like())
    for cut in list(range(0, 64)) + list(range(64, len(frame), max(1, len(frame) // 97))) + [len(frame) - 1]:
        with pytest.raises(CodecError):
            codec.decode_tensor(frame[:cut])
    with pytest.raises(CodecError):
        codec.decode_tensor(frame + b"\0")
    with pytest.raises(CodecError):
        codec.decode_tensor(b"")


def _reframe(frame: bytes, pos: int, value: int) -> bytes:
    """Change one header byte and fix the checksum, so only the header check can refuse it."""
    from lmcache_client.codec.frame import checksum

    bad = bytearray(frame)
    bad[pos] = value
    body = bytes(bad[:-4])
    return body + checksum(body).to_bytes(4, "little")


@pytest.mark.parametrize("spec", ENCODED_SPECS)
def test_wrong_magic_version_mode_dtype_are_errors(spec: str) -> None:
    codec = make_codec(spec, SHAPE, torch.bfloat16)
    frame = codec.encode(kv_like())
    assert frame[:4] == MAGIC and frame[4] == 1
    with pytest.raises(CodecError, match="magic"):
        codec.decode_tensor(_reframe(frame, 0, ord("X")))
    with pytest.raises(CodecError, match="version 2"):
        codec.decode_tensor(_reframe(frame, 4, 2))
    with pytest.raises(CodecError, match="codec"):
        codec.decode_tensor(_reframe(frame, 5, (frame[5] % 3) + 1))
    with pytest.raises(CodecError, match="dtype"):
        codec.decode_tensor(_reframe(frame, 6, DTYPE_CODES["float16"]))


@pytest.mark.parametrize("spec", ENCODED_SPECS)
def test_frames_of_another_spec_or_shape_are_errors(spec: str) -> None:
    codec = make_codec(spec, SHAPE, torch.bfloat16)
    frame = codec.encode(kv_like())
    others = [s for s in ENCODED_SPECS if CodecSpec.parse(s) != CodecSpec.parse(spec)] + ["int8:group=64"]
    for other in others:
        with pytest.raises(CodecError):
            make_codec(other, SHAPE, torch.bfloat16).decode_tensor(frame)
    for shape in [(4, 2, 48, 2, 64), (3, 2, 48, 1, 64), (3, 2, 48, 2, 32), (3, 2, 40, 2, 64)]:
        with pytest.raises(CodecError):
            make_codec(spec, shape, torch.bfloat16).decode_tensor(frame)
    with pytest.raises(CodecError):
        make_codec(spec, SHAPE, torch.float16).decode_tensor(frame)


# -- int8 (grouped quantization) -------------------------------------------------------------


def out_rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an ulp of the chunk dtype at |x| (the final cast back to that dtype)."""
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    return x.abs() * 2.0**-mant + 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, group", [(8, 32), (8, 64), (4, 32), (2, 32), (4, 16)])
def test_int8_error_within_half_a_step_per_element(dtype: torch.dtype, bits: int, group: int) -> None:
    from lmcache_client.codec.quant import quantize_groups

    codec = make_codec(f"int8:bits={bits},group={group}", SHAPE, dtype)
    x = kv_like(dtype=dtype, seed=bits + group)
    frame = codec.encode(x)
    y = codec.decode_tensor(frame)
    _, _, steps = quantize_groups(x.reshape(-1, group).float(), bits)
    err = (y.float() - x.float()).reshape(-1, group)
    bound = steps.float()[:, None] / 2 * (1 + 1e-6) + out_rounding(y.float().reshape(-1, group), dtype)
    assert (err.abs() <= bound).all(), float((err.abs() - bound).max())
    # the step is what the group's range needs, not more (rounded up to float16 only)
    span = x.reshape(-1, group).float().amax(1) - x.reshape(-1, group).float().amin(1)
    assert (steps.float() <= span / (2**bits - 1) * 1.002 + 1e-7).all()
    assert len(frame) == codec.max_encoded_bytes(SHAPE[2])
    elements = math.prod(SHAPE)
    assert len(frame) * 8 / elements == pytest.approx(bits + 32 / group, abs=0.05)


def test_int8_constant_and_tiny_groups() -> None:
    codec = make_codec("int8", SHAPE, torch.bfloat16)
    for x in (
        torch.full(SHAPE, 3.5),
        torch.zeros(SHAPE),
        torch.full(SHAPE, 1e-7),
        torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)) * 1e-6,
    ):
        x = x.bfloat16()
        y = codec.decode_tensor(codec.encode(x))
        assert (y.float() - x.float()).abs().max() <= 1e-6 + x.float().abs().max() * 2**-7


@pytest.mark.parametrize("spec", ["int8", "cachegen"])
def test_lossy_modes_refuse_values_they_cannot_hold(spec: str) -> None:
    codec = make_codec(spec, SHAPE, torch.float32)
    for bad in (math.inf, math.nan, 1e6):
        x = kv_like(dtype=torch.float32)
        x[1, 1, 3, 0, 5] = bad
        with pytest.raises(ValueError, match="finite"):
            codec.encode(x)


def test_int8_group_must_divide_the_row() -> None:
    with pytest.raises(ValueError, match="must divide"):
        make_codec("int8:group=256", (2, 2, 16, 1, 64), torch.bfloat16)


# -- cachegen ----------------------------------------------------------------------------------


def cachegen_steps(codec, frame: bytes) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The per-channel signed steps a cachegen frame carries, shaped (L, 2, 1, H, D)."""
    from lmcache_client.codec import frame as framing

    _, body = framing.unpack(frame)
    layers, _, _, heads, dim = codec.shape
    side = torch.frombuffer(bytearray(body[: 4 * codec.channels]), dtype=torch.float16)
    return side.view(2, layers, 2, 1, heads, dim)[0].float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, anchor, tokens", [(4, 16, 48), (2, 16, 48), (3, 8, 37), (4, 4, 9), (6, 64, 48)])
def test_cachegen_error_bound_per_element(dtype: torch.dtype, bits: int, anchor: int, tokens: int) -> None:
    codec = make_codec(f"cachegen:bits={bits},anchor={anchor}", SHAPE, dtype)
    x = kv_like(dtype=dtype, seed=bits)[:, :, :tokens].contiguous()
    frame = codec.encode(x)
    y = codec.decode_tensor(frame)
    signed = cachegen_steps(codec, frame)  # negative: the channel is coded against its mean, no anchors
    step = signed.abs()
    err = (y.float() - x.float()).abs()
    bound = (step / 2).expand_as(err).clone()
    bound[:, :, ::anchor] = torch.where(signed > 0, step / 4, step / 2)[:, :, 0:1]  # anchors: the finer step
    bound = bound * (1 + 1e-5) + out_rounding(y.float(), dtype) + 1e-6
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("data", ["kv", "gauss", "zeros", "outliers"])
def test_cachegen_meets_its_bit_budget(bits: int, data: str) -> None:
    shape = (4, 2, 64, 2, 64)
    codec = make_codec(f"cachegen:bits={bits}", shape, torch.bfloat16)
    g = torch.Generator().manual_seed(bits)
    x = {
        "kv": lambda: kv_like(shape),
        "gauss": lambda: torch.randn(shape, generator=g),
        "zeros": lambda: torch.zeros(shape),
        "outliers": lambda: torch.randn(shape, generator=g) * (1 + 200 * (torch.rand(shape, generator=g) > 0.999)),
    }[data]().to(torch.bfloat16)
    frame = codec.encode(x)
    assert len(frame) * 8 <= bits * x.numel(), len(frame) * 8 / x.numel()
    assert len(frame) <= codec.max_encoded_bytes(shape[2])
    y = codec.decode_tensor(frame)
    if data == "zeros":
        assert not y.any()


def test_cachegen_beats_plain_4bit_on_structured_data() -> None:
    """Same data, cachegen at 4 bits (all overhead in) vs plain 4-bit groups of 32 (5 bits)."""
    x = kv_like((4, 2, 128, 2, 64)).float()
    errors = {}
    for spec in ("cachegen:bits=4", "int8:bits=4,group=32"):
        codec = make_codec(spec, (4, 2, 128, 2, 64), torch.bfloat16)
        frame = codec.encode(x.bfloat16())
        errors[spec] = ((codec.decode_tensor(frame).float() - x).square().mean().item(), len(frame))
    assert errors["cachegen:bits=4"][1] < errors["int8:bits=4,group=32"][1]
    assert errors["cachegen:bits=4"][0] < errors["int8:bits=4,group=32"][0]


@pytest.mark.parametrize("peak", [3, 127, 128, 300, 32767])
def test_symbol_coding_round_trips_narrow_and_wide(peak: int) -> None:
    """Symbols outside -128..127 take a second byte plane per segment; both kinds decode exactly."""
    from lmcache_client.codec import entropy

    g = torch.Generator().manual_seed(peak)
    sym = torch.randint(-3, 4, (6, 500), generator=g, dtype=torch.int32)
    sym[2, 17], sym[5, 499] = peak, -peak
    body = entropy.encode_symbols(sym, 6)
    wide = peak >= 128
    assert entropy.plane_count(memoryview(body)) == (12 if wide else 6)
    back, offset = entropy.decode_symbols(memoryview(body), sym.numel(), 6, torch.device("cpu"))
    assert offset == (0 if wide else 128)
    assert torch.equal(back.to(torch.int32) - offset, sym.reshape(-1))
    with pytest.raises(CodecError):
        entropy.decode_symbols(memoryview(body), sym.numel(), 3, torch.device("cpu"))


@pytest.mark.parametrize("threads", [1, 2])
def test_lossless_large_chunk_segments_decode_exactly(threads: int) -> None:
    """From 1 Mi elements each byte plane is 4 zstd frames, decoded in parallel on torch's threads."""
    shape = (4, 2, 256, 4, 129)  # 1,056,768 elements: segments of unequal size
    codec = make_codec("lossless", shape, torch.bfloat16)
    x = kv_like(shape)
    frame = codec.encode(x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = codec.decode_tensor(frame)
    finally:
        torch.set_num_threads(before)
    assert same_bits(x, y)
    bad = bytearray(frame)
    bad[len(frame) // 2] ^= 0x10
    with pytest.raises(CodecError):
        codec.decode_tensor(bytes(bad))


# -- a zstd bomb in a codec frame (issue 29 item 4) -----------------------------------
_BOMB = r"""
import io, json, resource, sys
import torch
import zstandard
from lmcache_client.codec import CodecError, make_codec
from lmcache_client.codec import frame, planes

torch.set_num_threads(int(sys.argv[1]))
shape = (1, 2, 16, 1, 64)
codec = make_codec("lossless", shape, torch.bfloat16)
good = codec.encode(torch.randn(shape).to(torch.bfloat16))
codec.decode_tensor(good)  # warm: every allocation a normal decode makes

# A zstd frame declaring 1 GiB of content (1 GiB of zeros, streamed: ~32 KiB).
sink = io.BytesIO()
writer = zstandard.ZstdCompressor(level=1, write_content_size=True).stream_writer(sink, size=1 << 30, closefd=False)
zeros = bytes(1 << 20)
for _ in range(1024):
    writer.write(zeros)
writer.flush(zstandard.FLUSH_FRAME)
bomb = sink.getvalue()
assert zstandard.frame_content_size(bomb) == 1 << 30

plane = 2048  # each byte plane of 2048 bf16 elements
body = planes._COUNT.pack(2) + planes._ENTRY.pack(planes.ZSTD, len(bomb)) * 2 + bomb + bomb
evil = frame.pack(codec.spec.mode_id, frame.DTYPE_CODES["bfloat16"], codec.tag, shape, body)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    codec.decode_tensor(evil)
    outcome = "decoded"
except CodecError as err:
    outcome = "CodecError: " + str(err)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"outcome": outcome, "grown_kib": grown}))
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_a_zstd_bomb_is_a_codec_error_without_the_allocation(threads: int) -> None:
    """A plane declaring 1 GiB (the frame's shape implies 2 KiB) raises CodecError
    with peak RSS growth < 64 MiB (ru_maxrss in a process of its own)."""
    pytest.importorskip("zstandard")
    done = subprocess.run(
        [sys.executable, "-c", _BOMB, str(threads)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("CodecError"), result
    assert result["grown_kib"] < 64 * 1024, result

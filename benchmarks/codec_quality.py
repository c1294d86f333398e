"""Quality of the KV codec on a small Llama that has learned something.

For held-out sequences of ``--prefix + --cont`` tokens (Python standard
library files the model never saw): the prefix is run once, its KV cast to
bfloat16 and cut into chunks of ``--chunk`` tokens in the L2THD layout (the
last one partial), every chunk encoded and decoded with each codec setting,
the decoded KV put back as the cache, and the continuation run on it.  Each
setting is compared with the run on the uncompressed bfloat16 KV (= mode
``none``): next-token top-1 agreement, mean KL(base || codec) of the
next-token distributions, and the perplexity change; sizes are bits per
element of the encoded frames (all headers, scales and checksums included)
against bfloat16's 16.

    flock /tmp/lmcache-bench.lock .venv/bin/python benchmarks/codec_quality.py

Prints a table and PASS/MISS lines against issue #17's targets.  The model
comes from benchmarks/codec_model.py (trained first when missing).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import codec_model  # noqa: E402

from lmcache_client.codec import CodecSpec, make_codec  # noqa: E402

SETTINGS = [
    ("none", "none"),
    ("lossless", "lossless"),
    ("int8", "int8"),
    ("q4-g32 (plain)", "int8:bits=4,group=32"),
    ("q2-g32 (plain)", "int8:bits=2,group=32"),
    ("cachegen b2", "cachegen:bits=2"),
    ("cachegen b3", "cachegen:bits=3"),
    ("cachegen b4", "cachegen:bits=4"),
    ("cachegen b4 a8", "cachegen:bits=4,anchor=8"),
]


def to_chunks(cache: Any, chunk: int) -> list[torch.Tensor]:
    """Per sequence of the batch, its KV as L2THD bfloat16 chunks (last may be partial)."""
    keys = torch.stack([layer.keys for layer in cache.layers])  # L, B, H, T, D
    values = torch.stack([layer.values for layer in cache.layers])
    kv = torch.stack([keys, values], dim=1).permute(2, 0, 1, 4, 3, 5)  # B, L, 2, T, H, D
    kv = kv.to(torch.bfloat16)
    tokens = kv.shape[3]
    return [[kv[b, :, :, s : s + chunk].contiguous() for s in range(0, tokens, chunk)] for b in range(kv.shape[0])]


def from_chunks(chunks: list[list[torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    kv = torch.stack([torch.cat(seq, dim=2) for seq in chunks]).float()  # B, L, 2, T, H, D
    kv = kv.permute(1, 2, 0, 4, 3, 5)  # L, 2, B, H, T, D
    return DynamicCache(
        ddp_cache_data=[(kv[layer, 0].contiguous(), kv[layer, 1].contiguous()) for layer in range(kv.shape[0])]
    )


@torch.no_grad()
def run(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' past_key_values rename
    torch.set_num_threads(args.threads)
    model, tok, meta = codec_model.load()
    print(
        f"model: {codec_model.CACHE_DIR} (held-out perplexity at training {meta['held_out_ppl']:.2f}, "
        f"vocabulary {meta['vocab']})"
    )
    ids = codec_model.held_out_ids(tok)
    span = args.prefix + args.cont
    stride = max(span, (len(ids) - span) // args.seqs)
    seqs = torch.stack([ids[i * stride : i * stride + span] for i in range(args.seqs)])
    prefix, cont = seqs[:, : args.prefix], seqs[:, args.prefix :]
    out = model(input_ids=prefix, use_cache=True)
    chunks = to_chunks(out.past_key_values, args.chunk)
    cfg = model.config
    shape = (cfg.num_hidden_layers, 2, args.chunk, cfg.num_key_value_heads, cfg.head_dim)
    feed, labels = cont[:, :-1], cont[:, 1:]

    def evaluate(decoded: list[list[torch.Tensor]]) -> torch.Tensor:
        logits = model(input_ids=feed, past_key_values=from_chunks(decoded), use_cache=True).logits
        return torch.log_softmax(logits.float(), dim=-1)

    base = evaluate(chunks)
    base_nll = -base.gather(-1, labels[..., None]).mean().item()
    print(
        f"{args.seqs} sequences x ({args.prefix} prefix + {args.cont} continuation) tokens; "
        f"chunks of {args.chunk}; bf16 KV perplexity {math.exp(base_nll):.3f}\n"
    )
    rows = []
    cols = ("setting", "spec tag", "bits/el", "x bf16", "top-1", "mean KL", "ppl", "d ppl")
    widths = (-18, -22, 7, 6, 7, 9, 7, 7)
    header = " ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(cols, widths))
    print(header)
    print("-" * len(header))
    for name, text in SETTINGS + [(s, s) for s in args.extra]:
        spec = CodecSpec.parse(text)
        codec = make_codec(spec, shape, torch.bfloat16)
        nbytes = elements = 0
        decoded = []
        for seq in chunks:
            row = []
            for c in seq:
                frame = codec.encode(c)
                nbytes += len(frame)
                elements += c.numel()
                row.append(codec.decode_tensor(frame))
            decoded.append(row)
        logp = evaluate(decoded)
        top1 = (logp.argmax(-1) == base.argmax(-1)).float().mean().item()
        kl = (base.exp() * (base - logp)).sum(-1).mean().item()
        nll = -logp.gather(-1, labels[..., None]).mean().item()
        bits = nbytes * 8 / elements
        dppl = math.exp(nll - base_nll) - 1
        rows.append((name, spec, bits, top1, kl, dppl))
        print(
            f"{name:<18} {spec.tag or '-':<22} {bits:7.3f} {16 / bits:6.2f} {top1 * 100:6.2f}% {kl:9.2e} "
            f"{math.exp(nll):7.3f} {dppl * 100:+6.2f}%",
            flush=True,
        )

    def get(name: str) -> tuple[Any, ...]:
        return next(r for r in rows if r[0] == name)

    print()
    fails = 0

    def verdict(ok: bool, what: str) -> None:
        nonlocal fails
        fails += not ok
        print(f"{'PASS' if ok else 'MISS'}: {what}")

    _, _, _, t, k, _ = get("lossless")
    verdict(t == 1.0 and k == 0.0, f"lossless is exact (top-1 {t * 100:.2f}%, KL {k:.1e})")
    _, _, _, t, _, _ = get("int8")
    verdict(t >= 0.995, f"int8 top-1 agreement {t * 100:.2f}% >= 99.5%")
    name = args.target
    _, _, bits, t, _, d = get(name)
    verdict(16 / bits >= 4.0, f"{name}: {16 / bits:.2f}x smaller than bf16 (>= 4x), {bits:.3f} bits/element")
    verdict(t >= 0.985, f"{name}: top-1 agreement {t * 100:.2f}% >= 98.5%")
    verdict(d <= 0.01, f"{name}: perplexity {d * 100:+.2f}% within +1%")
    _, _, qbits, qt, qk, _ = get("q4-g32 (plain)")
    _, _, _, _, k, _ = get(name)
    verdict(
        bits <= qbits and t >= qt,
        f"{name} beats plain q4-g32: {bits:.2f} vs {qbits:.2f} bits/element, "
        f"top-1 {t * 100:.2f}% vs {qt * 100:.2f}%, KL {k:.2e} vs {qk:.2e}",
    )
    return fails


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=384)
    ap.add_argument("--cont", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default="cachegen b4", help="the setting checked against the cachegen targets")
    ap.add_argument("--extra", nargs="*", default=[], help="more codec specs to measure")
    args = ap.parse_args()
    t0 = time.perf_counter()
    fails = run(args)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()

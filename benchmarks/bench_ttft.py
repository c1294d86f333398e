"""Time to first token, cold vs warm, through the HF adapter and a real daemon, on CPU.

For each prompt length (1K, 2K, 4K, 8K tokens by default) and each repetition,
a fresh random prompt of which 90% is a shared prefix:

``cold``   prefill of prefix + suffix A with nothing cached (the daemon is asked,
           misses, the model computes every token); its chunks are then stored
           (not timed: an engine stores while it decodes).
``warm``   prefill of prefix + suffix B: the prefix's full chunks come from the
           daemon, the model computes the rest.
``ideal``  the limit for ``warm``: the model over the same suffix with the prefix
           KV already in memory, plus a raw ``get`` of the prefix's chunk bytes
           from the daemon (moving the bytes, without building the KV cache).

TTFT is the time until the next-token logits exist (lookup + load + forward).
Repetitions of cold, warm and ideal are interleaved, so a burst of outside
load hits all three; the table shows medians, and the ratios are medians of
the per-repetition ratios (cold and warm of one repetition run back to back,
so outside load skews them alike).  Target: warm <= 0.2x cold at 4K tokens.

The model: a Llama-architecture decoder built from a config with seeded
random weights (no download) -- 4 layers, hidden 768, 12 attention heads, 3
KV heads (GQA, head_dim 64), MLP 2048, vocab 32000, fp32, SDPA attention, 74M
parameters; ``--hidden``/``--layers`` change it.  On one CPU core its
4K-token prefill takes seconds, so the forward pass dominates TTFT as it does
for a real model on a GPU, while its KV is 6 KiB per token (21 MiB for a
3.5K-token prefix): the ratio shows what skipping prefill saves, not what
moving bytes costs.  It is wide enough that at 4K tokens the attention over
the context (which the warm suffix still pays in full) is not most of the
work, and small enough that the 8K cold runs fit a run of a few minutes.
Only the last position's logits are computed (what TTFT needs); a forward
that computes logits for every prompt position would inflate the cold times.
torch runs one thread by default: on a shared two-core machine the figures
are much steadier, and the other core serves the daemon.

``--codec none,lossless,int8,cachegen`` runs the whole benchmark once per KV
codec mode, each against a daemon started with that ``kv_codec`` (the adapter
reads it from ``hello``: the chunks are encoded on save and decoded on load),
and ends with a table of warm TTFT per mode against ``none`` measured in the
same run (``none`` is added first when missing).

Run: ``python benchmarks/bench_ttft.py [--sizes 1024,2048,4096,8192] [--reps 3] [--codec MODES] [--json out.json]``
JSON: a list of rows ``{"prompt_tokens", "shared_prefix_tokens", "cold_ttft_s",
"warm_ttft_s"}`` plus ``reused_tokens``, ``ratio``, ``ideal_warm_s``,
``warm_lookup_s``, ``warm_load_s``, ``warm_compute_s``, ``raw_get_s``,
``suffix_prefill_s``, ``ideal_over_warm``, ``cold_save_s``, ``reps`` (and ``codec``
with ``--codec``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmcache_client import CacheClient
from lmcache_client.integrations.hf import CachedPrefill, PrefillResult

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import announce_load, free_port, load_average, raise_on_sigterm, wait_until, workspace  # noqa: E402

VOCAB = 32000
TARGET_RATIO_AT_4K = 0.2
MODEL_ID = "bench/llama-random"


@dataclasses.dataclass
class Options:
    sizes: list[int]
    reps: int
    shared: float
    chunk_size: int
    transport: str
    threads: int
    hidden: int
    layers: int
    json_path: Path | None
    codecs: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Sample:
    cold: PrefillResult
    warm: PrefillResult
    suffix_prefill_s: float
    raw_get_s: float


@dataclasses.dataclass
class Row:
    prompt_tokens: int
    shared_prefix_tokens: int
    reused_tokens: int
    cold_ttft_s: float
    warm_ttft_s: float
    warm_lookup_s: float
    warm_load_s: float
    warm_compute_s: float
    suffix_prefill_s: float
    raw_get_s: float
    cold_save_s: float
    ratio: float
    """Median over repetitions of warm / cold, each pair measured back to back."""
    ideal_over_warm: float
    """Median of ideal / warm: how close warm TTFT gets to its limit (1.0 = at it)."""
    reps: int

    @property
    def ideal_warm_s(self) -> float:
        return self.suffix_prefill_s + self.raw_get_s

    def as_json(self) -> dict[str, Any]:
        row = {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}
        row.update(ideal_warm_s=round(self.ideal_warm_s, 4))
        return row


def build_model(hidden: int, layers: int) -> Any:
    """Llama shapes: head_dim 64, a quarter as many KV heads as heads, MLP 8/3 x hidden
    rounded up to a multiple of 256."""
    heads = hidden // 64
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=-(-hidden * 8 // 3 // 256) * 256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=16384,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return model.eval()  # type: ignore[no-untyped-call]


def _drop_tail(cache: Any, keep: int) -> None:
    """Crop a DynamicCache to its first ``keep`` tokens (transformers 5 takes a negative count)."""
    total = cache.get_seq_length()
    try:
        cache.crop(keep)
    except ValueError:
        cache.crop(keep - total)


class Bench:
    def __init__(self, opts: Options, address: str):
        self.opts = opts
        self.model = build_model(opts.hidden, opts.layers)
        self.client = CacheClient(address, timeout_s=60.0, fail_open=False)
        model_id = f"{MODEL_ID}-L{opts.layers}-H{opts.hidden}"
        self.adapter = CachedPrefill(self.model, self.client, model_id=model_id, chunk_size=opts.chunk_size)
        self.rng = torch.Generator().manual_seed(1234)

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=self.rng)]

    def warm_up(self) -> None:
        """One untimed round trip, so kernels and sockets are set up before timing."""
        prompt = self.tokens(2 * self.opts.chunk_size + 8)
        self.adapter.prefill(prompt)
        self.adapter.prefill(prompt)

    def sample(self, n: int) -> Sample:
        shared = int(n * self.opts.shared)
        prefix = self.tokens(shared)
        prompt_a, prompt_b = prefix + self.tokens(n - shared), prefix + self.tokens(n - shared)
        cold = self.adapter.prefill(prompt_a, save=False)
        assert cold.reused_tokens == 0, "the cold prompt must not hit"
        self.adapter.save(cold)
        warm = self.adapter.prefill(prompt_b, save=False)
        reused = warm.reused_tokens
        # The limit: the same suffix over the prefix KV already in memory ...
        _drop_tail(warm.cache, reused)
        ids = torch.tensor([prompt_b[reused:]])
        with torch.inference_mode():
            started = time.perf_counter()
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.adapter.cache_kwarg: warm.cache})
            suffix_prefill_s = time.perf_counter() - started
        # ... plus moving the prefix's bytes from the daemon, as raw buffers.
        keys = warm.keys[: reused // self.opts.chunk_size]
        started = time.perf_counter()
        got = self.adapter.transfer.get_prefix(keys)
        raw_get_s = time.perf_counter() - started
        assert len(got) == len(keys)
        return Sample(cold, warm, suffix_prefill_s, raw_get_s)

    def run(self) -> list[Row]:
        samples: dict[int, list[Sample]] = {n: [] for n in self.opts.sizes}
        for rep in range(self.opts.reps):
            for n in self.opts.sizes:
                s = self.sample(n)
                samples[n].append(s)
                print(
                    f"  rep {rep + 1}/{self.opts.reps} {n:>5} tokens: cold {s.cold.timings.first_token_s:6.3f}s"
                    f"  warm {s.warm.timings.first_token_s:6.3f}s (reused {s.warm.reused_tokens})"
                    f"  ratio {s.warm.timings.first_token_s / s.cold.timings.first_token_s:5.3f}"
                    f"  suffix-only {s.suffix_prefill_s:6.3f}s  raw get {s.raw_get_s * 1e3:5.1f}ms",
                    flush=True,
                )
        return [self._row(n, samples[n]) for n in self.opts.sizes]

    def _row(self, n: int, samples: list[Sample]) -> Row:
        def med(values: Sequence[float]) -> float:
            return statistics.median(values)

        return Row(
            prompt_tokens=n,
            shared_prefix_tokens=int(n * self.opts.shared),
            reused_tokens=samples[0].warm.reused_tokens,
            cold_ttft_s=med([s.cold.timings.first_token_s for s in samples]),
            warm_ttft_s=med([s.warm.timings.first_token_s for s in samples]),
            warm_lookup_s=med([s.warm.timings.lookup_s for s in samples]),
            warm_load_s=med([s.warm.timings.load_s for s in samples]),
            warm_compute_s=med([s.warm.timings.compute_s for s in samples]),
            suffix_prefill_s=med([s.suffix_prefill_s for s in samples]),
            raw_get_s=med([s.raw_get_s for s in samples]),
            cold_save_s=med([s.cold.timings.save_s for s in samples]),
            ratio=med([s.warm.timings.first_token_s / s.cold.timings.first_token_s for s in samples]),
            ideal_over_warm=med([(s.suffix_prefill_s + s.raw_get_s) / s.warm.timings.first_token_s for s in samples]),
            reps=len(samples),
        )

    def close(self) -> None:
        self.client.close()


def _pings(client: CacheClient) -> bool:
    try:
        client.ping(timeout_s=0.5)
        return True
    except Exception:
        return False


def report(rows: list[Row]) -> bool:
    print(
        f"\n{'prompt':>7} {'shared':>7} {'reused':>7} {'cold_ttft_s':>11} {'warm_ttft_s':>11} {'ratio':>6}"
        f" {'ideal_s':>8} {'ideal/warm':>10}   warm = lookup + load + compute (s)"
    )
    for r in rows:
        print(
            f"{r.prompt_tokens:>7} {r.shared_prefix_tokens:>7} {r.reused_tokens:>7} {r.cold_ttft_s:>11.3f}"
            f" {r.warm_ttft_s:>11.3f} {r.ratio:>6.3f} {r.ideal_warm_s:>8.3f} {r.ideal_over_warm:>10.2f}"
            f"   {r.warm_lookup_s:.4f} + {r.warm_load_s:.4f} + {r.warm_compute_s:.3f}"
        )
    at_4k = [r for r in rows if r.prompt_tokens == 4096]
    if not at_4k:
        return True
    ok = at_4k[0].ratio <= TARGET_RATIO_AT_4K
    print(f"\ntarget warm <= {TARGET_RATIO_AT_4K}x cold at 4K: {at_4k[0].ratio:.3f}x -> {'PASS' if ok else 'MISSED'}")
    return ok


def _parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,2048,4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="repetitions per length (median shown)")
    p.add_argument("--shared", type=float, default=0.9, help="shared prefix fraction (default 0.9)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--transport", choices=("ipc", "tcp"), default="ipc", help="same-host engines use ipc")
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's choice (default 1, see above)")
    p.add_argument("--hidden", type=int, default=768, help="model width, a multiple of 64 (default 768)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", type=Path, dest="json_path")
    p.add_argument("--codec", default="", help="KV codec modes to compare, e.g. none,lossless,int8,cachegen")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.reps < 1 or not 0 < a.shared < 1 or any(s <= a.chunk_size for s in sizes):
        p.error("need --reps >= 1, 0 < --shared < 1, and sizes above --chunk-size")
    codecs = [c for c in a.codec.split(",") if c]
    if codecs and "none" not in codecs:
        codecs.insert(0, "none")
    return Options(
        sizes, a.reps, a.shared, a.chunk_size, a.transport, a.threads, a.hidden, a.layers, a.json_path, codecs
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = _parse_args(argv)
    raise_on_sigterm()
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    started = time.perf_counter()
    announce_load()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; chunk_size {opts.chunk_size}")
    by_codec: dict[str, list[Row]] = {}
    try:
        for codec in opts.codecs or [""]:
            if codec:
                print(f"\n=== kv_codec {codec}")
            rows = run_once(opts, codec)
            report(rows)
            by_codec[codec] = rows
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the daemon", file=sys.stderr)
        return 130
    if opts.codecs:
        report_codecs(by_codec)
    print(f"load average at the end: {load_average():.2f}; total {time.perf_counter() - started:.0f}s")
    if opts.json_path is not None:
        out = [{**r.as_json(), **({"codec": c} if c else {})} for c, rows in by_codec.items() for r in rows]
        opts.json_path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {len(out)} rows to {opts.json_path}")
    return 0


def run_once(opts: Options, codec: str) -> list[Row]:
    """One daemon (with ``kv_codec`` = ``codec`` when given) and the benchmark against it."""
    with workspace("lmcache-ttft-") as (procs, workdir):
        bench: Bench | None = None
        try:
            address = f"ipc://{workdir}/daemon.sock" if opts.transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
            argv_ = [sys.executable, "-m", "lmcache_server", "--listen", address, "--metrics-port", "0"]
            if codec:
                argv_ += ["--set", f"kv_codec={codec}"]
            daemon = procs.start("daemon", [*argv_, "--max-local-cpu-size", "2GiB"])
            logging.getLogger("lmcache_client").setLevel(logging.ERROR)  # pings before it is up fail
            with CacheClient(address, timeout_s=0.5) as probe:
                wait_until(lambda: _pings(probe), 60, "daemon", daemon.check_alive)
            logging.getLogger("lmcache_client").setLevel(logging.NOTSET)
            bench = Bench(opts, address)
            config = bench.model.config
            print(
                f"model: Llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                f"{config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, "
                f"MLP {config.intermediate_size}, "
                f"{sum(p.numel() for p in bench.model.parameters()) / 1e6:.1f}M parameters, fp32, "
                f"attention {config._attn_implementation}"
            )
            bench.warm_up()
            print(f"daemon at {address}; namespace {bench.adapter.transfer.namespace}")
            return bench.run()
        finally:
            if bench is not None:
                bench.close()


def report_codecs(by_codec: dict[str, list[Row]]) -> None:
    """Warm TTFT per codec mode against ``none`` of the same run."""
    base = {r.prompt_tokens: r for r in by_codec.get("none", [])}
    print(f"\n{'codec':>18} {'prompt':>7} {'warm_ttft_s':>11} {'vs none':>8} {'warm load_s':>11} {'cold/warm':>9}")
    for codec, rows in by_codec.items():
        for r in rows:
            ref = base.get(r.prompt_tokens)
            vs = f"{r.warm_ttft_s / ref.warm_ttft_s:.2f}x" if ref else "-"
            print(
                f"{codec:>18} {r.prompt_tokens:>7} {r.warm_ttft_s:>11.3f} {vs:>8} {r.warm_load_s:>11.4f}"
                f" {1 / r.ratio:>8.1f}x"
            )


if __name__ == "__main__":
    sys.exit(main())

"""A small Llama that has learned something, for measuring the KV codec's quality.

Trains, on Python's own standard-library sources (every machine with Python
has them), a byte-level BPE tokenizer (the ``tokenizers`` library) and a
4-layer Llama (``transformers``: hidden 256, 4 query heads, 2 KV heads
(GQA), head dim 64, RoPE), for a few minutes on 2 CPU threads.  One file in
ten (by a CRC of its path) is held out for evaluation.  The result goes to
``~/.cache/lmcache-server/codec-model/`` (config, weights, tokenizer,
``meta.json``), outside git, and is rebuilt when missing.

    flock /tmp/lmcache-bench.lock .venv/bin/python benchmarks/codec_model.py [--steps 300] [--force]

Prints step and loss while training, then the held-out perplexity, which
must be far below the vocabulary size (4096) for the quality figures to mean
anything.  ``load()`` is what benchmarks/codec_quality.py uses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any

import torch

CACHE_DIR = Path(os.environ.get("LMCACHE_CODEC_MODEL_DIR", Path.home() / ".cache" / "lmcache-server" / "codec-model"))
VOCAB = 4096
SEQ = 512
MAX_CHARS = 12_000_000  # of training text; enough for a few minutes of steps


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library's *.py sources, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size < 400_000)
    held = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0]
    train = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 10 != 0]
    return train, held


def read_texts(files: list[Path], max_chars: int) -> list[str]:
    texts, total = [], 0
    for p in files:
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t)
        if total >= max_chars:
            break
    return texts


def train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_corpus(tok: Any, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<eos>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=SEQ,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )


@torch.no_grad()
def perplexity(model: Any, ids: torch.Tensor, seqs: int = 24) -> float:
    model.eval()
    n = min(seqs, len(ids) // SEQ)
    batch = ids[: n * SEQ].view(n, SEQ)
    losses = [model(input_ids=batch[i : i + 4], labels=batch[i : i + 4]).loss.item() for i in range(0, n, 4)]
    model.train()
    return math.exp(sum(losses) / len(losses))


def train(steps: int, batch: int, lr: float) -> dict[str, Any]:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    train_files, held_files = stdlib_files()
    t0 = time.perf_counter()
    texts = read_texts(train_files, MAX_CHARS)
    tok = train_tokenizer(texts)
    ids = encode_corpus(tok, texts)
    held_ids = encode_corpus(tok, read_texts(held_files, 600_000))
    print(
        f"tokenizer: {VOCAB} tokens, {len(ids)} training tokens from {len(texts)} files, "
        f"{len(held_ids)} held-out tokens ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    model = LlamaForCausalLM(model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(ids) - SEQ - 1, (batch,), generator=g)
        x = torch.stack([ids[s : s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append(loss.item())
        if step % 25 == 0 or step == 1:
            mean = sum(recent[-25:]) / len(recent[-25:])
            print(
                f"step {step:4d}  loss {mean:.3f} (mean of the last 25)  {time.perf_counter() - t0:.0f} s", flush=True
            )
    ppl = perplexity(model, held_ids)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(CACHE_DIR)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(CACHE_DIR)
    meta = {
        "steps": steps,
        "batch": batch,
        "seq": SEQ,
        "held_out_ppl": ppl,
        "vocab": VOCAB,
        "train_s": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
    }
    (CACHE_DIR / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"held-out perplexity {ppl:.2f} (vocabulary {VOCAB}); saved to {CACHE_DIR}", flush=True)
    return meta


def load(rebuild: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode, tokenizer, meta), training it first when the cache holds none."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    if not (CACHE_DIR / "meta.json").exists():
        if not rebuild:
            raise FileNotFoundError(f"no codec model in {CACHE_DIR}; run benchmarks/codec_model.py")
        torch.set_num_threads(2)
        train(steps=300, batch=4, lr=1e-3)
    model = LlamaForCausalLM.from_pretrained(CACHE_DIR, dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(CACHE_DIR)
    return model, tok, json.loads((CACHE_DIR / "meta.json").read_text())


def held_out_ids(tok: Any) -> torch.Tensor:
    """Token ids of the held-out files, the evaluation text."""
    _, held = stdlib_files()
    return encode_corpus(tok.backend_tokenizer, read_texts(held, 2_000_000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="retrain even when the cache has a model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if (CACHE_DIR / "meta.json").exists() and not args.force:
        meta = json.loads((CACHE_DIR / "meta.json").read_text())
        print(f"cached model in {CACHE_DIR}: held-out perplexity {meta['held_out_ppl']:.2f} (--force to retrain)")
        return
    train(args.steps, args.batch, args.lr)


if __name__ == "__main__":
    main()

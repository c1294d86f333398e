"""Mode ``cachegen``: anchor/delta quantization, per-layer step allocation,
rate control and entropy coding (after CacheGen, SIGCOMM'24).

Per layer and K/V, per channel (kv head x head dim), over the chunk's tokens:

- the tokens are split into groups of ``anchor``; the first token of a group
  is its anchor, quantized against the channel mean ``m`` with the fine step
  ``d / 2``; every other token is quantized as its delta against the
  *decoded* anchor with step ``d``, so errors do not accumulate:
  ``|x - x'| <= d / 4`` for anchors and ``<= d / 2`` for the others.  A
  channel whose deltas would cost more bits than its values (a fast-rotating
  RoPE pair of K, noise-like V) is coded against its mean instead, every
  token with step ``d`` (``|x - x'| <= d / 2``); the sign of its stored step
  says which;
- the step ``d`` of a channel is ``lam * w[layer, K/V] * s`` where ``s`` mixes
  the channel's spread with its layer's (K has outlier channels: a channel's
  own scale keeps them from eating everyone's precision), ``w`` gives early
  layers finer steps, and ``lam`` is found by rate control: a few rounds of
  "quantize, estimate the entropy from histograms, rescale" until the frame
  fits ``bits`` bits per element, all overhead included;
- the integer symbols are entropy coded (:mod:`.entropy`).

Only the encoder chooses steps; the frame stores them (float16 per channel,
signed) with the channel means, so the allocation can improve without a new
format.  Body: signed steps fp16 (L, 2, H, D), means fp16 (L, 2, H, D), then
the symbols.  Chunks of very few tokens cannot meet the budget (the side
information alone is 32 bits per channel); they are coded as small as the
steps allow.

Primitive: :class:`CacheGenCodec`.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Codec, Shape5, bytes_tensor
from .entropy import decode_symbols, encode_symbols, entropy_bits, max_symbol_bytes
from .frame import CodecError, header_bytes
from .quant import check_range
from .spec import CodecSpec

ANCHOR_RATIO = 2.0
"""Anchors use a step this many times finer than deltas (format constant)."""
_FP16_TINY = 2.0**-24
_FP16_BIG = 32768.0


class CacheGenCodec(Codec):
    """CacheGen-style codec; ``bits`` is the target of average bits per element, frame included."""

    # encoder-only knobs (the frame stores the steps they produce)
    channel_weight = 0.5
    """0: one step per layer and K/V; 1: steps proportional to each channel's spread."""
    layer_tilt = 2.0
    """log2 ratio of the last layer's step to the first's (> 0: finer steps early)."""
    k_weight = 1.0
    v_weight = 1.0
    slack = 0.96
    """Fraction of the bit budget the rate control aims at (Huffman's loss over entropy)."""
    fill = 0.03
    """A frame this fraction under budget is good enough (else it is redone with finer steps)."""

    def __init__(self, spec: CodecSpec, shape: Shape5, dtype: Any) -> None:
        super().__init__(spec, shape, dtype)
        self.bits = int(spec.get("bits"))
        self.anchor = int(spec.get("anchor"))
        self.channels = self.shape[0] * 2 * self.shape[3] * self.shape[4]

    def _elements(self, tokens: int) -> int:
        return self.raw_bytes(tokens) // self.element_bytes

    def _max_body_bytes(self, tokens: int) -> int:
        # the rate control's fallback never exceeds 16-bit symbols (two planes) plus zstd's bound
        return 4 * self.channels + max_symbol_bytes(self._elements(tokens), 2 * self.shape[0])

    # -- encoder ----------------------------------------------------------------
    def _layer_weights(self, device: torch.device) -> torch.Tensor:
        layers = self.shape[0]
        pos = torch.linspace(-0.5, 0.5, layers, device=device) if layers > 1 else torch.zeros(1, device=device)
        w = torch.pow(2.0, pos * self.layer_tilt)
        kv = torch.tensor([self.k_weight, self.v_weight], device=device)
        return (w[:, None] * kv[None, :]).view(layers, 2, 1, 1, 1)

    def _symbols(self, x: torch.Tensor, mean: torch.Tensor, step: torch.Tensor, anchored: torch.Tensor) -> torch.Tensor:
        a = self.anchor
        anchor_sym = torch.round((x[:, :, ::a] - mean) / (step / ANCHOR_RATIO))
        anchors = mean + anchor_sym * (step / ANCHOR_RATIO)
        pred = torch.where(anchored, anchors.repeat_interleave(a, dim=2)[:, :, : x.shape[2]], mean)
        sym = torch.round((x - pred) / step)
        sym[:, :, ::a] = torch.where(anchored, anchor_sym, sym[:, :, ::a])
        return sym.to(torch.int32)

    def _anchored(self, x: torch.Tensor, var_mean: torch.Tensor) -> torch.Tensor:
        """Per channel: do deltas against anchors cost fewer bits than values against the mean?

        Deltas save ``(A-1)/A * log2(var_mean / var_delta) / 2`` bits per element; their
        anchors cost about one bit more each (the finer step), 1/A of the tokens.
        """
        a = self.anchor
        tokens = x.shape[2]
        if tokens <= 1:
            return torch.zeros_like(var_mean, dtype=torch.bool)
        d = x - x[:, :, ::a].repeat_interleave(a, dim=2)[:, :, :tokens]
        var_delta = d.square().sum(dim=2, keepdim=True) / max(1, tokens - (tokens + a - 1) // a)
        gain = (a - 1) / a * 0.5 * torch.log2(var_mean.clamp(min=1e-30) / var_delta.clamp(min=1e-30)) - 1 / a
        return gain > 0

    def _steps(self, lam: float, base: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        step = torch.maximum(base * lam, floor).clamp_(max=_FP16_BIG).to(torch.float16)
        return step.clamp_(min=_FP16_TINY).float()

    def _encode_body(self, chunk: torch.Tensor) -> bytes:
        x = chunk.detach().float()
        layers, _, tokens, heads, dim = x.shape
        n = x.numel()
        check_range(x.amin(), x.amax())
        mean = x.mean(dim=2, keepdim=True).to(torch.float16).float()
        dev = x - mean
        var_c = dev.square().mean(dim=2, keepdim=True)
        anchored = self._anchored(x, var_c)
        rms_c = var_c.sqrt()
        rms_l = dev.square().mean(dim=(2, 3, 4), keepdim=True).sqrt()
        cw = self.channel_weight
        base = (rms_c.clamp(min=1e-12) ** cw) * (rms_l.clamp(min=1e-12) ** (1 - cw)) * self._layer_weights(x.device)
        # no symbol may pass MAX_SYMBOL: anchors <= 2 * 2 * 5000, deltas <= (2 max|dev| + d/4) / d
        floor = dev.abs().amax(dim=2, keepdim=True) / 5000
        fixed = header_bytes(self.tag) + 4 * self.channels + 32
        budget_bits = self.bits * n - 8 * fixed
        target = max(budget_bits * self.slack, 0.05 * n)
        groups = layers * 2
        lam = 4.13 * 2.0 ** (-target / n)
        # rate control on every 4th channel (a quarter of the work; the entropy per element is the same)
        sub = (slice(None), slice(None), slice(None), slice(None), slice(None, None, 4 if dim >= 16 else 1))
        xs, ms, bs, fs, an = x[sub], mean[sub], base[sub], floor[sub], anchored[sub]
        for _ in range(3):
            sym = self._symbols(xs, ms, self._steps(lam, bs, fs), an)
            est = entropy_bits(sym, groups) * n / sym.numel()
            lam *= 2.0 ** ((est - target) / n)
        # real encodes: the coded size can beat the histogram estimate (zstd also finds runs of
        # zeros), so a frame well under budget is redone finer, one over it coarser
        best, last = b"", b""
        for attempt in range(1, 7):
            step = self._steps(lam, base, floor)
            sym = self._symbols(x, mean, step, anchored)
            last = self._pack(torch.where(anchored, step, -step), mean, encode_symbols(sym, groups))
            over = 8 * (len(last) + header_bytes(self.tag)) - self.bits * n
            if over <= 0:
                best = max(best, last, key=len)
                if over > -self.fill * self.bits * n or attempt >= 3:
                    break
                lam *= 2.0 ** (over / n * 0.9)
            elif lam > 1e12:  # a chunk of a few tokens: the side information alone passes the budget
                break
            else:
                lam *= 2.0 ** (1.1 * over / n + 0.01 * attempt)
        return best or last

    def _pack(self, step: torch.Tensor, mean: torch.Tensor, coded: bytes) -> bytes:
        side = torch.stack([step.to(torch.float16), mean.to(torch.float16)]).cpu()
        return bytes(side.contiguous().view(torch.uint8).reshape(-1).numpy()) + coded

    # -- decoder ----------------------------------------------------------------
    def _decode_body(self, body: memoryview, tokens: int, device: torch.device) -> torch.Tensor:
        layers, _, _, heads, dim = self.shape
        side_bytes = 4 * self.channels
        if len(body) < side_bytes:
            raise CodecError("cachegen body truncated before its steps")
        side = bytes_tensor(body[:side_bytes]).to(device).view(torch.float16).view(2, layers, 2, 1, heads, dim).float()
        signed, mean = side[0], side[1]
        step, anchored = signed.abs(), signed > 0
        if not bool(torch.isfinite(side).all()) or not bool((step > 0).all()):
            raise CodecError("cachegen body has invalid steps")
        sym, offset = decode_symbols(body[side_bytes:], self._elements(tokens), 2 * layers, device)
        sym = sym.view(layers, 2, tokens, heads, dim)
        a = self.anchor
        groups = -(-tokens // a)
        if groups * a != tokens:  # a partial chunk: pad to whole anchor groups, cut after
            pad = torch.zeros(layers, 2, groups * a - tokens, heads, dim, dtype=sym.dtype, device=device)
            sym = torch.cat([sym, pad], dim=2)
        # (layers, 2, groups, anchor, heads, dim): the prediction is one row per group, broadcast
        sym = sym.view(layers, 2, groups, a, heads, dim)
        step, mean, anchored = step[:, :, None], mean[:, :, None], anchored[:, :, None]
        fine = step / ANCHOR_RATIO
        anchors = torch.addcmul(mean - offset * fine, sym[:, :, :, :1], fine)
        # symbols are stored + offset: the offset goes into the (small) per-group prediction row
        x = torch.addcmul(torch.where(anchored, anchors, mean) - offset * step, sym, step)
        x[:, :, :, :1] = torch.where(anchored, anchors, x[:, :, :, :1])
        return x.view(layers, 2, groups * a, heads, dim)[:, :, :tokens]

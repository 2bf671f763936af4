"""The KV-cache of the generation engine, stored quantized along the head dimension.

A decode step attends over every key and value so far. The cache keeps them in a number format of
the registry (``precision.formats``), quantized **along the head dimension** -- the contraction
axis of ``q·kᵀ`` for keys; for values the same per-token layout, as rollout engines store them --
and dequantizes them in attention (``model.attention.SDPAttention``)::

    one layer, one row:  keys / values  [slots, ng, hn]     ng = query groups on this TP rank
      bf16 / fp32          codes = the bit patterns                       (the reference: BF16)
      mxfp8/6/4            codes (FP4 two per byte) + one E8M0 byte per 32 along hn
      nvfp4                codes (two per byte) + one E4M3 byte per 16 along hn + an FP32 scale per head
      fp8_e4m3 / e5m2      codes + an FP32 scale per head
      hif8                 codes + an FP32 scale per head

Formats with a tensor-level scale (FP8, HiF8, NVFP4's FP32 scale) take one scale **per KV head**
from a calibrated amax (``KVFormat.quantize(t, amax)`` with ``amax`` of shape ``[ng]``), as FP8-RL
recalibrates per-head scales at each policy update (``model.generate.calibrate_kv``); values beyond
the calibrated range saturate. Block formats need no calibration: each token's head vector is
blocked on its own, so a token's stored bits never depend on the other tokens in the cache.

The trainer sees what the cache stored through :meth:`KVFormat.fake_quantize` (``--kv-quant``):
the same quantize -> dequantize, with a straight-through gradient.

    fmt = KVFormat.parse("mxfp4")
    fmt.check_head_dim(64, "--kv-quant")                   # block 32 must divide the head dim
    cache = KVCache(num_layers=2, groups=2, head_dim=64, fmt=fmt)
    k_all, v_all = cache.layers[0].update(k_new, v_new)    # [sq, b, ng, hn] in, [sk, b, ng, hn] out
    cache.advance(k_new.shape[0])                          # once per forward, after every layer
    cache.bytes_per_token                                  # K and V of every layer, scales included

Per-layer formats: ``fmt`` may also be a sequence with one entry per layer (a ``KVFormat`` or None),
as a rollout plan with KV rules gives it (``model.rollout_plan``: e.g. the last layer's cache in FP8,
the others in MXFP4); each layer then stores, dequantizes and counts bytes in its own format::

    cache = KVCache(3, 2, 64, [KVFormat("mxfp4"), KVFormat("mxfp4"), KVFormat("fp8")], amax)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from precision.formats import FORMATS, QuantizedTensor, format_names, get_format

__all__ = ["KVCache", "KVFormat", "LayerKV", "kv_format_names", "per_head_amax"]

ALIASES = {"fp8": "fp8_e4m3"}


def kv_format_names() -> tuple[str, ...]:
    """Valid KV-cache formats: every registry format that rounds deterministically to nearest."""
    return format_names() + tuple(ALIASES)


def per_head_amax(t: torch.Tensor) -> torch.Tensor:
    """``[ng]`` float32: max |t| per head of ``t`` ``[..., ng, hn]`` (non-finite values ignored)."""
    a = t.detach().float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.reshape(-1, t.shape[-2], t.shape[-1]).amax(dim=(0, 2)) if a.numel() else a.new_zeros(t.shape[-2])


@dataclass(frozen=True)
class KVFormat:
    """How the KV-cache stores keys and values: a registry format, blocks along the head dimension."""

    fmt: str = "bf16"
    """A registry format name (``precision.formats.FORMATS``) or ``fp8`` (= ``fp8_e4m3``)."""

    def __post_init__(self):
        name = ALIASES.get(self.fmt, self.fmt)
        if name not in FORMATS:
            raise ValueError(f"unknown KV-cache format {self.fmt!r}; valid: {', '.join(kv_format_names())}")
        object.__setattr__(self, "fmt", name)

    @classmethod
    def parse(cls, value: str, flag: str = "--kv-quant") -> KVFormat:
        """``value`` as a ``KVFormat``; a one-line error naming ``flag`` and the valid formats."""
        try:
            return cls(value.strip())
        except ValueError:
            raise ValueError(f"{flag} {value!r}: unknown KV-cache format; valid: {', '.join(kv_format_names())}") from None

    @property
    def format(self):
        return get_format(self.fmt)

    @property
    def per_head_scale(self) -> bool:
        """Whether the format needs a calibrated amax per head (a tensor-level scale)."""
        return self.format.tensor_scaled

    @property
    def bits_per_element(self) -> float:
        """Stored bits per cached element, block scales included (per-head scales are amortized)."""
        return self.format.bits_per_element

    def check_head_dim(self, head_dim: int, flag: str = "--kv-quant") -> None:
        """Refuse (one line naming ``flag``) a block format whose block does not divide ``head_dim``."""
        f = self.format
        bad = (f.blocked and head_dim % f.block) or (f.packable and head_dim % {4: 2, 6: 4}[f.code_bits])
        if bad:
            ok = [n for n in format_names() if not FORMATS[n].blocked or head_dim % FORMATS[n].block == 0]
            raise ValueError(f"{flag} {self.fmt}: its {f.block}-element blocks do not divide the head dimension "
                             f"{head_dim} (--hidden-size / --num-attention-heads); valid for this model: {', '.join(ok)}")

    # ------------------------------------------------------------------ quantize / dequantize
    def quantize(self, t: torch.Tensor, amax: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """Stored form of ``t`` ``[..., ng, hn]``: ``codes`` (packed for 4/6-bit formats), ``scales``
        (block scale bytes ``[..., ng, hn / block]``; per-tensor formats: the FP32 encode scale per head
        ``[ng]``) and ``tensor_scale`` (NVFP4's FP32 ``g_enc`` per head ``[ng]``). ``amax`` ``[ng]``: the
        calibrated amax of each head for formats with a tensor-level scale (default: ``t``'s own)."""
        f = self.format
        if f.tensor_scaled:
            amax = per_head_amax(t) if amax is None else amax
            qs = [f.quantize(t[..., h, :], axis=-1, amax=amax[h]) for h in range(t.shape[-2])]
            codes = torch.stack([q.codes for q in qs], dim=-2)
            if f.blocked:  # NVFP4: block bytes per head, g_enc per head
                scales = torch.stack([q.scales for q in qs], dim=-2)
                tensor_scale = torch.stack([q.tensor_scale.reshape(()) for q in qs])
            else:
                scales, tensor_scale = torch.stack([q.scales.reshape(()) for q in qs]), None
        else:
            q = f.quantize(t, axis=-1)
            codes, scales, tensor_scale = q.codes, q.scales, None
        return {"codes": f.pack(codes) if f.packable else codes, "scales": scales, "tensor_scale": tensor_scale}

    def dequantize(self, stored: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """float32 values ``[..., ng, hn]`` of a :meth:`quantize` result (or a slice of one)."""
        f = self.format
        codes = f.unpack(stored["codes"]) if f.packable else stored["codes"]
        if not f.tensor_scaled:
            return f.dequantize(QuantizedTensor(self.fmt, codes, stored["scales"], codes.dim() - 1))
        heads = []
        for h in range(codes.shape[-2]):
            c = codes[..., h, :]
            if f.blocked:
                q = QuantizedTensor(self.fmt, c, stored["scales"][..., h, :], c.dim() - 1,
                                    tensor_scale=stored["tensor_scale"][h])
            else:
                q = QuantizedTensor(self.fmt, c, stored["scales"][h], c.dim() - 1)
            heads.append(f.dequantize(q))
        return torch.stack(heads, dim=-2)

    def fake_quantize(self, t: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """``t`` as the cache would return it (quantize -> dequantize, ``t``'s dtype), with a
        straight-through gradient: the forward sees the stored values, the backward the identity."""
        stored = self.dequantize(self.quantize(t.detach(), amax)).to(t.dtype)
        return t + (stored - t).detach() if t.requires_grad else stored


class LayerKV:
    """One layer's cached keys and values: ``[batch, slots, ng, hn]`` in stored form.

    ``update(k, v)`` (called by the layer's core attention with the new tokens' keys and values
    ``[sq, b, ng, hn]``, after RoPE) writes them at slots ``cache.length ..`` and returns every cached
    key and value so far, dequantized, ``[sk, b, ng, hn]`` in ``k``'s dtype.
    """

    def __init__(self, cache: KVCache, amax: torch.Tensor | None, fmt: KVFormat | None = None):
        self.cache = cache
        self.fmt = fmt  # this layer's stored format (None: the activations' own dtype)
        self.amax = amax  # [2, ng] calibrated per-head amax of K and V (tensor-scaled formats)
        self.k: dict[str, torch.Tensor | None] | None = None
        self.v: dict[str, torch.Tensor | None] | None = None

    def _store(self, old, new):
        """Append ``new`` (stored form, [b, sq, ...]) after slot ``cache.length`` of ``old``."""
        n = self.cache.length
        if old is None:
            return dict(new)
        out = {}
        for key, t in new.items():
            if t is None or t.dim() <= 1:  # per-head scales: fixed by calibration
                out[key] = t
            else:
                out[key] = torch.cat([old[key][:, :n], t], dim=1)
        return out

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fmt = self.fmt
        k_b, v_b = k.transpose(0, 1), v.transpose(0, 1)  # [b, sq, ng, hn]
        if fmt is None:  # no quantization: the activations' own dtype
            new_k, new_v = {"codes": k_b}, {"codes": v_b}
        else:
            if fmt.per_head_scale and self.amax is None:
                raise RuntimeError(f"KV-cache format {fmt.fmt} needs calibrated per-head scales (layer "
                                   f"{self.cache.layers.index(self)}): "
                                   "call model.generate.calibrate_kv(model, tokens) first")
            amax_k = self.amax[0] if self.amax is not None else None
            amax_v = self.amax[1] if self.amax is not None else None
            new_k, new_v = fmt.quantize(k_b, amax_k), fmt.quantize(v_b, amax_v)
        self.k, self.v = self._store(self.k, new_k), self._store(self.v, new_v)
        if fmt is None:
            k_all, v_all = self.k["codes"], self.v["codes"]
        else:
            k_all, v_all = fmt.dequantize(self.k).to(k.dtype), fmt.dequantize(self.v).to(v.dtype)
        return k_all.transpose(0, 1), v_all.transpose(0, 1)

    def keep_rows(self, index: torch.Tensor) -> None:
        for stored in (self.k, self.v):
            if stored is None:
                continue
            for key, t in stored.items():
                if t is not None and t.dim() > 1:
                    stored[key] = t.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes held (codes, block scales and per-head scales of K and V)."""
        return sum(t.numel() * t.element_size() for s in (self.k, self.v) if s for t in s.values() if t is not None)


class KVCache:
    """The whole model's KV-cache on this rank: one :class:`LayerKV` per transformer layer.

    ``fmt`` None stores keys and values unquantized (the model's activation dtype); otherwise the
    format's stored form; a sequence of ``num_layers`` entries (``KVFormat`` or None) gives each layer
    its own. ``formats``: the per-layer list. ``amax``: per layer ``[2, ng]`` calibrated per-head amaxes (needed by
    formats with a tensor-level scale). ``length``: slots filled in every layer (the engine calls
    :meth:`advance` after each forward).
    """

    def __init__(self, num_layers: int, groups: int, head_dim: int,
                 fmt: KVFormat | None | Sequence[KVFormat | None],
                 amax: list[torch.Tensor | None] | None = None, act_bytes: int = 4):
        if fmt is None or isinstance(fmt, KVFormat):
            formats = [fmt] * num_layers
        else:
            formats = list(fmt)
            if len(formats) != num_layers:
                raise ValueError(f"KVCache: {len(formats)} per-layer KV formats for {num_layers} layers")
        self.formats: list[KVFormat | None] = formats
        self.groups, self.head_dim, self.num_layers = groups, head_dim, num_layers
        self.act_bytes = act_bytes
        self.length = 0
        amax = amax or [None] * num_layers
        if len(amax) != num_layers:
            raise ValueError(f"KVCache: {len(amax)} per-layer amaxes for {num_layers} layers")
        self.layers = [LayerKV(self, a, f) for a, f in zip(amax, formats)]

    @property
    def fmt(self) -> KVFormat | None:
        """The format every layer shares; a cache with per-layer formats that differ has none."""
        if any(f != self.formats[0] for f in self.formats):
            raise AttributeError("KVCache.fmt: the layers store different formats; read KVCache.formats")
        return self.formats[0]

    def advance(self, n: int) -> None:
        self.length += n

    def keep_rows(self, rows: list[int]) -> None:
        """Keep batch ``rows`` of every layer (in that order): finished rows leave the batch."""
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.layers:
            if layer.k is not None:
                layer.keep_rows(index.to(layer.k["codes"].device))

    @property
    def bytes_per_token(self) -> float:
        """Stored bytes of one token's keys and values over every layer on this rank (each in its own
        format), block scales included (per-head scales amortized to zero)."""
        bits = sum(f.bits_per_element if f is not None else 8 * self.act_bytes for f in self.formats)
        return 2 * self.groups * self.head_dim * bits / 8

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

"""``precision.quantize``: one entry point from a high-precision tensor to a quantized one.

>>> q = quantize(x, "mxfp4", axis=-1)        # blocks of 32 along the last axis
>>> q.codes, q.scales, q.packed()            # uint8 codes, E8M0 scale bytes, two FP4 per byte
>>> x_q = q.dequantize(torch.float32)

Formats (``FORMATS``):

============  ===========  ======================================================
name          scaling      elements
============  ===========  ======================================================
fp32          none         float32, not rounded at all; ``codes`` are the 32-bit patterns
bf16          none         bfloat16 (RNE cast); ``codes`` are the 16-bit patterns
fp8_e4m3      per tensor   E4M3, saturating
fp8_e5m2      per tensor   E5M2, saturating
hif8          per tensor   HiFloat8, ties away, saturating at 2^15
mxfp8_e4m3    32-block     E4M3 + E8M0 scale
mxfp8_e5m2    32-block     E5M2 + E8M0 scale
mxfp4         32-block     E2M1 + E8M0 scale
nvfp4         16-block     E2M1 + E4M3 scale + FP32 tensor scale
============  ===========  ======================================================

Per-tensor formats take an optional ``amax`` (delayed scaling: the scale comes from history,
values beyond range saturate and ``num_clipped`` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precision import blocks
from precision.elements import E2M1, E4M3, E5M2, ElementSpec, fp8_decode, fp8_encode
from precision.hif8 import HIF8_MAX, hif8_decode, hif8_encode
from precision.srand import SRKey
from precision.tensorwise import scale_from_amax, tensor_amax

__all__ = ["FormatSpec", "FORMATS", "QuantizedTensor", "quantize", "ROUNDINGS", "SCALE_RULES"]

ROUNDINGS = ("nearest", "stochastic")
SCALE_RULES = ("floor", "rceil")


@dataclass(frozen=True)
class FormatSpec:
    name: str
    scaling: str  # "none" | "tensor" | "block"
    element: ElementSpec | None  # None for fp32, bf16 and hif8
    block: int = 0
    max_normal: float = 0.0
    bits: int = 16

    @property
    def is_mx(self) -> bool:
        return self.name.startswith("mx")


FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in (
        FormatSpec("fp32", "none", None, bits=32),
        FormatSpec("bf16", "none", None),
        FormatSpec("fp8_e4m3", "tensor", E4M3, max_normal=E4M3.max_normal, bits=8),
        FormatSpec("fp8_e5m2", "tensor", E5M2, max_normal=E5M2.max_normal, bits=8),
        FormatSpec("hif8", "tensor", None, max_normal=HIF8_MAX, bits=8),
        FormatSpec("mxfp8_e4m3", "block", E4M3, block=32, max_normal=E4M3.max_normal, bits=8),
        FormatSpec("mxfp8_e5m2", "block", E5M2, block=32, max_normal=E5M2.max_normal, bits=8),
        FormatSpec("mxfp4", "block", E2M1, block=32, max_normal=E2M1.max_normal, bits=4),
        FormatSpec("nvfp4", "block", E2M1, block=16, max_normal=E2M1.max_normal, bits=4),
    )
}


def format_spec(name: str) -> FormatSpec:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; valid: {', '.join(FORMATS)}") from None


@dataclass
class QuantizedTensor:
    """The result of :func:`quantize`.

    ``codes``: one uint8 per element, shaped like the input (bf16: the int16 bit patterns).
    ``scales``: MX -- uint8 E8M0 bytes, shaped like the input with the block axis shrunk to
    ceil(n / 32); NVFP4 -- uint8 E4M3 bytes likewise (blocks of 16); per-tensor -- the float32
    encode scale (a 0-d tensor). ``tensor_scale``: NVFP4's FP32 encode scale ``g_enc``.
    ``num_clipped``: per-tensor formats, how many finite values saturated (0-d int64 tensor).
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor | None
    axis: int
    tensor_scale: torch.Tensor | None = None
    prescale: float = 1.0
    num_clipped: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        spec = FORMATS[self.fmt]
        if spec.name == "fp32":
            return self.codes.view(torch.float32).to(dtype)
        if spec.name == "bf16":
            return self.codes.view(torch.bfloat16).to(dtype)
        if spec.scaling == "tensor":
            vals = hif8_decode(self.codes) if spec.name == "hif8" else fp8_decode(self.codes, spec.element)
            return (vals * (1.0 / self.scales)).to(dtype)
        n = self.codes.shape[self.axis]
        cb = blocks.to_blocks(self.codes, self.axis, spec.block)
        sb = self.scales.movedim(self.axis, -1)
        if spec.name == "nvfp4":
            out = blocks.nvfp4_dequantize_blocks(cb, sb, self.tensor_scale)
        else:
            out = blocks.mx_dequantize_blocks(cb, sb, spec.element, self.prescale)
        return blocks.from_blocks(out, self.axis, n).to(dtype)

    def packed(self) -> torch.Tensor:
        """Two 4-bit codes per byte along the last axis, low nibble = even index."""
        if FORMATS[self.fmt].bits != 4:
            raise ValueError(f"packed(): only 4-bit formats pack two codes per byte, not {self.fmt}")
        if self.codes.shape[-1] % 2:
            raise ValueError(f"packed(): last dimension must be even, got {self.codes.shape[-1]}")
        c = self.codes.reshape(*self.codes.shape[:-1], -1, 2)
        return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    rounding: str = "nearest",
    scale_rule: str = "floor",
    generator: torch.Generator | None = None,
    prescale: float = 1.0,
    amax: torch.Tensor | float | None = None,
    sr: SRKey | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt``; block formats take their blocks along ``axis``.

    ``rounding``: ``nearest`` (ties to even; HiF8 ties away) or ``stochastic``: uniforms from
    ``sr`` (a :class:`precision.srand.SRKey`: counter-based, a function of the global element
    index -- what training uses) or else one ``torch.rand`` draw from ``generator``.
    ``scale_rule``: MX scale rule, ``floor`` (OCP) or ``rceil``. ``prescale``: multiply before
    rounding and divide after (0.75 for stochastic MXFP4). ``amax``: formats with a tensor-level
    scale (per-tensor FP8/HiF8, NVFP4's FP32 tensor scale), the amax to scale by (delayed scaling,
    or the whole tensor's amax under tensor parallelism); a float or a 0-d float32 tensor; default
    the tensor's own.
    """
    spec = format_spec(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: unknown mode {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule: unknown rule {scale_rule!r}; valid: {', '.join(SCALE_RULES)}")
    if x.dim() == 0:
        raise ValueError("quantize: x must have at least one dimension")
    axis = axis % x.dim()
    xf = x.float()

    if spec.name == "fp32":
        if rounding == "stochastic":
            raise ValueError("fp32: stochastic rounding is not supported; valid: nearest")
        return QuantizedTensor(fmt, xf.clone().view(torch.int32), None, axis)

    if spec.name == "bf16":
        if rounding == "stochastic":
            raise ValueError("bf16: stochastic rounding is not supported; valid: nearest")
        return QuantizedTensor(fmt, xf.to(torch.bfloat16).view(torch.int16), None, axis)

    if spec.scaling == "tensor":
        cur = tensor_amax(xf)
        used = cur if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        scale = scale_from_amax(used, spec.max_normal)
        v = xf * scale
        clipped = (v.abs() > spec.max_normal) & torch.isfinite(v)
        if spec.name == "hif8":
            if rounding != "nearest":
                raise ValueError("hif8: stochastic rounding is not supported; valid: nearest")
            codes = hif8_encode(v, saturate=True)
        else:
            u = sr.uniforms(xf.shape, xf.device) if sr is not None and rounding == "stochastic" else None
            codes = fp8_encode(v, spec.element, rounding, generator, u)
        return QuantizedTensor(fmt, codes, scale, axis, num_clipped=clipped.sum(), amax=cur)

    n = xf.shape[axis]
    xb = blocks.to_blocks(xf, axis, spec.block)
    u = None
    if sr is not None and rounding == "stochastic":  # natural layout, then blocked like x (pad: 0)
        u = blocks.to_blocks(sr.uniforms(xf.shape, xf.device), axis, spec.block)
    if spec.name == "nvfp4":
        used = tensor_amax(xf) if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        g_enc = blocks.nvfp4_tensor_scale(used.reshape(()))
        codes, sbytes = blocks.nvfp4_quantize_blocks(xb, g_enc, rounding, generator, u)
        extra = {"tensor_scale": g_enc}
    else:
        codes, sbytes = blocks.mx_quantize_blocks(xb, spec.element, scale_rule, rounding, generator, prescale,
                                                  u)
        extra = {"prescale": prescale}
    codes = blocks.from_blocks(codes, axis, n)
    return QuantizedTensor(fmt, codes, sbytes.movedim(-1, axis), axis, **extra)


def fake_quantize(x: torch.Tensor, fmt: str, **kw) -> torch.Tensor:
    """quantize -> dequantize to float32 (the emulated operand)."""
    return quantize(x, fmt, **kw).dequantize(torch.float32)


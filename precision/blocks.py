"""Block-scaled formats: MX (MXFP8, MXFP6, MXFP4: any element of ``precision.elements``) and NVFP4.

Blocks are consecutive elements along one axis of the tensor -- for a GEMM operand, its
contraction axis. A length that is not a multiple of the block size is **zero-padded** for the
block computation only: padding never changes a block's amax, and the codes returned keep the
input's shape.

MX (OCP v1.0): 32 elements share an E8M0 scale byte ``s`` meaning ``2^(s-127)``; elements are
``RNE(V / X)`` (or stochastic), saturating.
  * ``floor`` (OCP default): exponent = floor(log2(amax)) - emax_elem. The block maximum may clip.
  * ``rceil`` (NVIDIA hardware): scale = 2^ceil(log2(amax / max_normal)). Never clips.
  Exponents clamp to [-127, 127]. A block of zeros/FP32 subnormals gets byte 0x00 and zero codes
  with their sign (-0 stays -0); a block holding NaN or +-Inf gets byte 0xFF and decodes
  entirely to NaN.

NVFP4: 16 E2M1 elements share an E4M3 scale; an FP32 per-tensor scale maps the tensor amax onto
the product of the element and scale ranges (TransformerEngine's order of operations, see
NUMERICS.md: every step one FP32 operation). A block whose E4M3 scale rounds to zero stores zero
codes (with their sign).

2-D tiles (weights, :func:`tile_amax`): a 2-D tensor is cut into ``tile x tile`` squares (16 for
NVFP4, 32 for MX: the block size), each square's amax sets the one scale all its elements share,
and elements are encoded exactly as in 1-D blocks. The codes and scales are then the same whichever
axis is the contraction axis: blocks along one axis of a square are its rows, along the other its
columns, and every one of them carries the square's scale. Edge squares of a shape that is not a
multiple are zero-padded (TransformerEngine's reference pads both dims with zeros), so their amax
is that of the elements present.
"""

from __future__ import annotations

import torch

from precision.elements import (
    E2M1,
    E4M3,
    ElementSpec,
    decode_element,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    encode_element,
    exponent_floor,
    fdiv,
    pow2,
    round_to_grid,
)
from precision.enums import Rounding, ScaleRule

__all__ = [
    "FP32_MAX",
    "from_blocks",
    "mx_dequantize_blocks",
    "mx_quantize_blocks",
    "mx_scale_bytes",
    "nvfp4_dequantize_blocks",
    "nvfp4_quantize_blocks",
    "pairwise_sum",
    "tile_amax",
    "to_blocks",
]

FP32_MAX = torch.finfo(torch.float32).max
SCALE_NAN = 0xFF


def to_blocks(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Move ``axis`` last, zero-pad it to a multiple of ``block``, view as ``[..., nblocks, block]``."""
    x = x.movedim(axis, -1).contiguous()
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (n + pad) // block, block)


def from_blocks(xb: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks` for a tensor whose ``axis`` had length ``n``."""
    x = xb.reshape(*xb.shape[:-2], -1)[..., :n]
    return x.movedim(-1, axis)


def pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power-of-two length) in one fixed FP32 order: halves added
    element-wise, ``t[..., :n/2] + t[..., n/2:]``, until one is left. ``torch.sum``'s order is the
    backend's own (vectorized lanes on CPU, a tree on GPU, another under ``torch.compile``); this
    one every quantizer (reference, fused, Triton) repeats bit for bit."""
    n = t.shape[-1]
    if n & (n - 1):
        raise ValueError(f"pairwise_sum: the last axis must be a power of two, got {n}")
    while n > 1:
        n //= 2
        t = t[..., :n] + t[..., n:]
    return t[..., 0]


def tile_amax(x: torch.Tensor, axis: int, tile: int) -> torch.Tensor:
    """Each ``tile x tile`` square's amax of a 2-D ``x``, laid out as :func:`to_blocks`' block amax
    along ``axis`` -- ``[rows, ceil(n / tile)]`` (``axis`` last), every row of a square carrying the
    square's amax. Both dims zero-padded to whole squares; NaN and Inf propagate to their square."""
    if x.dim() != 2:
        raise ValueError(f"2-D block scaling: expected a 2-D tensor (a weight [out, in]), got shape {tuple(x.shape)}")
    xt = x.float().movedim(axis % 2, -1)
    rows, n = xt.shape
    pr, pn = (-rows) % tile, (-n) % tile
    padded = torch.nn.functional.pad(xt.abs(), (0, pn, 0, pr))
    sq = padded.reshape((rows + pr) // tile, tile, (n + pn) // tile, tile).amax(dim=(1, 3))
    return sq.repeat_interleave(tile, dim=0)[:rows]


def mx_scale_bytes(amax: torch.Tensor, spec: ElementSpec, scale_rule: str) -> torch.Tensor:
    """Per-block E8M0 scale bytes (int32, 0..254) from float32 block amax (finite, >= 0)."""
    if scale_rule == "floor":
        e = exponent_floor(amax) - spec.emax
    elif scale_rule == "rceil":
        # ceil(log2(r)), r = amax / max_normal in FP32: exponent bits, +1 unless r is a power of two.
        # FP32-subnormal r is first scaled by 2^64 (exact) into the normal range.
        r = fdiv(amax, spec.max_normal)
        tiny = r < torch.finfo(torch.float32).tiny
        r = torch.where(tiny, r * 2.0**64, r)
        up = (r.view(torch.int32) & 0x7FFFFF) != 0
        e = exponent_floor(r) + up.to(torch.int32) - torch.where(tiny, 64, 0).to(torch.int32)
    else:
        raise ValueError(f"scale_rule: unknown rule {scale_rule!r}; valid: {', '.join(ScaleRule.values())}")
    e = e.clamp(-127, 127)
    zero = exponent_floor(amax) == -127  # amax is 0 or an FP32 subnormal
    return torch.where(zero, torch.zeros_like(e), e + 127)


def _sign_code(x: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    """The signed-zero code of each element of ``x`` (uint8: the sign bit alone)."""
    return torch.signbit(x).to(torch.uint8) << spec.sign_shift


def mx_quantize_blocks(
    xb: torch.Tensor,
    spec: ElementSpec,
    scale_rule: ScaleRule | str = ScaleRule.FLOOR,
    rounding: Rounding | str = Rounding.NEAREST,
    generator: torch.Generator | None = None,
    prescale: float = 1.0,
    u: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., nblocks, 32]`` float32 blocks -> (element codes uint8, scale bytes uint8).

    ``prescale`` (e.g. 0.75 for the SR trick of arXiv 2502.20586) multiplies the values before
    rounding; the dequantizer divides it back out. Stochastic rounding uses ``u`` (uniforms shaped
    like ``xb``) when given, else one draw from ``generator``. ``amax``: ``[..., nblocks]``, the
    amax each block's scale comes from (2-D tiles: :func:`tile_amax`); default each block's own.
    """
    xb = xb.float()
    amax = xb.abs().amax(dim=-1) if amax is None else amax.float()
    finite_amax = torch.isfinite(amax)  # False where the block holds NaN or +-Inf
    amax = torch.where(finite_amax, amax, torch.zeros_like(amax))
    sbyte = mx_scale_bytes(amax, spec, scale_rule)
    zero = exponent_floor(amax) == -127  # all zeros / FP32 subnormals (byte 0 alone may be 2^-127)
    inv_scale = pow2(127 - sbyte)  # 1 / 2^(s-127); s = 0 -> 2^127 (only reached by all-small blocks)
    v = xb * inv_scale.unsqueeze(-1)
    if prescale != 1.0:
        v = v * prescale
    codes = encode_element(v, spec, rounding, generator, u)
    # Blocks of zeros / FP32 subnormals encode as zeros with their sign (-0 stays -0); blocks
    # holding NaN/Inf get the NaN scale byte and zero codes (no host sync: branch-free).
    codes = torch.where(zero.unsqueeze(-1), _sign_code(xb, spec), codes)
    bad = ~finite_amax
    sbyte = torch.where(bad, torch.full_like(sbyte, SCALE_NAN), sbyte)
    codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
    return codes, sbyte.to(torch.uint8)


def mx_dequantize_blocks(codes: torch.Tensor, sbytes: torch.Tensor, spec: ElementSpec,
                         prescale: float = 1.0) -> torch.Tensor:
    """Inverse of :func:`mx_quantize_blocks`: float32 ``[..., nblocks, 32]``."""
    vals = decode_element(codes, spec)
    s = sbytes.to(torch.int32)
    scale = torch.where(s == SCALE_NAN, float("nan"), pow2(s - 127))
    out = vals * scale.unsqueeze(-1)
    if prescale != 1.0:
        out = fdiv(out, prescale)
    return out


def mx_fake_quantize_blocks(
    xb: torch.Tensor,
    spec: ElementSpec,
    scale_rule: ScaleRule | str = ScaleRule.FLOOR,
    rounding: Rounding | str = Rounding.NEAREST,
    u: torch.Tensor | None = None,
    prescale: float = 1.0,
) -> torch.Tensor:
    """quantize -> dequantize of ``[..., nblocks, block]`` MX blocks in one branch-free expression.

    Values identical to ``mx_dequantize_blocks(*mx_quantize_blocks(...))`` (tested), but without
    element codes, so ``torch.compile`` can fuse it into one loop (``kernels.fused``). Elements
    are rounded arithmetically (``round_to_grid``), not through codes or casts: a second,
    independent formulation of the same numbers.
    """
    xb = xb.float()
    amax = xb.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    sbyte = mx_scale_bytes(torch.where(finite, amax, torch.zeros_like(amax)), spec, scale_rule)
    v = xb * pow2(127 - sbyte)
    if prescale != 1.0:
        v = v * prescale
    if spec is E2M1 and (not Rounding.parse(rounding, "rounding").stochastic or u is not None):
        q = e2m1_round(v, rounding, u) * pow2(sbyte - 127)
    else:
        q = round_to_grid(v, spec, rounding, u=u) * pow2(sbyte - 127)
    if prescale != 1.0:
        q = fdiv(q, prescale)
    zero = exponent_floor(amax) == -127  # zero / FP32-subnormal blocks: zeros with their sign
    q = torch.where(zero, torch.copysign(torch.zeros_like(q), xb), q)
    return torch.where(finite, q, torch.full_like(q, float("nan")))


# ---------------------------------------------------------------- NVFP4
def nvfp4_tensor_scale(amax_tensor: torch.Tensor) -> torch.Tensor:
    """FP32 encode scale ``g_enc`` mapping the tensor amax to 448*6 (1 for an all-zero tensor)."""
    amax_tensor = amax_tensor.float()
    g = torch.clamp(fdiv(E4M3.max_normal * E2M1.max_normal, amax_tensor), max=FP32_MAX)  # one division
    return torch.where(amax_tensor == 0, torch.ones_like(g), g)


def nvfp4_quantize_blocks(
    xb: torch.Tensor,
    g_enc: torch.Tensor,
    rounding: Rounding | str = Rounding.NEAREST,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., nblocks, 16]`` float32 blocks -> (E2M1 codes, E4M3 scale bytes).

    A block holding NaN/Inf gets the E4M3 NaN scale byte (0x7F) and decodes to NaN. ``amax``:
    ``[..., nblocks]``, the amax each block's scale comes from (2-D tiles); default its own.
    """
    xb = xb.float()
    amax = xb.abs().amax(dim=-1) if amax is None else amax.float()
    finite = torch.isfinite(amax)
    g_dec = 1.0 / g_enc
    s_dec = torch.clamp(amax * fdiv(g_enc, E2M1.max_normal), max=E4M3.max_normal)
    s_dec = torch.where(finite, s_dec, torch.zeros_like(s_dec)).to(torch.float8_e4m3fn)
    s_enc = torch.clamp(1.0 / (s_dec.float() * g_dec), max=FP32_MAX)
    v = torch.clamp(xb * s_enc.unsqueeze(-1), -E2M1.max_normal, E2M1.max_normal)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    codes = e2m1_encode(v, rounding, generator, u)
    # A block whose scale rounds to zero holds zeros (with their sign), not saturated codes.
    codes = torch.where((s_dec.float() == 0).unsqueeze(-1), _sign_code(xb, E2M1), codes)
    sbytes = s_dec.view(torch.uint8)
    sbytes = torch.where(finite, sbytes, torch.full_like(sbytes, 0x7F))
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return codes, sbytes


def nvfp4_dequantize_blocks(codes: torch.Tensor, sbytes: torch.Tensor, g_enc: torch.Tensor) -> torch.Tensor:
    s = sbytes.view(torch.float8_e4m3fn).float()  # 0x7F decodes to NaN
    g_dec = 1.0 / g_enc
    return e2m1_decode(codes) * (s * g_dec).unsqueeze(-1)


def nvfp4_fake_quantize_blocks(
    xb: torch.Tensor,
    g_enc: torch.Tensor,
    rounding: Rounding | str = Rounding.NEAREST,
    u: torch.Tensor | None = None,
) -> torch.Tensor:
    """quantize -> dequantize of NVFP4 blocks, branch-free (see :func:`mx_fake_quantize_blocks`)."""
    xb = xb.float()
    amax = xb.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    g_dec = 1.0 / g_enc
    s_dec = torch.clamp(torch.where(finite, amax, torch.zeros_like(amax)) * fdiv(g_enc, E2M1.max_normal),
                        max=E4M3.max_normal).to(torch.float8_e4m3fn).float()
    s_enc = torch.clamp(1.0 / (s_dec * g_dec), max=FP32_MAX)
    v = torch.clamp(xb * s_enc, -E2M1.max_normal, E2M1.max_normal)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    if not Rounding.parse(rounding, "rounding").stochastic or u is not None:
        q = e2m1_round(v, rounding, u) * (s_dec * g_dec)
    else:
        q = round_to_grid(v, E2M1, rounding, u=u) * (s_dec * g_dec)
    return torch.where(finite, q, torch.full_like(q, float("nan")))

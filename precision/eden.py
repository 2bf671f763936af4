"""MS-EDEN: unbiased NVFP4 rounding with a lower error than stochastic rounding (Quartet II,
arXiv 2601.22813).

Stochastic rounding makes every element unbiased by adding up to a whole grid step of noise per
element. EDEN (a random rotation followed by round-to-nearest and one rescaling factor) is unbiased
over the random rotation instead: with ``x`` rotated by a random-sign Hadamard, the nearest grid
point ``q`` of ``x`` is biased towards the grid, but ``q * <x, x> / <x, q>`` is, in expectation over
the rotation, ``x`` itself -- with nearest rounding's small error on every element. MS-EDEN puts
that factor into the micro-scale (the E4M3 block scale) and rounds the corrected scale
stochastically between its two E4M3 neighbours, so the stored scale is unbiased too and the codes
stay NVFP4's. The GEMM must therefore rotate both operands with random signs (``rht16*``, ``rht128*``).

Order of operations -- the Quartet II authors' quantizer (their Triton kernel
``eden_1x16s_fp4_kernel``), each step one FP32 operation::

    val_max = 6 / scale_override        # scale_override = (17/16) * 0.93: the backward's setting
    s_dec   = amax_tensor / 255.99 / val_max     # (1 for an all-zero tensor); 255.99, not 448:
                                                 # room for the correction to move a scale up
    s_b     = e4m3(amax_block / val_max / s_dec)   (1 where that rounds to 0)
    v       = x / (s_b * s_dec)
    q       = rtn_e2m1(v)                  # ties away from zero (thresholds 0.25, 0.75, ..., 5)
    c       = sum(v * v) / sum(v * q)      # over the EDEN group (1 where the sum is 0)
    s       = sr_e4m3(s_b * c)             # per 16-block: up with probability (s_b*c - down) / (up - down)
    x_hat   = q * s * s_dec

The EDEN group is the rotation's group: the correction ``c`` is one number per group of rotated
elements, multiplied into each of the group's 16-block scales, each then rounded with its own
uniform. ``eden`` (rounding ``ms_eden``): 16-element groups under a 16-point random rotation
(``rht16*``; the fouroversix training code runs the authors' kernel so). ``eden128``
(``ms_eden128``): 128-element groups under a 128-point random rotation (``rht128*``) -- the
Quartet II authors' setting (their backward rotates 128 elements at a time and computes the
correction over the rotation group; measured here, its bias is small but not zero: the group's
factor mixes eight block scales -- docs/controls.md). Sums run in ``precision.blocks.pairwise_sum``'s fixed order
(the fused quantizer repeats it bit for bit; the authors' ``tl.sum`` has its own). The one uniform a
block's scale draws is the block's first element's SR uniform (``precision.srand``), so a run is
reproducible from its seed and a TP shard draws what TP=1 draws.

Storage is NVFP4's: E2M1 codes, E4M3 scale bytes and ``tensor_scale = 1 / s_dec`` (a hardware
GEMM applies ``1 / tensor_scale``; the FP32 reciprocal can differ from ``s_dec`` in its last bit).
"""

from __future__ import annotations

import numpy as np
import torch

from precision.blocks import FP32_MAX, from_blocks, pairwise_sum, to_blocks
from precision.elements import E2M1, e2m1_encode, fdiv

__all__ = ["BACKWARD_SCALE_OVERRIDE", "EDEN_SCALE_MAX", "ms_eden_quantize", "ms_eden_quantize_blocks", "rtn_e2m1_away"]

BACKWARD_SCALE_OVERRIDE = (17 / 16) * 0.93  # Quartet II's backward: amax maps to 6 / 0.988
EDEN_SCALE_MAX = 255.99  # the largest block scale before the correction (E4M3 max is 448)
BLOCK = 16  # NVFP4's block: one E4M3 scale, one SR uniform
VAL_MAX = float(np.float32(E2M1.max_normal / BACKWARD_SCALE_OVERRIDE))  # what a block's amax maps to
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # E2M1 midpoints; a midpoint rounds up
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def rtn_e2m1_away(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, midpoints away from zero, saturating at 6; sign kept."""
    a = v.abs()
    idx = torch.bucketize(a, torch.tensor(_THRESHOLDS, device=v.device), right=True)
    return torch.copysign(torch.tensor(_VALUES, device=v.device)[idx], v)


def _sr_e4m3(c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of positive FP32 ``c`` onto E4M3 between its two neighbours: up with
    probability ``(c - down) / (up - down)`` (the authors' bit-neighbour construction)."""
    bits = c.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)

    def val(b):
        return (b & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()

    cur, prev, nxt = val(bits), val(bits - 1), val(bits + 1)
    above = cur > c
    up = torch.where(above, cur, nxt)
    down = torch.where(above, prev, cur)
    p_up = (c - down) / (up - down)
    return torch.where(u < p_up, up, down)


def ms_eden_quantize_blocks(
    xb: torch.Tensor,
    amax_tensor: torch.Tensor,
    u_block: torch.Tensor,
    group: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MS-EDEN of float32 blocks ``[..., nblocks, 16]`` under the tensor-level ``amax_tensor``
    (0-d), with one uniform per block ``u_block [..., nblocks]``; EDEN's correction is shared by
    each ``group`` consecutive elements (16: the block; 128: eight blocks -- ``nblocks`` must then
    be a multiple of 8). Returns ``(E2M1 codes, E4M3 scale bytes, tensor_scale = 1 / s_dec)``. A
    block holding NaN/Inf gets the NaN scale byte 0x7F and zero codes (NVFP4's rule)."""
    per = group // BLOCK
    if group % BLOCK or per & (per - 1) or xb.shape[-2] % per:
        raise ValueError(f"ms_eden: EDEN group {group} must be a power-of-two multiple of {BLOCK} dividing the "
                         f"blocked axis ({xb.shape[-2] * BLOCK} elements); zero-pad it to whole groups")
    xb = xb.float()
    amax_t = amax_tensor.float().reshape(())
    val_max = torch.tensor(VAL_MAX, device=xb.device)
    s_dec = fdiv(fdiv(amax_t, EDEN_SCALE_MAX), val_max)
    s_dec = torch.where(amax_t == 0, torch.ones_like(s_dec), s_dec)
    amax_b = xb.abs().amax(dim=-1)
    finite = torch.isfinite(amax_b)
    x = torch.where(finite.unsqueeze(-1), xb, torch.zeros_like(xb))
    amax_b = torch.where(finite, amax_b, torch.zeros_like(amax_b))
    s_b = fdiv(fdiv(amax_b, val_max), s_dec).to(torch.float8_e4m3fn).float()
    s_b = torch.where(s_b == 0, torch.ones_like(s_b), s_b)
    v = fdiv(x, (s_b * s_dec).unsqueeze(-1))
    q = rtn_e2m1_away(v)
    lead = v.shape[:-2]
    num = pairwise_sum((v * v).reshape(*lead, -1, group))  # [..., ngroups]
    den = pairwise_sum((v * q).reshape(*lead, -1, group))
    corr = torch.where(den == 0, torch.ones_like(num), fdiv(num, torch.where(den == 0, torch.ones_like(den), den)))
    corr = corr.repeat_interleave(per, dim=-1)  # each block's group's factor
    scale = _sr_e4m3(s_b * corr, u_block.float())
    codes = e2m1_encode(torch.where(q == 0, torch.copysign(torch.zeros_like(q), xb), q))  # exact: q is on the grid
    sbytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    sbytes = torch.where(finite, sbytes, torch.full_like(sbytes, 0x7F))
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return codes, sbytes, torch.clamp(1.0 / s_dec, max=FP32_MAX)


def ms_eden_quantize(
    xf: torch.Tensor,
    axis: int,
    amax_tensor: torch.Tensor,
    u: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    group: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MS-EDEN of a float32 tensor with 16-element blocks along ``axis``: ``(codes shaped like
    xf, scale bytes with ``axis`` shrunk to ceil(n / 16), tensor_scale)``. ``u``: SR uniforms
    shaped like ``xf`` (each block uses its first element's), else one draw per block from
    ``generator``. ``group``: EDEN's group (16 or 128; the axis is zero-padded to whole groups
    for the sums, as the GEMM pads it to whole rotation groups)."""
    n = xf.shape[axis]
    xb = to_blocks(xf, axis, 16)
    if u is not None:
        ub = to_blocks(u, axis, 16)[..., 0]
    else:
        ub = torch.rand(xb.shape[:-1], generator=generator, device=xf.device, dtype=torch.float32)
    per, nb = group // BLOCK, xb.shape[-2]
    pad = (-nb) % per if per else 0
    if pad:  # zero blocks complete the last group (they change neither sum); their outputs are dropped
        xb = torch.nn.functional.pad(xb, (0, 0, 0, pad))
        ub = torch.nn.functional.pad(ub, (0, pad))
    codes, sbytes, tensor_scale = ms_eden_quantize_blocks(xb, amax_tensor, ub, group)
    codes, sbytes = codes[..., :nb, :], sbytes[..., :nb]
    return from_blocks(codes, axis, n), sbytes.movedim(-1, axis), tensor_scale


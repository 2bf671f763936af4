"""QuEST-style MXFP4 scales (Quartet's forward pass, arXiv 2505.14669; QuEST, arXiv 2502.05003).

Plain MXFP4 scales each 32-block so that its largest value lands near the top of the E2M1 grid:
one outlier sets the step for all 32 elements. After a Hadamard rotation a block is close to
Gaussian, and the error of a 4-bit grid on Gaussian data is smallest when the grid is clipped at a
fixed multiple of the standard deviation (2.92 sigma for E2M1's +-6, a Lloyd-Max style fit);
values beyond are clipped. Quartet's forward quantizer (the authors' Triton kernel
``mxfp4_forward_kernel`` with ``quest=True``, ``gaussian_scale = 2.92247856 / 6``) does exactly
that, with the scale rounded down to a power of two so that it is an E8M0 byte::

    sigma = sqrt(mean(x^2) - mean(x)^2)            # over the 32-block (the rotated values);
                                                   # sums in precision.blocks.pairwise_sum's order
    e     = floor(log2(2.92247856 / 6 * sigma + 1e-8))     # the block's E8M0 exponent
    q     = e2m1(x / 2^e)   nearest, a midpoint rounds towards zero; |x / 2^e| > 5 -> 6 (clipped)
                            (or stochastic, as the kernel's ``stochastic_round``; beyond 6 -> 6)
    x_hat = q * 2^e

So the clipping level ``6 * 2^e`` lies between 1.46 and 2.92 sigma. Differences from the
authors' kernel, both for robustness: the variance is clamped at 0 before the square root (in FP32
``mean(x^2) - mean(x)^2`` can come out a hair below zero for a constant block, which the kernel
turns into NaN), and ``floor(log2)`` is read from the exponent bits (exact) rather than from an
approximate ``log2``. The exponent is clamped to E8M0's [-127, 127]; a block holding NaN/Inf gets
the NaN scale byte 0xFF (the MX rule). Codes and scale bytes are MXFP4's, so any MXFP4 consumer
reads them. The GEMM must rotate its operands (``had32`` as in Quartet, or any rotation): the
Gaussian fit is what the rotation buys.
"""

from __future__ import annotations

import torch

from precision.blocks import SCALE_NAN, from_blocks, pairwise_sum, to_blocks
from precision.elements import E2M1, e2m1_encode, exponent_floor, pow2, round_to_grid
from precision.enums import Rounding

__all__ = ["GAUSSIAN_CLIP", "QUEST_SCALE", "quest_quantize", "quest_quantize_blocks", "rtn_e2m1_toward_zero"]

GAUSSIAN_CLIP = 2.92247856  # MSE-optimal clipping of E2M1's grid for a unit Gaussian, in sigmas
QUEST_SCALE = GAUSSIAN_CLIP / 6.0  # sigma -> the grid unit (E2M1's largest value is 6)
EPS = 1e-8
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def rtn_e2m1_toward_zero(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, a midpoint rounding towards zero (strict ``>`` thresholds), |v| > 5 -> 6."""
    idx = torch.bucketize(v.abs(), torch.tensor(_THRESHOLDS, device=v.device), right=False)
    return torch.copysign(torch.tensor(_VALUES, device=v.device)[idx], v)


def quest_quantize_blocks(xb: torch.Tensor, rounding: Rounding | str = Rounding.NEAREST,
                          generator: torch.Generator | None = None,
                          u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QuEST MXFP4 of float32 blocks ``[..., nblocks, 32]``: ``(E2M1 codes, E8M0 scale bytes,
    clipped [..., nblocks, 32] bool: |x / 2^e| >= 6, the elements QuEST's trust mask drops)``.
    ``rounding`` stochastic (the authors' kernel has it too: between the two neighbouring grid
    values, everything beyond 6 to 6) takes ``u`` (uniforms shaped like ``xb``) or ``generator``."""
    xb = xb.float()
    n = float(xb.shape[-1])
    finite = torch.isfinite(xb).all(dim=-1)
    x = torch.where(finite.unsqueeze(-1), xb, torch.zeros_like(xb))
    mean_sq = pairwise_sum(x * x) / n
    mean = pairwise_sum(x) / n
    sigma = torch.sqrt(torch.clamp(mean_sq - mean * mean, min=0.0))
    e = exponent_floor(QUEST_SCALE * sigma + EPS).clamp(-127, 127)
    v = x * pow2(-e).unsqueeze(-1)  # exact: a power of two
    if Rounding.parse(rounding, "quest rounding").stochastic:
        q = round_to_grid(v, E2M1, Rounding.STOCHASTIC, generator, u)
    else:
        q = rtn_e2m1_toward_zero(v)
    codes = e2m1_encode(torch.where(q == 0, torch.copysign(torch.zeros_like(q), xb), q))  # q is on the grid
    sbytes = torch.where(finite, e + 127, torch.full_like(e, SCALE_NAN)).to(torch.uint8)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return codes, sbytes, v.abs() >= E2M1.max_normal


def quest_quantize(xf: torch.Tensor, axis: int, rounding: Rounding | str = Rounding.NEAREST,
                   generator: torch.Generator | None = None,
                   u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """QuEST MXFP4 of a float32 tensor, 32-blocks along ``axis``: ``(codes shaped like xf, scale
    bytes with ``axis`` shrunk to ceil(n / 32))``. A partial last block is zero-padded for its
    statistics (as every MX block here)."""
    n = xf.shape[axis]
    ub = to_blocks(u, axis, 32) if u is not None else None
    codes, sbytes, _ = quest_quantize_blocks(to_blocks(xf, axis, 32), rounding, generator, ub)
    return from_blocks(codes, axis, n), sbytes.movedim(-1, axis)

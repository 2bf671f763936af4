"""Per-block figures of one GEMM operand: why a block format loses what it loses along an axis.

A block format gives each ``block`` consecutive elements along the GEMM's contraction axis one scale,
set by the block's largest magnitude. Fprop and Dgrad contract over features, so ``x``, ``w`` and
``dy`` are blocked along a feature row; Wgrad (``dw = dyᵀ·x``) contracts over tokens, so its ``dy``
and ``x`` are blocked along a column of 32 *tokens*, where one token (the first of a sequence, a
delimiter, a high-loss token) can sit orders of magnitude above the others and push the rest of its
block below the format's smallest step. These figures measure exactly that, per operand:

=====================  ============================================================================
``flushed_nonzero``    fraction of the non-zero elements that quantized to zero
``block_max_median``   mean over blocks of max|x| / median|x| (median: mean of the two middle
                       magnitudes of the block; blocks whose median is 0 are left out; 0 when
                       no block has a non-zero median -- a real value is never below 1)
``block_top_share``    mean over blocks of the share of the block's energy in its largest element,
                       max x² / Σ x² (1/block for a flat block, 1 for a single spike; all-zero
                       blocks left out; 0 when every block is zero)
``had16_*``            the same three after a 16-point Hadamard along the contraction axis (the
                       rotated tensor quantized again, nearest rounding, its own amax): what the
                       study's deterministic Hadamard would change. Left out where the operand
                       already is rotated, or its axis is not a multiple of 16.
=====================  ============================================================================

``block_figures(hp, deq, axis, block)`` computes the first three; ``hadamard_figures(hp, fmt, axis,
block, scale_rule)`` the rotated ones. Blocks are ``block`` elements along ``axis`` (the format's own
block; per-tensor and unscaled formats use 32, the MX block, so an FP8 run shows what MXFP4 would
see); a trailing partial block is left out. Non-finite elements count as zeros.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_METRICS", "HADAMARD_METRICS", "DEFAULT_BLOCK", "block_figures", "hadamard_figures"]

BLOCK_METRICS = ("flushed_nonzero", "block_max_median", "block_top_share")
HADAMARD_METRICS = tuple(f"had16_{m}" for m in BLOCK_METRICS)
DEFAULT_BLOCK = 32
HADAMARD_SIZE = 16


def _full_blocks(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """``[nblocks, block]``: ``x``'s full blocks of ``block`` elements along ``axis``."""
    x = x.movedim(axis, -1)
    n = (x.shape[-1] // block) * block
    return x[..., :n].reshape(-1, block)


@torch.no_grad()
def block_figures(hp: torch.Tensor, deq: torch.Tensor, axis: int = -1, block: int = DEFAULT_BLOCK) -> dict[str, float]:
    """``flushed_nonzero``, ``block_max_median`` and ``block_top_share`` of ``hp`` (the quantizer's
    input) and ``deq`` (its dequantized output), blocks of ``block`` along ``axis``."""
    hp = hp.float()
    hp = torch.where(torch.isfinite(hp), hp, torch.zeros_like(hp))
    nonzero = hp != 0
    count = int(nonzero.sum())
    flushed = float((nonzero & (deq.float() == 0)).sum()) / count if count else 0.0
    mag = _full_blocks(hp.abs(), axis, block)
    if mag.numel() == 0:
        return {"flushed_nonzero": flushed, "block_max_median": 0.0, "block_top_share": 0.0}
    srt = mag.sort(-1).values
    lo, hi = (block - 1) // 2, block // 2
    median = (srt[:, lo] + srt[:, hi]) / 2
    top = srt[:, -1]
    has_median = median > 0
    ratio = float((top[has_median] / median[has_median]).mean()) if bool(has_median.any()) else 0.0
    sq = mag.double().square()
    energy = sq.sum(-1)
    live = energy > 0
    share = float((sq.amax(-1)[live] / energy[live]).mean()) if bool(live.any()) else 0.0
    return {"flushed_nonzero": flushed, "block_max_median": ratio, "block_top_share": share}


@torch.no_grad()
def hadamard_figures(hp: torch.Tensor, fmt: str, axis: int = -1, block: int = DEFAULT_BLOCK,
                     scale_rule: str | None = None) -> dict[str, float]:
    """``had16_*``: :func:`block_figures` of ``hp`` rotated by the 16-point Hadamard along ``axis``
    and quantized to ``fmt`` (nearest rounding, ``scale_rule`` where the format has scale rules,
    scaled by the rotated tensor's own amax). Empty where the axis is not a multiple of 16."""
    from precision.formats import get_format
    from precision.quantize import quantize
    from precision.rotation import rotate

    hp = hp.float()
    hp = torch.where(torch.isfinite(hp), hp, torch.zeros_like(hp))
    if hp.dim() == 0 or hp.shape[axis] % HADAMARD_SIZE:
        return {}
    rot = rotate(hp, axis, HADAMARD_SIZE)
    rule = scale_rule if get_format(fmt).has_scale_rules else None
    deq = quantize(rot, fmt, axis=axis, scale_rule=rule).dequantize(torch.float32)
    return {f"had16_{k}": v for k, v in block_figures(rot, deq, axis, block).items()}

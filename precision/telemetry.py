"""Numerics telemetry for one quantized GEMM operand: how much did quantization cost here?

``operand_stats(hp, deq, fmt, axis, scale_amax)`` compares the high-precision operand (after any
rotation: what the quantizer actually saw) with its dequantized value:

=============  ==================================================================================
``sqnr_db``    10·log10(Σ hp² / Σ (hp − deq)²); 200 dB when exact (e.g. an all-zero tensor)
``clipped``    fraction of finite values whose magnitude exceeded the largest value their scale
               can represent (per block for MX -- MXFP8/6/4, FLOOR scales -- and NVFP4; per tensor
               -- from the amax the scale was *computed from*, which lags under delayed scaling,
               times ``headroom`` = max normal / scale target: 1 for FP8, 2^12 for HiF8's 2^3
               target -- for FP8 / HiF8; MXFP4's ``quest`` scales: |x| / 2^e >= 6, QuEST's trust mask;
               NVFP4 ``4over6`` is counted with plain NVFP4's block limits)
``flushed``    fraction of non-zero values that quantized to zero (underflow)
``amax``       max |hp| over finite values
``amax_ratio`` this tensor's amax / the amax its scale came from (> 1: delayed scaling lagged)
=============  ==================================================================================

and the per-block figures of ``precision.block_stats`` (``flushed_nonzero``, ``block_max_median``,
``block_top_share``, and the same after a 16-point Hadamard, ``had16_*``, for operands whose GEMM
does not rotate them already: ``rotated=True`` leaves those out), over blocks along the
contraction axis -- tokens for Wgrad's ``dy`` and ``x``, features for Fprop's and Dgrad's operands.

These are the numbers a person reads to see which GEMM operand of which layer is breaking
training (``launch/report.py`` renders them as heatmaps). Computed only on telemetry steps.
"""

from __future__ import annotations

import math

import torch

from precision import blocks
from precision.block_stats import BLOCK_METRICS, DEFAULT_BLOCK, HADAMARD_METRICS, block_figures, hadamard_figures
from precision.elements import E4M3, fdiv
from precision.formats import Format, ScaleRule, Scaling, get_format
from precision.quest import quest_quantize_blocks

__all__ = ["operand_stats", "METRICS"]

METRICS = ("sqnr_db", "clipped", "flushed", "amax", "amax_ratio", *BLOCK_METRICS, *HADAMARD_METRICS)
_MAX_DB = 200.0


def _block_limits(hp: torch.Tensor, spec: Format, axis: int, tensor_amax: float | None) -> torch.Tensor:
    """Largest representable magnitude of each element's block (FLOOR scales), shaped like ``hp``.
    Two-level formats (NVFP4) take their FP32 tensor scale from ``tensor_amax`` (the amax the
    quantizer's tensor scale came from) or else this tensor's own."""
    n = hp.shape[axis]
    xb = blocks.to_blocks(hp, axis, spec.block)
    amax = xb.abs().amax(-1, keepdim=True)
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    if spec.kind == Scaling.TWO_LEVEL:
        whole = amax.amax() if tensor_amax is None else torch.tensor(float(tensor_amax), device=hp.device)
        g_enc = blocks.nvfp4_tensor_scale(whole)
        s_dec = torch.clamp(amax * fdiv(g_enc, spec.max_normal), max=E4M3.max_normal)
        limit = spec.max_normal * s_dec.to(torch.float8_e4m3fn).float() * (1.0 / g_enc)
    else:
        sbyte = blocks.mx_scale_bytes(amax, spec.element, ScaleRule.FLOOR)
        limit = spec.max_normal * blocks.pow2(sbyte - 127)
    return blocks.from_blocks(limit.expand_as(xb), axis, n)


@torch.no_grad()
def operand_stats(hp: torch.Tensor, deq: torch.Tensor, fmt: str, axis: int = -1,
                  scale_amax: float | None = None, scale_rule: str = "floor",
                  headroom: float = 1.0, rotated: bool = False) -> dict[str, float]:
    hp, deq = hp.float(), deq.float()
    finite = torch.isfinite(hp)
    hpf = torch.where(finite, hp, torch.zeros_like(hp))
    err = torch.where(finite, hp - deq, torch.zeros_like(hp))
    signal, noise = hpf.pow(2).sum().item(), err.pow(2).sum().item()
    sqnr = _MAX_DB if noise == 0 else min(_MAX_DB, 10 * math.log10(max(signal, 1e-300) / noise))
    amax = hpf.abs().amax().item() if hp.numel() else 0.0
    numel = max(hp.numel(), 1)
    flushed = ((hpf != 0) & (deq == 0)).sum().item() / numel
    spec = get_format(fmt)
    if spec.kind == Scaling.TENSOR:
        ref = amax if scale_amax is None else scale_amax
        clipped = ((hpf.abs() > ref * headroom) & finite).sum().item() / numel if ref > 0 else 0.0
    elif spec.blocked and scale_rule == ScaleRule.QUEST:  # clipped where |x / 2^e| >= 6 (precision.quest)
        mask = quest_quantize_blocks(blocks.to_blocks(hpf, axis, spec.block))[2]
        clipped = (blocks.from_blocks(mask, axis, hp.shape[axis]) & finite & (hpf != 0)).sum().item() / numel
    elif spec.blocked and scale_rule == ScaleRule.FLOOR:
        limits = _block_limits(hpf, spec, axis, scale_amax if spec.tensor_scaled else None)
        clipped = ((hpf.abs() > limits) & finite).sum().item() / numel
    else:  # fp32 / bf16 (no scale); RCEIL scales never clip
        clipped = 0.0
    ref_amax = amax if scale_amax is None else scale_amax
    ratio = amax / ref_amax if ref_amax > 0 else 1.0
    out = {"sqnr_db": sqnr, "clipped": clipped, "flushed": flushed, "amax": amax, "amax_ratio": ratio}
    block = spec.block if spec.blocked else DEFAULT_BLOCK
    out.update(block_figures(hp, deq, axis, block))
    if not rotated:
        out.update(hadamard_figures(hp, fmt, axis, block, scale_rule))
    return out

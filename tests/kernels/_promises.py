"""What cuBLAS promises about a BF16-output GEMM, as a check the GPU tests share.

cuBLAS does not promise that a GEMM asked for BF16 output runs the algorithm its FP32-output twin
runs: the kernel, its split-K factor and so the order of the FP32 accumulation may differ by output
type. What holds: both accumulate in FP32 (reductions kept in FP32: ``allow_bf16_reduced_precision
_reduction`` off), so the BF16 result is the FP32 product, in some summation order, rounded once;
and a call repeated with the same arguments on the same device gives the same bits.
"""

from __future__ import annotations

import torch


def assert_one_bf16_rounding_of(b16: torch.Tensor, f32: torch.Tensor, k: int, where: str = "") -> None:
    """``b16`` is ``f32`` rounded once to BF16 up to the accumulation order of a ``k``-long FP32
    sum: within half a BF16 ulp (2^-9 relative, 2^-8 allowed for a tie decided by the order) plus
    ``k`` FP32 ulps of the largest output (a reordered sum moves by at most that)."""
    assert b16.dtype == torch.bfloat16 and f32.dtype == torch.float32, where
    diff = (b16.float() - f32).abs()
    bound = f32.abs() * 2.0 ** -8 + k * 2.0 ** -23 * f32.abs().max()
    bad = diff > bound
    assert not bad.any(), f"{where}: {int(bad.sum())} outputs beyond one BF16 rounding (worst {diff.max().item():.3e})"

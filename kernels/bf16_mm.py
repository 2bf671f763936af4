"""The ``bf16_mm`` GEMM backend: an emulated GEMM on BF16 tensor cores, FP32 accumulation and output.

The ``emulated`` backend (the specification) multiplies FP32 dequantizations of the quantized
operands with an IEEE FP32 GEMM -- on an H200 about a fifteenth of the BF16 tensor-core rate. Every
format whose ``Format.bf16_exact`` is true (BF16, FP8 E4M3/E5M2, HiF8, MXFP8, MXFP6, MXFP4, NVFP4)
has quantized values BF16 holds exactly once its tensor-level FP32 factors move to the output
(``kernels.bf16_operand``), and a BF16 x BF16 product is exact in FP32. So this backend takes the
same operands from the one pipeline (``gemm_operands(..., bf16=True)``: rotation, TP-reduced amax,
scales, SR streams, amax histories, telemetry, QAT warm-up), and runs::

    out [M, N] = mm(A_bf16 [M, K], B_bf16 [N, K]ᵀ, out_dtype=float32) * out_scale_a * out_scale_b
                 (/ (prescale_a * prescale_b) for the 3/4 SR pre-scale)

    FPROP  A = x  [T, in]     B = w  [out, in]       (contraction axis last: views, no copies
    DGRAD  A = dy [T, out]    B = wᵀ [in, out]        for the plain BF16 preset; the quantizer
    WGRAD  A = dyᵀ[out, T]    B = xᵀ [in, T]          writes MX/FP8 operands K-last)

``mm`` is ``torch.mm(a, b, out_dtype=torch.float32)`` on CUDA (cuBLAS BF16 GEMM with FP32
output; torch 2.13 has it for CUDA only), else an IEEE FP32 GEMM of the upcast operands -- the
same products, exact, with FP32 accumulation -- which is what CPU tests of this backend run. For
the ``bf16`` preset it is a plain cuBLAS BF16 GEMM of the BF16 activations and weights. Asked for
a BF16 result (``out_dtype``) with no FP32 factor after the product (``bf16``, MXFP4, MXFP6), cuBLAS
writes BF16 itself with FP32 reductions (``mm_bf16_out``): its FP32 result rounded once.

Results differ from the ``emulated`` backend's only in accumulation order and, where a tensor
factor moved to the output, in where that factor is rounded in (per-tensor FP8/HiF8, NVFP4, the SR
pre-scale) -- as on the hardware ``torch._scaled_mm`` backends. ``kernels.backends`` selects it
under ``auto`` on devices with BF16 tensor cores (sm_80+, gfx90a/gfx942/gfx950) for every GEMM no
FP8/MX tensor-core GEMM takes.
"""

from __future__ import annotations

import functools
import logging
import re

import torch

from kernels.gemm import BACKENDS, bf16_single_rounding, ieee_fp32_matmul
from kernels.operand import QuantizedOperand, gemm_operands
from precision.recipe import Gemm, GemmRecipe
from precision.state import LayerQuantState

__all__ = ["bf16_gemm", "bf16_operands_gemm", "mm_bf16_out", "mm_fp32_out", "refuses_out_dtype"]

log = logging.getLogger(__name__)


@functools.cache
def _warn_no_out_dtype(why: str) -> None:
    log.warning("torch.mm(..., out_dtype=torch.float32) is unavailable here (%s); bf16_mm GEMMs "
                "run as FP32 GEMMs of the BF16 operands (same products, slower)", why)


_OUT_DTYPE_REFUSED: set = set()  # devices where torch.mm refused out_dtype (asked once per process)
# The one refusal the FP32 fallback is for: torch has no ``mm(..., out_dtype=)`` overload (TypeError
# naming the keyword) or no kernel of it for this device ("Could not run 'aten::mm.dtype'").
_NO_OUT_DTYPE = re.compile(r"Could not run 'aten::mm\.dtype'")


def refuses_out_dtype(e: BaseException) -> bool:
    """Whether ``e`` from ``torch.mm(a, b, out_dtype=torch.float32)`` says the overload is missing
    (and not, e.g., out of memory or operands of different dtypes)."""
    msg = str(e)
    if isinstance(e, TypeError):  # an older torch: no overload lists an out_dtype argument
        return "unexpected keyword argument 'out_dtype'" in msg or (
            "invalid combination" in msg and "out_dtype=" in msg and "dtype out_dtype" not in msg)
    return isinstance(e, RuntimeError) and bool(_NO_OUT_DTYPE.search(msg))  # NotImplementedError included


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` of BF16 matrices with FP32 accumulation and an FP32 result."""
    if a.is_cuda and a.device not in _OUT_DTYPE_REFUSED:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError) as e:  # NotImplementedError is a RuntimeError
            if not refuses_out_dtype(e):
                raise  # a real failure, not a missing overload
            _OUT_DTYPE_REFUSED.add(a.device)
            _warn_no_out_dtype(str(e).splitlines()[0])
    with ieee_fp32_matmul():
        return a.float() @ b.float()


def mm_bf16_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` of BF16 matrices, FP32 accumulation, the result rounded once to BF16:
    on CUDA cuBLAS writes BF16 itself (FP32 reductions kept: ``kernels.gemm.bf16_single_rounding``),
    elsewhere the FP32 result of :func:`mm_fp32_out` is rounded."""
    if a.is_cuda:
        with bf16_single_rounding():
            return torch.mm(a, b)
    return mm_fp32_out(a, b).to(torch.bfloat16)


def bf16_operands_gemm(a: QuantizedOperand, b: QuantizedOperand, mm=None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``A_k @ B_kᵀ`` of two operands in BF16 form, with their output factors applied, rounded once
    to ``out_dtype``. Where no FP32 factor follows the product (no ``out_scale``, no SR pre-scale:
    the ``bf16`` preset, MXFP4, MXFP6) a BF16 result comes from the GEMM itself."""
    pa, pb = a.fmt.prescale_factor, b.fmt.prescale_factor
    if (out_dtype == torch.bfloat16 and mm is None and a.out_scale is None and b.out_scale is None
            and pa == 1.0 and pb == 1.0):
        return mm_bf16_out(a.bf16, b.bf16.t())
    out = (mm or mm_fp32_out)(a.bf16, b.bf16.t())
    scales = [s for s in (a.out_scale, b.out_scale) if s is not None]
    if len(scales) == 2:
        out = out * (scales[0] * scales[1])
    elif scales:
        out = out * scales[0]
    if pa != 1.0 or pb != 1.0:  # undo the 3/4 SR pre-scale
        out = out / (pa * pb)
    return out.to(out_dtype)


def bf16_gemm(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, state: LayerQuantState, *,
              mm=None, quantizer: str = "auto", shared_dy=None, out_dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
    """GEMM ``g`` (operands in natural layouts, ``kernels.gemm``) on BF16 tensor cores.

    ``mm`` / ``quantizer`` let tests substitute the matrix product and the quantizer; ``shared_dy``
    as in ``kernels.gemm.gemm``."""
    ops = gemm_operands(g, a, b, recipe, state, impl=quantizer, bf16=True, shared_dy=shared_dy)
    return bf16_operands_gemm(ops.a, ops.b, mm, out_dtype)


def _bf16_mm(g, a, b, recipe, state, *, shared_dy=None, out_dtype=torch.float32):
    return bf16_gemm(g, a, b, recipe, state, shared_dy=shared_dy, out_dtype=out_dtype)


BACKENDS.setdefault("bf16_mm", _bf16_mm)

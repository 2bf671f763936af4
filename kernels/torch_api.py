"""The torch APIs the GPU path uses, looked up once with a guard for each (torch 2.11 and later).

==============================================  ===================================================
API                                             used by, and what happens where it is missing
==============================================  ===================================================
``torch.mm(a, b, out_dtype=torch.float32)``     ``bf16_mm``: BF16 GEMM with FP32 output. Missing
                                                (no ``mm.dtype`` overload, or no kernel for the
                                                device): FP32 GEMM of the upcast operands, said once
``torch.nn.functional.scaled_mm`` + its enums   ``mx_scaled_mm`` (block scales, swizzle). Missing,
  (``ScalingType``, ``SwizzleType``)            or enum members under other names: the positional
                                                ``torch._scaled_mm`` call
``torch._scaled_mm``                            ``fp8_scaled_mm`` / ``mx_scaled_mm``. Missing: those
                                                backends are not offered (``auto`` picks ``bf16_mm``)
``fp32_precision`` flags                        ``kernels.gemm.ieee_fp32_matmul``: only flags that
                                                exist are switched (the legacy ones always are)
``scaled_dot_product_attention(enable_gqa=)``   ``model.attention``: grouped-query attention
``torch._scaled_mm(..., out_dtype=bfloat16)``   BF16 output written by the FP8 GEMM itself (in every
                                                torch with ``_scaled_mm``)
``matmul.allow_bf16_reduced_precision_reduction``  ``kernels.gemm.bf16_single_rounding``: a BF16-output
  (``..._split_k``: torch 2.12 and later)       cuBLAS GEMM keeps FP32 reductions; the split-K flag
                                                is restored only where it exists
meta checks of the scaled GEMMs (what fake      ``kernels.scaled_mm``: an MXFP4 call whose entry
  tensors under ``torch.compile`` run)          point's meta check counts scales from the packed K
                                                runs outside the traced graph
==============================================  ===================================================

Where torch 2.11 and 2.13 differ in those meta checks (read from both releases' sources): 2.11's
``torch._scaled_mm`` check counts MXFP4 E8M0 scales from the packed K (K/2 bytes), 2.13's from
the element count K, as the CUDA kernel does; ``F.scaled_mm``'s check counts them from the packed
K in both. So for K > 128 a correct MXFP4 call fails there under fake tensors only;
``fp4_meta_check_ok`` finds out per entry point by running one such call on ``meta`` tensors.
2.13 also applies the layout checks (row-major ``self``, column-major ``mat2``) to CPU tensors no
longer, and words its per-tensor refusals differently ("scale_a must have 1 Float element").

The enum members have been spelled two ways across torch releases (``BlockWise1x32`` /
``Blockwise_1x32``, ``SWIZZLE_32_4_4`` / ``Swizzle_32_4_4``); both are accepted. ``api_report()`` is
the list the device check prints beside the versions.
"""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["api_report", "fp4_meta_check_ok", "has_bf16_reduction_flag", "has_fp32_precision_flags", "has_scaled_mm",
           "scaled_mm_enums", "sdpa_has_enable_gqa"]

_SPELLINGS = {  # member -> the names it has had
    "tensor": ("TensorWise", "Tensorwise"),
    "block16": ("BlockWise1x16", "Blockwise_1x16"),
    "block32": ("BlockWise1x32", "Blockwise_1x32"),
    "swizzle": ("SWIZZLE_32_4_4", "Swizzle_32_4_4"),
    "no_swizzle": ("NO_SWIZZLE", "NoSwizzle"),
}


def _member(enum, names):
    for n in names:
        if hasattr(enum, n):
            return getattr(enum, n)
    return None


@functools.cache
def scaled_mm_enums() -> dict | None:
    """``{"tensor", "block16", "block32", "swizzle", "no_swizzle"}`` members of ``F.ScalingType`` /
    ``F.SwizzleType``, or None where ``F.scaled_mm`` or any of them is missing."""
    F = torch.nn.functional
    scaling, swizzle = getattr(F, "ScalingType", None), getattr(F, "SwizzleType", None)
    if not hasattr(F, "scaled_mm") or scaling is None or swizzle is None:
        return None
    out = {k: _member(swizzle if "swizzle" in k else scaling, names) for k, names in _SPELLINGS.items()}
    return None if any(v is None for v in out.values()) else out


def has_scaled_mm() -> bool:
    return hasattr(torch, "_scaled_mm")


def has_fp32_precision_flags() -> bool:
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


@functools.cache
def _mm_has_out_dtype() -> bool:
    try:  # the overload list is in the TypeError a call with an unknown keyword raises
        torch.mm(torch.zeros(1, 1), torch.zeros(1, 1), out_dtype_probe=None)
    except TypeError as e:
        return "out_dtype" in str(e)
    return False


def has_bf16_reduction_flag() -> bool:
    return hasattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction")


def sdpa_has_enable_gqa() -> bool:
    try:
        return "enable_gqa" in inspect.signature(torch.nn.functional.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: its docstring lists the argument
        return "enable_gqa" in (torch.nn.functional.scaled_dot_product_attention.__doc__ or "")


@functools.cache
def fp4_meta_check_ok(entry: str) -> bool:
    """Whether ``entry``'s meta check (``torch._scaled_mm`` or ``F.scaled_mm``) accepts a correct
    MXFP4 call with K = 256: E8M0 scales in the blocked layout counted from the 256 elements."""
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    e8 = getattr(torch, "float8_e8m0fnu", None)
    if f4 is None or e8 is None:
        return False
    a = torch.empty(128, 128, dtype=torch.uint8, device="meta").view(f4)  # [M, K/2]
    b = torch.empty(128, 128, dtype=torch.uint8, device="meta").view(f4).t()  # [K/2, N], column-major
    sa = torch.empty(128 * 8, dtype=torch.uint8, device="meta").view(e8)  # 128 rows x K/32 = 8 scales
    sb = torch.empty(128 * 8, dtype=torch.uint8, device="meta").view(e8)
    try:
        if entry == "torch._scaled_mm":
            torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        else:
            enums = scaled_mm_enums()
            if enums is None:
                return False
            torch.nn.functional.scaled_mm(a, b, sa, enums["block32"], sb, enums["block32"],
                                          swizzle_a=enums["swizzle"], swizzle_b=enums["swizzle"],
                                          output_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return False
    return True


def api_report() -> list[str]:
    """One line per API: present, or the guarded path this torch takes instead."""
    enums = scaled_mm_enums()
    rows = [
        ("torch.mm(out_dtype=)", _mm_has_out_dtype(), "bf16_mm upcasts to an FP32 GEMM"),
        ("torch._scaled_mm", has_scaled_mm(), "no FP8/MX tensor-core backends"),
        ("F.scaled_mm + ScalingType/SwizzleType", enums is not None, "positional torch._scaled_mm call"),
        ("fp32_precision flags", has_fp32_precision_flags(), "legacy TF32 flags only"),
        ("SDPA enable_gqa", sdpa_has_enable_gqa(), "grouped-query attention unavailable"),
        ("allow_bf16_reduced_precision_reduction", has_bf16_reduction_flag(),
         "BF16-output GEMMs may reduce split-K partial sums in BF16"),
        ("torch._scaled_mm meta check of MXFP4 scales", has_scaled_mm() and fp4_meta_check_ok("torch._scaled_mm"),
         "counts the packed K: MXFP4 calls run outside torch.compile graphs"),
        ("F.scaled_mm meta check of MXFP4 scales", enums is not None and fp4_meta_check_ok("F.scaled_mm"),
         "counts the packed K: MXFP4 calls run outside torch.compile graphs"),
    ]
    return [f"torch {torch.__version__}"] + [
        f"  {name}: {'yes' if ok else 'MISSING -> ' + fallback}" for name, ok, fallback in rows]

"""``kernels.gemm``: the one GEMM entry point every linear layer calls.

``gemm(Gemm.X, a, b, recipe, backend)`` takes the two operands in their natural layouts and
knows from the GEMM which axis each is contracted over::

    FPROP  y  = x  · wᵀ   a = x  [T, in],  b = w [out, in]   contract a.axis 1, b.axis 1
    DGRAD  dx = dy · w    a = dy [T, out], b = w [out, in]   contract a.axis 1, b.axis 0
    WGRAD  dw = dyᵀ· x    a = dy [T, out], b = x [T, in]     contract a.axis 0, b.axis 0

Every backend gets its operands from ``kernels.operand.gemm_operands`` -- rotation, whole-tensor
amax, current or delayed scale, quantization, telemetry, written once. The ``emulated`` backend is
the executable specification and runs on any device: it takes the operands' float32
dequantizations -- which hold every quantized value exactly -- and multiplies them with FP32
accumulation (true FP32: TF32 is switched off around the product, whatever the user set).
Hardware backends (``kernels.scaled_mm``) register themselves in ``BACKENDS``, take the same
operands in hardware form and must reproduce the emulated backend's quantized operands bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from kernels.operand import CONTRACTION_AXES, gemm_operands
from precision.recipe import Gemm, GemmRecipe
from precision.state import LayerQuantState

__all__ = ["BACKENDS", "CONTRACTION_AXES", "OUT_DTYPES", "bf16_single_rounding", "fp32_gemm", "gemm",
           "ieee_fp32_matmul"]

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what gemm(..., out_dtype=) returns


def _read(getter):
    """A TF32 flag's value, or None where torch refuses to read it (the legacy and new APIs disagree)."""
    try:
        return getter()
    except RuntimeError:
        return None


@contextlib.contextmanager
def ieee_fp32_matmul():
    """FP32 matmuls inside are IEEE FP32 (no TF32), whatever ``torch.backends.cuda.matmul.allow_tf32``
    / ``torch.set_float32_matmul_precision`` / ``fp32_precision`` the user set; restored after.

    torch keeps a legacy flag (``allow_tf32``, ``set_float32_matmul_precision``) and new per-backend
    ones (``fp32_precision``), and refuses ("mix of the legacy and new APIs") a cuBLAS GEMM when they
    disagree. So the switch uses the API family the user's setting came from: the legacy setters
    when the legacy flags read consistently (they keep both families in step), else the new flags.
    """
    matmul = torch.backends.cuda.matmul
    flags = [f for f in (matmul, getattr(getattr(torch.backends, "mkldnn", None), "matmul", None))
             if f is not None and hasattr(f, "fp32_precision")]
    new_before = [f.fp32_precision for f in flags]
    precision = _read(torch.get_float32_matmul_precision)
    allow = _read(lambda: matmul.allow_tf32)
    legacy = precision is not None and allow is not None
    try:
        if legacy and (precision != "highest" or allow):
            torch.set_float32_matmul_precision("highest")
            matmul.allow_tf32 = False
        for f in flags:
            if f.fp32_precision not in ("ieee", "none"):
                f.fp32_precision = "ieee"
        yield
    finally:
        if legacy:
            if _read(torch.get_float32_matmul_precision) != precision:
                torch.set_float32_matmul_precision(precision)
            if _read(lambda: matmul.allow_tf32) != allow:
                matmul.allow_tf32 = allow
        for f, b in zip(flags, new_before):
            if f.fp32_precision != b:
                f.fp32_precision = b


@contextlib.contextmanager
def bf16_single_rounding():
    """BF16-output cuBLAS GEMMs inside keep their reductions in FP32, so the BF16 result is one
    rounding of the FP32 accumulator: ``allow_bf16_reduced_precision_reduction`` (on by default:
    split-K partial sums may be reduced in BF16) is switched off, and restored after."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        split_k = matmul.allow_bf16_reduced_precision_reduction_split_k  # torch >= 2.12: a second flag
    except AttributeError:
        split_k = None
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before if split_k is None else (before, split_k)


def fp32_gemm(g: Gemm, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GEMM ``g`` of two float32 operands (natural layouts), IEEE FP32 accumulation."""
    with ieee_fp32_matmul():
        if g is Gemm.FPROP:
            return a @ b.t()  # [T, in] @ [in, out]
        if g is Gemm.DGRAD:
            return a @ b  # [T, out] @ [out, in]
        return a.t() @ b  # [out, T] @ [T, in]


def _emulated(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe,
              state: LayerQuantState, impl: str = "auto", *, shared_dy=None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    ops = gemm_operands(g, a, b, recipe, state, impl=impl)  # (a shared dy is for hardware backends)
    # === FP32-accumulated GEMM on exactly-representable operands; one rounding to out_dtype ===
    return fp32_gemm(g, ops.a.values, ops.b.values).to(out_dtype)


def _reference(g, a, b, recipe, state, *, shared_dy=None, out_dtype=torch.float32):
    return _emulated(g, a, b, recipe, state, impl="reference", out_dtype=out_dtype)


# emulated: fused (compiled) quantizers; reference: the eager specification. Same bits.
# A backend is called as impl(g, a, b, recipe, state, *, shared_dy=None, out_dtype=torch.float32)
# and returns the FP32-accumulated result rounded once to out_dtype.
BACKENDS: dict[str, Callable] = {"emulated": _emulated, "reference": _reference}


def gemm(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, backend: str = "emulated",
         *, state: LayerQuantState | None = None, shared_dy=None,
         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Run GEMM ``g`` on 2-D operands ``a``, ``b`` under ``recipe``; returns the FP32-accumulated
    result rounded once to ``out_dtype`` (float32 by default; the linear layers ask for their
    activations' dtype, so a BF16 run's GEMMs write BF16 directly where the GEMM can, bit for bit
    what rounding its FP32 result would give).

    ``state`` carries the layer's random streams and amax histories; without one, a fresh state
    (seed 0) is used, so stochastic rounding repeats the same draws on every call. ``shared_dy``:
    Dgrad's and Wgrad's plan for one read of a backward's ``dy`` (``kernels.cast_transpose.share_dy``).
    """
    g = Gemm(g)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{g.value}: operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    a_axis, b_axis = CONTRACTION_AXES[g]
    if a.shape[a_axis] != b.shape[b_axis]:
        raise ValueError(f"{g.value}: contraction lengths differ: {g.operands[0]} {tuple(a.shape)} "
                         f"axis {a_axis} vs {g.operands[1]} {tuple(b.shape)} axis {b_axis}")
    try:
        impl = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"{g.value}: unknown GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}") from None
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{g.value}: out_dtype {out_dtype} is not supported; valid: "
                         + ", ".join(str(d).removeprefix("torch.") for d in OUT_DTYPES))
    return impl(g, a, b, recipe, state if state is not None else LayerQuantState(), shared_dy=shared_dy,
                out_dtype=out_dtype)

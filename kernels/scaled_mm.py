"""Hardware GEMM backends: ``fp8_scaled_mm`` (per-tensor FP8) and ``mx_scaled_mm`` (MXFP8/MXFP4/NVFP4).

Both take their operands from the one operand pipeline (``kernels.operand.gemm_operands``, with
``codes=True``: the Triton quantizer on CUDA, bit-identical to the reference; the reference
elsewhere) -- same rotation, TP-reduced amax, scales, SR streams, amax histories, telemetry and QAT
warm-up as the emulated backend -- and add only what the hardware needs: the codes and scales laid
out its way (``hw_operand``, ``kernels.layouts``) and the call to ``torch._scaled_mm``::

    A_k [M, K] (row-major)  x  B_k [N, K] (B = B_k.t(), column-major)  ->  out [M, N]

* FP8: E4M3/E5M2 data, float32 decode scales ``1/scale`` (one per tensor), FP32 output.
* MX: E2M1 packed two per byte (``float4_e2m1fn_x2``) or FP8 data, E8M0 block scales
  (``float8_e8m0fnu``); NVFP4: E4M3 block scales and the two FP32 tensor scales -- applied by the
  GEMM itself through ``F.scaled_mm``'s two-level recipe (1x16 blocks, then per tensor: BF16 output
  written directly), else to the FP32 output. Scales in the cuBLAS blocked layout on sm_100,
  row-major on gfx950, laid out once per prepared operand (a weight's, once per optimizer step).

Shapes are zero-padded (contraction axis to a multiple of 32, rows to a multiple of 32): zero
codes are +0.0 and all-zero blocks have zero scales, so the product is unchanged and the output is
sliced back. ``HwOperand.decode()`` turns a prepared operand back into float32 values with the
reference's own dequantization expressions: the CPU tests hold those equal, bit for bit, to the
emulated backend's operands for every GEMM layout (the ``_scaled_mm`` call itself needs the GPU).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

import torch

from kernels.backends import (BackendError, capability_name, device_backends, device_capability, probed_entry,
                              recipe_backend, select_backend)
from kernels.gemm import BACKENDS, fp32_gemm
from kernels.layouts import pack_fp4, to_blocked, unpack_fp4
from kernels.operand import CONTRACTION_AXES, QuantizedOperand, gemm_operands
from kernels.torch_api import fp4_meta_check_ok, has_scaled_mm, scaled_mm_enums
from precision import blocks
from precision.elements import fp8_decode
from precision.formats import Scaling
from precision.quantize import FORMATS
from precision.recipe import Gemm, GemmRecipe, parse_gemm
from precision.state import LayerQuantState

__all__ = ["ENTRY_POINTS", "REFUSALS", "HwOperand", "emulated_scaled_mm", "entry_points", "hw_gemm", "hw_operand",
           "torch_scaled_mm"]

K_MULTIPLE = 32
ROW_MULTIPLE = 32


@dataclass
class HwOperand:
    """One GEMM operand as the hardware consumes it (contraction-major, padded)."""

    fmt: str
    codes: torch.Tensor  # uint8 [rows, K] (FP8, or FP4 one per element) or [rows, K/2] packed FP4
    scales: torch.Tensor  # per-tensor: float32 encode scale (0-d); block: uint8 [rows, K/block]
    scale_layout: str  # "tensor" | "blocked" | "row_major"
    rows: int
    k: int
    tensor_scale: torch.Tensor | None = None  # NVFP4 g_enc
    prescale: float = 1.0
    decode_scale: torch.Tensor | None = None  # 1 / scales per tensor (NVFP4: 1 / tensor_scale), from the quantizer

    @functools.cached_property
    def data(self) -> torch.Tensor:
        """The data tensor in the dtype ``_scaled_mm`` takes."""
        if FORMATS[self.fmt].bits == 4:
            return self.codes.view(torch.float4_e2m1fn_x2)
        return self.codes.view(FORMATS[self.fmt].element.torch_dtype)

    @functools.cached_property
    def scale(self) -> torch.Tensor:
        """The scale tensor in the dtype and layout ``_scaled_mm`` takes (laid out on first use)."""
        if self.scale_layout == "tensor":
            d = self.decode_scale  # the quantizer's own 1 / scale (one IEEE division)
            if d is not None:  # the Triton quantizer's is already the 1-element tensor _scaled_mm takes
                return d if d.dim() == 1 else d.reshape(1)
            return (1.0 / self.scales).reshape(1).float()
        s = to_blocked(self.scales) if self.scale_layout == "blocked" else self.scales
        two_level = FORMATS[self.fmt].kind == Scaling.TWO_LEVEL  # NVFP4: E4M3 block scales
        return s.view(torch.float8_e4m3fn if two_level else torch.float8_e8m0fnu)

    @functools.cached_property
    def tensor_decode(self) -> torch.Tensor:
        """NVFP4: the FP32 decode factor ``1 / g_enc`` as a 1-element tensor (the quantizer's own
        division where it handed one over), the second level of ``F.scaled_mm``'s NVFP4 recipe."""
        if self.decode_scale is not None:
            return self.decode_scale.reshape(1)
        return (1.0 / self.tensor_scale).reshape(1).float()

    def two_level_in_gemm(self, entry: str) -> bool:
        """Whether the GEMM through ``entry`` applies NVFP4's tensor scales itself: ``F.scaled_mm``'s
        two-level recipe, which takes swizzled (blocked) block scales only."""
        return FORMATS[self.fmt].kind == Scaling.TWO_LEVEL and entry == "F.scaled_mm" and self.scale_layout == "blocked"

    def decode(self) -> torch.Tensor:
        """float32 ``[rows, K]`` values, with the reference's dequantization expressions."""
        spec = FORMATS[self.fmt]
        if self.scale_layout == "tensor":
            return fp8_decode(self.codes, spec.element) * (1.0 / self.scales)
        codes = unpack_fp4(self.codes) if spec.bits == 4 else self.codes
        cb = codes.reshape(self.rows, -1, spec.block)
        if spec.kind == Scaling.TWO_LEVEL:
            out = blocks.nvfp4_dequantize_blocks(cb, self.scales, self.tensor_scale)
        else:
            out = blocks.mx_dequantize_blocks(cb, self.scales, spec.element, self.prescale)
        return out.reshape(self.rows, self.k)


def _pad2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the end of both dims to ``[rows, cols]``."""
    if tuple(t.shape) == (rows, cols):
        return t
    out = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def hw_operand(q: QuantizedOperand, scale_layout: str = "blocked") -> HwOperand:
    """The hardware form of an operand from ``kernels.operand``: codes (contiguous: A row-major, B
    column-major once transposed) and block scales zero-padded
    (contraction axis to a multiple of 32, rows to a multiple of 32; +0.0 codes and all-zero blocks'
    scale bytes are 0 in MX and NVFP4 alike), FP4 packed two per byte. Made once per operand and
    layout: a weight served again from the step cache brings its hardware form (scales laid out) along."""
    kept = q.hw.get(scale_layout) if q.hw is not None else None
    if kept is not None:
        return kept
    hw = _hw_operand(q, scale_layout)
    q.hw = {**(q.hw or {}), scale_layout: hw}
    return hw


def _hw_operand(q: QuantizedOperand, scale_layout: str) -> HwOperand:
    spec = FORMATS[q.fmt.fmt]
    block = spec.blocked
    rows = q.codes.shape[0]
    k = q.codes.shape[1] * (2 if q.packed else 1)
    rows_p, k_p = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE, -(-k // K_MULTIPLE) * K_MULTIPLE
    if q.packed:
        codes = _pad2(q.codes, rows_p, k_p // 2).contiguous()
    else:  # (a 2-D weight's Dgrad codes are a transposed view: packing keeps that stride order)
        codes = _pad2(q.codes, rows_p, k_p)
        codes = (pack_fp4(codes) if spec.bits == 4 else codes).contiguous()
    scales = _pad2(q.scales, rows_p, k_p // spec.block).contiguous() if block else q.scales
    return HwOperand(q.fmt.fmt, codes, scales, scale_layout if block else "tensor", rows_p, k_p,
                     tensor_scale=q.tensor_scale,
                     prescale=q.fmt.prescale_factor if spec.kind != Scaling.TWO_LEVEL else 1.0,
                     decode_scale=q.decode_scale)


# ============================================================================ the GEMM call
log = logging.getLogger(__name__)

# Some block-scaled GEMMs refuse FP32 output ("Block-wise scaling only supports BFloat16 or Half
# output types"): those formats run with BF16 output, decided once per format pair and said once.
_OUT_DTYPE: dict[tuple[str, str], torch.dtype] = {}
# What torch raises when a scaled GEMM cannot run: RuntimeError (cuBLAS / shape checks),
# NotImplementedError (MX/NVFP4 through F.scaled_mm on a build without FBGEMM GenAI; a subclass of
# RuntimeError, named for the reader) and ValueError (F.scaled_mm's argument checks).
REFUSALS = (RuntimeError, NotImplementedError, ValueError)
_OUT_DTYPE_REFUSAL = re.compile(r"(output|out_dtype)[^\n]*(bfloat16|bf16)|(bfloat16|bf16)[^\n]*output",
                                re.IGNORECASE)


def torch_scaled_mm(a: HwOperand, b: HwOperand, out_dtype: torch.dtype = torch.float32,
                    entry: str | None = None) -> torch.Tensor:
    """``A_k @ B_k.t()`` through the hardware entry point ``entry`` (``ENTRY_POINTS``; None: the
    first :func:`entry_points` offers for the format), rounded once to ``out_dtype``.

    ``out_dtype=torch.bfloat16`` where no FP32 factor follows the product (per-tensor FP8, whose
    scales the GEMM applies itself, and MX without the SR pre-scale): the GEMM writes BF16 directly,
    bit for bit its FP32 result rounded to BF16. Otherwise (NVFP4's tensor scales, the pre-scale) the
    GEMM writes FP32 where the library allows it: a refusal of FP32 output (and only that) is retried
    with BF16 output; that choice is cached per format pair and logged once. Any other error
    propagates.
    """
    entry = entry or entry_points(a.fmt)[0]
    in_gemm = a.two_level_in_gemm(entry)  # NVFP4's tensor scales applied by the GEMM (F.scaled_mm)
    if (out_dtype == torch.bfloat16 and (FORMATS[a.fmt].kind != Scaling.TWO_LEVEL or in_gemm) and a.prescale == 1.0
            and b.prescale == 1.0):
        return _call_scaled_mm(a, b, torch.bfloat16, entry)
    key = (a.fmt, b.fmt, entry)
    dt = _OUT_DTYPE.get(key, torch.float32)
    try:
        out = _call_scaled_mm(a, b, dt, entry)
    except REFUSALS as e:
        if dt is not torch.float32 or not _OUT_DTYPE_REFUSAL.search(str(e)):
            raise
        log.warning("%s refused FP32 output for %s x %s (%s); these GEMMs now run with BF16 output",
                    entry, a.fmt, b.fmt, str(e).splitlines()[0])
        dt = torch.bfloat16
        out = _call_scaled_mm(a, b, dt, entry)
    _OUT_DTYPE[key] = dt
    out = out.float()
    if FORMATS[a.fmt].kind == Scaling.TWO_LEVEL and not in_gemm:  # NVFP4's FP32 tensor scales (g_dec_a * g_dec_b)
        out = out * ((1.0 / a.tensor_scale) * (1.0 / b.tensor_scale))
    if a.prescale != 1.0 or b.prescale != 1.0:  # undo the 3/4 SR pre-scale
        out = out / (a.prescale * b.prescale)
    return out.to(out_dtype)


def _via_torch_scaled_mm(a: HwOperand, b: HwOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm``: cuBLASLt; per-tensor FP32 scales, or block scales told apart by dtype
    (E8M0: MX 1x32, E4M3: NVFP4 1x16) in the layout ``HwOperand.scale`` gives."""
    return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=b.scale, out_dtype=out_dtype)


def _via_f_scaled_mm(a: HwOperand, b: HwOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm``: the scaling recipe and swizzle named explicitly. NVFP4 with
    blocked scales as the two-level recipe (1x16 E4M3 blocks, then the FP32 tensor decode factor: the
    GEMM applies ``g_dec_a * g_dec_b`` to its FP32 accumulator before the one rounding to
    ``out_dtype``); with row-major scales as single-level 1x16 blocks (the caller applies them)."""
    enums = scaled_mm_enums()
    if a.two_level_in_gemm("F.scaled_mm"):
        rec, sw = [enums["block16"], enums["tensor"]], [enums["swizzle"], enums["no_swizzle"]]
        return torch.nn.functional.scaled_mm(a.data, b.data.t(), [a.scale, a.tensor_decode], rec,
                                             [b.scale, b.tensor_decode], rec, swizzle_a=sw, swizzle_b=sw,
                                             output_dtype=out_dtype)
    if a.scale_layout == "tensor":
        rec, sw = enums["tensor"], enums["no_swizzle"]
    else:
        rec = enums["block16"] if FORMATS[a.fmt].block == 16 else enums["block32"]
        sw = enums["swizzle"] if a.scale_layout == "blocked" else enums["no_swizzle"]
    return torch.nn.functional.scaled_mm(a.data, b.data.t(), a.scale, rec, b.scale, rec, swizzle_a=sw,
                                         swizzle_b=sw, output_dtype=out_dtype)


# The hardware GEMM entry points, each called as fn(a: HwOperand, b: HwOperand, out_dtype).
ENTRY_POINTS = {"F.scaled_mm": _via_f_scaled_mm, "torch._scaled_mm": _via_torch_scaled_mm}


def entry_points(fmt: str, *, f_scaled_mm: bool | None = None, torch_scaled_mm: bool | None = None) -> tuple[str, ...]:
    """The entry points the installed torch has for format ``fmt``, in the order the start-up probe
    tries them: ``torch._scaled_mm`` first (cuBLASLt, in every CUDA build; MXFP4 through
    ``F.scaled_mm`` needs a build with FBGEMM GenAI, and torch 2.13's meta check of that call counts
    MXFP4 scales from the packed K, so it fails under fake tensors for K > 128), then
    ``F.scaled_mm`` (recipe and swizzle named explicitly) -- except NVFP4, which tries
    ``F.scaled_mm`` first: only its two-level recipe lets the GEMM apply the tensor scales and write
    BF16 itself. ``f_scaled_mm`` / ``torch_scaled_mm``: whether each exists (None: ask this torch,
    ``kernels.torch_api``); the probe records what served each pair."""
    have_f = scaled_mm_enums() is not None if f_scaled_mm is None else f_scaled_mm
    have_t = has_scaled_mm() if torch_scaled_mm is None else torch_scaled_mm
    order = (("torch._scaled_mm", have_t), ("F.scaled_mm", have_f))
    if FORMATS[fmt].kind == Scaling.TWO_LEVEL:
        order = order[::-1]
    return tuple(e for e, ok in order if ok)


def _call_scaled_mm(a: HwOperand, b: HwOperand, out_dtype: torch.dtype, entry: str) -> torch.Tensor:
    try:
        fn = ENTRY_POINTS[entry]
    except KeyError:
        raise ValueError(f"scaled GEMM entry point {entry!r}; valid: {', '.join(ENTRY_POINTS)}") from None
    spec = FORMATS[a.fmt]
    if (spec.bits == 4 and spec.block == 32 and torch.compiler.is_compiling()
            and not fp4_meta_check_ok(entry)):  # this torch's fake-tensor check miscounts MXFP4 scales
        return torch.compiler.disable(fn)(a, b, out_dtype)
    return fn(a, b, out_dtype)


def emulated_scaled_mm(a: HwOperand, b: HwOperand) -> torch.Tensor:
    """What ``torch_scaled_mm`` computes, from the prepared operands, on any device (FP32)."""
    return a.decode() @ b.decode().t()


# ============================================================================ the backends
def hw_gemm(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, state: LayerQuantState, *,
            backend: str, capability="device", mm=None, quantizer: str = "auto", shared_dy=None,
            out_dtype: torch.dtype = torch.float32, entry: str | None = None) -> torch.Tensor:
    """GEMM ``g`` on a hardware backend, rounded once to ``out_dtype``, through ``entry`` (None: the
    entry point the start-up probe chose for the format here, else the first the installed torch
    offers). ``capability`` / ``mm`` / ``quantizer`` let tests simulate one (a substitute ``mm``
    returns FP32, rounded here)."""
    cap = device_capability(a.device) if capability == "device" else capability
    hw, why = recipe_backend(recipe, cap)
    if backend not in device_backends(cap):
        raise BackendError(f"{g.value}: backend {backend} is not available on {capability_name(cap)} "
                           f"(hardware GEMMs there: {', '.join(device_backends(cap)) or 'none'})")
    if hw != backend:
        raise BackendError(f"{g.value}: backend {backend} cannot run {recipe.spec()} ({why})")
    a_axis, b_axis = CONTRACTION_AXES[g]
    m, n = a.shape[1 - a_axis], b.shape[1 - b_axis]
    ops = gemm_operands(g, a, b, recipe, state, impl=quantizer, codes=True, shared_dy=shared_dy)
    if ops.high_precision:  # QAT warm-up: the BF16 GEMM the emulated backend runs
        return fp32_gemm(g, ops.a.values, ops.b.values).to(out_dtype)
    layout = "row_major" if cap == "gfx950" else "blocked"
    hw_a, hw_b = hw_operand(ops.a, layout), hw_operand(ops.b, layout)
    if mm is None:
        out = torch_scaled_mm(hw_a, hw_b, out_dtype, entry or probed_entry(cap, (recipe.a.fmt, recipe.b.fmt)))
    else:
        out = mm(hw_a, hw_b).float()
    return out[:m, :n].to(out_dtype)


def _fp8_scaled_mm(g, a, b, recipe, state, *, shared_dy=None, out_dtype=torch.float32):
    return hw_gemm(g, a, b, recipe, state, backend="fp8_scaled_mm", shared_dy=shared_dy, out_dtype=out_dtype)


def _mx_scaled_mm(g, a, b, recipe, state, *, shared_dy=None, out_dtype=torch.float32):
    return hw_gemm(g, a, b, recipe, state, backend="mx_scaled_mm", shared_dy=shared_dy, out_dtype=out_dtype)


def _auto(g, a, b, recipe, state, *, shared_dy=None, out_dtype=torch.float32):
    return BACKENDS[select_backend(recipe, a.device, gemm=g)](g, a, b, recipe, state, shared_dy=shared_dy,
                                                               out_dtype=out_dtype)


BACKENDS.setdefault("fp8_scaled_mm", _fp8_scaled_mm)
BACKENDS.setdefault("mx_scaled_mm", _mx_scaled_mm)
BACKENDS.setdefault("auto", _auto)


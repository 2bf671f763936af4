"""Hardware GEMM backends: ``fp8_scaled_mm`` (per-tensor FP8) and ``mx_scaled_mm`` (MXFP8/MXFP4/NVFP4).

Both quantize each operand exactly as the emulated backend does -- same rotation, same random
streams and amax histories from the layer's ``LayerQuantState``, same quantizer numerics (the
Triton quantizer on CUDA, bit-identical to the reference; the reference elsewhere) -- but keep the
codes and scales instead of dequantizing, lay them out the way the hardware wants
(``kernels.layouts``) and call ``torch._scaled_mm``::

    A_k [M, K] (row-major)  x  B_k [N, K] (B = B_k.t(), column-major)  ->  out [M, N]

* FP8: E4M3/E5M2 data, float32 decode scales ``1/scale`` (one per tensor), FP32 output.
* MX: E2M1 packed two per byte (``float4_e2m1fn_x2``) or FP8 data, E8M0 block scales
  (``float8_e8m0fnu``); NVFP4: E4M3 block scales and the two FP32 tensor scales applied to the
  output. Scales in the cuBLAS blocked layout on sm_100, row-major on gfx950.

Shapes are zero-padded (contraction axis to a multiple of 32, rows to a multiple of 32): zero
codes are +0.0 and all-zero blocks have zero scales, so the product is unchanged and the output is
sliced back. ``HwOperand.decode()`` turns a prepared operand back into float32 values with the
reference's own dequantization expressions: the CPU tests hold those equal, bit for bit, to the
emulated backend's operands for every GEMM layout (the ``_scaled_mm`` call itself needs the GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.backends import BackendError, capability_name, device_backends, device_capability, recipe_backend
from kernels.fused import _sr_uniforms
from kernels.gemm import BACKENDS, CONTRACTION_AXES, _pad_axis, whole_tensor_amax
from kernels.layouts import pack_fp4, to_blocked, unpack_fp4
from precision import blocks
from precision.elements import fp8_decode
from precision.quantize import FORMATS
from precision.quantize import quantize as reference_quantize
from precision.recipe import Gemm, GemmRecipe, OperandFormat
from precision.rotation import rotate, rotation_size
from precision.state import LayerQuantState

__all__ = ["HwOperand", "prepare_operand", "hw_gemm", "torch_scaled_mm", "emulated_scaled_mm"]

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

    @property
    def data(self) -> torch.Tensor:
        """The data tensor in the dtype ``_scaled_mm`` takes."""
        if FORMATS[self.fmt].bits == 4:
            return self.codes.view(torch.float4_e2m1fn_x2)
        return self.codes.view(FORMATS[self.fmt].element.torch_dtype)

    @property
    def scale(self) -> torch.Tensor:
        """The scale tensor in the dtype and layout ``_scaled_mm`` takes."""
        if self.scale_layout == "tensor":
            return (1.0 / self.scales).reshape(1).float()
        s = to_blocked(self.scales) if self.scale_layout == "blocked" else self.scales
        return s.view(torch.float8_e4m3fn if self.fmt == "nvfp4" else torch.float8_e8m0fnu)

    def decode(self) -> torch.Tensor:
        """float32 ``[rows, K]`` values, with the reference's dequantization expressions."""
        spec = FORMATS[self.fmt]
        if self.scale_layout == "tensor":
            return fp8_decode(self.codes, spec.element) * (1.0 / self.scales)
        codes = unpack_fp4(self.codes) if spec.bits == 4 else self.codes
        cb = codes.reshape(self.rows, -1, spec.block)
        if self.fmt == "nvfp4":
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


def prepare_operand(t: torch.Tensor, axis: int, fmt: OperandFormat, gemm: Gemm, operand: str,
                    state: LayerQuantState, call: int, scale_layout: str = "blocked",
                    quantizer: str = "auto") -> HwOperand:
    """Quantize one 2-D operand along ``axis`` (as the emulated backend would) into hardware form.

    ``quantizer``: ``triton`` (CUDA, or the CPU interpreter), ``reference``, or ``auto`` (Triton on
    CUDA when installed). Updates the amax history and telemetry like ``quantize_operand``.
    """
    spec = FORMATS[fmt.fmt]
    block = spec.scaling == "block"
    gen = state.generator(gemm, operand, call, t.device) if fmt.rounding == "stochastic" else None
    history = state.amax_history(gemm, operand, fmt) if fmt.amax_algo != "current" else None
    # tensor parallelism: per-tensor scales from the whole tensor's amax (kernels.gemm)
    whole = whole_tensor_amax(t, state) if not block and spec.scaling == "tensor" else None
    amax = history.amax() if history is not None else whole
    if quantizer == "auto":
        from kernels.quantizer import triton_missing_reason

        quantizer = "triton" if t.is_cuda and triton_missing_reason(t, fmt.fmt) is None else "reference"
    kw = dict(axis=axis, rounding=fmt.rounding, scale_rule=fmt.scale_rule, prescale=fmt.prescale_factor,
              amax=amax)
    rows, k = t.shape[1 - axis], t.shape[axis]
    rows_p, k_p = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE, -(-k // K_MULTIPLE) * K_MULTIPLE
    packed = False
    if quantizer == "triton":
        from kernels.triton_quant import quantize_triton

        u = None
        if gen is not None:  # the emulated backend's draws, in its order
            u = (_sr_uniforms(t, axis, spec.block, gen) if block
                 else torch.rand(t.shape, generator=gen, device=t.device))
        packed = spec.bits == 4 and k == k_p
        r = quantize_triton(t, fmt.fmt, uniforms=u, layout="contraction_last", pack=packed,
                            dequantize=state.collect_stats, **kw)
        codes, scales, g_enc = r.codes, r.scales, r.tensor_scale
        cur, nclip, deq = r.amax, r.num_clipped, r.dequantized
    elif quantizer == "reference":
        q = reference_quantize(t, fmt.fmt, generator=gen, **kw)  # the same draws as the emulated backend
        codes = q.codes.movedim(axis, -1)
        scales = q.scales.movedim(axis, -1) if block else q.scales
        g_enc, cur, nclip = q.tensor_scale, q.amax, q.num_clipped
        deq = q.dequantize() if state.collect_stats else None
    else:
        raise ValueError(f"quantizer: unknown {quantizer!r}; valid: auto, triton, reference")
    # Zero padding: +0.0 codes, and all-zero blocks' scale bytes are 0 in MX and NVFP4 alike.
    if packed:
        codes = _pad2(codes, rows_p, k_p // 2)
    else:
        codes = _pad2(codes, rows_p, k_p)
        codes = pack_fp4(codes) if spec.bits == 4 else codes.contiguous()
    if block:
        scales = _pad2(scales, rows_p, k_p // spec.block).contiguous()
    _record(state, gemm, operand, fmt, t, axis, history, amax, cur if whole is None else whole, nclip, deq)
    return HwOperand(fmt.fmt, codes, scales, scale_layout if block else "tensor", rows_p, k_p,
                     tensor_scale=g_enc, prescale=fmt.prescale_factor if fmt.fmt != "nvfp4" else 1.0)


def _record(state, gemm, operand, fmt, t, axis, history, amax, cur, nclip, deq) -> None:
    """Amax history and telemetry, as ``kernels.gemm.quantize_operand`` records them."""
    scale_amax = None
    if cur is not None:
        c = float(cur)
        scale_amax = c if amax is None else float(amax)
        if history is not None:
            history.update(c)
        state.record(gemm, operand, amax=c, num_clipped=int(nclip), scale_amax=scale_amax, numel=t.numel())
    if state.collect_stats and deq is not None:
        from precision.telemetry import operand_stats

        state.record(gemm, operand, **operand_stats(t, deq, fmt.fmt, axis, scale_amax, fmt.scale_rule))


# ============================================================================ the GEMM call
_OUT_DTYPE: dict[str, torch.dtype] = {}


def torch_scaled_mm(a: HwOperand, b: HwOperand) -> torch.Tensor:
    """``A_k @ B_k.t()`` through ``torch._scaled_mm`` (FP32 output where the library allows it)."""
    kind = "tensor" if a.scale_layout == "tensor" else "block"
    dtypes = [_OUT_DTYPE[kind]] if kind in _OUT_DTYPE else [torch.float32, torch.bfloat16]
    err = None
    for dt in dtypes:
        try:
            out = _call_scaled_mm(a, b, dt)
        except RuntimeError as e:  # e.g. block-scaled GEMMs with BF16 output only
            err = e
            continue
        _OUT_DTYPE[kind] = dt
        out = out.float()
        if a.fmt == "nvfp4":  # NVFP4's FP32 tensor scales multiply the output (g_dec_a * g_dec_b)
            out = out * ((1.0 / a.tensor_scale) * (1.0 / b.tensor_scale))
        if a.prescale != 1.0 or b.prescale != 1.0:  # undo the 3/4 SR pre-scale
            out = out / (a.prescale * b.prescale)
        return out
    raise err


def _call_scaled_mm(a: HwOperand, b: HwOperand, out_dtype: torch.dtype) -> torch.Tensor:
    A, B = a.data, b.data.t()
    if a.scale_layout == "tensor":
        return torch._scaled_mm(A, B, scale_a=a.scale, scale_b=b.scale, out_dtype=out_dtype)
    F = torch.nn.functional
    if hasattr(F, "scaled_mm"):
        rec = F.ScalingType.BlockWise1x16 if a.fmt == "nvfp4" else F.ScalingType.BlockWise1x32
        sw = F.SwizzleType.SWIZZLE_32_4_4 if a.scale_layout == "blocked" else F.SwizzleType.NO_SWIZZLE
        return F.scaled_mm(A, B, a.scale, rec, b.scale, rec, swizzle_a=sw, swizzle_b=sw,
                           output_dtype=out_dtype)
    return torch._scaled_mm(A, B, a.scale, b.scale, out_dtype=out_dtype)


def emulated_scaled_mm(a: HwOperand, b: HwOperand) -> torch.Tensor:
    """What ``torch_scaled_mm`` computes, from the prepared operands, on any device (FP32)."""
    return a.decode() @ b.decode().t()


# ============================================================================ the backends
def hw_gemm(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, state: LayerQuantState, *,
            backend: str, capability="device", mm=None, quantizer: str = "auto") -> torch.Tensor:
    """GEMM ``g`` on a hardware backend; ``capability``/``mm``/``quantizer`` let tests simulate one."""
    cap = device_capability(a.device) if capability == "device" else capability
    hw, why = recipe_backend(recipe, cap)
    if backend not in device_backends(cap):
        raise BackendError(f"{g.value}: backend {backend} is not available on {capability_name(cap)} "
                           f"(hardware GEMMs there: {', '.join(device_backends(cap)) or 'none'})")
    if hw != backend:
        raise BackendError(f"{g.value}: backend {backend} cannot run {recipe.spec()} ({why})")
    a_axis, b_axis = CONTRACTION_AXES[g]
    m, n = a.shape[1 - a_axis], b.shape[1 - b_axis]
    call = state.next_call(g)
    if recipe.rotation != "none":  # exactly the emulated backend's rotation
        r = rotation_size(recipe.rotation)
        multiple = math.lcm(r, *(FORMATS[f.fmt].block or 1 for f in (recipe.a, recipe.b)))
        a, b = _pad_axis(a, a_axis, multiple), _pad_axis(b, b_axis, multiple)
        signs = None
        if recipe.rotation.startswith("rht"):
            signs = state.rotation_signs(g, r, call if recipe.rotation.endswith("resample") else None)
        a, b = rotate(a, a_axis, r, signs), rotate(b, b_axis, r, signs)
    layout = "row_major" if cap == "gfx950" else "blocked"
    names = g.operands
    qa = prepare_operand(a, a_axis, recipe.a, g, names[0], state, call, layout, quantizer)
    qb = prepare_operand(b, b_axis, recipe.b, g, names[1], state, call, layout, quantizer)
    out = (mm or torch_scaled_mm)(qa, qb)
    return out[:m, :n].float()


def _fp8_scaled_mm(g, a, b, recipe, state):
    return hw_gemm(g, a, b, recipe, state, backend="fp8_scaled_mm")


def _mx_scaled_mm(g, a, b, recipe, state):
    return hw_gemm(g, a, b, recipe, state, backend="mx_scaled_mm")


def _auto(g, a, b, recipe, state):
    from kernels.backends import select_backend

    return BACKENDS[select_backend(recipe, a.device, gemm=g)](g, a, b, recipe, state)


BACKENDS.setdefault("fp8_scaled_mm", _fp8_scaled_mm)
BACKENDS.setdefault("mx_scaled_mm", _mx_scaled_mm)
BACKENDS.setdefault("auto", _auto)


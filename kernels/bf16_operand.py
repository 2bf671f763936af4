"""The BF16 form of a quantized GEMM operand: what a BF16 tensor-core GEMM multiplies.

Every format whose ``Format.bf16_exact`` is true has dequantized values that BF16 holds exactly
once the FP32 factors that apply to the whole tensor are taken out and applied to the GEMM output
instead. A quantized operand (codes and scales, contraction axis last: ``[rows, K]``) becomes::

    bf16       [rows, K]  BF16 values, exact                   out_scale (0-d FP32)   prescale
    ---------  ------------------------------------------------ ---------------------- --------
    bf16       the RNE cast itself                              none                   1
    per-tensor element value (E4M3, E5M2, HiF8)                 1 / scale              1
    MX         element x 2^(scale byte - 127 + c)               2^-c                   3/4 or 1
    NVFP4      E2M1 element x E4M3 block scale                  g_dec = 1 / g_enc      1

so that ``GEMM(spec operands) = (bf16_a @ bf16_bᵀ) * out_scale_a * out_scale_b / (prescale_a *
prescale_b)`` with the same quantized operands. ``fp32_values`` rebuilds the FP32 operand from the
BF16 one with the specification's own last operation -- ``element * (1 / scale)`` for per-tensor
formats, ``fdiv(element * 2^e, prescale)`` for MX (the shift ``2^c`` is undone exactly) -- so for
those it equals ``precision.quantize(...).dequantize()`` bit for bit (``tests/kernels/
test_bf16_path.py``, on subnormal and saturated scales, NaN blocks, RCEIL and SR).

Two honest limits:

* NVFP4: the specification dequantizes ``e2m1 * fl(s_block * g_dec)``; with ``g_dec`` on the GEMM
  output the product rounds ``g_dec`` in at a different place (as ``torch._scaled_mm`` on
  Blackwell does). The codes, block and tensor scales are the specification's, bit for bit, and the
  BF16 operand is exactly ``e2m1 * s_block``; operand times ``g_dec`` is within 1 ulp of the spec
  (3 x 2^-149 where ``s_block * g_dec`` is an FP32 subnormal).
* MXFP8: an E4M3 (E5M2) element's last bit under the smallest scale, 2^-136 (2^-143), lies below
  BF16's smallest subnormal 2^-133. The shift ``c = min(Format.bf16_shift, 254 - emax - max scale
  byte)`` (per operand, on the device) lifts the smallest values into range unless the largest
  would overflow; only a tensor holding both blocks below ~2^-116 and blocks above ~2^124 (E4M3)
  would lose bits, and no real activation or gradient does.
"""

from __future__ import annotations

import torch

from precision.elements import fdiv, pow2
from precision.formats import QuantizedTensor, Scaling
from precision.recipe import OperandFormat

__all__ = ["bf16_form", "fp32_values", "mx_shift"]

_SCALE_NAN = 0xFF


def mx_shift(scales: torch.Tensor, spec) -> torch.Tensor:
    """The power-of-two shift ``c`` (0-d int32, on the device) of an MX operand's BF16 form."""
    s = scales.to(torch.int32)
    smax = torch.where(s == _SCALE_NAN, torch.zeros_like(s), s).amax() if s.numel() else s.new_zeros(())
    return torch.clamp(254 - spec.element.emax - smax, 0, spec.bf16_shift)


def bf16_form(fmt: OperandFormat, codes: torch.Tensor, scales: torch.Tensor | None,
              tensor_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(bf16 [rows, K], out_scale)`` of one quantized operand given contraction-last ``codes``
    (uint8, one per element; BF16 formats: the int16 bit patterns) and ``scales`` (uint8 block scales
    ``[rows, K / block]``, or the per-tensor FP32 encode scale). ``out_scale`` is None when there is
    no factor to move; the SR pre-scale is ``fmt.prescale_factor``."""
    spec = fmt.format
    if not spec.bf16_exact:
        raise ValueError(f"{spec.name}: its dequantized values are not exactly BF16 values "
                         "(Format.bf16_exact); use the FP32 emulated GEMM")
    if spec.kind == Scaling.NONE:  # the cast's bit patterns are BF16 already
        return codes.view(torch.bfloat16), None
    if spec.kind == Scaling.TENSOR:
        return spec.decode(codes).to(torch.bfloat16), 1.0 / scales
    if spec.kind == Scaling.TWO_LEVEL:
        unit = torch.ones((), device=codes.device)  # g_enc = 1: e2m1 * s_block, exact
        vals = spec.dequantize(QuantizedTensor(spec.name, codes, scales, 1, tensor_scale=unit))
        return vals.to(torch.bfloat16), 1.0 / tensor_scale
    if spec.bf16_shift == 0:
        vals = spec.dequantize(QuantizedTensor(spec.name, codes, scales, 1))
        return vals.to(torch.bfloat16), None
    c = mx_shift(scales, spec)
    s = scales.to(torch.int32)
    shifted = torch.where(s == _SCALE_NAN, s, s + c).to(torch.uint8)  # never reaches 0xFF (see mx_shift)
    vals = spec.dequantize(QuantizedTensor(spec.name, codes, shifted, 1))
    return vals.to(torch.bfloat16), pow2(-c).float()


def fp32_values(bf16: torch.Tensor, out_scale: torch.Tensor | None, prescale: float = 1.0) -> torch.Tensor:
    """The FP32 operand the BF16 form stands for, by the specification's last operation(s)."""
    v = bf16.float()
    if out_scale is not None:
        v = v * out_scale
    return fdiv(v, prescale) if prescale != 1.0 else v

"""``precision.quantize``: one entry point from a high-precision tensor to a quantized one.

>>> q = quantize(x, "mxfp4", axis=-1)        # blocks of 32 along the last axis
>>> q.codes, q.scales, q.packed()            # uint8 codes, E8M0 scale bytes, two FP4 per byte
>>> x_q = q.dequantize(torch.float32)
>>> quantize(x, OperandFormat("mxfp4", rounding="stochastic"), sr=SRKey(seed))   # a recipe slot whole

The formats and what each does live in ``precision.formats`` (``FORMATS``, one object per
format; ``precision.formats.format_table()`` prints the table the README shows). Formats with a
tensor-level scale (per-tensor FP8 / HiF8, NVFP4's FP32 scale) take an optional ``amax`` (delayed
scaling, or the whole tensor's amax under tensor parallelism): the scale comes from it, values
beyond range saturate and ``num_clipped`` counts them (per-tensor formats).
"""

from __future__ import annotations

import torch

from precision.enums import Rounding, ScaleRule
from precision.formats import FORMATS, Format, QuantizedTensor, get_format
from precision.recipe import OperandFormat
from precision.srand import SRKey
from precision.tensorwise import tensor_amax

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "SCALE_RULES",
    "FormatSpec",
    "QuantizedTensor",
    "fake_quantize",
    "format_spec",
    "margin_amax",
    "quantize",
    "resolve_format",
]

FormatSpec = Format  # the registry's format objects (kept under their older name)
ROUNDINGS = Rounding.values()
SCALE_RULES = ScaleRule.values()


def format_spec(name) -> Format:
    """The registry entry for ``name`` (a one-line error listing the valid names)."""
    return get_format(name)


def resolve_format(fmt, rounding=None, scale_rule=None, prescale=None):
    """``(Format, Rounding, ScaleRule, prescale)`` from a format name / ``Format`` with keyword
    settings (defaults nearest, floor, 1.0; checked against the format: ``Format.check``), or from an
    ``OperandFormat`` that carries them itself (validated when it was made)."""
    if isinstance(fmt, OperandFormat):
        given = [k for k, v in (("rounding", rounding), ("scale_rule", scale_rule), ("prescale", prescale))
                 if v is not None]
        if given:
            raise ValueError(f"quantize: {fmt} is an OperandFormat, which carries its own rounding, scale rule "
                             f"and prescale; do not also pass {', '.join(given)}")
        return fmt.format, fmt.rounding, fmt.scale_rule, fmt.prescale_factor
    f = get_format(fmt)
    r, s = f.check(Rounding.NEAREST if rounding is None else rounding, ScaleRule.FLOOR if scale_rule is None else scale_rule)
    return f, r, s, 1.0 if prescale is None else prescale


def margin_amax(fmt, x: torch.Tensor, amax):
    """The amax a quantizer scales by once an ``OperandFormat``'s ``margin`` is applied:
    ``amax * 2^margin`` (the tensor's own amax when ``amax`` is None), so that ``scale_target / it``
    is ``scale_target / amax / 2^margin`` bit for bit (a power-of-two factor is exact in FP32).
    ``amax`` unchanged without a margin."""
    if not isinstance(fmt, OperandFormat) or not fmt.margin:
        return amax
    a = tensor_amax(x) if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(())
    return a * 2.0**fmt.margin


def quantize(
    x: torch.Tensor,
    fmt,
    *,
    axis: int = -1,
    rounding: str | None = None,
    scale_rule: str | None = None,
    generator: torch.Generator | None = None,
    prescale: float | None = None,
    amax: torch.Tensor | float | None = None,
    sr: SRKey | None = None,
    block2d: bool | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt``; block formats take their blocks along ``axis``.

    ``block2d``: 2-D ``Format.tile`` squares of a 2-D ``x`` (a weight; NVFP4 16x16, MX 32x32), one
    scale per square -- the codes are then the same along either axis (``QuantizedTensor.along``).
    An ``OperandFormat`` brings its own (``/2d``).

    ``fmt``: a format name (``FORMATS``), a ``Format``, or an ``OperandFormat`` (which brings its
    own rounding, scale rule and prescale). ``rounding``: ``nearest`` (default; ties to even, HiF8
    ties away) or ``stochastic``: uniforms from ``sr`` (a :class:`precision.srand.SRKey`:
    counter-based, a function of the global element index -- what training uses) or else one
    ``torch.rand`` draw from ``generator``. ``scale_rule``: MX scale rule, ``floor`` (default, OCP)
    or ``rceil``. ``prescale``: multiply before rounding and divide after (0.75 for stochastic
    MX). ``amax``: formats with a tensor-level scale (per-tensor FP8/HiF8, NVFP4's FP32 tensor
    scale), the amax to scale by; a float or a 0-d float32 tensor; default the tensor's own. The
    scale is ``scale_target / amax`` (``Format.scale_target``; an ``OperandFormat`` divides it by
    2^``margin``).
    """
    amax = margin_amax(fmt, x, amax)
    f, rounding, scale_rule, prescale = resolve_format(fmt, rounding, scale_rule, prescale)
    if isinstance(fmt, OperandFormat):
        if block2d is not None:
            raise ValueError(f"quantize: {fmt} is an OperandFormat, which carries its own 2-D setting; "
                             "do not also pass block2d")
        block2d = fmt.block2d
    return f.quantize(x, axis=axis, rounding=rounding, scale_rule=scale_rule, generator=generator,
                      prescale=prescale, amax=amax, sr=sr, block2d=bool(block2d))


def fake_quantize(x: torch.Tensor, fmt, **kw) -> torch.Tensor:
    """quantize -> dequantize to float32 (the emulated operand)."""
    return quantize(x, fmt, **kw).dequantize(torch.float32)

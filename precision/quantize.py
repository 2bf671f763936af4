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
from precision.formats import FORMATS, Format, QuantizedTensor, format_names, get_format
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
    "operand_format",
    "quantize",
    "quantize_call",
]

FormatSpec = Format  # the registry's format objects (kept under their older name)
ROUNDINGS = Rounding.values()
SCALE_RULES = ScaleRule.values()
PRESCALE = 0.75  # OperandFormat.prescale: 3/4 before stochastic rounding (arXiv 2502.20586)


def format_spec(name) -> Format:
    """The registry entry for ``name`` (a one-line error listing the valid names)."""
    return get_format(name)


def operand_format(fmt, rounding=None, scale_rule=None, prescale=None, block2d=None) -> OperandFormat:
    """The one adapter of the older call forms: an ``OperandFormat`` from a format name / ``Format``
    with keyword settings (defaults nearest, floor, no pre-scale, 1-D blocks; each checked against the
    format with the quantizer's one-line errors), or an ``OperandFormat`` itself (which carries its
    own settings: passing any of them too is an error). Every quantizer below the public entry points
    (``precision.quantize``, ``kernels.quantize``) takes the ``OperandFormat`` whole."""
    given = {k: v for k, v in (("rounding", rounding), ("scale_rule", scale_rule), ("prescale", prescale),
                               ("block2d", block2d)) if v is not None}
    if isinstance(fmt, OperandFormat):
        if given:
            raise ValueError(f"quantize: {fmt} is an OperandFormat, which carries its own rounding, scale rule, "
                             f"prescale and 2-D setting; do not also pass {', '.join(given)}")
        return fmt
    f = get_format(fmt)
    r, s = f.check(Rounding.NEAREST if rounding is None else rounding, ScaleRule.FLOOR if scale_rule is None else scale_rule)
    if block2d and not f.tile:
        raise ValueError(f"{f.name}: 2-D block scaling does not apply; valid with: "
                         f"{', '.join(format_names(lambda g: g.tile))}")
    if prescale not in (None, 1.0, PRESCALE):
        raise ValueError(f"{f.name}: prescale {prescale!r}: valid 1.0 (none) or {PRESCALE} (the 3/4 SR pre-scale)")
    scaled = prescale == PRESCALE
    if scaled and not (f.has_scale_rules and r.stochastic):
        raise ValueError(f"{f.name}: prescale needs an MX format with stochastic rounding")
    return OperandFormat(f.name, rounding=r, scale_rule=s, prescale=scaled, block2d=bool(block2d))


def quantize_call(fmt, sr=None, *, rounding=None, scale_rule=None, prescale=None, block2d=None, generator=None):
    """``(OperandFormat, sr)`` of a public quantize call, whatever form it took: the one adapter of the
    older keyword settings (:func:`operand_format`) and of ``generator=`` (the older name of ``sr``;
    an ``SRKey`` given as ``sr`` wins). Both public entry points, ``precision.quantize`` and
    ``kernels.quantize``, read their arguments through it."""
    return operand_format(fmt, rounding, scale_rule, prescale, block2d), generator if sr is None else sr


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
    amax: torch.Tensor | float | None = None,
    sr: SRKey | torch.Generator | None = None,
    rounding: str | None = None,
    scale_rule: str | None = None,
    prescale: float | None = None,
    block2d: bool | None = None,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt``; block formats take their blocks along ``axis``.

    ``fmt``: an ``OperandFormat`` (a recipe slot whole: format, rounding, scale rule, pre-scale, 2-D
    tiles, margin), or a format name / ``Format`` with the older keyword settings (one adapter,
    :func:`operand_format`): ``rounding`` ``nearest`` (default; ties to even, HiF8 ties away) or
    ``stochastic``; ``scale_rule`` (MX) ``floor`` (default, OCP) or ``rceil``; ``prescale`` 0.75
    (stochastic MX: multiply before rounding, divide after); ``block2d``: 2-D ``Format.tile`` squares
    of a 2-D ``x`` (a weight; NVFP4 16x16, MX 32x32), one scale per square -- the codes are then the
    same along either axis (``QuantizedTensor.along``).

    ``sr``: stochastic rounding's uniforms -- a :class:`precision.srand.SRKey` (counter-based, a
    function of the global element index: what training uses) or a ``torch.Generator`` (one
    ``torch.rand`` draw; ``generator=`` is the older name). ``amax``: formats with a tensor-level
    scale (per-tensor FP8/HiF8, NVFP4's FP32 tensor scale), the amax to scale by; a float or a 0-d
    float32 tensor; default the tensor's own. The scale is ``scale_target / amax``
    (``Format.scale_target``; an ``OperandFormat`` divides it by 2^``margin``).
    """
    op, sr = quantize_call(fmt, sr, rounding=rounding, scale_rule=scale_rule, prescale=prescale, block2d=block2d,
                           generator=generator)
    return op.format.quantize(x, op, axis=axis, amax=margin_amax(op, x, amax), sr=sr)


def fake_quantize(x: torch.Tensor, fmt, **kw) -> torch.Tensor:
    """quantize -> dequantize to float32 (the emulated operand)."""
    return quantize(x, fmt, **kw).dequantize(torch.float32)

"""Pure-PyTorch reference numerics and the precision data model. Imports neither Triton nor megatron.

Public API::

    precision.quantize(x, fmt, *, axis=-1, rounding="nearest", scale_rule="floor", generator=None)
    precision.Gemm, OperandFormat, GemmRecipe, LinearPrecision
    precision.presets.get(name), precision.presets.names()
    precision.PrecisionPolicy, PrecisionPlan, Rule, parse_precision
"""

from precision import presets
from precision.policy import PrecisionPlan, PrecisionPolicy, Rule, parse_precision
from precision.quantize import FORMATS, QuantizedTensor, fake_quantize, quantize
from precision.recipe import Gemm, GemmRecipe, LinearPrecision, OperandFormat, SpecError
from precision.state import LayerQuantState

__all__ = [
    "quantize",
    "fake_quantize",
    "QuantizedTensor",
    "FORMATS",
    "Gemm",
    "OperandFormat",
    "GemmRecipe",
    "LinearPrecision",
    "SpecError",
    "PrecisionPolicy",
    "PrecisionPlan",
    "Rule",
    "parse_precision",
    "presets",
    "LayerQuantState",
]

"""Pure-PyTorch reference numerics and the precision data model. Imports neither Triton nor megatron.

Public API::

    precision.quantize(x, fmt, *, axis=-1, rounding="nearest", scale_rule="floor", generator=None, sr=None)
    precision.FORMATS (name -> Format), Rounding, ScaleRule, AmaxAlgo, Scaling, SRKey
    precision.Gemm, OperandFormat, GemmRecipe, LinearPrecision
    precision.presets.get(name), precision.presets.names()
    precision.PrecisionPolicy, PrecisionPlan, Rule, parse_precision
"""

from precision import presets
from precision.formats import FORMATS, AmaxAlgo, Format, QuantizedTensor, Rounding, ScaleRule, Scaling
from precision.policy import PrecisionPlan, PrecisionPolicy, Rule, parse_precision
from precision.quantize import fake_quantize, quantize
from precision.recipe import Gemm, GemmRecipe, LinearPrecision, OperandFormat, SpecError
from precision.srand import SRKey
from precision.state import LayerQuantState

__all__ = [
    "quantize",
    "fake_quantize",
    "QuantizedTensor",
    "FORMATS",
    "Format",
    "Rounding",
    "ScaleRule",
    "AmaxAlgo",
    "Scaling",
    "SRKey",
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

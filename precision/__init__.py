"""Pure-PyTorch reference numerics and the precision data model. Imports neither Triton nor megatron.

Public API::

    precision.quantize(x, fmt, *, axis=-1, amax=None, sr=None)   # fmt: an OperandFormat, or a name
                                                                  # (+ the older rounding=, scale_rule=, ...)
    precision.FORMATS (name -> Format), SRKey
    precision.Rounding, ScaleRule, AmaxAlgo, Scaling    (precision.enums: the typed vocabularies)
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

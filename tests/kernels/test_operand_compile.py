"""The operand pipeline of one linear runs under ``torch.compile`` without graph breaks.

Each GEMM's two operands -- padding, rotation, whole-tensor amax, scale, quantization, telemetry --
trace into one graph (``fullgraph=True``). On CPU the pure-torch quantizers stand in for the
Triton kernels (which the interpreter cannot trace); on a CUDA device (``pytest -m gpu``, the device
check's step 3) the Triton quantizers' launches are traced too. The weight's step cache is a host
decision on tensor identity: a traced graph quantizes the weight on every call instead (the same
bits: cached weights never use stochastic rounding), which this checks against eager.
"""

import pytest
import torch

from kernels.operand import gemm_operands
from kernels.quantizer import triton_missing_reason
from precision import LayerQuantState, presets
from precision.recipe import Gemm


def _operands(preset, gemm, impl, device):
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g).to(device) for s in ((64, 64), (32, 64), (64, 32)))
    pair = {Gemm.FPROP: (x, w), Gemm.DGRAD: (dy, w), Gemm.WGRAD: (dy, x)}[gemm]
    recipe = getattr(presets.get(preset), gemm.value)

    def run(a, b):
        ops = gemm_operands(gemm, a, b, recipe, LayerQuantState(0, "l"), impl=impl, codes=True)
        return [t for q in (ops.a, ops.b) for t in (q.codes, q.scales, q.decode_scale) if t is not None]

    return run, pair


def _check(preset, gemm, impl, device):
    torch._dynamo.reset()
    run, (a, b) = _operands(preset, gemm, impl, device)
    compiled = torch.compile(run, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    for got, want in zip(compiled(a, b), run(a, b), strict=True):
        assert torch.equal(got, want), (preset, gemm)


@pytest.mark.parametrize("preset,gemm", [("fp8", Gemm.FPROP), ("fp8", Gemm.WGRAD), ("mxfp4_sr", Gemm.DGRAD),
                                         ("wgrad_hadamard", Gemm.WGRAD), ("nvfp4", Gemm.FPROP)],
                         ids=lambda v: getattr(v, "value", v))
def test_operand_pipeline_compiles_without_graph_breaks(preset, gemm):
    _check(preset, gemm, "reference", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton launches are traced on a CUDA device only")
@pytest.mark.parametrize("preset,gemm", [("fp8", Gemm.FPROP), ("wgrad_hadamard", Gemm.WGRAD)],
                         ids=lambda v: getattr(v, "value", v))
def test_triton_operand_pipeline_compiles_without_graph_breaks(preset, gemm):
    if (why := triton_missing_reason(torch.zeros(1, device="cuda"))) is not None:
        pytest.skip(str(why))
    _check(preset, gemm, "triton", "cuda")

"""The ``fp32`` format and preset: no rounding anywhere, exact FP32 GEMMs, output layer in FP32."""

import pytest
import torch

from kernels.fused import fake_quantize
from kernels.gemm import gemm
from model.linear import policy_linear
from precision import FORMATS, Gemm, OperandFormat, PrecisionPolicy, SpecError, presets, quantize


def _awkward(shape, seed=0, emin=-140, emax=120):
    """Values bf16 cannot hold (full 24-bit mantissas, FP32 subnormals, huge magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(emin, emax, shape, generator=g).float())
    x.view(-1)[0] = 1.0 + 2.0**-23  # one ulp above 1: bf16 rounds it to 1
    return x


def test_fp32_quantize_is_the_identity_bit_for_bit():
    x = _awkward((5, 37))
    q = quantize(x, "fp32", axis=0)
    assert torch.equal(q.codes, x.view(torch.int32))
    assert torch.equal(q.dequantize(torch.float32).view(torch.int32), x.view(torch.int32))
    out, _ = fake_quantize(x, "fp32", axis=0)
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))
    assert not torch.equal(quantize(x, "bf16").dequantize(), x)  # the test input is not bf16-exact
    assert FORMATS["fp32"].bits == 32 and FORMATS["fp32"].scaling == "none"


def test_fp32_refuses_stochastic_rounding_naming_the_format():
    with pytest.raises(SpecError, match="fp32: stochastic rounding"):
        OperandFormat("fp32", rounding="stochastic")


@pytest.mark.parametrize("g", list(Gemm))
def test_fp32_gemm_is_the_plain_fp32_product(g):
    recipe = presets.get("fp32").recipe(g)
    t, i, o = 12, 20, 8
    a = _awkward((t, i if g is Gemm.FPROP else o), 1, -20, 20)
    b = _awkward((o, i) if g is not Gemm.WGRAD else (t, i), 2, -20, 20)
    expected = {Gemm.FPROP: lambda: a @ b.t(), Gemm.DGRAD: lambda: a @ b, Gemm.WGRAD: lambda: a.t() @ b}[g]()
    for backend in ("emulated", "reference"):
        assert torch.equal(gemm(g, a, b, recipe, backend), expected), backend


def test_fp32_linear_matches_autograd_in_fp32():
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    y = policy_linear(x, w, presets.get("fp32"))
    y.square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = x2 @ w2.t()
    y2.square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_fp32_preset_keeps_every_layer_fp32_including_the_output_layer():
    names = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc2", "output_layer"]
    plan = PrecisionPolicy.from_args("fp32").resolve(names, 1)
    fp32 = presets.get("fp32")
    assert all(plan[n] == fp32 for n in names)
    assert PrecisionPolicy.from_args("bf16").resolve(names, 1)["output_layer"] == presets.get("bf16")

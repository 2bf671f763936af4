"""The fused quantizers and the emulated backend equal the eager reference bit for bit."""

import pytest
import torch

from kernels import gemm
from kernels.fused import compile_available, fake_quantize
from model.linear import policy_linear
from precision import Gemm, LayerQuantState, presets, quantize


def bits_equal(a, b):
    """Same bits everywhere, except that any NaN equals any NaN (payloads are not part of the spec)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 80, generator=g) * torch.logspace(-4, 4, 80)  # 80: a partial block
    x[3, 5] = float("nan")
    x[7:9, 40] = float("inf")
    x[10, :32] = 0
    x[11, :32] = 1e-40
    x[12, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    return x


CASES = [(f, axis, rule, rnd)
         for f in ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4", "fp8_e4m3", "fp8_e5m2")
         for axis in (0, 1)
         for rule in (("floor", "rceil") if f.startswith("mx") else ("floor",))
         for rnd in ("nearest", "stochastic")]


@pytest.mark.parametrize("fmt,axis,rule,rounding", CASES)
def test_eager_expression_equals_reference(fmt, axis, rule, rounding):
    x = data()
    ref = quantize(x, fmt, axis=axis, scale_rule=rule, rounding=rounding,
                   generator=torch.Generator().manual_seed(5)).dequantize()
    out, _ = fake_quantize(x, fmt, axis=axis, scale_rule=rule, rounding=rounding,
                           generator=torch.Generator().manual_seed(5), impl="eager")
    assert bits_equal(ref, out)


# Compiling costs seconds per variant on 2 cores: a representative subset, each layout and rounding.
COMPILED = [("mxfp4", 0, "floor", "nearest"), ("mxfp4", 1, "rceil", "stochastic"),
            ("nvfp4", 1, "floor", "nearest"), ("fp8_e5m2", 0, "floor", "nearest")]


@pytest.mark.skipif(not compile_available(), reason="torch.compile has no working backend here")
@pytest.mark.parametrize("fmt,axis,rule,rounding", COMPILED)
def test_compiled_equals_reference(fmt, axis, rule, rounding):
    x = data()
    ref = quantize(x, fmt, axis=axis, scale_rule=rule, rounding=rounding,
                   generator=torch.Generator().manual_seed(5)).dequantize()
    out, _ = fake_quantize(x, fmt, axis=axis, scale_rule=rule, rounding=rounding,
                           generator=torch.Generator().manual_seed(5), impl="compiled")
    assert bits_equal(ref, out)


@pytest.mark.parametrize("name", ["wgrad_hadamard", "nvfp4", "fp8", "mxfp4_sr"])
def test_emulated_backend_equals_reference_backend(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g)
    w = torch.randn(32, 64, generator=g)
    dy = torch.randn(64, 32, generator=g)
    outs = []
    for backend in ("reference", "emulated"):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = policy_linear(xr, wr, presets.get(name), state=LayerQuantState(3, "l"), backend=backend)
        y.backward(dy)
        outs.append((y, xr.grad, wr.grad))
    for a, b in zip(*outs):
        assert bits_equal(a, b)


def test_gemm_checks_contraction_lengths():
    rec = presets.get("mxfp4").fprop
    with pytest.raises(ValueError, match="fprop: contraction lengths differ"):
        gemm(Gemm.FPROP, torch.randn(4, 32), torch.randn(8, 16), rec)


@pytest.mark.skipif(not compile_available(), reason="torch.compile unavailable here")
def test_past_the_recompile_limit_new_shapes_run_eagerly(caplog):
    """lm-eval feeds ever new shapes; past dynamo's recompile limit fullgraph would raise. The kernel
    falls back to the same expression eagerly: same bits as the reference, no error."""
    from kernels import fused

    fake_quantize(torch.randn(3, 64), "mxfp4", impl="compiled")  # the kernel exists (limits raised)
    fused._warn_recompile_limit.cache_clear()
    with torch._dynamo.config.patch(recompile_limit=1):
        for rows in (5, 6, 7):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            out, _ = fake_quantize(x, "mxfp4", impl="compiled")
            assert torch.equal(out, quantize(x, "mxfp4").dequantize(torch.float32))
    assert "recompile limit reached" in caplog.text

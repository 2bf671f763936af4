"""The fused quantizers and the emulated backend equal the eager reference bit for bit."""

import numpy as np
import pytest
import torch

from kernels import gemm
from kernels.fused import compile_available, fake_quantize
from kernels.quantizer import TRITON_FORMATS
from model.linear import policy_linear
from precision import FORMATS, Gemm, LayerQuantState, OperandFormat, presets, quantize


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


# every format with a fused expression (the registry's; MXFP6 included), each of its scale rules
CASES = [(f, axis, str(rule), rnd)
         for f in TRITON_FORMATS
         for axis in (0, 1)
         for rule in FORMATS[f].scale_rules
         for rnd in ("nearest", "stochastic")]


@pytest.mark.parametrize("fmt,axis,rule,rounding", CASES)
def test_eager_expression_equals_reference(fmt, axis, rule, rounding):
    x = data()
    ref = quantize(x, fmt, axis=axis, scale_rule=rule, rounding=rounding,
                   generator=torch.Generator().manual_seed(5)).dequantize()
    out, _ = fake_quantize(x, OperandFormat(fmt, rounding=rounding, scale_rule=rule), axis=axis,
                           sr=torch.Generator().manual_seed(5), impl="eager")
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
    out, _ = fake_quantize(x, OperandFormat(fmt, rounding=rounding, scale_rule=rule), axis=axis,
                           sr=torch.Generator().manual_seed(5), impl="compiled")
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
    fused._warn_not_compiled.cache_clear()
    with torch._dynamo.config.patch(recompile_limit=1):
        for rows in (5, 6, 7):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            out, _ = fake_quantize(x, "mxfp4", impl="compiled")
            assert torch.equal(out, quantize(x, "mxfp4").dequantize(torch.float32))
    assert "recompile limit reached" in caplog.text


@pytest.mark.skipif(not compile_available(), reason="torch.compile unavailable here")
def test_under_a_dispatch_mode_the_kernel_runs_eagerly_and_compiles_again_after():
    """A Python dispatch mode (profilers, counters) stops dynamo from tracing; fullgraph would raise
    and leave the frame refused. The kernel runs eagerly under the mode (the mode sees its ops) and
    compiled again once the mode is gone, with the reference's bits both times."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(9))
    ref = quantize(x, "mxfp4").dequantize(torch.float32)
    with Count():
        out, _ = fake_quantize(x, "mxfp4", impl="compiled")
    assert Count.ops > 0 and torch.equal(out, ref)
    out, _ = fake_quantize(x, "mxfp4", impl="compiled")
    assert torch.equal(out, ref)


# ------------------------------------------------------------------ counter-based SR, tensor amax
@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.skipif(
    not compile_available(), reason="torch.compile has no working backend here"))])
@pytest.mark.parametrize("fmt,axis", [("mxfp4", 0), ("nvfp4", 1), ("fp8_e5m2", 0)])
def test_sr_key_equals_reference(fmt, axis, impl):
    """SRKey uniforms computed inside the (compiled) expression equal the reference's."""
    from precision.srand import SRKey

    x = data()
    key = SRKey(123456789, row_offset=2, global_cols=80)
    ref = quantize(x, fmt, axis=axis, rounding="stochastic", sr=key).dequantize()
    out, _ = fake_quantize(x, OperandFormat(fmt, rounding="stochastic"), axis=axis, sr=key, impl=impl)
    assert bits_equal(ref, out)


@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.skipif(
    not compile_available(), reason="torch.compile has no working backend here"))])
def test_nvfp4_external_amax_and_defect_vectors(impl):
    """A given tensor amax (0-d tensor or float); the NVFP4 tie vector; signed zeros of MX zero
    blocks (values are what the codes decode to)."""
    x = data()
    for amax in (torch.tensor(1e5), 1e5):
        ref = quantize(x, "nvfp4", axis=1, amax=amax).dequantize()
        assert bits_equal(ref, fake_quantize(x, "nvfp4", axis=1, amax=amax, impl=impl)[0])
    t = torch.zeros(1, 32)
    t[0, 0], t[0, 16] = 4.3125, 1.6171875
    f32 = np.float32
    g_dec = f32(1) / (f32(2688) / f32(4.3125))
    assert fake_quantize(t, "nvfp4", impl=impl)[0][0, 16].item() == f32(6) * (f32(160) * g_dec)  # scale 160
    z = torch.zeros(1, 32)
    z[0, :3] = torch.tensor([-0.0, -1e-40, 1e-40])
    out, _ = fake_quantize(z, "mxfp4", impl=impl)
    assert torch.signbit(out[0, :3]).tolist() == [True, True, False]


@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.skipif(
    not compile_available(), reason="torch.compile has no working backend here"))])
@pytest.mark.parametrize("fmt,axis,rule,rounding", [("mxfp6_e2m3", 0, "rceil", "nearest"),
                                                    ("mxfp6_e3m2", 1, "floor", "stochastic")])
def test_mxfp6_equals_reference(fmt, axis, rule, rounding, impl):
    from precision.srand import SRKey

    x = data()
    op = OperandFormat(fmt, rounding=rounding, scale_rule=rule)
    kw = dict(axis=axis, sr=SRKey(77) if rounding == "stochastic" else None)
    assert bits_equal(quantize(x, op, **kw).dequantize(), fake_quantize(x, op, impl=impl, **kw)[0])

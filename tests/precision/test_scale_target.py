"""The per-tensor scale rule ``scale = scale_target / amax / 2^margin``, against hand-computed values."""

import pytest
import torch

from precision import OperandFormat, quantize
from precision.formats import FORMATS
from precision.recipe import LinearPrecision, SpecError
from precision.telemetry import operand_stats


def test_registry_scale_targets():
    assert FORMATS["fp8_e4m3"].scale_target == 448.0  # TE: amax -> max normal
    assert FORMATS["fp8_e5m2"].scale_target == 57344.0
    assert FORMATS["hif8"].scale_target == 8.0  # top of HiF8's 3-mantissa-bit binades
    assert FORMATS["hif8"].max_normal == 32768.0


def test_hif8_default_target_puts_values_in_the_precise_binades():
    # amax 10 -> scale 2^3 / 10 = 0.8: the amax maps to 8, inside the 3-mantissa-bit binades
    x = torch.tensor([10.0, 1.3, -7.0])
    q = quantize(x, "hif8")
    assert q.scales.item() == pytest.approx(0.8, rel=0, abs=1e-7)
    # 8 -> 8; 1.04 -> 1.0; -5.6 -> -5.5 (2^2 binade, 3 bits: 4, 4.5, 5, 5.5, ...)
    assert torch.allclose(q.dequantize() * 0.8, torch.tensor([8.0, 1.0, -5.5]), rtol=0, atol=1e-6)
    assert q.num_clipped.item() == 0


def test_hif8_margin_minus_12_is_the_fp8_rule():
    x = torch.tensor([1.0, 2.0, 4.0, 100.0])
    old = OperandFormat("hif8", margin=-12)  # 2^3 * 2^12 = 2^15: amax -> max finite
    assert old.scale_target == 32768.0
    q = quantize(x, old, amax=torch.tensor(4.0))
    assert q.scales.item() == 8192.0  # 2^15 / 4
    assert q.num_clipped.item() == 1 and q.dequantize()[3].item() == 4.0  # saturated at 2^15 / 8192
    # and what the FP8 rule does to a value near the amax: 3.9 * 8192 = 31948.8 -> 2^15 (1 mantissa bit)
    assert quantize(torch.tensor([3.9]), old, amax=4.0).dequantize().item() == 4.0


def test_fp8_margin_is_te_semantics():
    x = torch.tensor([7.0, 1.0])
    assert quantize(x, OperandFormat("fp8_e4m3")).scales.item() == 64.0  # 448 / 7
    q = quantize(x, OperandFormat("fp8_e4m3", margin=1))  # 448 / 7 / 2^1
    assert q.scales.item() == 32.0 and q.dequantize().tolist() == [7.0, 1.0]
    # bit for bit the reference with the amax scaled by 2^margin
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    a = quantize(y, OperandFormat("fp8_e5m2", margin=3), amax=2.5)
    b = quantize(y, "fp8_e5m2", amax=20.0)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_margin_spec_round_trip_and_errors():
    lp = LinearPrecision.parse("fprop=hif8+delayed(max,64)+margin(2),dgrad=bf16,wgrad=bf16")
    assert lp.fprop.a.margin == 2 and lp.fprop.a.scale_target == 2.0
    assert LinearPrecision.parse(str(lp)) == lp
    with pytest.raises(SpecError, match=r"fp8_e4m3: margin -1 must be an integer in \[0, 64\]"):
        OperandFormat("fp8_e4m3", margin=-1)
    with pytest.raises(SpecError, match=r"hif8: margin -13 must be an integer in \[-12, 64\]"):
        OperandFormat("hif8", margin=-13)
    with pytest.raises(SpecError, match="mxfp4: margin applies to per-tensor formats only"):
        OperandFormat("mxfp4", margin=1)


def test_telemetry_clipping_counts_the_headroom():
    x = torch.tensor([1.0, 2.0, 4.0, 100.0])
    deq = quantize(x, "hif8", amax=4.0).dequantize()
    s = operand_stats(x, deq, "hif8", scale_amax=4.0, headroom=32768 / 8)
    assert s["clipped"] == 0.0 and s["amax_ratio"] == 25.0


@pytest.mark.parametrize("fmt", [OperandFormat("fp8_e4m3", margin=2), OperandFormat("hif8", margin=-5)])
def test_fused_quantizer_applies_the_margin_as_the_reference(fmt):
    from kernels.fused import fake_quantize

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 5
    want = quantize(x, fmt, axis=1).dequantize()
    got, stats = fake_quantize(x, fmt, axis=1, impl="eager")
    assert torch.equal(got, want) and int(stats["num_clipped"]) == 0
    got_delayed, _ = fake_quantize(x, fmt, axis=1, impl="eager", amax=torch.tensor(2.0))
    assert torch.equal(got_delayed, quantize(x, fmt, axis=1, amax=2.0).dequantize())

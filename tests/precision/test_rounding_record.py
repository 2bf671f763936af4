"""Rounding-alignment records (precision.rounding_record): record the rollout's rounding, replay it.

Hand-computed MXFP4 block (amax 5.1 -> FLOOR scale 2^0, so the scaled values are the inputs):
  0.3 -> 0.5 up, 0.8 -> 1 up, 1.2 -> 1 down, 1.3 -> 1.5 up, 2.6 -> 3 up, -0.7 -> -0.5 up (towards
  +inf), 5.1 -> 6 up, 0.1 -> 0 down, zeros on the grid (down).
"""

from __future__ import annotations

import pytest
import torch

from precision.quantize import quantize
from precision.rounding_record import (
    code_agreement,
    record_rounding,
    recordable_formats,
    replay_fake_quantize,
    replay_quantize,
)

FMTS = ("mxfp4", "nvfp4")


def _block(values, n=32):
    x = torch.zeros(1, n)
    x[0, : len(values)] = torch.tensor(values)
    return x


def test_directions_and_size_hand_computed():
    q, rec = record_rounding(_block([0.3, 0.8, 1.2, 1.3, 2.6, -0.7, 5.1, 0.1]), "mxfp4")
    assert q.scales.tolist() == [[127]]
    assert rec.directions()[0, :9].tolist() == [True, True, False, True, True, True, True, False, False]
    assert not rec.directions()[0, 8:].any()
    assert rec.direction.tolist() == [0b01111011, 0, 0, 0]  # bit i = element i, low bit first
    assert rec.bits_per_element == (32 + 8) / 32  # 1 direction bit + an 8-bit scale per 32
    _, nv = record_rounding(torch.randn(64, 256), "nvfp4")
    assert nv.bits_per_element == pytest.approx(1 + 8 / 16 + 32 / (64 * 256))
    assert set(recordable_formats()) == {"mxfp4", "nvfp4", "mxfp6_e2m3", "mxfp6_e3m2"}


@pytest.mark.parametrize("fmt", FMTS + ("mxfp6_e2m3",))
@pytest.mark.parametrize("shape,axis", [((8, 96), 1), ((40, 6), 0), ((3, 5, 40), -1)])
def test_replay_on_identical_inputs_is_the_rollouts_quantization(fmt, shape, axis):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3
    x.view(-1)[::7] = 0.0  # zeros, and a -0
    x.view(-1)[3] = -0.0
    q, rec = record_rounding(x, fmt, axis=axis)
    for window in (0.25, 0.0):
        r = replay_quantize(x, rec, window=window)
        assert torch.equal(r.codes, q.codes) and torch.equal(r.scales, q.scales)  # bit for bit, -0 kept
        assert torch.equal(r.dequantize(), quantize(x, fmt, axis=axis).dequantize())
    assert code_agreement(replay_quantize(x, rec), q) == 1.0


@pytest.mark.parametrize("fmt", FMTS)
def test_replay_restores_agreement_on_slightly_different_inputs(fmt):
    g = torch.Generator().manual_seed(1)
    x_roll = torch.randn(64, 128, generator=g)
    x_train = x_roll * (1 + 2e-3 * torch.randn(64, 128, generator=g))  # another kernel's rounding, say
    q_roll, rec = record_rounding(x_roll, fmt)
    own = code_agreement(quantize(x_train, fmt, axis=-1), q_roll)
    replayed = code_agreement(replay_quantize(x_train, rec), q_roll)
    assert own < 0.999 and replayed == 1.0, (own, replayed)  # measured: own 0.993 (both formats)


def test_replay_rule_by_hand():
    roll = _block([4.0, 1.24, 0.99, 2.6])  # scale 2^0: 1.24 -> 1 (down), 0.99 -> 1 (up), 2.6 -> 3 (up)
    train = _block([4.0, 1.26, 1.01, 2.4])  # own nearest: 1.5, 1, 2
    q, rec = record_rounding(roll, "mxfp4")
    vals = lambda qt: qt.dequantize()[0, :4].tolist()
    assert vals(q) == [4.0, 1.0, 1.0, 3.0]
    assert vals(quantize(train, "mxfp4")) == [4.0, 1.5, 1.0, 2.0]
    # 1.26: inside [1, 1.5] -> recorded "down" = 1; 1.01 is within 1/4 step of 1 -> its own nearest 1;
    # 2.4 sits in [2, 3] at 0.4 -> recorded "up" = 3
    assert vals(replay_quantize(train, rec)) == [4.0, 1.0, 1.0, 3.0]
    # window 0 (direction everywhere): 1.01 in [1, 1.5] goes "up" to 1.5 -- why the window exists
    assert vals(replay_quantize(train, rec, window=0.0)) == [4.0, 1.0, 1.5, 3.0]


def test_replay_uses_the_recorded_scale():
    q, rec = record_rounding(_block([3.9, 0.7]), "mxfp4")  # amax 3.9: scale 2^-1; 7.8 -> 6, 1.4 -> 1.5
    train = _block([4.1, 0.7])  # amax 4.1: its own scale would be 2^0, and 0.7 -> 0.5
    assert q.scales.tolist() == [[126]] and q.dequantize()[0, :2].tolist() == [3.0, 0.75]
    assert quantize(train, "mxfp4").scales.tolist() == [[127]]
    assert quantize(train, "mxfp4").dequantize()[0, :2].tolist() == [4.0, 0.5]
    r = replay_quantize(train, rec)
    assert r.scales.tolist() == [[126]] and r.dequantize()[0, :2].tolist() == [3.0, 0.75]  # the rollout's


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="'fp8_e4m3' cannot be recorded; valid: mxfp6_e2m3"):
        record_rounding(torch.ones(4, 32), "fp8_e4m3")
    from precision.recipe import OperandFormat

    with pytest.raises(ValueError, match="stochastically"):
        record_rounding(torch.ones(4, 32), OperandFormat("mxfp4", rounding="stochastic"))
    _, rec = record_rounding(torch.ones(4, 32), "mxfp4")
    with pytest.raises(ValueError, match=r"x is \(4, 16\), the record \(4, 32\)"):
        replay_quantize(torch.ones(4, 16), rec)


def test_fake_quant_mode_has_the_replayed_values_and_a_straight_through_gradient():
    x_roll = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    _, rec = record_rounding(x_roll, "nvfp4")
    x = (x_roll * 1.001).requires_grad_(True)
    y = replay_fake_quantize(x, rec)
    assert torch.equal(y.detach(), replay_quantize(x.detach(), rec).dequantize())
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).expand(4, 64))

"""QuEST-style MXFP4 (``mxfp4/quest``, Quartet's forward) against an oracle written in this file.

The oracle is a NumPy float32 transcription of the authors' quantizer (``mxfp4_forward_kernel``
with ``quest=True`` and ``gaussian_scale = 2.92247856 / 6``, as Quartet's forward quantizer calls
it): the block's standard deviation, the scale rounded down to a power of two, E2M1 by strict
midpoint thresholds (a midpoint rounds towards zero), everything beyond 5 to 6. No test vectors
are published; the inputs are Gaussian, Student-t(3) and hand-made blocks, rotated by had32 as in
Quartet.
"""

import numpy as np
import pytest
import torch

from precision.elements import e2m1_decode
from precision.quantize import quantize
from precision.recipe import Gemm, OperandFormat, SpecError, parse_gemm
from precision.rotation import rotate
from precision.srand import SRKey

F32 = np.float32


def oracle(x: np.ndarray, u: np.ndarray | None = None):
    """32-blocks along the last axis of a 2-D float32 ``x`` -> (E2M1 values, power-of-two units);
    with uniforms ``u`` (shaped like ``x``) the kernel's stochastic rounding instead of nearest."""
    xb = x.reshape(x.shape[0], -1, 32).astype(F32)
    mean_sq = (xb * xb).sum(-1, dtype=F32) / F32(32)
    mean = xb.sum(-1, dtype=F32) / F32(32)
    std = np.sqrt(np.maximum(mean_sq - mean * mean, F32(0))).astype(F32)
    scales = (F32(2.92247856 / 6.0) * std + F32(1e-8)).astype(F32)
    _, exp = np.frexp(scales)  # scales = m * 2^exp, m in [0.5, 1): floor(log2) = exp - 1
    unit = np.ldexp(F32(1), exp - 1).astype(F32)
    a = np.abs(xb / unit[..., None])
    q = np.where(a > 5, 6, np.where(a > 3.5, 4, np.where(a > 2.5, 3, np.where(
        a > 1.75, 2, np.where(a > 1.25, 1.5, np.where(a > 0.75, 1, np.where(a > 0.25, 0.5, 0)))))))
    if u is not None:  # the kernel's stochastic_round branch
        high = np.where(a > 4, 6, np.where(a > 3, 4, np.where(a > 2, 3, np.where(
            a > 1.5, 2, np.where(a > 1.0, 1.5, np.where(a > 0.5, 1, 0.5))))))
        low = np.where(a > 4, 4, np.where(a > 3, 3, np.where(a > 2, 2, np.where(
            a > 1.5, 1.5, np.where(a > 1.0, 1.0, np.where(a > 0.5, 0.5, 0.0))))))
        p_up = ((a - low) / (high - low)).astype(F32)
        q = np.where(u.reshape(a.shape) < p_up, high, low)
    return (q * np.sign(xb)).reshape(x.shape).astype(F32), unit


@pytest.mark.parametrize("kind", ["randn", "student_t3", "rand01", "spiky"])
def test_equals_the_authors_quantizer(kind):
    g = torch.Generator().manual_seed(3)
    for seed in range(4):
        shape = (16, 128)
        if kind == "randn":
            x = torch.randn(shape, generator=g) * 10.0 ** (seed - 2)
        elif kind == "student_t3":
            x = torch.randn(shape, generator=g) / (torch.randn((3, *shape), generator=g).square().sum(0) / 3).sqrt()
        elif kind == "rand01":
            x = torch.randint(0, 2, shape, generator=g).float()
        else:
            x = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.05) * 50
        xr = rotate(x, 1, 32)
        q = quantize(xr, OperandFormat("mxfp4", scale_rule="quest"))
        ref_q, unit = oracle(xr.numpy())
        assert np.array_equal(e2m1_decode(q.codes).numpy(), ref_q)
        assert np.array_equal(2.0 ** (q.scales.numpy().astype(np.float64) - 127), unit.astype(np.float64))
        assert np.array_equal(q.dequantize().numpy(), (ref_q.reshape(16, -1, 32) * unit[..., None]).reshape(shape))
        key = SRKey(seed)  # the kernel's stochastic rounding, fed the same uniforms
        q = quantize(xr, OperandFormat("mxfp4", scale_rule="quest", rounding="stochastic"), sr=key)
        ref_q, unit = oracle(xr.numpy(), key.uniforms(xr.shape, xr.device).numpy())
        assert np.array_equal(e2m1_decode(q.codes).numpy(), ref_q)
        assert np.array_equal(2.0 ** (q.scales.numpy().astype(np.float64) - 127), unit.astype(np.float64))


def test_hand_vectors_scale_from_the_std_and_clip_a_spike():
    # [1, -1] x 16: std 1 -> 0.487 -> unit 2^-2 (byte 125); +-1 -> +-4 -> exact.
    x = torch.tensor([1.0, -1.0] * 16).reshape(1, 32)
    q = quantize(x, OperandFormat("mxfp4", scale_rule="quest"))
    assert q.scales.item() == 125 and torch.equal(q.dequantize(), x)
    # [3, 0 x 31]: std 0.522 -> 0.254 -> unit 2^-2; 3 -> 12, clipped to 6 -> 1.5. Plain MXFP4 keeps 3.
    x = torch.zeros(1, 32)
    x[0, 0] = 3.0
    q = quantize(x, OperandFormat("mxfp4", scale_rule="quest"))
    assert q.scales.item() == 125 and q.codes[0, 0].item() == 0x7 and q.dequantize()[0, 0].item() == 1.5
    assert quantize(x, "mxfp4").dequantize()[0, 0].item() == 3.0
    # a midpoint rounds towards zero: [1.25 * 2^-2 ...] -> 1, not 1.5 (the authors' strict '>')
    x = torch.tensor([1.0, -1.0] * 16).reshape(1, 32)
    x[0, 2] = 1.25 * 0.25 * 4  # v = 1.25 * 4 = 5 -> 4 (midpoint of 4 and 6 goes down)
    q = quantize(x, OperandFormat("mxfp4", scale_rule="quest"))
    assert q.scales.item() == 125 and q.dequantize()[0, 2].item() == 1.0


def test_nonfinite_and_zero_blocks():
    x = torch.zeros(2, 64)
    x[0, 5] = float("inf")
    q = quantize(x, OperandFormat("mxfp4", scale_rule="quest"))
    assert q.scales[0, 0].item() == 0xFF and torch.isnan(q.dequantize()[0, :32]).all()
    assert torch.equal(q.dequantize()[1], torch.zeros(64)) and torch.equal(q.dequantize()[0, 32:], torch.zeros(32))


def test_spec_rules_and_refusals():
    r = parse_gemm("mxfp4/quest+had32", Gemm.FPROP)
    assert r.a.scale_rule == "quest" and str(r) == "mxfp4+quest+had32"
    with pytest.raises(SpecError, match=r"^fprop: quest fits a Gaussian to Hadamard-rotated blocks: add a rotation"):
        parse_gemm("mxfp4/quest", Gemm.FPROP)
    with pytest.raises(SpecError, match=r"mxfp8_e4m3: the quest scale rule .* applies to mxfp4 only"):
        parse_gemm("mxfp8_e4m3/quest+had32", Gemm.FPROP)
    with pytest.raises(SpecError, match=r"nvfp4: the quest scale rule .* applies to mxfp4 only"):
        parse_gemm("nvfp4/quest+had16", Gemm.FPROP)
    assert str(parse_gemm("mxfp4/quest/sr+had32", Gemm.WGRAD)) == "mxfp4+sr+quest+had32"
    with pytest.raises(SpecError, match=r"quest scales 1-D blocks from their own statistics; drop prescale"):
        OperandFormat("mxfp4", scale_rule="quest", rounding="stochastic", prescale=True)
    with pytest.raises(SpecError, match=r"quest scales 1-D blocks from their own statistics; drop 2d"):
        OperandFormat("mxfp4", scale_rule="quest", block2d=True)


def test_fprop_runs_it_through_the_operand_pipeline():
    from kernels.gemm import fp32_gemm, gemm
    from precision.state import LayerQuantState

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    recipe = parse_gemm("mxfp4/quest+had32", Gemm.FPROP)
    y = gemm(Gemm.FPROP, x, w, recipe, "emulated", state=LayerQuantState(0, "l"))
    assert torch.equal(y, gemm(Gemm.FPROP, x, w, recipe, "reference", state=LayerQuantState(0, "l")))
    qx = quantize(rotate(x, 1, 32), recipe.a).dequantize()
    qw = quantize(rotate(w, 1, 32), recipe.b).dequantize()
    assert torch.equal(y, fp32_gemm(Gemm.FPROP, qx, qw))
    assert recipe.a.triton_missing is None  # a Triton kernel too (tests/kernels/test_triton_controls.py)


def test_telemetry_counts_what_quest_clips():
    from precision.telemetry import operand_stats

    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 3.0, 0.5  # 3 clips to 1.5 (see the hand vector above); 0.5 does not
    deq = quantize(x, OperandFormat("mxfp4", scale_rule="quest")).dequantize()
    assert operand_stats(x, deq, "mxfp4", -1, None, "quest")["clipped"] == 1 / 32
    assert operand_stats(x, quantize(x, "mxfp4").dequantize(), "mxfp4")["clipped"] == 0.0

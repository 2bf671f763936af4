"""MXFP6 (OCP MX v1.0 ``mxfp6_e2m3`` / ``mxfp6_e3m2``): exhaustive element encodings against
ml_dtypes, whole blocks against torchao's ``to_mx``, packed storage, and use through the recipe
grammar, the policy, the GEMM and telemetry."""

import ml_dtypes
import numpy as np
import pytest
import torch

from model.linear import policy_linear
from precision import FORMATS, LinearPrecision, PrecisionPolicy, SRKey, quantize
from precision.elements import E2M3, E3M2, element_values, grid_decode, grid_encode
from precision.formats import pack_codes, unpack_codes
from precision.telemetry import operand_stats

ORACLE = {"e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}
FP6 = [("mxfp6_e2m3", E2M3), ("mxfp6_e3m2", E3M2)]


def every_bf16_value() -> torch.Tensor:
    """All 65536 bf16 bit patterns as float32 (every binade, every FP6 tie), finite only, plus the
    float32 neighbours of each FP6 tie (one ulp either side)."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[torch.isfinite(x)]


def oracle_codes(a: torch.Tensor, spec) -> np.ndarray:
    """ml_dtypes' RNE cast; it is finite-only, so clamp to the max normal first (saturation)."""
    clamped = np.clip(a.numpy(), -spec.max_normal, spec.max_normal)
    return clamped.astype(ORACLE[spec.name]).view(np.uint8)


@pytest.mark.parametrize("spec", [E2M3, E3M2], ids=lambda s: s.name)
def test_every_code_decodes_like_ml_dtypes(spec):
    codes = np.arange(64, dtype=np.uint8)
    want = codes.view(ORACLE[spec.name]).astype(np.float32)
    got = element_values(spec).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))  # -0 (code 0x20) included
    assert got.max() == spec.max_normal and np.abs(got[got != 0]).min() == spec.min_subnormal
    assert torch.equal(grid_decode(torch.from_numpy(codes), spec), torch.from_numpy(want))


@pytest.mark.parametrize("spec", [E2M3, E3M2], ids=lambda s: s.name)
def test_every_bf16_input_encodes_like_ml_dtypes(spec):
    x = every_bf16_value()
    vals = element_values(spec).abs().unique()
    mids = (vals[1:] + vals[:-1]) / 2  # the ties, and one float32 ulp either side of each
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(99.0))])
    x = torch.cat([x, near, -near])
    got = grid_encode(x, spec).numpy()
    assert np.array_equal(got, oracle_codes(x, spec))


def _adversarial(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 128, generator=g)
    x[:8] *= torch.exp2(torch.randint(-40, 40, (8, 1), generator=g).float())
    x[8, :32] = torch.linspace(-7.99, 7.99, 32)  # mantissa above E2M3's 1.875: FLOOR clips
    x[9, :32] = torch.linspace(-31.0, 31.0, 32)  # above E3M2's 1.75: FLOOR clips
    x[10, :32] = 0.0
    x[11, :16] = torch.tensor([0.0625, 0.1875, 1.0625, 3.75, 4.25, 13.0, 15.0, 26.0] * 2)  # ties
    return x


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("fmt,spec", FP6, ids=[f for f, _ in FP6])
def test_mxfp6_blocks_match_torchao_to_mx(fmt, spec, rule):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = _adversarial()
    elem = DTYPE_FP6_E2M3 if spec is E2M3 else DTYPE_FP6_E3M2
    scale_ref, data_ref = to_mx(x, elem, 32, getattr(ScaleCalculationMode, rule.upper()))
    q = quantize(x, fmt, scale_rule=rule)
    assert torch.equal(q.scales, scale_ref.view(torch.uint8).reshape(q.scales.shape))
    assert torch.equal(q.codes, data_ref.view(torch.uint8))


@pytest.mark.parametrize("fmt,spec", FP6, ids=[f for f, _ in FP6])
def test_mxfp6_zero_block_keeps_signs_and_nonfinite_block_is_nan(fmt, spec):
    x = torch.zeros(2, 32)
    x[0, :2] = torch.tensor([-0.0, 1e-41])
    x[1, 3] = float("inf")
    q = quantize(x, fmt)
    assert q.scales[:, 0].tolist() == [0x00, 0xFF]
    assert q.codes[0, :2].tolist() == [1 << spec.sign_shift, 0]
    assert torch.signbit(q.dequantize()[0, :2]).tolist() == [True, False]
    assert torch.isnan(q.dequantize()[1]).all()


def test_registry_entries():
    for fmt, spec in FP6:
        f = FORMATS[fmt]
        assert (f.block, f.code_bits, f.bits_per_element, f.element) == (32, 6, 6.25, spec)
        assert f.supports_sr and f.has_scale_rules and f.blocked and not f.delayed
    assert FORMATS["mxfp4"].bits_per_element == 4.25 and FORMATS["nvfp4"].bits_per_element == 4.5
    assert FORMATS["fp8_e4m3"].bits_per_element == 8 and FORMATS["bf16"].bits_per_element == 16


def test_six_bit_packing_four_codes_in_three_bytes():
    codes = torch.tensor([[0x01, 0x22, 0x3F, 0x10, 0x00, 0x2A, 0x15, 0x3C]], dtype=torch.uint8)
    packed = pack_codes(codes, 6)
    # lowest index in the lowest bits: a little-endian bit string, written out by hand
    bits = "".join(format(int(c), "06b")[::-1] for c in codes[0])
    want = [int(bits[i:i + 8][::-1], 2) for i in range(0, len(bits), 8)]
    assert packed.tolist() == [want] and packed.shape == (1, 6)
    assert torch.equal(unpack_codes(packed, 6), codes)
    q = quantize(torch.randn(3, 64), "mxfp6_e3m2")
    assert q.packed().shape == (3, 48) and torch.equal(FORMATS["mxfp6_e3m2"].unpack(q.packed()), q.codes)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_codes(codes[:, :6], 6)


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2"])
def test_mxfp6_stochastic_rounding_unbiased(fmt):
    x = torch.full((128, 128), 1.2)  # scale 1 (amax 1.2 -> 2^0 for E2M3/E3M2 floor), between grid points
    x[:, 0] = 4.0  # pins each block's scale to 2^0
    q = quantize(x, fmt, rounding="stochastic", sr=SRKey(5)).dequantize()[:, 1:]
    lo, hi = (1.125, 1.25) if fmt == "mxfp6_e2m3" else (1.0, 1.25)
    assert set(q.unique().tolist()) == {lo, hi}
    p = (1.2 - lo) / (hi - lo)
    assert abs(q.mean().item() - 1.2) < 4 * (hi - lo) * (p * (1 - p) / q.numel()) ** 0.5


def test_mxfp6_through_the_spec_grammar_policy_gemm_and_telemetry():
    p = LinearPrecision.parse("base=fp8,wgrad=mxfp6_e2m3/sr@mxfp6_e3m2+rceil")
    assert str(p.wgrad.a) == "mxfp6_e2m3/sr/rceil" and str(p.wgrad.b) == "mxfp6_e3m2/rceil"
    assert LinearPrecision.parse(str(p)) == p
    plan = PrecisionPolicy.from_args("mxfp4", ["kind:fc2=fprop=mxfp6_e3m2,dgrad=mxfp6_e2m3,wgrad=mxfp6_e2m3"]).resolve(
        ["decoder.layers.0.mlp.linear_fc2", "decoder.layers.0.mlp.linear_fc1"], 1)
    lp = plan["decoder.layers.0.mlp.linear_fc2"]
    assert lp.fprop.a.fmt == "mxfp6_e3m2" and plan["decoder.layers.0.mlp.linear_fc1"].fprop.a.fmt == "mxfp4"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)
    y = policy_linear(x, w, lp)
    xq = quantize(x.detach(), "mxfp6_e3m2", axis=1).dequantize()
    wq = quantize(w.detach(), "mxfp6_e3m2", axis=1).dequantize()
    assert torch.equal(y, xq @ wq.t())
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(w.grad).all()
    blk = torch.zeros(1, 32)
    blk[0, :3] = torch.tensor([7.9, 1.0, -7.8])  # E2M3 FLOOR: scale 2^0, 7.9 and 7.8 clip at 7.5
    deq = quantize(blk, "mxfp6_e2m3").dequantize()
    stats = operand_stats(blk, deq, "mxfp6_e2m3")
    assert stats["clipped"] == 2 / 32 and deq[0, 0].item() == 7.5
    assert operand_stats(blk, quantize(blk, "mxfp6_e2m3", scale_rule="rceil").dequantize(), "mxfp6_e2m3",
                         scale_rule="rceil")["clipped"] == 0


def test_mxfp6_stays_emulated_on_every_device():
    """No torch._scaled_mm path for MXFP6 here: on GPUs auto picks the emulation on BF16 tensor cores
    (``bf16_mm``: MXFP6 values are BF16-exact), on CPU the FP32 emulated spec; asking for
    mx_scaled_mm is refused in one line naming the GEMM."""
    from kernels.backends import BackendError, select_backend

    lp = LinearPrecision.parse("fprop=mxfp6_e2m3,dgrad=mxfp6_e3m2,wgrad=mxfp6_e2m3/sr")
    for cap in ((10, 0), "gfx950", (9, 0)):
        assert set(select_backend(lp, cap).values()) == {"bf16_mm"}
    assert set(select_backend(lp, None).values()) == {"emulated"}
    with pytest.raises(BackendError, match="fprop: backend mx_scaled_mm cannot run mxfp6_e2m3"):
        select_backend(lp.fprop, (10, 0), "mx_scaled_mm")


def test_mxfp6_and_fp32_in_sweep_grids(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "launch"))
    import sweep

    runs = sweep.expand_runs({"grid": {"wgrad": ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2/sr@mxfp6_e2m3"]}})
    assert [LinearPrecision.parse(r.precision).wgrad.a.fmt for r in runs] == ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"]
    runs = sweep.expand_runs({"grid": {"presets": ["fp32", {"fp6_wgrad": "base=fp8,wgrad=mxfp6_e2m3"}]}})
    assert [r.label for r in runs] == ["fp32", "fp6_wgrad"]

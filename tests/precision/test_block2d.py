"""2-D block scaling for weights: the tile rule (NUMERICS.md, "2-D block scaling"), the spec
grammar (``/2d``), its refusals, and the ``nvfp4`` preset as TransformerEngine's recipe."""

import pytest
import torch

from precision import PrecisionPolicy, SpecError, presets, quantize
from precision.blocks import tile_amax
from precision.formats import FORMATS
from precision.policy import PrecisionPlan, load_plan_file, write_plan_file
from precision.recipe import Gemm, LinearPrecision, OperandFormat
from precision.rotation import TE_SIGNS, fixed_signs


# ============================================================================ the tile rule
def test_nvfp4_tile_scale_is_the_tile_amax_scale():
    """One E4M3 scale per 16x16 square from the square's amax, under the FP32 tensor scale; edge
    squares of a 40 x 24 weight hold only the elements present (zero padding)."""
    torch.manual_seed(0)
    w = torch.randn(40, 24)
    w[17, 3] = 9.0  # square (1, 0)'s amax
    q = quantize(w, "nvfp4", axis=1, block2d=True)
    g = q.tensor_scale
    for i in range(3):
        for j in range(2):
            sq = w[16 * i:16 * i + 16, 16 * j:16 * j + 16]
            want = torch.clamp(sq.abs().max() * (g / 6.0), max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            rows = q.scales[16 * i:16 * i + 16, j]
            assert (rows == want).all(), (i, j)
    assert q.tile_scales().shape == (3, 2)
    # 1-D blocks of the same weight have their own amax per row-block: they differ
    assert not torch.equal(quantize(w, "nvfp4", axis=1).scales, q.scales)


def test_mx_tile_scale_floor_rule_and_nan_square():
    """MX 32x32 squares: E8M0 byte floor(log2(square amax)) - emax + 127; a NaN poisons its square only."""
    w = torch.ones(64, 64) * 0.5
    w[40, 50] = 100.0  # square (1, 1): floor(log2 100) = 6, E2M1 emax 2 -> 4 + 127
    w[3, 40] = float("nan")  # square (0, 1)
    q = quantize(w, "mxfp4", axis=0, block2d=True)
    squares = q.tile_scales()  # axis 0 last: [squares along axis 1, squares along axis 0]
    assert squares.tolist() == [[124, 124], [0xFF, 131]]  # 0.5: floor(log2 0.5) - 2 + 127 = 124
    deq = q.dequantize()
    assert torch.isnan(deq[:32, 32:]).all() and not torch.isnan(deq[32:, :]).any()
    torch.testing.assert_close(tile_amax(w, 1, 32)[::32], torch.tensor([[0.5, float("nan")], [0.5, 100.0]]),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp6_e2m3"])
def test_2d_refusals_at_the_format(fmt):
    with pytest.raises(ValueError, match="2-D block scaling takes a 2-D tensor"):
        quantize(torch.ones(2, 3, 32), fmt, block2d=True)
    with pytest.raises(ValueError, match="fp8_e4m3: 2-D block scaling does not apply; valid with: .*nvfp4"):
        quantize(torch.ones(4, 32), "fp8_e4m3", block2d=True)
    assert FORMATS[fmt].tile == FORMATS[fmt].block


def test_1d_tensor_cannot_serve_the_other_axis():
    q = quantize(torch.randn(32, 32), "nvfp4", axis=1)
    with pytest.raises(ValueError, match="1-D blocks along axis 1 cannot serve axis 0"):
        q.along(0)


# ============================================================================ the spec grammar
TE = "fprop=nvfp4@nvfp4/2d,dgrad=nvfp4/sr@nvfp4/2d,wgrad=nvfp4/sr@nvfp4+rht16_te"


def test_spec_round_trips_and_the_preset_is_te():
    p = LinearPrecision.parse(TE)
    assert str(p) == TE and LinearPrecision.parse(str(p)) == p
    assert presets.get("nvfp4") == p
    assert p.fprop.b == OperandFormat("nvfp4", block2d=True) and not p.fprop.a.block2d
    assert p.dgrad.a.rounding == "stochastic" and p.dgrad.b.block2d and p.dgrad.b.rounding == "nearest"
    assert p.wgrad.rotation == "rht16_te" and p.wgrad.a.rounding == "stochastic" and p.wgrad.b.rounding == "nearest"
    mx = LinearPrecision.parse("base=mxfp4,fprop=mxfp4@mxfp4/2d,dgrad=mxfp4@mxfp4/2d/rceil")
    assert LinearPrecision.parse(str(mx)) == mx and mx.dgrad.b.scale_rule == "rceil"
    old = LinearPrecision.parse("fprop=nvfp4,dgrad=nvfp4/sr@nvfp4,wgrad=nvfp4/sr@nvfp4+rht16")  # the 1-D recipe
    assert not old.fprop.b.block2d and old.wgrad.rotation == "rht16"
    assert "2-D 16x16" in presets.describe("nvfp4") and "fprop=nvfp4,dgrad=nvfp4/sr@nvfp4" in presets.describe("nvfp4")


@pytest.mark.parametrize("spec, message", [
    ("base=bf16,fprop=nvfp4/2d@nvfp4", r"^fprop: operand x \(nvfp4/2d\): 2-D block scaling \(2d\) applies to weights only"),
    ("base=bf16,fprop=nvfp4+2d", r"^fprop: operand x \(nvfp4/2d\): .* weights only"),
    ("base=bf16,dgrad=nvfp4/2d@nvfp4", r"^dgrad: operand dy \(nvfp4/2d\): .* weights only"),
    ("base=bf16,wgrad=nvfp4@nvfp4/2d", r"^wgrad: operand x \(nvfp4/2d\): .* weights only"),
    ("base=bf16,wgrad=nvfp4/2d@nvfp4", r"^wgrad: operand dy \(nvfp4/2d\)"),
    ("base=bf16,fprop=fp8@fp8/2d", r"^fprop: fp8_e4m3: 2-D block scaling \(2d\) does not apply; valid with: .*nvfp4"),
    ("base=bf16,dgrad=nvfp4@nvfp4/2d/sr", r"^dgrad: nvfp4/2d: 2-D weight tiles round to nearest"),
])
def test_refusals_name_the_gemm_and_slot(spec, message):
    with pytest.raises(SpecError, match=message) as e:
        LinearPrecision.parse(spec)
    assert "\n" not in str(e.value)


def test_direct_construction_is_checked_too():
    from precision.recipe import GemmRecipe

    x2d = OperandFormat("nvfp4", block2d=True)
    with pytest.raises(SpecError, match="^wgrad: operand dy"):
        LinearPrecision(wgrad=GemmRecipe(x2d, OperandFormat("nvfp4")))


def test_plan_file_round_trip(tmp_path):
    names = ["decoder.layers.0.mlp.linear_fc1", "output_layer"]
    path = tmp_path / "plan.yaml"
    write_plan_file(str(path), "nvfp4", linears={"output_layer": "bf16"})
    plan = PrecisionPolicy.from_args(str(path), []).resolve(names, 1)
    assert plan[names[0]] == presets.get("nvfp4")
    again = PrecisionPlan.from_dict(plan.to_dict())
    assert again[names[0]] == presets.get("nvfp4") and again[names[0]].dgrad.b.block2d
    assert load_plan_file(str(path)).default == "nvfp4"


def test_te_sign_vector():
    """TE's Wgrad sign vector (its get_wgrad_sign_vector), as the 16-bit mask of its -1 entries."""
    assert sum(1 << i for i, v in enumerate(TE_SIGNS) if v == -1) == 0xD7E8
    assert torch.equal(fixed_signs("rht16_te"), torch.tensor(TE_SIGNS, dtype=torch.float32))
    assert fixed_signs("rht16") is None and Gemm.WGRAD.operands == ("dy", "x")


def test_unknown_modifier_lists_2d():
    with pytest.raises(SpecError, match=r"unknown modifier '2D'; valid: sr, eden, eden128, prescale, 2d, "):
        LinearPrecision.parse("base=bf16,fprop=nvfp4@nvfp4/2D")

"""Recipes, presets and policies: parse/str round trips, validation messages, rule resolution."""

import dataclasses
import re

import pytest

from precision import Gemm, GemmRecipe, LinearPrecision, OperandFormat, PrecisionPolicy, Rule, SpecError, presets
from precision.policy import parse_precision

STUDY_LADDER = ["bf16", "fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4", "mxfp4_sr", "mxfp4_rht",
                "wgrad_hadamard", "mxfp4_hadamard_all", "nvfp4", "hif8_w8a8"]


def test_all_design_presets_exist_with_tables():
    assert set(STUDY_LADDER) <= set(presets.names())
    for name in presets.names():
        doc = presets.describe(name)
        assert "| fprop" in doc and "| dgrad" in doc and "| wgrad" in doc, name


@pytest.mark.parametrize("name", STUDY_LADDER)
def test_preset_str_round_trips(name):
    p = presets.get(name)
    assert LinearPrecision.parse(str(p)) == p


def test_wgrad_hadamard_contents():
    p = presets.get("wgrad_hadamard")
    mx = OperandFormat("mxfp4")
    assert p.fprop == GemmRecipe(mx, mx) and p.dgrad == GemmRecipe(mx, mx)
    assert p.wgrad == GemmRecipe(mx, mx, "had16")


def test_fp8_is_hybrid_and_the_base_for_partial_mxfp4():
    p = presets.get("mxfp4_fprop")
    assert p.dgrad.operand("dy", Gemm.DGRAD).fmt == "fp8_e5m2"
    assert p.dgrad.operand("w", Gemm.DGRAD).fmt == "fp8_e4m3"
    assert p.wgrad.operand("x", Gemm.WGRAD).fmt == "fp8_e4m3"
    assert p.fprop.a.fmt == "mxfp4"


def test_compact_spec_forms():
    p = LinearPrecision.parse("fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4+had16")
    assert p == presets.get("wgrad_hadamard")
    q = LinearPrecision.parse("base=fp8, wgrad=mxfp4/sr/prescale@mxfp4+rceil")
    assert q.fprop == presets.get("fp8").fprop
    assert q.wgrad.a == OperandFormat("mxfp4", rounding="stochastic", prescale=True, scale_rule="rceil")
    assert q.wgrad.b == OperandFormat("mxfp4", scale_rule="rceil")
    assert LinearPrecision.parse(str(q)) == q
    h = LinearPrecision.parse("fprop=hif8+delayed(max,64),dgrad=bf16,wgrad=bf16")
    assert h.fprop.a.amax_algo == "max" and h.fprop.a.amax_history_len == 64
    assert h == presets.get("hif8_w8a8")


@pytest.mark.parametrize("spec,message", [
    ("fprop=mxfp5,dgrad=bf16,wgrad=bf16", "fprop: unknown format 'mxfp5'; valid: "),
    ("fprop=bf16,dgrad=bf16,wgrad=mxfp4+had17", "wgrad: unknown modifier 'had17'"),
    ("fprop=bf16,dgrad=bf16,fprop=mxfp4", "fprop: given twice"),
    ("fprop=bf16,dgrad=bf16,wgrad=bf16,xgrad=bf16", "unknown key 'xgrad'"),
    ("fprop=bf16+sr,dgrad=bf16,wgrad=bf16", "fprop: bf16: stochastic rounding is not supported"),
    ("fprop=fp8+rceil,dgrad=bf16,wgrad=bf16", "fprop: fp8_e4m3: scale rule 'rceil' applies to MX formats only"),
    ("fprop=mxfp4+delayed(max,16),dgrad=bf16,wgrad=bf16", "fprop: mxfp4: delayed scaling applies to per-tensor"),
    ("fprop=mxfp4+prescale,dgrad=bf16,wgrad=bf16", "fprop: mxfp4: prescale (3/4) needs"),
    ("fprop=mxfp4@mxfp4@mxfp4,dgrad=bf16,wgrad=bf16", "fprop: 'mxfp4@mxfp4@mxfp4' has 3 operands"),
    ("dgrad=mxfp4+had16+had32,fprop=bf16,wgrad=bf16", "dgrad: two rotations"),
    ("base=fp9,wgrad=bf16", "unknown precision preset 'fp9'"),
])
def test_invalid_specs_name_the_gemm_and_valid_values(spec, message):
    with pytest.raises(ValueError) as e:
        LinearPrecision.parse(spec)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_frozen_and_replace():
    p = presets.get("mxfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.wgrad = GemmRecipe()
    q = dataclasses.replace(p, wgrad=dataclasses.replace(p.wgrad, rotation="had16"))
    assert q == presets.get("wgrad_hadamard")
    with pytest.raises(SpecError, match="unknown rotation 'had8'"):
        dataclasses.replace(p.wgrad, rotation="had8")


def test_spec_file(tmp_path):
    f = tmp_path / "recipe.yaml"
    f.write_text("base: fp8\nwgrad: mxfp4+had16\n")
    p = parse_precision(str(f))
    assert p.wgrad.rotation == "had16" and p.fprop == presets.get("fp8").fprop
    bad = tmp_path / "bad.yaml"
    bad.write_text("fprop: bf16\nwgard: bf16\n")
    with pytest.raises(SpecError, match=r"bad.yaml: unknown key\(s\) wgard"):
        parse_precision(str(bad))


def test_unknown_preset_message():
    valid = re.escape(", ".join(presets.names()))
    with pytest.raises(SpecError, match=f"unknown precision 'wgrad_hadamrd'.*presets: {valid}$"):
        parse_precision("wgrad_hadamrd")


# ---------------------------------------------------------------- policy
NAMES = [f"decoder.layers.{i}.{m}" for i in range(12) for m in
         ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")] + [
    "output_layer"]


def test_policy_first_match_anchored_globs():
    bf16, fp8 = presets.get("bf16"), presets.get("fp8")
    pol = PrecisionPolicy(presets.get("mxfp4"), [Rule("decoder.layers.1.*", bf16), Rule("decoder.layers.1*", fp8)])
    plan = pol.resolve(NAMES, 12)
    assert plan["decoder.layers.1.mlp.linear_fc1"] == bf16
    assert plan["decoder.layers.10.mlp.linear_fc1"] == fp8  # not caught by 'layers.1.*'
    assert plan["decoder.layers.2.mlp.linear_fc1"] == presets.get("mxfp4")


def test_policy_from_args_hif8_rules_and_user_override():
    pol = PrecisionPolicy.from_args("hif8_w8a8", ["output_layer=fp8"])
    plan = pol.resolve(NAMES, 12)
    hif8, bf16 = presets.get("hif8_w8a8"), presets.get("bf16")
    for i in (0, 1, 2, 10, 11):
        assert plan[f"decoder.layers.{i}.mlp.linear_fc1"] == bf16
    for i in range(3, 10):
        assert plan[f"decoder.layers.{i}.mlp.linear_fc1"] == hif8
        assert plan[f"decoder.layers.{i}.mlp.linear_fc2"] == hif8
        assert plan[f"decoder.layers.{i}.self_attention.linear_qkv"] == bf16
    assert plan["output_layer"] == presets.get("fp8")  # the user's rule wins over the preset's
    table = plan.table()
    assert "decoder.layers.5.mlp.linear_fc1" in table and "hif8+delayed(max,64)" in table


def test_policy_default_keeps_output_layer_bf16_and_helpers():
    pol = PrecisionPolicy.from_args("wgrad_hadamard").first_layers(1, "bf16").last_layers(1, "fp8")
    plan = pol.resolve(NAMES, 12)
    assert plan["output_layer"] == presets.get("bf16")
    assert plan["decoder.layers.0.mlp.linear_fc2"] == presets.get("bf16")
    assert plan["decoder.layers.11.mlp.linear_fc2"] == presets.get("fp8")
    assert plan["decoder.layers.5.mlp.linear_fc2"] == presets.get("wgrad_hadamard")
    assert plan.rule_for("decoder.layers.5.mlp.linear_fc2") == "--precision wgrad_hadamard"


def test_plan_serialises():
    plan = PrecisionPolicy.from_args("nvfp4", ["kind:attention=bf16", "layers:2-3=mxfp4"]).resolve(NAMES, 12)
    from precision import PrecisionPlan

    again = PrecisionPlan.from_dict(plan.to_dict())
    assert again == plan and dict(again) == dict(plan)


@pytest.mark.parametrize("rule,message", [
    ("first:x=bf16", "first:N needs a non-negative integer"),
    ("kind:mlpp=bf16", "unknown kind 'mlpp'"),
    ("layers:3=bf16", "layers:A-B needs two integers"),
    ("nobody", "expected SELECTOR=PRESET_OR_SPEC"),
    ("first:2=fp9", "unknown precision 'fp9'"),
])
def test_bad_rules(rule, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PrecisionPolicy.from_args("bf16", [rule])


# ---------------------------------------------------------------- partial specs
# Oracles: every expected recipe is built field by field from OperandFormat / GemmRecipe, never by
# the parser under test.
_E4M3, _E5M2 = OperandFormat("fp8_e4m3"), OperandFormat("fp8_e5m2")
_FP8 = LinearPrecision(GemmRecipe(_E4M3, _E4M3), GemmRecipe(_E5M2, _E4M3), GemmRecipe(_E5M2, _E4M3))
_MX = OperandFormat("mxfp4")


@pytest.mark.parametrize("spec,expected", [
    ("dgrad=fp8_e5m2@fp8_e4m3", LinearPrecision(dgrad=GemmRecipe(_E5M2, _E4M3))),
    ("wgrad=mxfp4/sr@mxfp4", LinearPrecision(wgrad=GemmRecipe(OperandFormat("mxfp4", rounding="stochastic"), _MX))),
    ("fprop=hif8+delayed(max,64)", LinearPrecision(fprop=GemmRecipe(
        *[OperandFormat("hif8", amax_algo="max", amax_history_len=64)] * 2))),
])
def test_partial_spec_as_precision_leaves_the_rest_bf16(spec, expected):
    assert parse_precision(spec) == expected
    assert PrecisionPolicy.from_args(spec).default == expected


def test_partial_rule_overrides_only_its_gemms_over_what_the_layer_would_get():
    pol = PrecisionPolicy.from_args("fp8", ["kind:mlp=wgrad=mxfp4+had16"])
    plan = pol.resolve(NAMES, 12)
    mlp = dataclasses.replace(_FP8, wgrad=GemmRecipe(_MX, _MX, "had16"))
    assert plan["decoder.layers.4.mlp.linear_fc1"] == mlp
    assert plan["decoder.layers.4.self_attention.linear_qkv"] == _FP8
    assert plan["output_layer"] == LinearPrecision()  # the preset's own output rule still applies
    assert "over --precision fp8" in plan.rule_for("decoder.layers.4.mlp.linear_fc1")
    # stacking: a partial rule over a full rule that comes after it, and over another partial rule
    plan = PrecisionPolicy.from_args("mxfp4", ["first:1=fprop=mxfp4/rceil", "kind:mlp=dgrad=bf16",
                                               "layers:0-0=fp8"]).resolve(NAMES, 12)
    fc1_0 = plan["decoder.layers.0.mlp.linear_fc1"]
    assert fc1_0 == dataclasses.replace(_FP8, fprop=GemmRecipe(*[OperandFormat("mxfp4", scale_rule="rceil")] * 2),
                                        dgrad=GemmRecipe())
    assert plan["decoder.layers.0.self_attention.linear_proj"].dgrad == _FP8.dgrad


def test_partial_rule_does_not_take_layers_from_later_rules_in_checks():
    pol = PrecisionPolicy.from_args("fp8", ["kind:mlp=wgrad=mxfp4", "kind:fc1=bf16"])
    pol.check_rules(12, NAMES)  # the second rule still decides fprop/dgrad of fc1: not shadowed
    pol = PrecisionPolicy.from_args("fp8", ["kind:mlp=bf16", "kind:fc1=wgrad=mxfp4"])
    with pytest.raises(SpecError, match="taken by an earlier rule"):
        pol.check_rules(12, NAMES)


def test_partial_spec_and_full_spec_existing_forms_unchanged():
    assert LinearPrecision.parse("base=fp8,wgrad=mxfp4+had16") == dataclasses.replace(
        _FP8, wgrad=GemmRecipe(_MX, _MX, "had16"))
    with pytest.raises(SpecError, match="empty spec"):
        LinearPrecision.parse(" , ")


def test_plan_summary_groups_layers_by_rule_exactly():
    plan = PrecisionPolicy.from_args("mxfp4", ["layers:0-1=bf16", "layers:3-3=bf16"]).resolve(NAMES, 12)
    lines = plan.summary().splitlines()
    assert lines[0] == "layer (count): precision  <- rule"
    both = "{self_attention.linear_qkv,self_attention.linear_proj,mlp.linear_fc1,mlp.linear_fc2}"
    assert lines[1] == (f"decoder.layers.[0-1].{both} (8): fprop=bf16,dgrad=bf16,wgrad=bf16  "
                        "<- --precision-rule layers:0-1=bf16")
    assert lines[2] == f"decoder.layers.[2,4-11].{both} (36): {presets.get('mxfp4')}  <- --precision mxfp4"
    assert lines[3].startswith(f"decoder.layers.[3].{both} (4): ")
    assert lines[4] == "output_layer (1): fprop=bf16,dgrad=bf16,wgrad=bf16  <- preset mxfp4: kind:output=bf16"
    assert sum(int(line.rsplit(" (", 1)[1].split(")")[0]) for line in lines[1:]) == len(NAMES)

"""Whole-plan files for ``--precision FILE``: round trip, precedence, and one-line errors."""

import pytest

from precision import PrecisionPolicy, SpecError, parse_precision, presets
from precision.policy import is_plan_file, load_plan_file, write_plan_file

NAMES = [f"decoder.layers.{i}.{k}" for i in range(3)
         for k in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
NAMES.append("output_layer")


def resolved(precision, rules=()):
    plan = PrecisionPolicy.from_args(precision, list(rules)).resolve(NAMES, 3)
    return {n: str(plan[n]) for n in NAMES}


def test_round_trip_resolves_to_the_written_plan(tmp_path):
    mx = "fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4+had16"
    path = tmp_path / "plan.yaml"
    write_plan_file(str(path), "fp8", rules=["layers:0-0=bf16", f"kind:mlp={mx}"],
                    linears={"decoder.layers.2.self_attention.linear_qkv": "mxfp4", "output_layer": "bf16"},
                    metadata={"cost_ratio": 0.61, "evidence": {"gap": [0.001, 0.004]}}, header="a comment\nline two")
    text = path.read_text()
    assert text.startswith("# a comment\n# line two\n")
    plan = resolved(str(path))
    fp8, bf16 = str(presets.get("fp8")), str(presets.get("bf16"))
    assert plan["decoder.layers.0.mlp.linear_fc1"] == bf16  # the first rule wins over kind:mlp
    assert plan["decoder.layers.1.mlp.linear_fc2"] == str(parse_precision(mx))
    assert plan["decoder.layers.1.self_attention.linear_qkv"] == fp8  # the default
    assert plan["decoder.layers.2.self_attention.linear_qkv"] == str(presets.get("mxfp4"))  # linears: first
    assert plan["output_layer"] == bf16
    pf = load_plan_file(str(path))
    assert dict(pf.metadata)["cost_ratio"] == 0.61 and pf.default == "fp8"
    # the same plan spelled with flags resolves identically (a plan file is those flags, written down)
    flags = resolved("fp8", ["decoder.layers.2.self_attention.linear_qkv=mxfp4", "layers:0-0=bf16", f"kind:mlp={mx}"])
    assert flags == plan


def test_user_rules_come_before_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    write_plan_file(str(path), "mxfp4", rules=["first:1=fp8"])
    plan = resolved(str(path), ["first:1=bf16"])
    assert plan["decoder.layers.0.mlp.linear_fc1"] == str(presets.get("bf16"))
    assert plan["decoder.layers.1.mlp.linear_fc1"] == str(presets.get("mxfp4"))
    assert plan["output_layer"] == str(presets.get("bf16"))  # the built-in output rule still applies


def test_json_plan_file_and_spec_file_still_work(tmp_path):
    js = tmp_path / "plan.json"
    js.write_text('{"default": "bf16", "rules": ["last:1=mxfp4"]}')
    assert resolved(str(js))["decoder.layers.2.mlp.linear_fc2"] == str(presets.get("mxfp4"))
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: fp8\nwgrad: mxfp4+had16\n")
    assert not is_plan_file(str(spec)) and is_plan_file(str(js))
    assert resolved(str(spec))["decoder.layers.0.mlp.linear_fc1"].endswith("wgrad=mxfp4+had16")


@pytest.mark.parametrize("body, message", [
    ("default: fp8\nrule: [first:1=bf16]\n", r"unknown key\(s\) rule; valid: default, linears, rules, metadata"),
    ("rules: [first:1=bf16]\n", r"default: missing or empty; give a preset or spec, e.g. default: fp8"),
    ("default: fp9\n", r"default: unknown precision 'fp9'"),
    ("default: fp8\nwgrad: mxfp4\n", r"mixes plan keys \(default\) with spec keys \(wgrad\)"),
    ("default: fp8\nrules: [first:1]\n", r"rules\[0\]: 'first:1': expected SELECTOR=PRESET_OR_SPEC"),
    ("default: fp8\nrules: [layers:3-1=bf16]\n", r"rules\[0\] 'layers:3-1=bf16': .*reversed range"),
    ("default: fp8\nrules: ['first:1=base=fp8,wgrad=mxfp9']\n",
     r"rules\[0\] 'first:1=base=fp8,wgrad=mxfp9': .*unknown format 'mxfp9'"),
    ("default: fp8\nrules: first:1=bf16\n", r"rules: expected a list of SELECTOR=VALUE strings"),
    ("default: fp8\nlinears: {output_layer: 3}\n", r"linears: output_layer: expected a preset name or spec"),
    ("default: fp8\nlinears: {'decoder.layers.*': bf16}\n", r"an exact layer name \(no glob or selector\)"),
    ("default: fp8\ndefault: bf16\n", r"default: given twice"),
    ("default: fp8\nmetadata: [1, 2]\n", r"metadata: expected a mapping"),
    ("default: [fp8\n", r"not valid YAML/JSON"),
])
def test_errors_name_the_flag_and_the_file(tmp_path, body, message):
    path = tmp_path / "plan.yaml"
    path.write_text(body)
    with pytest.raises(SpecError, match=message) as e:
        if is_plan_file(str(path)):
            load_plan_file(str(path))
        else:
            PrecisionPolicy.from_args(str(path))
    text = str(e.value)
    assert "\n" not in text
    if is_plan_file(str(path)) or "YAML" in message:
        assert text.startswith((f"--precision {path}: ", f"{path}: "))


def test_load_plan_file_of_a_broken_file_names_the_flag(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("default: [fp8\n")
    with pytest.raises(SpecError, match=rf"^--precision {path}: not valid YAML/JSON"):
        load_plan_file(str(path))


def test_rules_checked_against_the_model(tmp_path):
    path = tmp_path / "plan.yaml"
    write_plan_file(str(path), "fp8", rules=["layers:0-7=bf16"])
    policy = PrecisionPolicy.from_args(str(path))
    with pytest.raises(SpecError, match=rf"^--precision {path}: rules: layers:0-7=bf16: layer 7 is beyond the model"):
        policy.check_rules(3)
    write_plan_file(str(path), "fp8", linears={"decoder.layers.0.mlp.linear_fc9": "bf16"})
    with pytest.raises(SpecError, match=r"linears: decoder.layers.0.mlp.linear_fc9: matches no layer"):
        PrecisionPolicy.from_args(str(path)).check_rules(3, NAMES)
    write_plan_file(str(path), "fp8", rules=["last:1=bf16"])
    PrecisionPolicy.from_args(str(path)).check_rules(3, NAMES)  # a good file passes


def test_pretrain_accepts_a_plan_file(tmp_path):
    from pretrain.arguments import ConfigError, parse_args_or_raise, validate_args

    path = tmp_path / "plan.yaml"
    write_plan_file(str(path), "fp8", rules=["first:1=bf16"])
    args = parse_args_or_raise(["--model-size", "tiny", "--precision", str(path)])
    validate_args(args, 1, False)
    write_plan_file(str(path), "fp8", rules=["layers:0-9=bf16"])
    args = parse_args_or_raise(["--model-size", "tiny", "--precision", str(path)])
    with pytest.raises(ConfigError, match=rf"^--precision {path}: rules: layers:0-9=bf16: layer 9 is beyond"):
        validate_args(args, 1, False)

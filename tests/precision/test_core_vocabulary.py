"""The core's vocabulary: enums in a leaf module, rounding as a behaviour, format facts on ``Format``.

Oracles: Python's ``round`` (round half to even, the language's own rule) for nearest rounding;
the datasheet facts of ``precision.cost_model``'s docstring (which formats each target's tensor
cores take) for the rate classes; the module graph itself (``ast``) for the import structure.
"""

import ast
import pickle
from pathlib import Path

import pytest
import torch

from precision import FORMATS, OperandFormat, Rounding, presets
from precision.cost_model import TARGETS
from precision.enums import AmaxAlgo, ScaleRule, Scaling
from precision.recipe import Gemm, LinearPrecision, parse_gemm

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(modules imported at module level, modules imported inside functions) of one file."""
    tree = ast.parse(path.read_text())
    top, inner = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            (top.update if node in tree.body else inner.extend)(n for n in names if n)
    return top, inner


def test_enums_are_a_leaf_module():
    top, inner = _imports(ROOT / "precision" / "enums.py")
    assert {m.split(".")[0] for m in top} <= {"__future__", "enum", "torch"} and not inner


@pytest.mark.parametrize("module", ["blocks", "elements", "tensorwise", "formats", "quantize", "recipe",
                                    "presets", "cost_model"])
def test_no_import_inside_a_function_in_the_core(module):
    # the circles formats <-> blocks/elements/tensorwise, quantize -> recipe and recipe <-> presets
    # were broken by imports inside functions; the leaf module and the preset registry replace them
    _, inner = _imports(ROOT / "precision" / f"{module}.py")
    assert [m for m in inner if m.startswith(("precision", "kernels"))] == []


def test_quantizer_and_triton_quant_no_longer_import_each_other():
    top, _ = _imports(ROOT / "kernels" / "triton_quant.py")
    assert "kernels.quantizer" not in top  # TRITON_FORMATS is the registry's (Format.triton)


def test_the_vocabularies_are_the_registry_names():
    import precision.formats as pf

    assert pf.Rounding is Rounding and pf.ScaleRule is ScaleRule and pf.AmaxAlgo is AmaxAlgo and pf.Scaling is Scaling
    assert Rounding.values() == ("nearest", "stochastic", "ms_eden", "ms_eden128")
    assert Rounding.modifiers() == ("sr", "eden", "eden128")
    assert Rounding.from_modifier("sr") is Rounding.STOCHASTIC and Rounding.from_modifier("2d") is None


def test_rounding_members_carry_their_behaviour():
    assert not Rounding.NEAREST.stochastic and Rounding.NEAREST.nearest_even and Rounding.NEAREST.modifier is None
    assert Rounding.STOCHASTIC.stochastic and not Rounding.STOCHASTIC.nearest_even
    assert Rounding.STOCHASTIC.modifier == "sr" and Rounding.NEAREST.triton and Rounding.STOCHASTIC.triton


def test_nearest_step_rounding_is_python_round_half_even():
    steps = [0.0, 0.5, 1.5, 2.5, 3.49, 3.5, 4.5, 7.5, 1e6 + 0.5, 2.0**23 - 0.5]
    got = Rounding.NEAREST.round_steps(torch.tensor(steps, dtype=torch.float32))
    assert got.tolist() == [float(round(s)) for s in torch.tensor(steps, dtype=torch.float32).tolist()]


def test_stochastic_step_rounding_uses_u_and_is_unbiased():
    steps = torch.tensor([2.25, 2.25, 2.25, 5.0])
    assert Rounding.STOCHASTIC.round_steps(steps, torch.tensor([0.1, 0.3, 0.9, 0.999])).tolist() == [3, 2, 2, 5]
    g = torch.Generator().manual_seed(0)
    mean = Rounding.STOCHASTIC.round_steps(torch.full((200_000,), 1.3), generator=g).mean().item()
    assert abs(mean - 1.3) < 0.005  # 0.46 / sqrt(2e5) = 0.001 standard error


def test_rounding_enum_pickles_and_prints_as_its_string():
    r = pickle.loads(pickle.dumps(Rounding.STOCHASTIC))
    assert type(r) is str and r == "stochastic" and f"{Rounding.NEAREST}" == "nearest"
    assert Rounding.parse("stochastic", "x") is Rounding.STOCHASTIC
    with pytest.raises(ValueError, match=r"^rounding: unknown 'up'; valid: nearest, stochastic, ms_eden, ms_eden128$"):
        Rounding.parse("up", "rounding")


def test_spec_modifiers_come_from_the_rounding_members():
    op = parse_gemm("mxfp4/sr", Gemm.FPROP).a
    assert op.rounding is Rounding.STOCHASTIC and str(op) == "mxfp4/sr"
    assert LinearPrecision.parse("base=mxfp4_sr,fprop=bf16").wgrad.a.rounding is Rounding.STOCHASTIC


def test_the_preset_registry_serves_base():
    assert LinearPrecision.parse("base=fp8,wgrad=mxfp4").fprop == presets.get("fp8").fprop
    with pytest.raises(ValueError, match="unknown precision preset 'nope'; valid: bf16, "):
        LinearPrecision.parse("base=nope")


def test_operand_format_resolves_its_format_once_and_pickles_without_it():
    op = OperandFormat("mxfp4", rounding="stochastic")
    assert op.format is FORMATS["mxfp4"]
    blob = pickle.dumps(op)
    assert b"MXFormat" not in blob and b"ElementSpec" not in blob  # fields only: old checkpoints' form
    back = pickle.loads(blob)
    assert back == op and hash(back) == hash(op) and back.format is FORMATS["mxfp4"]


def test_triton_formats_are_a_registry_fact():
    from kernels.quantizer import TRITON_FORMATS

    assert TRITON_FORMATS == ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
                              "mxfp4", "nvfp4")
    assert not FORMATS["hif8"].triton and not FORMATS["bf16"].triton and FORMATS["nvfp4"].triton


def test_rate_classes_live_on_the_format_and_give_the_datasheet_native_tables():
    # the cost model's docstring table: B200 takes MXFP8/MXFP6/MXFP4/NVFP4, MI355X OCP MX only,
    # H200 FP8 only; HiF8 has tensor cores on none of them
    common = {"fp32": "fp32", "bf16": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
    mx = {"mxfp8_e4m3": "fp8", "mxfp8_e5m2": "fp8", "mxfp6_e2m3": "fp6", "mxfp6_e3m2": "fp6", "mxfp4": "fp4"}
    assert TARGETS["b200"].native == {**common, **mx, "nvfp4": "fp4"}
    assert TARGETS["mi355x"].native == {**common, **mx}
    assert TARGETS["h200"].native == common
    assert FORMATS["hif8"].rate_class is None and FORMATS["nvfp4"].rate_class == "fp4"


# ------------------------------------------------------------------ one quantize signature
def test_one_quantize_signature_below_the_public_entry_points():
    import inspect

    from kernels.fused import fake_quantize
    from precision.formats import Format

    bag = {"rounding", "scale_rule", "prescale", "generator", "block2d"}
    for fn in (Format.quantize, fake_quantize):
        params = inspect.signature(fn).parameters
        assert not bag & set(params), fn.__qualname__
        assert {"axis", "amax", "sr"} <= set(params) and all(
            params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("axis", "amax", "sr"))


def test_the_adapter_maps_the_older_keywords_onto_an_operand_format():
    from precision.quantize import operand_format

    assert operand_format("mxfp4", "stochastic", "rceil", 0.75) == OperandFormat("mxfp4", "stochastic", "rceil", True)
    assert operand_format("nvfp4", block2d=True).block2d and operand_format("fp8_e4m3") == OperandFormat("fp8_e4m3")
    op = OperandFormat("mxfp4", rounding="stochastic")
    assert operand_format(op) is op
    with pytest.raises(ValueError, match=r"^mxfp4: prescale 0.5: valid 1.0 \(none\) or 0.75"):
        operand_format("mxfp4", "stochastic", prescale=0.5)
    with pytest.raises(ValueError, match="carries its own rounding, scale rule, prescale and 2-D setting; "
                                         "do not also pass scale_rule"):
        operand_format(op, scale_rule="rceil")


def test_old_and_new_call_forms_give_the_same_bits():
    from precision import SRKey, quantize

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    op = OperandFormat("mxfp4", rounding="stochastic", scale_rule="rceil", prescale=True)
    new = quantize(x, op, axis=0, sr=SRKey(5))
    old = quantize(x, "mxfp4", axis=0, rounding="stochastic", scale_rule="rceil", prescale=0.75, sr=SRKey(5))
    fmt = FORMATS["mxfp4"].quantize(x, op, axis=0, sr=SRKey(5))
    assert torch.equal(new.codes, old.codes) and torch.equal(new.scales, fmt.scales) and torch.equal(new.codes, fmt.codes)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(quantize(x, op, sr=g1).codes, quantize(x, "mxfp4", rounding="stochastic", scale_rule="rceil",
                                                                  prescale=0.75, generator=g2).codes)
    with pytest.raises(ValueError, match="mxfp4.quantize: the operand format is nvfp4"):
        FORMATS["mxfp4"].quantize(x, OperandFormat("nvfp4"))


def test_2d_tiles_with_sr_are_a_recipe_refusal_not_a_quantizer_one():
    from precision import GemmRecipe, SpecError, quantize

    sr_2d = OperandFormat("nvfp4", rounding="stochastic", block2d=True)  # TE's quantizer tiles with SR too
    assert quantize(torch.randn(32, 32), sr_2d, sr=torch.Generator().manual_seed(0)).block2d
    with pytest.raises(SpecError, match=r"^nvfp4/2d: 2-D weight tiles round to nearest .*; drop sr$"):
        GemmRecipe(OperandFormat("nvfp4"), sr_2d)


@pytest.mark.parametrize("module", ["operand", "cast_transpose", "quantizer", "fused"])
def test_kernels_import_their_neighbours_at_the_top(module):
    # only the optional Triton modules (import triton at their top) are imported where they are used
    _, inner = _imports(ROOT / "kernels" / f"{module}.py")
    assert [m for m in inner if m.startswith(("precision", "kernels")) and m != "kernels.triton_quant"] == []

"""The format registry (``precision.formats``): typed vocabularies that read as plain strings,
valid-value lists taken from the registry, and the README's format table."""

import pickle
import re
from pathlib import Path

import pytest
import torch

from precision import FORMATS, AmaxAlgo, Gemm, OperandFormat, Rounding, ScaleRule, SpecError, quantize
from precision.formats import format_table
from precision.recipe import parse_gemm
from precision.tensorwise import AmaxHistory

README = Path(__file__).resolve().parents[2] / "docs" / "precision.md"  # the format table moved there from README.md


def test_enums_read_write_and_pickle_as_plain_strings():
    r = Rounding.STOCHASTIC
    assert str(r) == "stochastic" and f"{r}" == "stochastic" and r == "stochastic"
    assert hash(r) == hash("stochastic") and {"stochastic": 1}[r] == 1
    loaded = pickle.loads(pickle.dumps({"algo": AmaxAlgo.MAX}))
    assert type(loaded["algo"]) is str and loaded["algo"] == "max"  # checkpoints hold plain strings
    assert ScaleRule("rceil") is ScaleRule.RCEIL and repr(ScaleRule.RCEIL) == "'rceil'"


def test_operand_format_takes_strings_and_stores_typed_values():
    op = OperandFormat("mxfp4", rounding="stochastic", scale_rule="rceil")
    assert op.rounding is Rounding.STOCHASTIC and op.scale_rule is ScaleRule.RCEIL
    assert op == OperandFormat("mxfp4", Rounding.STOCHASTIC, ScaleRule.RCEIL)
    assert hash(op) == hash(OperandFormat("mxfp4", Rounding.STOCHASTIC, ScaleRule.RCEIL))
    assert str(op) == "mxfp4/sr/rceil" and parse_gemm("mxfp4/sr/rceil", Gemm.FPROP).a == op


def test_old_string_state_still_loads():
    h = AmaxHistory("max", 4)
    h.load_state_dict({"algo": "max", "history_len": 4, "ema_decay": 0.9, "history": [1.0, 3.0], "ema": 2.0})
    assert h.amax() == 3.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(fmt="mxfp5"), "unknown format 'mxfp5'; valid: " + ", ".join(FORMATS)),
    (dict(fmt="mxfp4", rounding="up"), "mxfp4: unknown rounding 'up'; valid: " + ", ".join(Rounding.values())),
    (dict(fmt="mxfp4", scale_rule="ceil"), "unknown scale rule 'ceil'; valid: " + ", ".join(ScaleRule.values())),
    (dict(fmt="bf16", rounding="stochastic"),
     "valid with: " + ", ".join(n for n, f in FORMATS.items() if f.supports_sr)),
    (dict(fmt="nvfp4", scale_rule="rceil"),
     "MX formats only (" + ", ".join(n for n, f in FORMATS.items() if f.has_scale_rules) + ")"),
    (dict(fmt="mxfp6_e2m3", amax_algo="max", amax_history_len=4),
     "per-tensor formats only (" + ", ".join(n for n, f in FORMATS.items() if f.delayed) + ")"),
])
def test_errors_list_the_registrys_valid_values(kwargs, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        OperandFormat(**kwargs)


def test_reference_quantize_errors_name_format_and_valid_values():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=re.escape("hif8: stochastic rounding is not supported; valid: nearest")):
        quantize(x, "hif8", rounding="stochastic")
    with pytest.raises(ValueError, match=re.escape("unknown format 'fp7'; valid: " + ", ".join(FORMATS))):
        quantize(x, "fp7")
    with pytest.raises(ValueError, match="fp8_e4m3: scale rule rceil does not apply"):
        quantize(x, "fp8_e4m3", scale_rule="rceil")


def test_quantize_takes_an_operand_format_whole():
    x = torch.randn(8, 64)
    op = OperandFormat("mxfp4", rounding="stochastic", scale_rule="rceil", prescale=True)
    gen = torch.Generator().manual_seed(3)
    a = quantize(x, op, generator=gen)
    b = quantize(x, "mxfp4", rounding="stochastic", scale_rule="rceil", prescale=0.75,
                 generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and a.prescale == 0.75
    with pytest.raises(ValueError, match="carries its own rounding"):
        quantize(x, op, rounding="nearest")


def test_readme_format_table_is_the_registry():
    text = README.read_text()
    assert format_table() in text
    for value in (*ScaleRule.values(), *AmaxAlgo.values()[1:]):
        assert f"`{value}`" in text, value

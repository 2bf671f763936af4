"""Each preset's docstring table says what each GEMM consumes: checked against what the preset resolves to.

A preset's docstring (``precision.presets``) carries a table, one row per GEMM::

    | GEMM  | consumes                                   | rotation              |
    | dgrad | dy nvfp4 (1-D 16, SR), w nvfp4 (2-D 16x16) | none                  |

The test reads every row and compares it with ``presets.get(name)``: the GEMMs in order, each
operand's name and format, its annotations (``SR``: stochastic rounding; ``1-D N``: N-element blocks
along the contraction axis; ``2-D NxN``: 2-D weight tiles; ``delayed(ALGO,N)``: delayed per-tensor
scaling with that amax algorithm and window), and the rotation with the axis it runs along. An
operand setting that differs from the plain format's and that the row does not mention fails too.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from precision import presets
from precision.formats import get_format
from precision.recipe import Gemm, OperandFormat

AXIS = {Gemm.FPROP: "in-features", Gemm.DGRAD: "out-features", Gemm.WGRAD: "tokens"}
ROW = re.compile(r"^\s*\|\s*(fprop|dgrad|wgrad)\s*\|(.*)\|(.*)\|\s*$")
OPERAND = re.compile(r"^(x|w|dy) ([a-z0-9_]+)(?:\+(delayed\([a-z_]+,\d+\)))?(?: (delayed\([a-z_]+,\d+\)))?"
                     r"(?: \(([^)]*)\))?$")


def _split_operands(text: str) -> list[str]:
    """``x hif8 delayed(max,64), w mxfp4 (SR)`` -> the two operands (commas inside parentheses kept)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()]


def _table(name: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in presets.describe(name).splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def _problems(name: str, gemm: Gemm, consumes: str, rotation: str) -> list[str]:
    recipe = getattr(presets.get(name), gemm.value)
    out = []
    ops = _split_operands(consumes)
    if [o.split(" ", 1)[0] for o in ops] != list(gemm.operands):
        return [f"{gemm.value}: operands {consumes!r}, expected {' and '.join(gemm.operands)}"]
    for text, op in zip(ops, (recipe.a, recipe.b)):
        m = OPERAND.match(text)
        if m is None:
            out.append(f"{gemm.value}: cannot read {text!r}")
            continue
        operand, fmt, delayed = m.group(1), m.group(2), m.group(3) or m.group(4)
        notes = [n.strip() for n in (m.group(5) or "").split(",") if n.strip()]
        if fmt != op.fmt:
            out.append(f"{gemm.value}: {operand} is {op.fmt}, the table says {fmt}")
        plain = OperandFormat(op.fmt)
        checked = set()
        if delayed is not None:
            algo, window = delayed[len("delayed("):-1].split(",")
            if (op.amax_algo, op.amax_history_len) != (algo, int(window)):
                out.append(f"{gemm.value}: {operand} has amax {op.amax_algo} over {op.amax_history_len}, "
                           f"the table says {delayed}")
            checked |= {"amax_algo", "amax_history_len"}
        for note in notes:
            if note == "SR":
                if not op.rounding.stochastic:
                    out.append(f"{gemm.value}: {operand} rounds {op.rounding}, the table says SR")
                checked.add("rounding")
            elif m2 := re.fullmatch(r"2-D (\d+)x(\d+)", note):
                if not op.block2d or int(m2.group(1)) != get_format(op.fmt).block:
                    out.append(f"{gemm.value}: {operand} is not in 2-D {m2.group(1)}x{m2.group(2)} tiles")
                checked.add("block2d")
            elif m3 := re.fullmatch(r"4over6(?:\((\w+)\))?", note):  # the FP4 error controls
                if op.four_over_six != (m3.group(1) or "mse"):
                    out.append(f"{gemm.value}: {operand} has 4over6 {op.four_over_six}, the table says {note}")
                checked.add("four_over_six")
            elif note in ("eden", "eden128"):
                if op.rounding.modifier != note:
                    out.append(f"{gemm.value}: {operand} rounds {op.rounding}, the table says {note}")
                checked.add("rounding")
            elif note == "quest":
                if op.scale_rule != "quest":
                    out.append(f"{gemm.value}: {operand} has scale rule {op.scale_rule}, the table says quest")
                checked.add("scale_rule")
            elif m1 := re.fullmatch(r"1-D (\d+)", note):
                if op.block2d or get_format(op.fmt).block != int(m1.group(1)):
                    out.append(f"{gemm.value}: {operand} is not in 1-D blocks of {m1.group(1)}")
            else:
                out.append(f"{gemm.value}: {operand}: unknown annotation {note!r}")
        for f in dataclasses.fields(OperandFormat):  # what the row leaves unsaid is the format's default
            if f.name not in checked | {"fmt"} and getattr(op, f.name) != getattr(plain, f.name):
                out.append(f"{gemm.value}: {operand} has {f.name}={getattr(op, f.name)}, not in the table")
    want = "none" if recipe.rotation == "none" else f"{recipe.rotation} along {AXIS[gemm]}"
    if rotation != want:
        out.append(f"{gemm.value}: rotation {recipe.rotation!r} is {want!r}, the table says {rotation!r}")
    return out


@pytest.mark.parametrize("name", presets.names())
def test_the_docstring_table_says_what_each_gemm_consumes(name):
    rows = _table(name)
    assert list(rows) == ["fprop", "dgrad", "wgrad"], f"preset {name}: no complete GEMM table in its docstring"
    problems = [p for gemm in Gemm for p in _problems(name, gemm, *rows[gemm.value])]
    assert problems == [], f"preset {name}: " + "; ".join(problems)


def test_the_check_catches_a_wrong_row():
    """The reader is not vacuous: a row naming the wrong format, a missing SR or a wrong rotation fails."""
    assert _problems("wgrad_hadamard", Gemm.WGRAD, "dy mxfp4, x mxfp4", "had16 along tokens") == []
    assert _problems("wgrad_hadamard", Gemm.WGRAD, "dy mxfp4, x mxfp4", "none") != []
    assert _problems("wgrad_hadamard", Gemm.WGRAD, "dy fp8_e5m2, x mxfp4", "had16 along tokens") != []
    assert _problems("mxfp4_sr", Gemm.WGRAD, "dy mxfp4, x mxfp4 (SR)", "none") != []  # dy's SR unsaid
    assert _problems("mxfp4_sr", Gemm.WGRAD, "dy mxfp4 (SR), x mxfp4 (SR)", "none") == []
    assert _problems("hif8_w8a8", Gemm.FPROP, "x hif8, w hif8 delayed(max,64)", "none") != []


def test_the_docs_preset_table_lists_every_preset():
    """docs/precision.md's preset table has one row per registered preset, in the registry's order."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "precision.md").read_text()
    table = text.split("| preset | fprop | dgrad | wgrad |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.MULTILINE)
    assert rows == presets.names()

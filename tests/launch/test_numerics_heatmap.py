"""The numerics heatmaps' colour scale is set by the quantized operands: a BF16 output layer's
55-66 dB SQNR beside MXFP4's 17-19 dB must not wash the quantized layers out. The plan comes from the
run's own ``precision_plan`` TensorBoard text, written by ``precision.policy``'s real plan table."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from launch import report
from precision.policy import PrecisionPolicy
from pretrain.evaluation.numerics_report import (
    COLUMNS,
    colour_limits,
    load_numerics,
    load_unquantized,
    unquantized_from_plan,
)

LAYERS = [f"decoder.layers.{i}.mlp.linear_fc1" for i in range(3)] + ["output_layer"]


def plan_table(precision: str) -> str:
    return PrecisionPolicy.from_args(precision).resolve(LAYERS, 3).table()


def write_run(tb, plan: str | None, sqnr) -> None:
    w = SummaryWriter(str(tb))
    if plan is not None:
        w.add_text("precision_plan", "```\n" + plan + "\n```", 0)
    for layer in LAYERS:
        for col in COLUMNS:
            w.add_scalar(f"numerics/{layer}/{col}/sqnr_db", sqnr(layer, col), 10)
    w.close()


def mxfp4_sqnr(layer: str, col: str) -> float:
    if layer == "output_layer":  # the preset keeps it in BF16: 16-bit rounding, ~60 dB
        return 60.0 + COLUMNS.index(col)
    return 17.0 + int(layer.split(".")[2])  # 17, 18, 19 dB


def test_plan_text_names_the_unquantized_operands():
    wide = unquantized_from_plan(plan_table("mxfp4"))
    assert wide == {("output_layer", c) for c in COLUMNS}  # the mxfp4 preset's BF16 output layer
    mixed = PrecisionPolicy.from_args("mxfp4", ["first:1=fprop=fp8_e4m3@bf16,dgrad=bf16,wgrad=mxfp4"])
    got = unquantized_from_plan(mixed.resolve(LAYERS, 3).table())
    first = "decoder.layers.0.mlp.linear_fc1"
    assert {(first, "fprop/w"), (first, "dgrad/dy"), (first, "dgrad/w")} <= got  # b of fprop; all of dgrad
    assert (first, "fprop/x") not in got and (first, "wgrad/dy") not in got


def test_colour_scale_set_by_quantized_layers(tmp_path):
    tb = tmp_path / "run" / "tensorboard"
    write_run(tb, plan_table("mxfp4"), mxfp4_sqnr)
    table, step = load_numerics(tmp_path / "run", None)
    wide = load_unquantized(tmp_path / "run", step)
    assert wide == {("output_layer", c) for c in COLUMNS}
    assert colour_limits(table, "sqnr_db", wide) == (17.0, 19.0)  # not (17, 65): the BF16 layer is off the scale
    # the image: the three quantized layers get three distinct colours spanning the colour map
    from matplotlib import colormaps

    lo, hi = colour_limits(table, "sqnr_db", wide)
    cmap = colormaps["magma_r"]
    shades = [np.array(cmap((v - lo) / (hi - lo))) for v in (17.0, 18.0, 19.0)]
    assert np.abs(shades[0] - shades[2]).max() > 0.5
    assert report.main([str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report" / "numerics_sqnr_db.png").stat().st_size > 5000


def test_colour_scale_without_a_plan_leaves_16_bit_roundings_out(tmp_path):
    write_run(tmp_path / "run", None, mxfp4_sqnr)
    table, step = load_numerics(tmp_path / "run", None)
    assert load_unquantized(tmp_path / "run", step) is None
    assert colour_limits(table, "sqnr_db", None) == (17.0, 19.0)


def test_all_bf16_run_keeps_its_own_scale(tmp_path):
    write_run(tmp_path / "run", plan_table("bf16"), lambda layer, col: 55.0 + COLUMNS.index(col))
    table, step = load_numerics(tmp_path / "run", None)
    assert colour_limits(table, "sqnr_db", load_unquantized(tmp_path / "run", step)) == pytest.approx((55.0, 60.0))
    assert report.main([str(tmp_path / "run")]) == 0

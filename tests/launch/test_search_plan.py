"""The plan search: the greedy core on toy problems with a known optimum, the launcher's flags and
plan files, and (slow) one end-to-end run on the tiny model."""

import itertools
import json
import math
import sys
from pathlib import Path

import pytest

from precision import SpecError, presets
from precision.recipe import Gemm
from pretrain.evaluation.stats import Interval
from pretrain.plan_search import (
    Ladder,
    Unit,
    apply_levels,
    cheapest_levels,
    fits,
    greedy_search,
    make_units,
    unit_sensitivity,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BUDGET = 0.01


def toy(penalty, saving, noise=0.0):
    """Additive toy: a plan's gap is the sum of its units' penalties (interval +- noise); its cost is 1
    minus the summed savings. Returns (units, n_levels, cost, evaluate, calls)."""
    units = list(penalty)
    n_levels = {u: len(penalty[u]) for u in units}
    calls = []

    def cost(levels):
        return 1.0 - sum(saving[u][levels.get(u, 0)] for u in units)

    def evaluate(levels):
        calls.append(dict(levels))
        m = sum(penalty[u][levels.get(u, 0)] for u in units)
        return Interval(m, m - noise, m + noise, 2, noise)

    return units, n_levels, cost, evaluate, calls


def brute_force(penalty, saving, noise=0.0):
    units = list(penalty)
    best = None
    for combo in itertools.product(*(range(len(penalty[u])) for u in units)):
        levels = dict(zip(units, combo))
        if sum(penalty[u][lv] for u, lv in levels.items()) + noise <= BUDGET:
            c = 1.0 - sum(saving[u][lv] for u, lv in levels.items())
            if best is None or c < best[0] - 1e-15:
                best = (c, levels)
    return best


# two sensitive units (a: its cheapest rung alone breaks the budget; b: fits alone, not with a's
# middle rung) and four nearly free ones; rungs: 0 baseline, 1 middle, 2 cheapest
PENALTY = {"a": [0, 0.003, 0.02], "b": [0, 0.002, 0.009], **{f"c{i}": [0, 0.00005, 0.0001] for i in range(4)}}
SAVING = {"a": [0, 0.05, 0.10], "b": [0, 0.05, 0.12], **{f"c{i}": [0, 0.02, 0.04] for i in range(4)}}
PRIORITY = ["a", "b", "c0", "c1", "c2", "c3"]  # most sensitive first


def test_greedy_finds_the_known_optimum():
    units, n, cost, evaluate, _calls = toy(PENALTY, SAVING)
    r = greedy_search(units, n, cost, evaluate, BUDGET, PRIORITY)
    best_cost, best_levels = brute_force(PENALTY, SAVING)
    assert r.levels == best_levels == {"a": 0, "b": 2, "c0": 2, "c1": 2, "c2": 2, "c3": 2}
    assert r.cost == pytest.approx(best_cost)
    # probes: all-cheapest (over), raise a (fits), lower a to 1 (over): three plans evaluated
    assert [p.fits for p in r.probes] == [False, True, False]
    assert r.probes[1].why == "raise a to rung 0 (baseline)"


def test_noise_makes_the_search_stricter():
    noise = 0.004  # the upper bound, not the mean, must be within budget
    units, n, cost, evaluate, _ = toy(PENALTY, SAVING, noise)
    r = greedy_search(units, n, cost, evaluate, BUDGET, PRIORITY)
    best_cost, best_levels = brute_force(PENALTY, SAVING, noise)
    assert r.levels == best_levels and r.cost == pytest.approx(best_cost)
    # with the noise b's cheapest rung no longer fits beside anything; both sensitive units end mid-ladder
    assert r.levels["a"] == 1 and r.levels["b"] == 1
    assert [p.why for p in r.probes][-1] == "lower a to rung 2"  # the last move tried, and refused


def test_cheapest_plan_that_fits_is_taken_at_once():
    units, n, cost, evaluate, calls = toy(PENALTY, SAVING)
    r = greedy_search(units, n, cost, evaluate, 1.0, PRIORITY)
    assert len(calls) == 1 and all(v == 2 for v in r.levels.values())


def test_zero_budget_returns_the_baseline_without_probing_it():
    units, n, cost, evaluate, calls = toy(PENALTY, SAVING)
    r = greedy_search(units, n, cost, evaluate, 0.0, PRIORITY)
    assert all(v == 0 for v in r.levels.values()) and r.cost == pytest.approx(1.0)
    assert {} not in [{k: v for k, v in c.items() if v} for c in calls]  # the baseline's gap is 0 by definition


def test_max_probes_bounds_the_search_and_keeps_a_fitting_plan():
    units, n, cost, evaluate, calls = toy(PENALTY, SAVING)
    r = greedy_search(units, n, cost, evaluate, BUDGET, PRIORITY, max_probes=1)
    assert len(calls) == 1 and "max-probes" in r.reason
    assert all(v == 0 for v in r.levels.values())  # nothing probed fits: the baseline


def test_a_rung_the_cost_model_says_is_dearer_is_never_tried():
    # memory-bound unit: its lowest rung costs more than its baseline (quantization passes)
    penalty = {"m": [0, 0.0, 0.0], "k": [0, 0.0, 0.0]}
    saving = {"m": [0, 0.03, -0.05], "k": [0, 0.01, 0.02]}
    units, n, cost, evaluate, calls = toy(penalty, saving)
    assert cheapest_levels(units, n, cost) == {"m": 1, "k": 2}
    r = greedy_search(units, n, cost, evaluate, BUDGET, ["m", "k"])
    assert r.levels == {"m": 1, "k": 2} and all(c.get("m") != 2 for c in calls)


def test_fits_needs_a_finite_upper_bound():
    assert fits(Interval(0.001, -0.001, 0.003, 2, 0.001), 0.01)
    assert not fits(Interval(0.001, math.nan, math.nan, 1, math.nan), 0.01)
    assert not fits(Interval(0.0, -0.02, 0.02, 2, 0.01), 0.01)


# ---------------------------------------------------------------- units, ladders, telemetry
NAMES = [f"decoder.layers.{i}.{k}" for i in range(2)
         for k in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
NAMES.append("output_layer")


def test_units_and_ladder_apply_to_one_gemm_of_one_layer():
    units = make_units(NAMES, "layer-gemm")
    assert [u.key for u in units][:3] == ["layer0/fprop", "layer0/dgrad", "layer0/wgrad"] and len(units) == 6
    assert len(make_units(NAMES, "gemm")) == 3 and len(make_units(NAMES, "linear-gemm")) == 24
    base = {n: presets.get("bf16") for n in NAMES}
    ladder = Ladder.parse("fprop=bf16>fp8>mxfp4;dgrad=bf16>mxfp4;wgrad=bf16>fp8>mxfp4+had16").from_baseline(
        {g: presets.get("bf16").recipe(g) for g in Gemm})
    plan = apply_levels(base, units, ladder, {"layer1/wgrad": 2, "layer0/fprop": 1})
    assert str(plan["decoder.layers.1.mlp.linear_fc1"]) == "fprop=bf16,dgrad=bf16,wgrad=mxfp4+had16"
    assert plan["decoder.layers.0.self_attention.linear_qkv"].fprop.spec() == "fp8_e4m3"
    assert plan["decoder.layers.0.self_attention.linear_qkv"].wgrad.spec() == "bf16"
    assert plan["output_layer"] == presets.get("bf16")
    fp8_base = {g: presets.get("fp8").recipe(g) for g in Gemm}
    assert Ladder.parse("wgrad=bf16>fp8>mxfp4+had16").from_baseline(fp8_base).rungs[Gemm.WGRAD] == (
        "fp8", "mxfp4+had16")


@pytest.mark.parametrize("text, message", [
    ("fprop=bf16>mxfp9", r"--ladder 'fprop=bf16>mxfp9': fprop: unknown format 'mxfp9'"),
    ("xgrad=bf16", r"unknown GEMM 'xgrad'; valid: fprop, dgrad, wgrad"),
    ("fprop=bf16;fprop=fp8", r"--ladder: fprop given twice"),
    ("fprop bf16", r"expected GEMM=RECIPE>RECIPE"),
    ("fprop=fp8>fp8", r"a recipe is listed twice"),
])
def test_ladder_errors(text, message):
    with pytest.raises(SpecError, match=message):
        Ladder.parse(text)


def test_ladder_must_contain_the_baseline():
    with pytest.raises(SpecError, match=r"--ladder: fprop: the baseline's recipe bf16 is not a rung of fp8>mxfp4"):
        Ladder.parse("fprop=fp8>mxfp4").from_baseline({g: presets.get("bf16").recipe(g) for g in Gemm})


def test_sensitivity_from_telemetry_tags():
    units = [Unit("layer0", Gemm.WGRAD, ("decoder.layers.0.mlp.linear_fc1",))]
    tag = "numerics/decoder.layers.0.mlp.linear_fc1/wgrad/{}/{}"
    scalars = {tag.format("dy", "sqnr_db"): [(10, 10.0), (20, 20.0)], tag.format("x", "sqnr_db"): [(10, 20.0)],
               tag.format("dy", "clipped"): [(10, 0.01)], tag.format("x", "clipped"): [(10, 0.0)],
               tag.format("dy", "flushed"): [(10, 0.1)], tag.format("x", "flushed"): [(10, 0.2)]}
    s = unit_sensitivity(scalars, units)["layer0/wgrad"]
    assert s["nsr"] == pytest.approx((0.1 + 0.01) / 2 + 0.01)  # mean over steps, summed over operands
    assert s["clipped"] == pytest.approx(0.01) and s["flushed"] == pytest.approx(0.3)
    assert unit_sensitivity({}, units)["layer0/wgrad"]["linears_seen"] == 0


# ---------------------------------------------------------------- the launcher
def _ctx(tmp_path, *flags, extra=("--model-size", "tiny", "--num-layers", "2", "--train-iters", "20")):
    from launch.search_plan import Context, build_parser

    args = build_parser().parse_args(["--out", str(tmp_path / "out"), "--probe-iters", "5", "--numerics-interval", "1",
                                      *flags])
    return Context(args, list(extra))


@pytest.mark.parametrize("flags, extra, message", [
    (["--budget", "abc"], None, r"--budget 'abc': expected a relative loss budget such as 1% or 0.01"),
    (["--budget", "150%"], None, r"--budget '150%': must be in \[0%, 100%\)"),
    (["--seeds", "0,0"], None, r"--seeds '0,0': expected distinct integers"),
    ([], ["--model-size", "tiny", "--train-iters", "20", "--seed", "3"], r"--seed after '--': set by the search"),
    ([], ["--model-size", "tiny", "--train-iters", "4"], r"--probe-iters 5: must be in 1..--train-iters \(4\)"),
    (["--baseline", "fp9"], None, r"--baseline: unknown precision 'fp9'"),
    (["--ladder", "fprop=fp8>mxfp4"], None, r"the baseline's recipe bf16 is not a rung"),
    (["--baseline", "hif8_w8a8"], ["--model-size", "tiny", "--num-layers", "8", "--train-iters", "20"],
     r"--baseline hif8_w8a8: its fprop differs between layers"),
])
def test_launcher_flag_errors(tmp_path, flags, extra, message):
    from launch.search_plan import SearchError

    with pytest.raises((SearchError, SpecError), match=message):
        if extra is None:
            _ctx(tmp_path, *flags)
        else:
            _ctx(tmp_path, *flags, extra=tuple(extra))


def test_written_plan_file_round_trips(tmp_path):
    from precision import PrecisionPolicy

    ctx = _ctx(tmp_path, "--baseline", "fp8")
    levels = {"layer0/wgrad": 1, "layer1/fprop": 1, "layer1/dgrad": 1, "layer1/wgrad": 1}
    plan = ctx.plan(levels)
    path = tmp_path / "plan.yaml"
    ctx.write_plan(path, plan, {"cost_ratio": ctx.cost(levels)})
    back = PrecisionPolicy.from_args(str(path)).resolve(ctx.names, ctx.num_layers)
    assert {n: str(back[n]) for n in ctx.names} == {n: str(p) for n, p in plan.items()}
    assert "layers:1-1=fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4+had16" in path.read_text()
    assert 0 < ctx.cost(levels) and math.isfinite(ctx.cost(levels))


@pytest.mark.slow
def test_search_plan_end_to_end(tmp_path):
    """One tiny search (1 layer, 3-iteration probes, 1 seed): calibration, a probe, a confirmation,
    and a plan file that pretrain's --precision takes (measured ~7 min on 2 heavily loaded cores)."""
    from launch.search_plan import main

    out = tmp_path / "search"
    argv = ["--out", str(out), "--baseline", "bf16", "--budget", "50%", "--seeds", "0", "--probe-iters", "3",
            "--numerics-interval", "1", "--max-probes", "1", "--fused-quantization", "--",
            "--model-size", "tiny", "--num-layers", "1", "--train-iters", "4", "--eval-iters", "2",
            "--log-interval", "1", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr-warmup-iters", "1"]
    assert main(argv) == 0
    summary = json.loads((out / "search.json").read_text())
    probes = json.loads((out / "probes.json").read_text())
    assert len(probes) == 1 and probes[0]["fits"]  # a 50% budget: the all-cheapest plan fits
    assert summary["cost_ratio"] < 1.0 and summary["confirmation"]["fits"]
    report = (out / "report.md").read_text()
    assert "layer0/wgrad" in report and "measured at 4 iterations" in report
    from precision import PrecisionPolicy

    plan = PrecisionPolicy.from_args(str(out / "plan.yaml")).resolve(["decoder.layers.0.mlp.linear_fc1"], 1)
    assert plan["decoder.layers.0.mlp.linear_fc1"].wgrad.spec() == "mxfp4+had16"
    assert main(argv) == 0  # resumable: a second run skips every finished run

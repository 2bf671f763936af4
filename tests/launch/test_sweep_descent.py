"""The descent comparison of noise-free sweeps (descent_steps): extra steps to reach the baseline's loss
during the descent, excess loss, Holm-adjusted verdicts and the published figures beside them."""

import math
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from pretrain.evaluation.extra_tokens import descent_gap, interpolate

from .test_sweep_report import assert_refused_in_one_line

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep


def curve(rate: float, steps: int = 60, floor: float = 0.0):
    """An exponential descent L(s) = floor + 8 exp(-s / rate): slowing the rate by a factor f makes the
    run reach L(s) at exactly f*s, i.e. 100 (f - 1) % extra steps at every s (the analytic oracle)."""
    return list(range(1, steps + 1)), [floor + 8.0 * math.exp(-s / rate) for s in range(1, steps + 1)]


def test_a_time_dilated_descent_costs_its_dilation_in_extra_steps():
    base, slow = curve(20.0), curve(22.0)
    d = descent_gap(slow, base, 8, 40)
    assert d.steps == 33 and not d.extra.censored
    assert d.extra.pct == pytest.approx(10.0, abs=0.05)  # linear interpolation between integer steps
    excess = sum(slow[1][s - 1] - base[1][s - 1] for s in range(8, 41)) / 33
    assert d.excess_loss == pytest.approx(excess, rel=1e-12)
    faster = descent_gap(curve(18.0), base, 8, 40)
    assert faster.extra.pct == pytest.approx(-10.0, abs=0.05) and faster.excess_loss < 0
    assert descent_gap(base, base, 8, 40).extra.pct == 0.0


def test_a_target_never_reached_makes_a_lower_bound():
    d = descent_gap(curve(20.0, floor=1.0), curve(20.0), 8, 40)  # stuck 1.0 above: late targets unreachable
    assert d.extra.censored and d.extra.pct > 0


def test_interpolation_and_an_empty_window():
    assert interpolate([1, 3], [4.0, 2.0], 2) == 3.0 and math.isnan(interpolate([1, 3], [4.0, 2.0], 5))
    assert math.isnan(descent_gap(curve(20.0, 5), curve(20.0), 8, 40).extra.pct)


def sweep_in(tmp_path: Path, text: str):
    """A sweep file of ``text`` under ``tmp_path``: its spec, its runs and an output folder."""
    f = tmp_path / "s.yaml"
    f.write_text(text)
    spec = sweep.load_sweep(str(f))
    return spec, sweep.expand_runs(spec, str(f)), tmp_path / "out"


def write_run(out: Path, run, losses):
    d = out / "runs" / run.name
    w = SummaryWriter(str(d / "tensorboard"))
    for i, v in enumerate(losses, 1):
        w.add_scalar("lm loss", v, i)
    w.add_scalar("lm loss validation", losses[-1], len(losses))
    w.close()
    sweep.write_status(d, state="done")


def test_sweep_prints_the_descent_table_with_holm_verdicts_and_published_figures(tmp_path):
    spec, runs, out = sweep_in(tmp_path, "seeds: [0, 1, 2]\nbaseline: fp8\ndescent_steps: [8, 40]\n"
                               "published: {source: 'the study', extra_tokens: {mxfp4: '+26%', wgrad_hadamard: '+8%'}}\n"
                               "contrasts: [[mxfp4, wgrad_hadamard]]\n"
                               "grid:\n  presets: [fp8, mxfp4, wgrad_hadamard]\n")
    rates = {"fp8": (20.0, 20.0, 20.0), "mxfp4": (22.0, 22.2, 21.8), "wgrad_hadamard": (20.1, 19.9, 20.0)}
    for r in runs:
        write_run(out, r, curve(rates[r.label][r.seed])[1])
    rows = sweep.collect(out, runs, "fp8", window=1, descent=spec["descent_steps"], published=spec["published"],
                         contrasts=spec["contrasts"])
    by = {r["run"]: r for r in rows}
    assert by["mxfp4__seed-1"]["descent_extra_pct"] == pytest.approx(11.0, abs=0.05)
    md = (out / "results.md").read_text()
    assert "## During the descent: steps 8-40" in md
    row = next(line for line in md.splitlines() if line.startswith("| mxfp4 | 3 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # per seed +10/+11/+9 %: averaged on log(1 + x) (geometric mean +10.0), t(0.975, 2) interval
    # back-transformed: about [+7.5, +12.5] (asymmetric)
    assert cells[3] == "worse" and cells[4].startswith(("+10.0", "+9.9")) and "[+7.5" in cells[4]
    assert cells[5] == "worse" and cells[6] == "+26%"
    had = next(line for line in md.splitlines() if line.startswith("| wgrad_hadamard | 3 |"))
    assert "not shown to differ" in had and had.rstrip().endswith("+8% |")
    assert "verdict (Holm over 3)" in md and "published: the study" in md
    # the contrast: +10/+11/+9 % over fp8 against -0.5/+0.5/0 % of the Hadamard's over fp8
    contrast = next(line for line in md.splitlines() if line.startswith("| mxfp4 vs wgrad_hadamard |"))
    assert "worse" in contrast and contrast.rstrip().endswith("|  |")
    csv = (out / "descent.csv").read_text().splitlines()
    assert csv[0].startswith("point,precision,seeds,first_step,last_step") and len(csv) == 5
    assert "descent_extra_pct" in (out / "results.csv").read_text().splitlines()[0]


def test_contrasts_compare_at_the_end_without_a_descent_window(tmp_path):
    """A sampled-batch sweep (no descent_steps) gets its contrasts as 'a vs b' rows of the end-of-run
    table: final validation gaps paired by seed, inside the same Holm adjustment as the baseline rows."""
    spec, runs, out = sweep_in(tmp_path, "seeds: [0, 1, 2]\nbaseline: fp8\ncontrasts: [[had16, mxfp4]]\n"
                                         "grid:\n  presets: [fp8, mxfp4, {had16: wgrad_hadamard}]\n")
    final = {"fp8": (3.00, 3.01, 2.99), "mxfp4": (3.10, 3.12, 3.09), "had16": (3.05, 3.06, 3.045)}
    for r in runs:
        write_run(out, r, [8.0 - 0.05 * i for i in range(60)] + [final[r.label][r.seed]])
    sweep.collect(out, runs, "fp8", window=1, contrasts=spec["contrasts"])
    md = (out / "results.md").read_text()
    assert "3 grid points x 3 seed(s)" in md and "then each contrast 'a vs b' (a against b)" in md
    assert "verdict (Holm over 3)" in md
    row = next(line for line in md.splitlines() if line.startswith("| had16 vs mxfp4 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # -0.05 / -0.06 / -0.045: mean -0.0517, the Hadamard better than plain MXFP4 after Holm over 3
    assert cells[4].startswith("-0.0517") and cells[-1] == "better"
    csv = (out / "summary.csv").read_text().splitlines()
    assert len(csv) == 5 and csv[4].startswith("had16 vs mxfp4,had16 vs mxfp4,3,")


def test_seed_field_gives_each_seed_its_own_starting_checkpoint(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("seeds: [3, 7]\nbase: {pretrained-checkpoint: 'start/s{seed}/checkpoints', lr: 1.0e-3}\n"
                 "grid:\n  presets: [fp8, mxfp4]\n")
    runs = sweep.expand_runs(sweep.load_sweep(str(f)), str(f))
    for r in runs:
        flags = r.flags
        assert flags[flags.index("--pretrained-checkpoint") + 1] == f"start/s{r.seed}/checkpoints"
        assert flags[flags.index("--seed") + 1] == str(r.seed) and "{seed}" not in " ".join(flags)
    f.write_text("base: {pretrained-checkpoint: 'start/s{seed}'}\ngrid:\n  presets: [fp8]\n")
    with pytest.raises(sweep.SweepError, match=r"uses \{seed\}, which needs seeds"):
        sweep.expand_runs(sweep.load_sweep(str(f)), str(f))


@pytest.mark.parametrize("text,message", [
    ("descent_steps: [40, 8]\ngrid:\n  presets: [fp8]\n", "descent_steps must be [first, last] training steps"),
    ("descent_steps: 8\ngrid:\n  presets: [fp8]\n", "descent_steps must be [first, last] training steps"),
    ("published: {source: s, extra_tokens: {mxfp5: '+1%'}}\ngrid:\n  presets: [fp8]\n",
     "published.extra_tokens: mxfp5 not among the runs' labels: fp8"),
    ("published: {extra_tokens: {fp8: '+1%'}}\ngrid:\n  presets: [fp8]\n", "published must map source (text)"),
    ("descent_steps: [8, 40]\ncontrasts: [[fp8, bf16]]\ngrid:\n  presets: [fp8, mxfp4]\n",
     "contrasts: bf16 not among the runs' labels: fp8, mxfp4"),
    ("descent_steps: [8, 40]\ncontrasts: [[fp8, fp8]]\ngrid:\n  presets: [fp8]\n",
     "contrasts must be a list of [label, against] pairs of two different labels"),
    ("smooth: 0\ngrid:\n  presets: [fp8]\n", "smooth must be a positive number of logged training losses"),
])
def test_bad_descent_and_published_keys_fail_with_one_line(tmp_path, text, message):
    assert_refused_in_one_line(tmp_path, text, message)


def test_the_noise_free_sweep_files_expand():
    for name, baseline, n in (("mxfp4_fullbatch_cpu", "wgrad_exact", 36), ("mxfp4_ladder_fullbatch_cpu", "fp8", 21),
                              ("mxfp4_dgrad_fullbatch_cpu", "dgrad_exact", 18),
                              ("mxfp4_fprop_fullbatch_cpu", "fprop_exact", 18),
                              ("mxfp4_continuation_cpu", "wgrad_exact", 48),
                              ("mxfp4_ladder_continuation_cpu", "fp8", 28),
                              ("mxfp4_continuation_sgd_cpu", "wgrad_exact", 20),
                              ("mxfp4_fprop_continuation_cpu", "fprop_exact", 24),
                              ("mxfp4_dgrad_continuation_cpu", "dgrad_exact", 24)):
        path = str(ROOT / "configs" / "sweeps" / f"{name}.yaml")
        s = sweep.load_sweep(path)
        runs = sweep.expand_runs(s, path)
        assert len(runs) == n and s["baseline"] == baseline and s["descent_steps"]
        flags = runs[0].flags
        assert flags[flags.index("--fixed-train-set") + 1] == flags[flags.index("--global-batch-size") + 1]
    # the continuation's runs start from their own seed's stage-1 checkpoint, a run of the stage-1 sweep
    path = str(ROOT / "configs" / "sweeps" / "mxfp4_continuation_start_cpu.yaml")
    starts = {r.seed: r.name for r in sweep.expand_runs(sweep.load_sweep(path), path)}
    path = str(ROOT / "configs" / "sweeps" / "mxfp4_continuation_cpu.yaml")
    for r in sweep.expand_runs(sweep.load_sweep(path), path):
        ckpt = r.flags[r.flags.index("--pretrained-checkpoint") + 1]
        assert ckpt == f"runs/mxfp4_continuation_start_cpu/runs/{starts[r.seed]}/checkpoints"


def test_the_study_sweep_files_are_valid_pretrain_runs():
    """Every run of the noise-free and long-horizon sweep files passes pretrain.py's own validation."""
    from pretrain.arguments import parse_args, validate_args

    for name in ("mxfp4_fullbatch_cpu", "mxfp4_ladder_fullbatch_cpu", "mxfp4_longhorizon_cpu",
                 "mxfp4_dgrad_fullbatch_cpu", "mxfp4_fprop_fullbatch_cpu"):
        path = str(ROOT / "configs" / "sweeps" / f"{name}.yaml")
        for r in sweep.expand_runs(sweep.load_sweep(path), path):
            validate_args(parse_args([*r.flags, "--precision", r.precision]), world_size=1, cuda=False)


@pytest.mark.parametrize("name,gemm", [("mxfp4_fullbatch_cpu", "wgrad"), ("mxfp4_dgrad_fullbatch_cpu", "dgrad"),
                                       ("mxfp4_fprop_fullbatch_cpu", "fprop"), ("mxfp4_continuation_cpu", "wgrad"),
                                       ("mxfp4_fprop_continuation_cpu", "fprop"),
                                       ("mxfp4_dgrad_continuation_cpu", "dgrad")])
def test_the_gemm_isolated_sweep_files_change_only_their_gemm(name, gemm):
    """In each GEMM-isolated study every treatment's plan equals the baseline's in the other two GEMMs
    (MXFP4) and differs from it in its own GEMM; the treatments are the study's six roundings."""
    from precision.recipe import Gemm, LinearPrecision

    path = str(ROOT / "configs" / "sweeps" / f"{name}.yaml")
    s = sweep.load_sweep(path)
    plans = {r.label: LinearPrecision.parse(r.precision) for r in sweep.expand_runs(s, path)}
    base = plans[s["baseline"]]
    assert {label.split("_", 1)[1] for label in plans} == {"exact", "fp8", "mxfp4", "had16", "rht16", "sr"}
    mxfp4 = LinearPrecision.parse("base=mxfp4")
    for label, plan in plans.items():
        for g in Gemm:
            if g.value == gemm:
                assert (getattr(plan, g.value) == getattr(base, g.value)) == (label == s["baseline"]), label
            else:
                assert getattr(plan, g.value) == getattr(base, g.value) == getattr(mxfp4, g.value), (label, g)

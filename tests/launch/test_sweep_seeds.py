"""Seed-aware sweeps: paired intervals (against hand-computed numbers), the not-shown-to-differ verdict,
hyper-parameter grids compared at each precision's best value, diverged runs, and a real two-seed
smoke sweep."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from pretrain.evaluation import stats

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import report
import sweep


# ---------------------------------------------------------------- interval arithmetic
def test_paired_interval_matches_a_hand_computed_example():
    # diffs 0.01, 0.03, 0.02: mean 0.02, sd 0.01; t(0.975, df=2) = 4.302653 (printed tables: 4.303)
    # half-width = 4.302653 * 0.01 / sqrt(3) = 0.0248414
    iv = stats.paired_interval([0.01, 0.03, 0.02])
    assert iv.mean == pytest.approx(0.02)
    assert iv.sd == pytest.approx(0.01)
    assert iv.half_width == pytest.approx(0.0248414, abs=1e-6)
    assert (iv.lo, iv.hi) == pytest.approx((0.02 - 0.0248414, 0.02 + 0.0248414), abs=1e-6)
    assert iv.within_noise is True
    assert stats.t_quantile(0.95, 2) == pytest.approx(4.302653, abs=1e-6)
    assert stats.t_quantile(0.95, 1) == pytest.approx(12.706205, abs=1e-6)


def test_interval_edge_cases():
    one = stats.paired_interval([0.5])
    assert one.n == 1 and math.isnan(one.lo) and one.within_noise is None
    assert one.text() == "+0.5000 (1 seed)"
    assert stats.paired_interval([]).n == 0
    assert stats.paired_interval([0.1, float("inf"), 0.3]).n == 2  # non-finite values are left out
    clear = stats.paired_interval([0.050, 0.052, 0.048])
    assert clear.within_noise is False and clear.lo > 0
    assert clear.text() == f"+0.0500 ± {clear.half_width:.4f}"


def test_paired_batch_se_hand_computed():
    # per-batch differences 0.1, 0.3, 0.2, 0.2: mean 0.2, sd sqrt(0.02/3), se = sd / 2
    a, b = [1.1, 1.3, 1.2, 1.2], [1.0, 1.0, 1.0, 1.0]
    assert stats.paired_batch_se(a, b) == pytest.approx(math.sqrt(0.02 / 3) / 2)
    assert math.isnan(stats.paired_batch_se([1.0], [1.0]))


# ---------------------------------------------------------------- synthetic sweeps
def _write_run(out: Path, run: sweep.Run, final: float, n: int = 40, val_batches=None):
    d = out / "runs" / run.name
    tb = d / "tensorboard"
    w = SummaryWriter(str(tb))
    for i in range(1, n + 1):  # a curve falling to `final` at step n
        w.add_scalar("lm loss", final + 0.02 * (n - i), i)
    w.add_scalar("lm loss validation", final, n)
    w.add_scalar("lm loss validation sem", 0.01, n)
    w.close()
    if val_batches is not None:
        (tb / "val_batches.jsonl").write_text(json.dumps({"iteration": n, "batch_losses": val_batches}) + "\n")
    sweep.write_status(d, state="done")


def _sweep_file(tmp_path, text) -> list[sweep.Run]:
    f = tmp_path / "s.yaml"
    f.write_text(text)
    return sweep.expand_runs(sweep.load_sweep(str(f)), str(f))


def test_seeds_pair_runs_and_mark_gaps_not_shown_to_differ(tmp_path):
    runs = _sweep_file(tmp_path, "seeds: [0, 1, 2]\nbaseline: fp8\ngrid:\n  presets: [fp8, mxfp4, wgrad_hadamard]\n")
    assert [r.name for r in runs[:3]] == ["fp8__seed-0", "fp8__seed-1", "fp8__seed-2"]
    assert runs[1].flags[-2:] == ["--seed", "1"]
    out = tmp_path / "out"
    base = {0: 3.90, 1: 3.95, 2: 3.85}  # seed-to-seed spread far larger than the paired gaps
    worse = {0: +0.050, 1: +0.052, 2: +0.048}  # consistently worse: real
    noise = {0: +0.010, 1: -0.020, 2: +0.015}  # sign flips: not shown to differ
    for r in runs:
        gap = {"fp8": {0: 0, 1: 0, 2: 0}, "mxfp4": worse, "wgrad_hadamard": noise}[r.label][r.seed]
        batches = [base[r.seed] + gap + 0.1 * (i - 1.5) for i in range(4)]
        _write_run(out, r, base[r.seed] + gap, val_batches=batches)
    rows = sweep.collect(out, runs, "fp8", window=1)
    by = {r["run"]: r for r in rows}
    assert by["mxfp4__seed-1"]["gap_val_loss"] == pytest.approx(0.052, abs=1e-5)
    summary = {s["precision"]: s for s in sweep.summarize(rows, "fp8")}
    assert summary["fp8"]["verdict"] == "baseline"
    assert summary["mxfp4"]["verdict"] == "worse"
    assert summary["mxfp4"]["gap_val"].mean == pytest.approx(0.050, abs=1e-5)
    assert summary["mxfp4"]["gap_val"].half_width == pytest.approx(
        stats.t_quantile(0.95, 2) * 0.002 / math.sqrt(3), abs=1e-5)
    assert summary["wgrad_hadamard"]["verdict"] == "not shown to differ"
    assert summary["mxfp4"]["val_loss_sd"] == pytest.approx(0.052, abs=1e-4)  # unpaired spread: large
    assert summary["mxfp4"]["gap_val_batch_se"] == pytest.approx(0.0, abs=1e-6)  # same offset every batch
    md = (out / "results.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| mxfp4 |"))
    assert "+0.0500 ± 0.0050" in row and "worse" in row
    assert "not shown to differ" in next(line for line in md.splitlines() if line.startswith("| wgrad_hadamard |"))
    assert len((out / "summary.csv").read_text().strip().splitlines()) == 4
    # the report CLI prints the same table for a sweep directory
    (out / "sweep.json").write_text(json.dumps({"sweep": {"baseline": "fp8"}, "extra": [],
                                                "runs": [r.__dict__ for r in runs]}))
    assert report.main([str(out)]) == 0


def test_hyper_parameter_grid_compares_each_precision_at_its_best(tmp_path):
    runs = _sweep_file(tmp_path, "seeds: [0, 1]\nbaseline: fp8\n"
                                 "grid:\n  presets: [fp8, mxfp4]\n  lr: [0.001, 0.002]\n")
    assert [r.name for r in runs[:4]] == ["fp8__lr-0.001__seed-0", "fp8__lr-0.001__seed-1",
                                          "fp8__lr-0.002__seed-0", "fp8__lr-0.002__seed-1"]
    assert runs[0].flags == ["--lr", "0.001", "--seed", "0"]
    out = tmp_path / "out"
    # fp8 is best at lr 0.002, mxfp4 at lr 0.001 (it needs the lower rate)
    loss = {("fp8", 0.001): 4.00, ("fp8", 0.002): 3.90, ("mxfp4", 0.001): 3.93, ("mxfp4", 0.002): 4.10}
    for r in runs:
        _write_run(out, r, loss[(r.label, r.point["lr"])] + 0.001 * r.seed)
    rows = sweep.collect(out, runs, "fp8", window=1)
    best = sweep.best_points(sweep.summarize(rows, "fp8"))
    assert best["fp8"]["lr"] == 0.002 and best["mxfp4"]["lr"] == 0.001
    md = (out / "results.md").read_text()
    tuned = md.split("own best lr")[1]
    row = next(line for line in tuned.splitlines() if line.startswith("| mxfp4 |"))
    assert "| 0.001 |" in row and "+0.0300" in row  # 3.93 at its best vs fp8's 3.90 at its best


def test_grid_precisions_may_be_named_specs(tmp_path):
    runs = _sweep_file(tmp_path, "baseline: mxfp4\ngrid:\n  presets: [mxfp4, {fprop_only: 'base=bf16,fprop=mxfp4'}]\n")
    assert [(r.name, r.precision) for r in runs] == [("mxfp4", "mxfp4"), ("fprop_only", "base=bf16,fprop=mxfp4")]
    with pytest.raises(sweep.SweepError, match="grid.presets: bad: fprop: unknown format 'mxfp5'"):
        _sweep_file(tmp_path, "grid:\n  presets: [{bad: 'base=bf16,fprop=mxfp5'}]\n")


def test_diverged_runs_are_a_result_and_not_rerun(tmp_path):
    runs = _sweep_file(tmp_path, "baseline: fp8\ngrid:\n  presets: [fp8, mxfp4_sr]\n")
    out = tmp_path / "out"
    _write_run(out, runs[0], 3.9)
    ckpt = out / "runs" / "mxfp4_sr" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / sweep.RUN_STATUS_FILE).write_text(json.dumps({"state": "diverged", "iteration": 7}))
    assert sweep.finish_run(out, runs[1], 1, 3.0) == "diverged"
    assert sweep.read_status(out, runs[1]) == "diverged"
    assert sweep._todo(out, runs, retry_diverged=False)[0] == []
    assert sweep._todo(out, runs, retry_diverged=True)[0] == [runs[1]]
    rows = sweep.collect(out, runs, "fp8", window=1)
    assert {r["run"]: r["status"] for r in rows}["mxfp4_sr"] == "diverged"
    assert "diverged in 1 of 1 seeds" in (out / "results.md").read_text()


# ---------------------------------------------------------------- a real sweep
def test_two_seed_smoke_sweep(tmp_path):
    f = tmp_path / "smoke.yaml"
    f.write_text("base:\n  model-size: tiny\n  num-layers: 1\n  train-iters: 3\n  lr-warmup-iters: 1\n"
                 "  eval-interval: 3\n  eval-iters: 2\n  log-interval: 1\n  micro-batch-size: 2\n"
                 "  global-batch-size: 2\nseeds: [0, 1]\nbaseline: bf16\ngrid:\n  presets: [bf16, fp8]\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "launch/sweep.py"), str(f), "--out", str(out)],
                       check=False, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "\r" not in r.stdout  # stdout is a pipe: whole lines, never carriage returns
    assert "runs: 4 done, 0 running" in r.stdout
    rows = {row[0]: row for row in (line.split(",") for line in (out / "results.csv").read_text().splitlines())}
    first = {}
    for name in ("bf16__seed-0", "bf16__seed-1", "fp8__seed-0", "fp8__seed-1"):
        scalars = sweep.read_scalars(out / "runs" / name / "tensorboard")
        first[name] = scalars["lm loss"][0][1]
        assert len(sweep.read_val_batches(out / "runs" / name / "tensorboard")[3]) == 2
        assert rows[name][1] == "done"
    assert first["bf16__seed-0"] != first["bf16__seed-1"]  # a seed changes initialization and data
    md = (out / "results.md").read_text()
    assert "2 grid points x 2 seed(s)" in md
    fp8_row = next(line for line in md.splitlines() if line.startswith("| fp8 |"))
    assert " ± " in fp8_row  # two seeds: every gap has an interval

"""Sweep file validation, results analysis and the numerics report, on synthetic TensorBoard logs."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import report
import sweep


def write_curve(tb: Path, losses, tps=1000.0, val=None):
    w = SummaryWriter(str(tb))
    for i, v in enumerate(losses, 1):
        w.add_scalar("lm loss", v, i)
        w.add_scalar("tokens-per-sec", tps, i)
    if val is not None:
        w.add_scalar("lm loss validation", val, len(losses))
    w.close()


def test_study_sweep_file_reproduces_the_ladder():
    s = sweep.load_sweep(str(ROOT / "configs/sweeps/mxfp4_study.yaml"))
    runs = sweep.expand_runs(s)
    labels = list(dict.fromkeys(r.label for r in runs))
    assert labels == ["fp32", "bf16", "fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4", "mxfp4_sr", "mxfp4_rht",
                      "wgrad_hadamard"]
    assert [r.name for r in runs[:3]] == ["fp32__seed-0", "fp32__seed-1", "fp32__seed-2"]
    assert s["baseline"] == "fp8"


def test_matrix_grid_expands_every_combination(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("grid:\n  fprop: [fp8, mxfp4]\n  wgrad: [mxfp4+had16, mxfp4+rht16, bf16]\n")
    runs = sweep.expand_runs(sweep.load_sweep(str(f)), str(f))
    assert len(runs) == 6
    assert runs[0].precision == "fprop=fp8,dgrad=fp8,wgrad=mxfp4+had16"


@pytest.mark.parametrize("text,message", [
    ("grid:\n  presets: [fp8, mxfp5]\n", "grid.presets: unknown precision preset 'mxfp5'"),
    ("grid:\n  wgrad: [mxfp4+had17]\n", "grid.wgrad: wgrad: unknown modifier 'had17'"),
    ("grid:\n  presets: [fp8]\nbaseline: bf16\n", "baseline 'bf16' is not one of the runs"),
    ("grid:\n  presets: [fp8]\nbase_flags: {}\n", "unknown key(s) base_flags"),
    ("grid:\n  xgrad: [fp8]\n", "grid key(s) xgrad; valid: presets, schedules, treatments, fprop, dgrad, wgrad"),
    ("seeds: [0, 0]\ngrid:\n  presets: [fp8]\n", "seeds must be a list of distinct integers"),
    ("grid:\n  presets: [fp8]\n  seed: [1, 2]\n", "grid.seed: set by the sweep itself; list seeds under 'seeds:'"),
    ("grid:\n  presets: [fp8]\n  lr: 0.1\n", "grid.lr: expected a non-empty list"),
    ("grid:\n  lr: [0.1]\n", "the grid names no precision"),
])
def test_bad_sweep_files_fail_with_one_line(tmp_path, text, message):
    assert_refused_in_one_line(tmp_path, text, message)


def assert_refused_in_one_line(tmp_path, text: str, message: str) -> None:
    """launch/sweep.py on a sweep file of ``text``: exit 2 and one stderr line containing ``message``."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    r = subprocess.run([sys.executable, str(ROOT / "launch/sweep.py"), str(f), "--out", str(tmp_path / "o")],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_collect_tables_plots_and_extra_tokens(tmp_path):
    out = tmp_path / "sweep"
    base = [4.0 - 0.01 * i for i in range(100)]  # reaches 3.01 at step 100
    slow = [4.0 - 0.008 * i for i in range(125)]  # reaches 3.01 ~25% later
    bad = [4.0 - 0.01 * i for i in range(50)] + [float("nan")] * 10
    runs = [sweep.Run("fp8", "fp8"), sweep.Run("mxfp4", "mxfp4"), sweep.Run("mxfp4_sr", "mxfp4_sr")]
    for r, curve in zip(runs, (base, slow, bad)):
        d = out / "runs" / r.name
        write_curve(d / "tensorboard", curve, val=curve[-1])
        sweep.write_status(d, state="done")
    rows = sweep.collect(out, runs, "fp8", window=1)
    by = {r["run"]: r for r in rows}
    assert by["fp8"]["extra_tokens_pct"] == 0.0
    assert by["mxfp4"]["extra_tokens_pct"] == pytest.approx(25.0, abs=1.5)
    # a diverged run has no extra tokens; it is reported as diverged, not as a number
    assert by["mxfp4_sr"]["diverged"] and math.isnan(by["mxfp4_sr"]["extra_tokens_pct"])
    assert by["mxfp4"]["gap_train_loss"] == pytest.approx(slow[-1] - base[-1], abs=1e-5)
    md = (out / "results.md").read_text()
    assert "| mxfp4 | done | mxfp4 |" in md
    assert "diverged in 1 of 1 seeds" in next(line for line in md.splitlines() if line.startswith("| mxfp4_sr |"))
    assert len((out / "results.csv").read_text().strip().splitlines()) == 4
    for png in ("loss_curves.png", "loss_gap_curves.png", "gap.png"):
        assert (out / png).stat().st_size > 5000


def test_report_heatmaps_and_worst_layers(tmp_path):
    tb = tmp_path / "run" / "tensorboard"
    w = SummaryWriter(str(tb))
    for layer in range(3):
        for col in report.COLUMNS:
            name = f"decoder.layers.{layer}.mlp.linear_fc1"
            sq = 20.0 - (10.0 if (layer == 1 and col == "wgrad/dy") else 0.0)
            w.add_scalar(f"numerics/{name}/{col}/sqnr_db", sq, 10)
            w.add_scalar(f"numerics/{name}/{col}/clipped", 0.01 * layer, 10)
            w.add_scalar(f"numerics/{name}/{col}/flushed", 0.0, 10)
    w.close()
    assert report.main([str(tmp_path / "run")]) == 0
    md = (tmp_path / "run" / "report" / "numerics.md").read_text()
    first_row = md.split("## sqnr_db")[1].splitlines()[4]
    assert "decoder.layers.1.mlp.linear_fc1 | wgrad/dy | 10" in first_row
    assert (tmp_path / "run" / "report" / "numerics_sqnr_db.png").stat().st_size > 5000


def test_report_refuses_runs_without_telemetry(tmp_path, capsys):
    write_curve(tmp_path / "tb", [1.0, 0.9])
    assert report.main([str(tmp_path)]) == 2
    assert "--numerics-interval" in capsys.readouterr().err

"""RL sweeps (``script: rl``) and precision schedules in sweeps: expansion into launch/rl.py /
--precision-schedule commands, one-line errors, and the RL results table against hand-computed
numbers."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep

from pretrain.rl.sweep_results import summarize_rl

RL_SWEEP = """script: rl
baseline: bf16
seeds: [0, 1]
base:
  task: configs/rl/arith.yaml
  precision: wgrad_hadamard
grid:
  treatments:
    - bf16: {rollout-precision: bf16}
    - fp4_tis: {rollout-precision: mxfp4, rollout-correction: tis}
"""


def _sweep_file(tmp_path, text) -> list[sweep.Run]:
    f = tmp_path / "s.yaml"
    f.write_text(text)
    return sweep.expand_runs(sweep.load_sweep(str(f)), str(f))


def test_rl_treatments_expand_into_rl_commands(tmp_path):
    runs = _sweep_file(tmp_path, RL_SWEEP)
    assert [r.name for r in runs] == ["bf16__seed-0", "bf16__seed-1", "fp4_tis__seed-0", "fp4_tis__seed-1"]
    cmd = sweep.run_command(tmp_path / "o", runs[2], 1, ["--rl-iters", "3"])
    assert cmd[cmd.index("--nproc-per-node") + 2].endswith("launch/rl.py")
    tail = cmd[cmd.index("--nproc-per-node") + 3:]
    # base flags, then the treatment's, then the seed; the sweep adds no --precision of its own
    assert tail[:8] == ["--task", "configs/rl/arith.yaml", "--precision", "wgrad_hadamard",
                        "--rollout-precision", "mxfp4", "--rollout-correction", "tis"]
    assert tail.count("--precision") == 1 and tail[-2:] == ["--rl-iters", "3"]
    assert "--seed" in tail and tail[tail.index("--seed") + 1] == "0"


def test_schedules_expand_into_precision_schedule_runs(tmp_path):
    runs = _sweep_file(tmp_path, "baseline: bf16\ngrid:\n  presets: [bf16]\n"
                                 "  schedules: [{fp8_warm: '0:fp8,5:mxfp4'}]\n")
    assert [(r.label, r.precision_flag, r.precision) for r in runs] == [
        ("bf16", "--precision", "bf16"), ("fp8_warm", "--precision-schedule", "0:fp8,5:mxfp4")]
    cmd = sweep.run_command(tmp_path / "o", runs[1], 1, [])
    assert cmd[cmd.index("--precision-schedule") + 1] == "0:fp8,5:mxfp4" and "--precision" not in cmd


@pytest.mark.parametrize("text,message", [
    (RL_SWEEP.replace("rollout-correction: tis", "rollout-corection: tis"),
     "grid.treatments: fp4_tis: rollout-corection: not a flag of the script"),
    (RL_SWEEP.replace("rollout-correction: tis", "save: x"), "grid.treatments: fp4_tis: save: set by the sweep"),
    (RL_SWEEP.replace("script: rl", "script: sft"), "script 'sft': valid: pretrain, rl"),
    (RL_SWEEP.replace("fp4_tis:", "bf16:"), "the grid has duplicate labels: bf16"),
    ("grid:\n  schedules: [{bad: '0:fp8,0:mxfp4'}]\n", "grid.schedules: bad: "),
])
def test_bad_rl_and_schedule_sweeps_fail_with_one_line(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert sweep.main([str(f), "--out", str(tmp_path / "o"), "--collect"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_bad_rl_sweep_prints_one_line_only(tmp_path):
    """As a user runs it: megatron-core's import notices (rl.py's parser imports it) stay off stderr."""
    f = tmp_path / "bad.yaml"
    f.write_text(RL_SWEEP.replace("rollout-correction: tis", "rollout-corection: tis"))
    r = subprocess.run([sys.executable, str(ROOT / "launch/sweep.py"), str(f), "--out", str(tmp_path / "o"),
                        "--collect"], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {f}: grid.treatments: fp4_tis: rollout-corection: not a flag of the script (see its --help)"]


def _write_rl_run(out: Path, run: sweep.Run, rewards: list[float], accuracies: list[float], k3: float):
    d = out / "runs" / run.name
    w = SummaryWriter(str(d / "tensorboard"))
    for i, r in enumerate(rewards, 1):
        w.add_scalar("rl/reward_mean", r, i)
        w.add_scalar("mismatch/k3_kl", k3, i)
        w.add_scalar("mismatch/ess_raw", 1.0 - 100 * k3, i)  # the raw ESS the table shows
        w.add_scalar("correction/ess", 1.0, i)  # no correction: 1 by construction, not tabled
        w.add_scalar("rollout/tokens_per_sec", 100.0, i)
        w.add_scalar("rollout/peak_memory_bytes", 2.0 * 2**20, i)
    for j, a in enumerate(accuracies):
        w.add_scalar("rl/heldout_accuracy", a, (j + 1) * len(rewards) // len(accuracies))
    w.close()
    sweep.write_status(d, state="done")


def test_rl_results_against_hand_computed_numbers(tmp_path):
    out = tmp_path / "sweep"
    runs = [sweep.Run(f"{label}__seed-{s}", "", [], label, {}, s, "", "rl")
            for label in ("bf16", "fp4") for s in (0, 1, 2)]
    base_acc, fp4_acc = [0.50, 0.60, 0.55], [0.40, 0.52, 0.44]
    for r in runs:
        s = r.seed
        if r.label == "bf16":
            _write_rl_run(out, r, [0.2, 0.4, 0.6], [0.3, base_acc[s]], 1e-6)
        else:
            _write_rl_run(out, r, [0.2, 0.3, 0.4], [0.3, fp4_acc[s]], 2e-3)
    rows = sweep.collect(out, runs, "bf16")
    assert rows[0]["reward_auc"] == pytest.approx(0.4) and rows[3]["reward_auc"] == pytest.approx(0.3)
    assert rows[0]["final_accuracy"] == pytest.approx(0.50) and rows[0]["accuracy_auc"] == pytest.approx(0.40)
    summary = {s["label"]: s for s in summarize_rl(rows, "bf16")}
    gap = summary["fp4"]["gap_final_accuracy"]
    # diffs -0.10, -0.08, -0.11: mean -0.096667, sd 0.015275, half-width t(0.975,2) * sd / sqrt(3) = 0.037946
    assert gap.mean == pytest.approx(-0.0966667, abs=1e-6)
    assert gap.sd == pytest.approx(0.0152753, abs=1e-6)
    assert gap.half_width == pytest.approx(0.037946, abs=1e-5)
    assert summary["fp4"]["verdict"] == "worse" and summary["bf16"]["verdict"] == "baseline"
    assert summary["fp4"]["gap_reward_auc"].mean == pytest.approx(-0.1)
    assert summary["fp4"]["k3_kl"] == pytest.approx(2e-3) and math.isnan(summary["fp4"]["k3_kl_sd"]) is False
    md = (out / "results.md").read_text()
    assert "| fp4 | 3 | 0.453 ± 0.061 | -0.097 ± 0.038 (3 seeds) | n/a | -0.048 ± 0.019 |" in md
    assert "verdict (Holm over 1) |" in md
    # ESS: the raw one (1 - 100 * 2e-3); k3_kl beside the BF16-rollout floor
    assert summary["fp4"]["ess"] == pytest.approx(0.8, abs=1e-6)
    assert "| 0.00200 (0.00000) | 0.800 |" in md and "| mean k3_kl (BF16 floor) | raw ESS |" in md  # one comparison: Holm's adjustment is the t-test itself
    # the same verdict function as the pretraining tables: with an accuracy margin both the
    # difference and the equivalence verdict print (issue #37: a shown difference no longer hides it)
    assert {s["label"]: s["verdict"] for s in summarize_rl(rows, "bf16", margin=0.2)}["fp4"] == "worse; equivalent (±0.2)"
    assert (out / "rl_curves.png").stat().st_size > 0 and (out / "summary.csv").exists()


RL_CLAIMS = """claims:
  study: rl_toy
  declared: 2026-12-07
  tests:
    - {id: bf16_learns, contrast: [bf16, start], metric: gain, direction: better, margin: 0.10}
    - {id: fp4_matches, contrast: [fp4_tis, bf16], metric: final_accuracy, direction: equivalent, margin: 0.03}
"""


def test_an_rl_sweeps_declared_claims_against_scipy(tmp_path):
    """Declared RL claims (issue #37): the gain over the start tested one-sided beyond its margin, the
    accuracy gap by two one-sided tests, both Holm-adjusted over the study; scipy is the oracle."""
    import json

    from scipy import stats as sps

    f = tmp_path / "s.yaml"
    f.write_text(RL_SWEEP.replace("seeds: [0, 1]", "seeds: [0, 1, 2, 3]") + RL_CLAIMS)
    sw = sweep.load_sweep(str(f))
    runs = sweep.expand_runs(sw, str(f))
    out = tmp_path / "out"
    start = 0.30
    final = {"bf16": [0.52, 0.47, 0.55, 0.50], "fp4_tis": [0.515, 0.475, 0.54, 0.505]}
    for r in runs:
        _write_rl_run(out, r, [0.2, 0.4, 0.6, 0.7], [start, final[r.label][r.seed]], 1e-4)
    (out / "sweep.json").write_text(json.dumps({"sweep": sw, "extra": [], "runs": [r.__dict__ for r in runs]}))
    sweep.collect(out, runs, "bf16")
    import csv

    rows = {r["claim"]: r for r in csv.DictReader((out / "claims.csv").open())}
    # float32 as TensorBoard stores them
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    gains = [f32(a) - f32(start) for a in final["bf16"]]
    p_gain = sps.ttest_1samp(gains, 0.10, alternative="greater").pvalue
    assert float(rows["bf16_learns"]["p"]) == pytest.approx(p_gain, rel=1e-4)
    # the csv's mean reads as the table's: the gain itself, and label - against for the gap
    assert float(rows["bf16_learns"]["mean"]) == pytest.approx(np.mean(gains), abs=1e-6)
    gaps = [f32(a) - f32(b) for a, b in zip(final["fp4_tis"], final["bf16"])]
    tost = max(sps.ttest_1samp(gaps, -0.03, alternative="greater").pvalue,
               sps.ttest_1samp(gaps, 0.03, alternative="less").pvalue)
    assert float(rows["fp4_matches"]["p"]) == pytest.approx(tost, rel=1e-4)
    assert float(rows["fp4_matches"]["mean"]) == pytest.approx(np.mean(gaps), abs=1e-6)
    holm = sorted([p_gain, tost])
    assert float(rows["fp4_matches"]["p_holm"]) == pytest.approx(
        max(min(1.0, 2 * holm[0]), holm[1]) if tost == holm[1] else min(1.0, 2 * tost), rel=1e-4)
    md = (out / "results.md").read_text()
    assert "## Declared claims of study rl_toy" in md and "final acc gap: exploratory verdict (Holm over" in md
    assert f"{sum(gains) / 4:+.4f} gain" in md and f"{sum(gaps) / 4:+.4f} acc" in md


@pytest.mark.parametrize("claims, message", [
    ("claims: {study: s, declared: 2026-12-07, tests: [{id: a, contrast: [fp4_tis, bf16], metric: val_loss, "
     "direction: worse}]}", r"metric 'val_loss'; valid for script: rl: final_accuracy, gain"),
    ("claims: {study: s, declared: 2026-12-07, tests: [{id: a, contrast: [bf16, fp4_tis], metric: gain, "
     "direction: better}]}", r"metric gain takes contrast \[label, start\]"),
    ("claims: {study: s, declared: 2026-12-07, tests: [{id: a, contrast: [fp4, start], metric: gain, "
     "direction: better}]}", r"claims.tests: fp4 not among the runs' labels: bf16, fp4_tis"),
])
def test_bad_rl_claims_are_one_line_errors(tmp_path, claims, message):
    with pytest.raises(sweep.SweepError, match=message) as e:
        _sweep_file(tmp_path, RL_SWEEP + claims + "\n")
    assert "\n" not in str(e.value)


def test_a_restarted_run_resumes_its_own_checkpoint_without_the_starting_ckpt_step(tmp_path):
    """A run with --ckpt-step (the starting policy's iteration) that saved its own checkpoint restarts
    from its own latest iteration: --ckpt-step is dropped with --load pointing at the run's directory
    (kept, it names an iteration the run's directory does not have and the restart is refused)."""
    from pretrain.sweep.runner import run_command, run_dir

    runs = _sweep_file(tmp_path, RL_SWEEP.replace("  precision: wgrad_hadamard\n",
                                                  "  precision: wgrad_hadamard\n  load: start\n  ckpt-step: 2000\n"))
    out = tmp_path / "out"
    fresh = run_command(out, runs[0], 1, [])
    assert fresh[fresh.index("--ckpt-step") + 1] == "2000" and fresh[fresh.index("--load") + 1] == "start"
    ckpt = run_dir(out, runs[0]) / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("100")
    again = run_command(out, runs[0], 1, [])
    assert "--ckpt-step" not in again and again[-2:] == ["--load", str(ckpt)]

"""The FP4-rollout RL sweep (``configs/sweeps/fp4_rollout.yaml``): its runs, its learning column
against hand-computed numbers, and a smoke-sized run of the same treatments end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep

from pretrain.rl.sweep_results import summarize_rl
from tests.launch.test_sweep_rl import _write_rl_run

SWEEP_FILE = ROOT / "configs" / "sweeps" / "fp4_rollout.yaml"


def test_the_sweep_file_expands_and_names_its_margin():
    spec = sweep.load_sweep(str(SWEEP_FILE))
    runs = sweep.expand_runs(spec, str(SWEEP_FILE))
    labels = list(dict.fromkeys(r.label for r in runs))
    assert labels[0] == spec["baseline"] == "bf16" and spec["equivalence_margin"] == 0.03
    assert len(runs) == len(labels) * len(spec["seeds"])
    plans = {r.label: r.flags[r.flags.index("--rollout-precision") + 1] for r in runs}
    assert plans == {"bf16": "bf16", "nvfp4": "nvfp4", "nvfp4_tis": "nvfp4"}  # FP4 weights, activations, KV
    tis = next(r for r in runs if r.label == "nvfp4_tis")
    assert tis.flags[tis.flags.index("--rollout-correction") + 1] == "tis"
    assert all("--rollout-correction" not in r.flags for r in runs if r.label != "nvfp4_tis")
    assert all("--load" in r.flags and r.script == "rl" for r in runs)


def test_the_wider_policy_sweep_file_loads_its_start_and_pairs_two_treatments():
    """fp4_rollout_h256.yaml: the same recipe from the hidden-256 SFT's iteration 2000 (the directory and
    step rl_task.py --policy-width 256 trains), BF16 rollouts against all-NVFP4 rollouts with and without
    token TIS."""
    f = ROOT / "configs" / "sweeps" / "fp4_rollout_h256.yaml"
    spec = sweep.load_sweep(str(f))
    runs = sweep.expand_runs(spec, str(f))
    assert spec["baseline"] == "bf16" and spec["equivalence_margin"] == 0.03 and spec["seeds"] == [0, 1, 2, 3]
    assert len(runs) == 12 and all(r.script == "rl" for r in runs)
    for r in runs:
        assert r.flags[r.flags.index("--load") + 1] == "runs/rl_task/sft_h256"
        assert r.flags[r.flags.index("--ckpt-step") + 1] == "2000"
    plans = {r.label: r.flags[r.flags.index("--rollout-precision") + 1] for r in runs}
    assert plans == {"bf16": "bf16", "nvfp4_tis": "nvfp4", "nvfp4": "nvfp4"}
    tis = [r for r in runs if "--rollout-correction" in r.flags]
    assert {r.label for r in tis} == {"nvfp4_tis"} and len(tis) == 4
    assert all(r.flags[r.flags.index("--rollout-correction") + 1] == "tis" for r in tis)
    # the recipe is the hidden-128 sweep's but for the number of iterations
    main = sweep.load_sweep(str(SWEEP_FILE))["base"]
    assert {k: v for k, v in spec["base"].items() if k not in ("load", "ckpt-step", "rl-iters")} == \
        {k: v for k, v in main.items() if k not in ("load", "rl-iters")}


def test_learning_gain_against_hand_computed_numbers(tmp_path):
    """``gain`` = final held-out accuracy minus the same run's first evaluation (the starting policy),
    interval over seeds; the verdict column names the metric it judges."""
    out = tmp_path / "sweep"
    runs = [sweep.Run(f"{label}__seed-{s}", "", [], label, {}, s, "", "rl")
            for label in ("bf16", "fp4") for s in (0, 1, 2)]
    finals = {"bf16": [0.50, 0.60, 0.55], "fp4": [0.40, 0.52, 0.44]}
    for r in runs:
        _write_rl_run(out, r, [0.2, 0.4, 0.6], [0.3, finals[r.label][r.seed]], 1e-6)
    rows = sweep.collect(out, runs, "bf16")
    summary = {s["label"]: s for s in summarize_rl(rows, "bf16")}
    # bf16 gains 0.20, 0.30, 0.25: mean 0.25, sd 0.05, half-width t(0.975,2)=4.3027 * 0.05 / sqrt(3) = 0.12421
    g = summary["bf16"]["gain_interval"]
    assert g.mean == pytest.approx(0.25) and g.half_width == pytest.approx(0.124210, abs=1e-5)
    # fp4 gains 0.10, 0.22, 0.14: mean 0.153333, sd 0.061101, half-width 0.151784 -> lower end 0.00155 > 0
    g = summary["fp4"]["gain_interval"]
    assert g.mean == pytest.approx(0.153333, abs=1e-5) and g.half_width == pytest.approx(0.151784, abs=1e-5)
    md = (out / "results.md").read_text()
    assert "| gain over start (95% CI) | final acc gap: verdict (Holm over 1) |" in md
    assert "| +0.250 ± 0.124; shown > 0 | baseline |" in md and "| +0.153 ± 0.152; shown > 0 | worse |" in md
    csv = (out / "results.csv").read_text().splitlines()
    assert csv[0].split(",")[6] == "gain" and float(csv[1].split(",")[6]) == pytest.approx(0.2, abs=1e-6)


@pytest.mark.slow
def test_smoke_sweep_of_the_sweep_files_treatments(tmp_path):
    """The sweep file's treatments, one seed, one iteration, on a tiny random-init policy, two at a time:
    every run finishes and the table has one row per treatment."""
    from pretrain.data.tokenizer import train_tokenizer
    from pretrain.rl.task import load_task, sft_examples

    tok = tmp_path / "tok.model"
    train_tokenizer(sft_examples(load_task(str(ROOT / "configs/rl/arith.yaml")), 2000), str(tok), vocab_size=274)
    spec = yaml.safe_load(SWEEP_FILE.read_text())
    spec["seeds"] = [0]
    spec["base"] = {"task": str(ROOT / "configs/rl/arith.yaml"), "tokenizer-model": str(tok), "num-layers": 3,
                    "hidden-size": 64, "ffn-hidden-size": 128, "num-attention-heads": 2, "seq-length": 24,
                    "rl-iters": 1, "prompts-per-step": 2, "group-size": 2, "max-new-tokens": 4, "eval-prompts": 4,
                    "eval-interval": 1, "temperature": spec["base"]["temperature"], "lr": spec["base"]["lr"]}
    f = tmp_path / "smoke.yaml"
    f.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "launch/sweep.py"), str(f), "--out", str(out), "--parallel", "2"],
                       check=False, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (out / "results.md").read_text()
    for label in ("bf16", "nvfp4", "nvfp4_tis"):
        assert f"| {label} | 1 |" in md
    assert "; 1 failed" not in md


def test_unfinished_runs_are_no_pair_and_are_reported(tmp_path):
    """A resumable sweep stopped midway: a running run's partial curve and a pending run give no pair
    (before: the running run's last evaluation entered the gap and a pending run read "failed")."""
    out = tmp_path / "sweep"
    runs = [sweep.Run(f"{label}__seed-{s}", "", [], label, {}, s, "", "rl")
            for label in ("bf16", "fp4") for s in (0, 1, 2, 3)]
    finals = {"bf16": [0.50, 0.60, 0.55, 0.50], "fp4": [0.40, 0.52, 0.44, 0.90]}
    for r in runs:
        if r.label == "fp4" and r.seed == 3:
            continue  # pending: nothing written
        _write_rl_run(out, r, [0.2, 0.4, 0.6], [0.3, finals[r.label][r.seed]], 1e-6)
    running = next(r for r in runs if r.label == "fp4" and r.seed == 2)
    sweep.write_status(out / "runs" / running.name, state="running")
    rows = sweep.collect(out, runs, "bf16")
    fp4 = {s["label"]: s for s in summarize_rl(rows, "bf16")}["fp4"]
    assert fp4["seeds"] == 2 and fp4["gap_final_accuracy"].n == 2 and fp4["failed"] == 0 and fp4["unfinished"] == 2
    assert fp4["gap_final_accuracy"].mean == pytest.approx(-0.09)  # seeds 0 and 1 only: -0.10, -0.08
    md = (out / "results.md").read_text()
    assert "; 2 not finished |" in md and "failed" not in md.split("## Runs")[0]

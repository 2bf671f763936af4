"""``configs/sweeps/fp4_controls_cpu.yaml``: the FP4 error controls study is what its write-up says --
each treatment changes one GEMM of the plain-NVFP4 baseline, the runs start from their own seed's
stage-1 checkpoint, every run passes pretrain.py's validation, and the declared claims name its labels."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep

PATH = str(ROOT / "configs" / "sweeps" / "fp4_controls_cpu.yaml")


def _runs():
    s = sweep.load_sweep(PATH)
    return s, sweep.expand_runs(s, PATH)


def test_each_treatment_changes_one_gemm_of_the_nvfp4_baseline():
    from precision.recipe import Gemm, LinearPrecision

    s, runs = _runs()
    assert len(runs) == 16 * 6 and s["baseline"] == "nvfp4" and s["descent_steps"] == [6, 40]
    plans = {r.label: LinearPrecision.parse(r.precision) for r in runs}
    base = plans["nvfp4"]
    for label, plan in plans.items():
        if label == "nvfp4":
            continue
        gemm = label.split("_", 1)[0]
        for g in Gemm:
            assert (getattr(plan, g.value) == getattr(base, g.value)) == (g.value != gemm), (label, g)
    # the controls where defined for each GEMM's operands, beside SR and had16
    assert {lab.split("_", 1)[1] for lab in plans if lab.startswith("wgrad_")} == \
        {"sr", "had16", "4over6", "eden", "eden128"}
    assert {lab.split("_", 1)[1] for lab in plans if lab.startswith("dgrad_")} == {"sr", "had16", "4over6", "eden"}
    assert {lab.split("_", 1)[1] for lab in plans if lab.startswith("fprop_")} == \
        {"sr", "had16", "4over6", "eden", "mxfp4_had32", "quest"}


def test_runs_start_from_their_seeds_stage1_checkpoint_and_pass_validation():
    from pretrain.arguments import parse_args, validate_args

    start = str(ROOT / "configs" / "sweeps" / "mxfp4_continuation_start_cpu.yaml")
    starts = {r.seed: r.name for r in sweep.expand_runs(sweep.load_sweep(start), start)}
    _, runs = _runs()
    for r in runs:
        i = r.flags.index("--pretrained-checkpoint")
        assert r.flags[i + 1] == f"runs/mxfp4_continuation_start_cpu/runs/{starts[r.seed]}/checkpoints"
        flags = r.flags[:i] + r.flags[i + 2:]  # the checkpoint is stage 1's output, absent here
        assert flags[flags.index("--fixed-train-set") + 1] == flags[flags.index("--global-batch-size") + 1]
        validate_args(parse_args([*flags, "--precision", r.precision]), world_size=1, cuda=False)


def test_the_declared_claims_name_the_studys_labels():
    s, runs = _runs()
    labels = {r.label for r in runs}
    c = s["claims"]
    assert c["declared"] == "2026-12-07" and c["study_claims"] == len(c["tests"]) == 6
    for t in c["tests"]:
        assert set(t["contrast"]) <= labels and t["metric"] == "extra_steps", t
        # a claim compares runs that differ in one GEMM only
        assert len({lab.split("_", 1)[0] for lab in t["contrast"] if lab != "nvfp4"}) == 1, t

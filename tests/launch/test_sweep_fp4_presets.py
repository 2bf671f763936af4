"""``configs/sweeps/fp4_presets_cpu.yaml``: the combined FP4 presets study is what its write-up says --
each grid point is the named preset whole, the runs start from their own seed's stage-1 checkpoint at
the width where every Dgrad contraction holds whole 128-groups, every run passes pretrain.py's
validation, and the declared claims name its labels."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep

PATH = str(ROOT / "configs" / "sweeps" / "fp4_presets_cpu.yaml")
START = str(ROOT / "configs" / "sweeps" / "fp4_presets_start_cpu.yaml")


def _runs(path=PATH):
    s = sweep.load_sweep(path)
    return s, sweep.expand_runs(s, path)


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_each_grid_point_is_a_whole_preset_and_the_comparator_is_its_rotation_without_the_controls():
    from precision import presets
    from precision.policy import parse_precision
    from precision.recipe import Gemm

    s, runs = _runs()
    assert len(runs) == 7 * 6 and s["baseline"] == "fp8" and s["descent_steps"] == [6, 40]
    plans = {r.label: parse_precision(r.precision) for r in runs}
    for name in ("fp8", "nvfp4", "nvfp4_4over6", "nvfp4_quartet2", "mxfp4", "mxfp4_quartet"):
        assert plans[name] == presets.get(name), name
    # mxfp4_had32 is mxfp4_quartet with QuEST and SR taken away: nearest MXFP4 under the same had32
    for g in Gemm:
        r, q = getattr(plans["mxfp4_had32"], g.value), getattr(plans["mxfp4_quartet"], g.value)
        assert r.rotation == q.rotation == "had32", g
        assert r.a.format.name == q.a.format.name == "mxfp4" and r.a.rounding == "nearest", g


def test_the_width_gives_whole_128_groups_on_every_dgrad_contraction():
    for path in (PATH, START):
        _, runs = _runs(path)
        f = runs[0].flags
        hidden, ffn = int(_flag(f, "--hidden-size")), int(_flag(f, "--ffn-hidden-size"))
        heads, groups = int(_flag(f, "--num-attention-heads")), int(_flag(f, "--num-query-groups"))
        head_dim = hidden // heads
        out_features = {"qkv": (heads + 2 * groups) * head_dim, "proj": hidden, "fc1": 2 * ffn, "fc2": hidden}
        assert all(n % 128 == 0 for n in out_features.values()), out_features


def test_runs_start_from_their_seeds_stage1_checkpoint_and_pass_validation():
    from pretrain.arguments import parse_args, validate_args

    starts = {r.seed: r.name for r in _runs(START)[1]}
    _, runs = _runs()
    assert {r.seed for r in runs} == set(starts)
    for r in runs:
        i = r.flags.index("--pretrained-checkpoint")
        assert r.flags[i + 1] == f"runs/fp4_presets_start_cpu/runs/{starts[r.seed]}/checkpoints"
        flags = r.flags[:i] + r.flags[i + 2:]  # the checkpoint is stage 1's output, absent here
        assert _flag(flags, "--fixed-train-set") == _flag(flags, "--global-batch-size")
        validate_args(parse_args([*flags, "--precision", r.precision]), world_size=1, cuda=False)


def test_the_declared_claims_name_the_studys_labels():
    s, runs = _runs()
    labels = {r.label for r in runs}
    c = s["claims"]
    assert c["declared"] == "2026-12-07" and c["study_claims"] == len(c["tests"]) == 3
    for t in c["tests"]:
        assert set(t["contrast"]) <= labels and t["metric"] == "extra_steps", t

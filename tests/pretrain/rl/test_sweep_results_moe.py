"""The RL sweep table of a mixture-of-experts policy (pretrain.rl.sweep_results): the routing columns and
the collapse iteration, against numbers computed here from the scalars written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from pretrain.sweep.report import collect
from pretrain.sweep.runner import write_status
from pretrain.sweep.spec import Run


def _run(out: Path, run: Run, topk: list[float], accuracies: list[tuple[int, float]]) -> None:
    d = out / "runs" / run.name
    w = SummaryWriter(str(d / "tensorboard"))
    for i, f in enumerate(topk, 1):
        w.add_scalar("rl/reward_mean", 0.5, i)
        w.add_scalar("mismatch/k3_kl", 1e-3, i)
        w.add_scalar("routing/topk_mismatch_fraction", f, i)
        w.add_scalar("routing/router_prob_gap", f / 10, i)
        w.add_scalar("routing/k3_kl_no_replay", 2e-3, i)
        w.add_scalar("routing/k3_kl_replay", 1e-3, i)
    for it, a in accuracies:
        w.add_scalar("rl/heldout_accuracy", a, it)
    w.close()
    write_status(d, state="done")


def test_moe_columns_and_collapse(tmp_path):
    out = tmp_path / "sweep"
    runs = [Run(f"{label}__seed-{s}", "", [], label, {}, s, "", "rl") for label in ("bf16", "nvfp4") for s in (0, 1)]
    for r in runs:
        if r.label == "bf16":
            _run(out, r, [0.0, 0.0, 0.0], [(0, 0.5), (2, 0.55), (3, 0.6)])
        else:  # seed 0 collapses at iteration 2 (0.35 < 0.5 - 0.10); seed 1 dips by exactly 0.10: not collapsed
            _run(out, r, [0.1, 0.2, 0.3 + 0.1 * r.seed], [(0, 0.5), (2, 0.35 if r.seed == 0 else 0.4), (3, 0.45)])
    rows = collect(out, runs, "bf16")  # writes results.md too
    by = {r["run"]: r for r in rows}
    assert by["nvfp4__seed-0"]["topk_mismatch"] == pytest.approx(0.2)
    assert by["nvfp4__seed-1"]["topk_mismatch"] == pytest.approx((0.1 + 0.2 + 0.4) / 3)
    assert by["nvfp4__seed-0"]["router_prob_gap"] == pytest.approx(0.02)
    assert by["nvfp4__seed-0"]["collapse_iteration"] == 2.0
    assert math.isnan(by["nvfp4__seed-1"]["collapse_iteration"]) and math.isnan(by["bf16__seed-0"]["collapse_iteration"])
    md = (out / "results.md").read_text()
    assert "| nvfp4 | 0.2167 ± 0.0236 | 0.0217 ± 0.0024 | 0.00200 | 0.00100 | 1 of 2 (2) |" in md
    assert "| bf16 | 0.0000 ± 0.0000 |" in md and "0 of 2 |" in md

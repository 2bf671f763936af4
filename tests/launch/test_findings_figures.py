"""The findings figures: one PNG per study from its per-seed CSV, the published figures of the
write-up's ``study (...)`` column beside the treatments they match (``launch/report.py --findings``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from scipy import stats

from launch import report
from pretrain.sweep.findings import published_figures, study_rows, writeup_for

WRITEUP = """# A study

| precision | extra steps % (95% CI) | verdict | study (arXiv 2605.09825) |
|---|---|---|---|
| `fp8` | baseline | baseline | baseline |
| `mxfp4_fprop` | +3.65 ± 0.71 | worse | +8–9 % |
| `mxfp4` | +4.06 ± 0.39 | worse | +26–27 % |
| `mxfp4_sr` | +4.20 ± 1.22 | worse | no convergence |
"""
CSV = """section,design,against,treatment,seed,extra_steps_pct
7.4,ladder,fp8,mxfp4_fprop,0,10.1
7.4,ladder,fp8,mxfp4_fprop,1,9.5
7.4,ladder,fp8,mxfp4_fprop,2,11.2
7.4,ladder,fp8,mxfp4,0,10.0
7.4,ladder,fp8,mxfp4,1,11.0
2,wgrad,wgrad_exact,wgrad_mxfp4,0,0.2
2,wgrad,wgrad_exact,wgrad_mxfp4,1,-0.1
"""


def test_published_figures_come_from_the_writeup_table():
    found, source = published_figures(WRITEUP)
    assert source == "arXiv 2605.09825"
    assert found == {("fp8", "mxfp4_fprop"): (8.0, 9.0), ("fp8", "mxfp4"): (26.0, 27.0)}  # "no convergence": none


def test_rows_are_t_intervals_over_seeds(tmp_path):
    (tmp_path / "s_per_seed.csv").write_text(CSV)
    value, rows = study_rows(tmp_path / "s_per_seed.csv")
    assert value == "extra_steps_pct"
    assert [r[0] for r in rows] == ["§7.4 ladder: mxfp4_fprop vs fp8", "§7.4 ladder: mxfp4 vs fp8",
                                    "§2 wgrad: wgrad_mxfp4 vs wgrad_exact"]
    vals = [10.1, 9.5, 11.2]
    sem = stats.sem(vals)
    lo, hi = stats.t.interval(0.95, len(vals) - 1, loc=sum(vals) / 3, scale=sem)
    iv = rows[0][2]
    assert rows[0][1] == ("fp8", "mxfp4_fprop")
    assert (iv.mean, iv.lo, iv.hi) == pytest.approx((sum(vals) / 3, lo, hi))


def test_report_writes_one_figure_per_study(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "s_per_seed.csv").write_text(CSV)
    (tmp_path / "s.md").write_text(WRITEUP)
    (results / "q_per_seed.csv").write_text("treatment,seed,val_loss_gap_to_bf16\na,0,0.001\na,1,0.002\n")
    (tmp_path / "q.yaml").write_text("equivalence_margin: 0.01\n")
    assert report.main(["--findings", str(results), "--out", str(tmp_path / "fig")]) == 0
    for name in ("s", "q"):
        assert (tmp_path / "fig" / f"{name}.png").stat().st_size > 5000
    assert "wrote 2 figure(s)" in capsys.readouterr().out
    assert report.main(["--findings", str(tmp_path / "fig"), "--out", str(tmp_path / "x")]) == 2
    assert "no *_per_seed.csv" in capsys.readouterr().err
    assert not math.isnan(study_rows(results / "q_per_seed.csv")[1][0][2].half_width)


def test_rl_study_rows_are_accuracy_gaps_paired_by_replicate(tmp_path):
    """An RL study's per-replicate CSV (treatment, replicate, final_accuracy): each treatment's gap to the
    file's first treatment, replicate by replicate, as a t interval; the committed RL studies draw."""
    (tmp_path / "r_per_seed.csv").write_text("treatment,replicate,final_accuracy\nbf16,0,0.50\nbf16,1,0.40\n"
                                             "bf16,2,0.45\nfp4,1,0.38\nfp4,0,0.47\nfp4,2,0.46\n")
    value, rows = study_rows(tmp_path / "r_per_seed.csv")
    assert value == "final_accuracy_gap" and [r[0] for r in rows] == ["bf16 vs bf16", "fp4 vs bf16"]
    gaps = [-0.03, -0.02, 0.01]  # paired by replicate, not by the rows' order
    lo, hi = stats.t.interval(0.95, 2, loc=sum(gaps) / 3, scale=stats.sem(gaps))
    assert (rows[1][2].mean, rows[1][2].lo, rows[1][2].hi) == pytest.approx((sum(gaps) / 3, lo, hi))
    assert rows[1][1] == ("bf16", "fp4")
    results = Path(__file__).resolve().parents[2] / "configs" / "sweeps" / "results"
    assert writeup_for("fp4_rollout_h256_rep", results.parent).name == "fp4_rollout.md"
    assert writeup_for("wgrad_scale_cpu_h4", results.parent).name == "wgrad_scale_cpu.md"
    assert writeup_for("moe_rollout", results.parent).name == "moe_rollout.md"
    assert writeup_for("no_such_study", results.parent) is None
    labels = [r[0] for r in study_rows(results / "fp4_presets_cpu_per_seed.csv")[1]]
    assert "mxfp4_quartet vs fp8 (lower bound: 1 censored)" in labels and "nvfp4 vs fp8" in labels
    for study in ("moe_rollout", "fp4_rollout_h256_rep"):
        v, r = study_rows(results / f"{study}_per_seed.csv")
        assert v == "final_accuracy_gap" and len(r) >= 2

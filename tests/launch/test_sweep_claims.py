"""A study's declared claims (issue #37): parsed with one-line errors, tested one-sided in their
declared direction (against scipy's t-tests), Holm-adjusted over all the study's claims, every other
verdict marked exploratory, and seeds added after the first table tested as a new confirmatory run."""

import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep

CLAIMS = """claims:
  study: toy
  declared: 2026-12-06
  study_claims: 3
  note: declared before the runs
  tests:
    - {id: mx_costs, contrast: [mxfp4, fp8], metric: val_loss, direction: worse}
    - {id: bf16_free, contrast: [bf16, fp8], metric: val_loss, direction: equivalent, margin: 0.02}
"""
# as TensorBoard stores them (float32), so scipy sees the values the report reads
VAL = {k: [float(np.float32(v)) for v in vs] for k, vs in {
    "fp8": [4.50, 4.61, 4.55, 4.58, 4.52, 4.60],
    "mxfp4": [4.512, 4.618, 4.561, 4.589, 4.531, 4.613],
    "bf16": [4.501, 4.609, 4.552, 4.579, 4.521, 4.601]}.items()}


def _write(out: Path, run, val: float):
    d = out / "runs" / run.name
    w = SummaryWriter(str(d / "tensorboard"))
    rng = random.Random(run.seed)
    for s in range(1, 41):
        w.add_scalar("lm loss", 4.0 + 3.0 * math.exp(-s / 10) + rng.gauss(0, 0.01), s)
    w.add_scalar("lm loss validation", val, 40)
    w.close()
    sweep.write_status(d, state="done")


def _study(tmp_path: Path, seeds: list[int], diverged: tuple[str, ...] = ()):
    f = tmp_path / "s.yaml"
    f.write_text(f"seeds: {seeds}\nbaseline: fp8\ngrid:\n  presets: [fp8, mxfp4, bf16]\n" + CLAIMS)
    sw = sweep.load_sweep(str(f))
    runs = sweep.expand_runs(sw, str(f))
    out = tmp_path / "out"
    for r in runs:
        if not (out / "runs" / r.name).exists():
            _write(out, r, VAL[r.label][r.seed])
        if r.name in diverged:
            sweep.write_status(out / "runs" / r.name, state="diverged")
    (out / "sweep.json").write_text(json.dumps({"sweep": sw, "extra": [], "runs": [r.__dict__ for r in runs]}))
    sweep.collect(out, runs, "fp8", window=5)
    return out


def _rows(out: Path) -> dict:
    lines = (out / "claims.csv").read_text().splitlines()
    head = lines[0].split(",")
    return {(r[1], r[2]): dict(zip(head, r)) for r in (line.split(",") for line in lines[1:])}


def test_declared_claims_are_tested_one_sided_and_holm_adjusted_over_the_whole_study(tmp_path):
    out = _study(tmp_path, [0, 1, 2, 3])
    rows = _rows(out)
    gaps = [VAL["mxfp4"][s] - VAL["fp8"][s] for s in range(4)]
    p = sps.ttest_1samp(gaps, 0.0, alternative="greater").pvalue
    cost = rows[("mx_costs", "False")]
    assert float(cost["p"]) == pytest.approx(p, rel=1e-4)
    bgaps = [VAL["bf16"][s] - VAL["fp8"][s] for s in range(4)]
    q = max(sps.ttest_1samp([g + 0.02 for g in bgaps], 0, alternative="greater").pvalue,
            sps.ttest_1samp([g - 0.02 for g in bgaps], 0, alternative="less").pvalue)
    free = rows[("bf16_free", "False")]
    assert float(free["p"]) == pytest.approx(q, rel=1e-4)
    # Holm over the study's 3 declared claims (the third, in another file, counts as p = 1)
    lo, hi = sorted([p, q])
    holm = {lo: 3 * lo, hi: max(3 * lo, 2 * hi)}
    assert float(cost["p_holm"]) == pytest.approx(min(1, holm[p]), rel=1e-4)
    assert float(free["p_holm"]) == pytest.approx(min(1, holm[q]), rel=1e-4)
    assert cost["verdict"] == "supported" and free["verdict"] == "supported"
    md = (out / "results.md").read_text()
    assert "## Declared claims of study toy (declared 2026-12-06; Holm over the study's 3 claims)" in md
    assert "Every other verdict in this report is exploratory" in md and "declared before the runs" in md
    assert "| exploratory verdict (Holm over 2) |" in md
    assert json.loads((out / "claims_first.json").read_text())["seeds"]["mx_costs"] == [0, 1, 2, 3]


def test_seeds_added_after_the_first_table_are_a_new_confirmatory_run(tmp_path):
    _study(tmp_path, [0, 1, 2, 3])
    out = _study(tmp_path, [0, 1, 2, 3, 4, 5])  # seeds 4-5 added after a look
    rows = _rows(out)
    assert rows[("mx_costs", "False")]["seeds"] == "0 1 2 3"  # the first look's seeds, unchanged
    new = rows[("mx_costs", "True")]
    assert new["seeds"] == "4 5"
    gaps = [VAL["mxfp4"][s] - VAL["fp8"][s] for s in (4, 5)]
    assert float(new["p"]) == pytest.approx(sps.ttest_1samp(gaps, 0.0, alternative="greater").pvalue, rel=1e-4)
    assert "Holm over the study's 5 claims" in (out / "results.md").read_text()  # 3 declared + 2 new runs
    assert "(new confirmatory run)" in (out / "results.md").read_text()
    # and the tables themselves say that seeds 4-5 came after the first look
    assert "**Seeds 4, 5 finished after this table was first produced" in (out / "results.md").read_text()


def test_the_report_writes_the_per_seed_values_its_claims_and_the_findings_figures_read(tmp_path):
    import csv

    from pretrain.sweep.findings import study_rows

    out = _study(tmp_path, [0, 1, 2, 3], diverged=("bf16__seed-3",))
    with open(out / "per_seed.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["against", "treatment", "seed", "extra_tokens_pct", "log_ratio", "val_loss_gap",
                             "censored", "claim"]
    by = {(r["against"], r["treatment"], int(r["seed"])): r for r in rows}
    assert len(rows) == 3 * 4 and {k[:2] for k in by} == {("fp8", "fp8"), ("fp8", "mxfp4"), ("fp8", "bf16")}
    for s in range(4):
        assert float(by["fp8", "mxfp4", s]["val_loss_gap"]) == pytest.approx(VAL["mxfp4"][s] - VAL["fp8"][s], abs=1e-9)
        assert by["fp8", "mxfp4", s]["claim"] == "mx_costs" and by["fp8", "fp8", s]["claim"] == ""
        assert float(by["fp8", "fp8", s]["log_ratio"]) == 0.0
    assert float(by["fp8", "bf16", 3]["log_ratio"]) == math.inf  # the diverged run: its side's worst outcome
    results = {(r["run"]): r for r in csv.DictReader(open(out / "results.csv", newline=""))}
    for s in range(4):  # a target never reached is flagged as the tables flag it
        assert by["fp8", "mxfp4", s]["censored"] == str(int(results[f"mxfp4__seed-{s}"]["extra_tokens_censored"] == "True"))
    # the claim's p-value (scipy) from the file's values is the one claims.csv printed
    gaps = [float(by["fp8", "mxfp4", s]["val_loss_gap"]) for s in range(4)]
    p = sps.ttest_1samp(gaps, 0.0, alternative="greater").pvalue
    assert float(_rows(out)[("mx_costs", "False")]["p"]) == pytest.approx(p, rel=1e-6)
    value, groups = study_rows(out / "per_seed.csv")  # the findings figure reads it as written
    assert value == "extra_tokens_pct" and [g[1] for g in groups] == [("fp8", "fp8"), ("fp8", "mxfp4"), ("fp8", "bf16")]


def test_a_diverged_seed_counts_as_the_worst_outcome_of_a_claim(tmp_path):
    # mxfp4 diverges in seeds 0-2: +inf for those seeds, and the 4th is worse too -> all four positive;
    # the exact one-sided signed-rank p with 4 seeds is 1/16 (scipy's, the oracle): not enough seeds
    out = _study(tmp_path, [0, 1, 2, 3], diverged=("mxfp4__seed-0", "mxfp4__seed-1", "mxfp4__seed-2"))
    cost = _rows(out)[("mx_costs", "False")]
    ref = sps.wilcoxon([3e9, 2e9, 1e9, VAL["mxfp4"][3] - VAL["fp8"][3]], alternative="greater", method="exact")
    assert float(cost["p"]) == pytest.approx(ref.pvalue) == pytest.approx(1 / 16)
    assert "diverged seeds: signed-rank test" in (out / "results.md").read_text()


@pytest.mark.parametrize("claims, message", [
    ("claims: {study: s, tests: []}", r"claims must map study, declared \(a date\) and tests"),
    (("script: rl\nclaims: {study: s, declared: 2026-12-06, tests: [{id: a, contrast: [mxfp4, fp8], "
     "metric: val_loss, direction: worse}]}"), r"metric 'val_loss'; valid for script: rl: final_accuracy, gain"),
    (("claims: {study: s, declared: yesterday, tests: [{id: a, contrast: [mxfp4, fp8], metric: val_loss, "
     "direction: worse}]}"), r"claims.declared must be an ISO date, e.g. 2026-12-06"),
    (("claims: {study: s, declared: 2026-12-06, tests: [{id: a, contrast: [mxfp4, fp8], metric: loss, "
     "direction: worse}]}"), r"metric 'loss'; valid for script: pretrain: val_loss, excess_loss, extra_steps, extra_tokens"),
    (("claims: {study: s, declared: 2026-12-06, tests: [{id: a, contrast: [mxfp4, fp8], metric: val_loss, "
     "direction: equivalent}]}"), r"margin must be a number >= 0 \(> 0 for equivalent"),
    (("claims: {study: s, declared: 2026-12-06, study_claims: 0, tests: [{id: a, contrast: [mxfp4, fp8], "
     "metric: val_loss, direction: worse}]}"), r"study_claims must be an integer >= the 1 tests"),
    (("claims: {study: s, declared: 2026-12-06, tests: [{id: a, contrast: [mxfp6, fp8], metric: val_loss, "
     "direction: worse}]}"), r"claims.tests: mxfp6 not among the runs' labels: fp8, mxfp4"),
])
def test_bad_claims_are_one_line_errors(tmp_path, claims, message):
    f = tmp_path / "s.yaml"
    f.write_text("baseline: fp8\ngrid:\n  presets: [fp8, mxfp4]\n" + claims + "\n")
    with pytest.raises(sweep.SweepError, match=message) as e:
        sweep.expand_runs(sweep.load_sweep(str(f)), str(f))
    assert "\n" not in str(e.value)


def test_report_adjusts_the_claims_of_several_sweeps_of_one_study_together(tmp_path, capsys):
    import report

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _study(tmp_path / "a", [0, 1, 2, 3]), _study(tmp_path / "b", [2, 3, 4, 5])
    assert report.main([str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "## Study toy: 4 claim tests from 2 sweeps, Holm over 4" in text  # 2 + 2 > study_claims: 3
    p = [float(r["p"]) for d in (a, b) for r in _rows(d).values()]
    order = sorted(range(4), key=p.__getitem__)  # Holm by hand: running max of (4 - rank) * p
    holm, run = [0.0] * 4, 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (4 - rank) * p[i]))
        holm[i] = run
    line = next(x for x in text.splitlines() if x.startswith(f"| {a} | mx_costs |"))
    assert float(line.split("|")[8]) == pytest.approx(holm[0], rel=1e-2)
    assert report.main([str(a), str(tmp_path)]) == 2  # not a sweep directory: one line
    assert "not a sweep directory" in capsys.readouterr().err

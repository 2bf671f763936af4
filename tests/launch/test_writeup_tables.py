"""Each study's write-up against its committed per-seed results (configs/sweeps/results/*.csv): the
tables are regenerated with the project's statistics and must appear in the write-up as printed, and
a figure in the prose that the results do not give fails the test -- so a write-up can be checked
without re-running its sweeps (issue #37)."""

import csv
import math
import re
from pathlib import Path

import pytest
from scipy.stats import t

from pretrain.evaluation import stats

SWEEPS = Path(__file__).resolve().parents[2] / "configs" / "sweeps"
RESULTS = SWEEPS / "results"


def _csv(name: str) -> list[dict]:
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def _section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i:text.index(end, i + len(start))]


def _figures(text: str, decimals: int) -> set[str]:
    """Every signed or unsigned decimal with exactly ``decimals`` digits, minus signs normalized."""
    return {m.replace("−", "-").lstrip("+") for m in re.findall(rf"[+−-]?\d+\.\d{{{decimals}}}(?!\d)", text)}


def _tost_p(d, margin: float) -> float:
    """Two one-sided t-tests (scipy) that the mean of ``d`` lies within ±``margin``: the larger p."""
    from scipy import stats as sps

    return max(sps.ttest_1samp(d, -margin, alternative="greater").pvalue,
               sps.ttest_1samp(d, margin, alternative="less").pvalue)


def _verdict(p_holm: float) -> str:
    return "supported" if p_holm < stats.ALPHA else "not supported"


# ---------------------------------------------------------------- hif8_qat_cpu.md
def _hif8_table() -> tuple[list[str], set[str]]:
    per_seed, telemetry = _csv("hif8_qat_cpu_per_seed.csv"), _csv("hif8_qat_cpu_telemetry.csv")
    names = list(dict.fromkeys(r["treatment"] for r in per_seed))
    values = {n: [float(r["val_loss_gap_to_bf16"]) for r in per_seed if r["treatment"] == n] for n in names}
    gaps = [stats.paired_interval(values[n]) for n in names]
    verdicts = stats.table_verdicts(gaps, [False] * len(names), margin=0.01)
    tel = {r["treatment"]: r for r in telemetry}
    rows = [f"| {n} | {g.text(4, seeds=True)} | {v} | {tel[n]['readings_with_clipping']} / {tel[n]['readings']} | "
            f"{tel[n]['max_clipped_fraction']} | {tel[n]['max_amax_ratio']} |" for n, g, v in zip(names, gaps, verdicts)]
    allowed = {f"{x:.4f}".lstrip("+") for vs in values.values() for x in vs}
    allowed |= {f"{g.mean:+.4f}".lstrip("+") for g in gaps} | {f"{g.half_width:.4f}" for g in gaps}
    allowed |= {f"{float(r['val_batch_se_of_gap']):.4f}" for r in telemetry}
    return rows, allowed


def test_hif8_write_up_table_regenerates_from_its_per_seed_values():
    text = (SWEEPS / "hif8_qat_cpu.md").read_text()
    rows, allowed = _hif8_table()
    for row in rows:
        assert row in text, f"hif8_qat_cpu.md lacks the regenerated row:\n{row}"
    results = _section(text, "## Results", "## Reading")
    missing = _figures(results, 4) - allowed
    assert not missing, f"figures in hif8_qat_cpu.md's results that the per-seed values do not give: {missing}"
    _assert_headline(text)


def _assert_headline(text: str) -> None:
    """The write-up's first paragraph after its title names its design, its family and a verdict."""
    head = text.split("\n\n")[1]
    assert head.startswith("**Headline**") and "design:" in head and "family:" in head, head[:200]
    assert any(v in head for v in ("shown", "supported", "not resolved", "non-reproduction")), head[:200]


# ---------------------------------------------------------------- mxfp4_fullbatch_cpu.md
def _claims_rows() -> list[str]:
    rows = _csv("mxfp4_fullbatch_cpu_claims.csv")
    ps = []
    for r in rows:
        n, m = int(r["seeds"]), float(r["mean_pct"])
        se = float(r["half_width_pct"]) / t.ppf(0.975, n - 1)
        ps.append(float(t.sf((m if r["direction"] == "worse" else -m) / se, n - 1)))
    out = []
    for r, p, a in zip(rows, ps, stats.holm_adjust(ps)):
        out.append(f"| {r['claim']} | {r['contrast']} | {r['direction']} | {r['seeds']} | "
                   f"{float(r['mean_pct']):+.2f} ± {float(r['half_width_pct']):.2f} | {p:.2g} | {a:.2g} | "
                   f"{'supported' if a < stats.ALPHA else 'not supported'} |")
    return out


def test_mxfp4_fullbatch_claims_table_regenerates_holm_over_the_study():
    text = (SWEEPS / "mxfp4_fullbatch_cpu.md").read_text()
    rows = _claims_rows()
    assert len(rows) == 9 and "Holm over 9" in text
    _assert_headline(text)
    for row in rows:
        assert row in text, f"mxfp4_fullbatch_cpu.md lacks the regenerated claim row:\n{row}"


# (section heading, the row's first cell, the column holding extra steps) per (section, treatment)
ROWS = {("2", "wgrad_fp8"): ("## 2.", "FP8", 2), ("2", "wgrad_mxfp4"): ("## 2.", "MXFP4", 2),
        ("2", "wgrad_had16"): ("## 2.", "MXFP4 + had16", 2), ("2", "wgrad_rht16"): ("## 2.", "MXFP4 + rht16", 2),
        ("2", "wgrad_sr"): ("## 2.", "MXFP4 + SR", 2),
        ("7.2", "wgrad_fp8"): ("### 7.2", "FP8", 2), ("7.2", "wgrad_mxfp4"): ("### 7.2", "MXFP4", 2),
        ("7.2", "wgrad_had16"): ("### 7.2", "MXFP4 + had16", 2), ("7.2", "wgrad_rht16"): ("### 7.2", "MXFP4 + rht16", 2),
        ("7.2", "wgrad_sr"): ("### 7.2", "MXFP4 + SR", 2),
        ("7.3", "wgrad_mxfp4"): ("### 7.3", "MXFP4", 1), ("7.3", "wgrad_had16"): ("### 7.3", "MXFP4 + had16", 1),
        ("7.4", "mxfp4_fprop"): ("### 7.4", "`mxfp4_fprop`", 2), ("7.4", "mxfp4"): ("### 7.4", "`mxfp4`", 2)}


def test_mxfp4_fullbatch_tables_regenerate_from_the_per_seed_values():
    # The write-up's figures came from unrounded values; the committed per-seed values are rounded to
    # 0.01, so a regenerated mean may move by 0.005 and a half-width by a little more: within 0.006
    # and 0.015 is "the same figure".
    text = (SWEEPS / "mxfp4_fullbatch_cpu.md").read_text()
    per_seed = _csv("mxfp4_fullbatch_cpu_per_seed.csv")
    for (section, treatment), (heading, label, col) in ROWS.items():
        vals = [float(r["extra_steps_pct"]) for r in per_seed if (r["section"], r["treatment"]) == (section, treatment)]
        iv = stats.paired_interval(vals)
        body = _section(text, heading, "\n#")
        line = next(x for x in body.splitlines() if x.startswith(f"| {label} |"))
        m = re.match(r"\s*([+−-][\d.]+) ± ([\d.]+)", line.split("|")[col + 1])
        mean, hw = float(m.group(1).replace("−", "-")), float(m.group(2))
        assert mean == pytest.approx(iv.mean, abs=0.006), (section, treatment, mean, iv.mean)
        assert hw == pytest.approx(iv.half_width, abs=0.015), (section, treatment, hw, iv.half_width)
        for v in vals:  # every per-seed value is in the write-up's prose or per-seed table
            assert f"{v:+.2f}".replace("-", "−") in body or f"{v:+.2f}" in body, (section, treatment, v)
    # §6's MXFP4 Fprop from scratch, quoted in §9
    fprop = stats.paired_interval([float(r["extra_steps_pct"]) for r in per_seed if r["treatment"] == "fprop_mxfp4"])
    assert f"{fprop.mean:+.2f} ± " in _section(text, "## 9.", "## 10.")
    # the seeds-4-7 look: plain MXFP4 at 4 seeds and on seeds 4-7 alone, as §7.2 prints them
    adam = {int(r["seed"]): float(r["extra_steps_pct"]) for r in per_seed
            if (r["section"], r["treatment"]) == ("7.2", "wgrad_mxfp4")}
    first = stats.paired_interval([adam[s] for s in range(4)])
    assert f"p = {first.p_value():.4f} at 4" in text
    assert f"(mean {sum(adam[s] for s in range(4, 8)) / 4:+.2f})" in text
    assert math.isclose(stats.paired_interval(list(adam.values())).p_value(), 0.058, abs_tol=0.001)


@pytest.mark.parametrize("name", sorted(p.name for p in SWEEPS.glob("*.md")))
def test_every_write_up_opens_with_design_family_and_verdict(name):
    _assert_headline((SWEEPS / name).read_text())


# ---------------------------------------------------------------- moe_precision_cpu.md
def test_moe_precision_write_up_regenerates_from_its_per_seed_values_and_claims():
    text = (SWEEPS / "moe_precision_cpu.md").read_text()
    per_seed = _csv("moe_precision_cpu_per_seed.csv")
    names = list(dict.fromkeys(r["treatment"] for r in per_seed))
    gaps = [stats.paired_interval([float(r["val_loss_gap_to_bf16"]) for r in per_seed if r["treatment"] == n])
            for n in names]
    verdicts = stats.table_verdicts(gaps, [n == "bf16" for n in names], margin=0.02)
    for n, g, v in zip(names, gaps, verdicts):
        losses = " / ".join(r["final_val_loss"] for r in per_seed if r["treatment"] == n)
        row = f"| {n} | {losses} | {g.text(4, seeds=True)} | {v} |"
        assert row in text, f"moe_precision_cpu.md lacks the regenerated row:\n{row}"
    claims = _csv("moe_precision_cpu_claims.csv")
    for first, confirm in zip(claims[0::2], claims[1::2]):
        assert first["claim"] == confirm["claim"] and confirm["new_confirmatory_run"] == "True"
        p, holm = float(confirm["p"]), float(confirm["p_holm"])
        cells = (f"| {first['claim']} | {first['label']} vs {first['against']} |", f"| {float(first['mean']):+.4f} | "
                 f"{float(confirm['mean']):+.4f} | {p:.2g} | {holm:.2g} | {confirm['verdict']} |")  # fmt: skip
        line = next((x for x in text.splitlines() if x.startswith(cells[0])), "")
        assert line.endswith(cells[1]), f"claim row of {first['claim']} does not match its tested values:\n{line}"
    _assert_headline(text)


# ---------------------------------------------------------------- fp4_rollout.md (true replicates)
def test_fp4_rollout_replicate_claims_regenerate_from_their_per_replicate_values():
    """The declared claims of fp4_rollout_h256_rep.yaml, recomputed with scipy from the committed
    per-replicate accuracies: TOST at the declared ±0.03 on the paired final-accuracy gap, a one-sided
    t-test of the BF16 arm's gain, Holm over the 2; the write-up's claims table and every figure of its
    results must follow from them."""
    import numpy as np
    from scipy import stats as sps

    text = (SWEEPS / "fp4_rollout.md").read_text()
    rows = _csv("fp4_rollout_h256_rep_per_seed.csv")
    by = {(r["treatment"], int(r["replicate"])): r for r in rows}
    reps = sorted({int(r["replicate"]) for r in rows})
    col = lambda arm, key: np.array([float(by[arm, r][key]) for r in reps])  # noqa: E731
    start = col("bf16", "initial_accuracy")
    assert (start == col("nvfp4_tis", "initial_accuracy")).all(), "both arms of a replicate share one start"
    gap = col("nvfp4_tis", "final_accuracy") - col("bf16", "final_accuracy")
    gain = col("bf16", "final_accuracy") - start
    p_tost = _tost_p(gap, 0.03)
    p_gain = sps.ttest_1samp(gain, 0.0, alternative="greater").pvalue
    holm = dict(zip(("tost", "gain"), stats.holm_adjust([p_tost, p_gain])))
    seeds = ",".join(map(str, reps))
    expected = [
        f"| nvfp4_tis_matches_bf16 | nvfp4_tis vs bf16 | final_accuracy | equivalent (margin 0.03) | {seeds} | "
        f"{gap.mean():+.4f} acc | {p_tost:.3g} | {holm['tost']:.3g} | {_verdict(holm['tost'])} |",
        f"| bf16_learns | bf16 vs start | gain | better | {seeds} | {gain.mean():+.4f} gain | {p_gain:.3g} | "
        f"{holm['gain']:.3g} | {_verdict(holm['gain'])} |"]
    for row in expected:
        assert row in text, f"fp4_rollout.md lacks the regenerated claim row:\n{row}"
    for r in reps:
        b, n = by["bf16", r], by["nvfp4_tis", r]
        row = (f"| {r} | {b['initial_accuracy']} | {b['final_accuracy']} | {n['final_accuracy']} | "
               f"{float(n['final_accuracy']) - float(b['final_accuracy']):+.3f} |")
        assert row in text, f"fp4_rollout.md lacks the regenerated replicate row:\n{row}"
    # figures of the results: the values, their paired intervals, the p-values, the means of the telemetry
    intervals = [stats.paired_interval(list(x)) for x in (
        gap, gain, col("nvfp4_tis", "final_accuracy") - start,
        col("nvfp4_tis", "accuracy_under_rollout_plan") - col("nvfp4_tis", "final_accuracy"),
        col("nvfp4_tis", "reward_auc") - col("bf16", "reward_auc"))]
    allowed = {f"{float(r[k]):.3f}" for r in rows for k in ("initial_accuracy", "final_accuracy")}
    allowed |= {f"{x:+.3f}".lstrip("+") for x in gap}
    for iv in intervals:
        allowed |= {f"{v:+.3f}".lstrip("+") for v in (iv.mean, iv.lo, iv.hi)} | {f"{iv.half_width:.3f}"}
    allowed |= {f"{col('nvfp4_tis', k).mean():.3f}" for k in ("mean_k3_kl", "raw_ess")}
    allowed |= {"0.487"}  # the start's accuracy on all 1,000 problems, from the section above the results
    results = _section(text, "### Results (all 8 runs", "## Hidden 128")
    missing = _figures(results, 3) - allowed
    assert not missing, f"figures in fp4_rollout.md's replicate results that its values do not give: {missing}"
    assert f"{p_tost:.3g}" in text.split("\n\n")[1] and f"{gap.mean():+.3f} ± {intervals[0].half_width:.3f}" in text
    _assert_headline(text)


# ---------------------------------------------------------------- wgrad_scale_cpu.md (interim look)
def test_wgrad_scale_interim_slopes_regenerate_from_the_per_seed_values():
    """The interim look's table (3 sizes): per-size means of the chained log token ratio and the
    least-squares slope against log10 parameters recomputed with numpy, the regression interval with
    scipy's t (n - 2 df), the seed bootstrap with pretrain.scale_study (its fixed seed); every cell of
    the write-up's rows must be these."""
    import numpy as np

    from pretrain.scale_study import Record, paired_effects, slope_over_sizes

    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    rows = _csv("wgrad_scale_cpu_per_seed.csv")
    sizes = list(dict.fromkeys(r["model_size"] for r in rows))
    params = _model_params(sizes)
    x = {(r["treatment"], r["model_size"], int(r["seed"])): float(r["extra_tokens_pct"]) for r in rows}
    recs = [Record(s, t, seed, v) for (t, s, seed), v in x.items()]
    section = _section(text, "### Interim look after part 2", "What this look says")
    for a, b in (("wgrad_mxfp4", "wgrad_fp8"), ("wgrad_mxfp4", "wgrad_had16"), ("wgrad_mxfp4", "wgrad_sr")):
        means = [np.mean([math.log1p(x[a, s, k] / 100) - math.log1p(x[b, s, k] / 100) for k in range(3)])
                 for s in sizes]
        lx = np.log10([params[s] for s in sizes])
        slope, icpt = np.polyfit(lx, means, 1)
        resid = np.array(means) - (slope * lx + icpt)
        se = math.sqrt(resid @ resid / (len(sizes) - 2) / ((lx - lx.mean()) @ (lx - lx.mean())))
        q = t.ppf(0.975, len(sizes) - 2)
        boot = slope_over_sizes(paired_effects(recs, a, b), params).boot
        cells = [f"| {a} vs {b} | {' / '.join(f'{100 * math.expm1(m):+.2f}' for m in means)} | {slope:+.4f} | "
                 f"{boot[0]:+.4f}, {boot[1]:+.4f} | {slope - q * se:+.4f}, {slope + q * se:+.4f} |"]
        lo, hi = min(boot[0], slope - q * se), max(boot[1], slope + q * se)
        verdict = "grows with size" if lo > 0 else "shrinks with size" if hi < 0 else "no trend shown"
        row = cells[0] + f" {verdict} |"
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated interim row:\n{row}"
    assert "not resolved" in text.split("\n\n")[1]
    _assert_headline(text)


def test_wgrad_scale_h4_claims_and_figures_regenerate_from_the_per_seed_values():
    """C3/C4 (wgrad_scale_cpu_h4.yaml) recomputed with scipy from the committed per-seed log ratios
    (one-sided t, Holm over the study's 4 claims with C1/C2 at p = 1), and every 2- and 4-decimal
    figure of the h4 section from the same file: per-seed and mean extra tokens with their intervals,
    the chained estimator, the end-of-run validation gaps."""
    import numpy as np
    from scipy import stats as sps

    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    section = _section(text, "### h4: the smallest size", "### Part 3 in pieces")
    rows = _csv("wgrad_scale_cpu_h4_per_seed.csv")
    by = {(r["against"], r["treatment"], int(r["seed"])): r for r in rows}
    seeds = sorted({int(r["seed"]) for r in rows})
    assert seeds == [0, 1, 2]
    col = lambda a, t, k: np.array([float(by[a, t, s][k]) for s in seeds])  # noqa: E731
    c3, c4 = col("wgrad_fp8", "wgrad_mxfp4", "log_ratio"), col("wgrad_mxfp4", "wgrad_had16", "log_ratio")
    p = [sps.ttest_1samp(c3, 0.0, alternative="greater").pvalue, sps.ttest_1samp(c4, 0.0, alternative="less").pvalue]
    holm = stats.holm_adjust(p + [1.0, 1.0])[:2]
    for cid, v, q, a in (("wgrad_costs_h4", c3, p[0], holm[0]), ("hadamard_recovers_h4", c4, p[1], holm[1])):
        cells = f"| {100 * math.expm1(v.mean()):+.2f} % | {q:.3g} | {a:.3g} | {_verdict(a)} |"
        line = next((x for x in section.splitlines() if x.startswith(f"| {cid} |")), "")
        assert line.endswith(cells), f"wgrad_scale_cpu.md's h4 claim row of {cid} does not match:\n{line}\n{cells}"
    pct = lambda x: 100 * math.expm1(x)  # noqa: E731
    allowed = {f"{float(r['extra_tokens_pct']):.2f}" for r in rows} | {f"{float(r['val_loss_gap']):.4f}" for r in rows}
    pairs = [("wgrad_fp8", "wgrad_mxfp4"), ("wgrad_mxfp4", "wgrad_had16"), ("wgrad_had16", "wgrad_mxfp4"),
             ("wgrad_sr", "wgrad_mxfp4"), ("fp8", "wgrad_fp8")]
    for a, b in pairs:
        iv = stats.paired_interval(list(col(a, b, "log_ratio")))
        allowed |= {f"{pct(x):.2f}" for x in (iv.mean, iv.lo, iv.hi)}
        g = stats.paired_interval(list(col(a, b, "val_loss_gap")))
        allowed |= {f"{g.mean:.4f}", f"{g.half_width:.4f}"}
    for a, b in (("wgrad_mxfp4", "wgrad_fp8"), ("wgrad_mxfp4", "wgrad_had16")):  # chained: each against FP8
        iv = stats.paired_interval(list(col("fp8", a, "log_ratio") - col("fp8", b, "log_ratio")))
        allowed |= {f"{pct(x):.2f}" for x in (iv.mean, iv.lo, iv.hi)}
    allowed |= {f"{x:.4f}" for x in (*p, *holm)}
    # not in the per-seed file: part 1's chained estimates (the interim table above) and the validation
    # batches' s.e. of a gap (the report's results.md)
    allowed |= {"-0.97", "0.70", "0.0032"}
    missing = (_figures(section, 2) | _figures(section, 4)) - allowed
    assert not missing, f"figures in wgrad_scale_cpu.md's h4 section that its values do not give: {missing}"


# the telemetry of the wgrad_mxfp4 runs at 2 tokens per parameter, per size: (label, file, run prefix, step)
TELEMETRY_BY_SIZE = (("32x2 (26)", "wgrad_scale_cpu_w32_telemetry.csv", "wgrad_mxfp4__model-size-scale_w32_d2", "26"),
                     ("32x4 (52)", "wgrad_scale_cpu_w32_telemetry.csv", "wgrad_mxfp4__model-size-scale_w32_d4", "52"),
                     ("64x2 (104 of h4)", "wgrad_scale_cpu_h4_telemetry.csv", "wgrad_mxfp4", "104"),
                     ("64x4 (208)", "wgrad_scale_cpu_p12_telemetry.csv", "wgrad_mxfp4__model-size-scale_w64_d4", "208"),
                     ("128x2 (416)", "wgrad_scale_cpu_p12_telemetry.csv", "wgrad_mxfp4__model-size-scale_w128_d2", "416"),
                     ("128x4 (832)", "wgrad_scale_cpu_part3a_telemetry.csv", "wgrad_mxfp4__model-size-scale_w128_d4", "832"),
                     ("256x2 (1664)", "wgrad_scale_cpu_part3b_telemetry.csv", "wgrad_mxfp4__model-size-scale_w256_d2", "1664"))


# the operands of the telemetry tables: (gemm, operand) -> the name a table gives it
OPERANDS = {("fprop", "x"): "Fprop `x` (features)", ("dgrad", "dy"): "Dgrad `dy` (features)",
            ("wgrad", "x"): "Wgrad `x` (tokens)", ("wgrad", "dy"): "Wgrad `dy` (tokens)",
            ("fprop", "w"): "Fprop `w` (features)"}


def _mean_pm(values: list[float]) -> str:
    """A telemetry cell: the mean over seeds ± the 95 % t half-width."""
    iv = stats.paired_interval(values)
    return f"{iv.mean:.3f} ± {iv.half_width:.3f}"


def _telemetry_by_seed(file: str, prefix: str, step: str) -> dict[tuple[str, str, str], list[float]]:
    """(gemm, operand, metric) -> the per-seed means over layers of the ``prefix`` runs at ``step``."""
    mean = {(r["run"], r["gemm"], r["operand"], r["step"], r["metric"]): float(r["mean"]) for r in _csv(file)}
    seeds = sorted({int(run.rsplit("-", 1)[1]) for run, *_ in mean if run.startswith(f"{prefix}__seed-")})
    keys = {(g, o, m) for run, g, o, st, m in mean if st == step and run.startswith(f"{prefix}__seed-")}
    return {k: [mean[f"{prefix}__seed-{s}", k[0], k[1], step, k[2]] for s in seeds] for k in keys}


def test_wgrad_scale_h4_telemetry_table_regenerates_from_the_committed_telemetry():
    """The h4 mechanism table (flush share and top share per operand over 4x the training, the
    wgrad_mxfp4 runs, mean over layers per seed then a 95 % t interval over seeds) and the paired
    figures under it, recomputed from results/wgrad_scale_cpu_h4_telemetry.csv."""
    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    section = _section(text, "### Over 4x the training", "### Across sizes at 2 tokens")
    by_step = {st: _telemetry_by_seed("wgrad_scale_cpu_h4_telemetry.csv", "wgrad_mxfp4", st)
               for st in ("104", "208", "312", "416")}

    def seeds(g, o, step, metric):
        return by_step[step][g, o, metric]

    for (g, o), name in OPERANDS.items():
        cells = [_mean_pm(seeds(g, o, st, "flushed_nonzero")) for st in ("104", "208", "312", "416")]
        cells += [_mean_pm(seeds(g, o, "416", "had16_flushed_nonzero"))]
        cells += [_mean_pm(seeds(g, o, st, "block_top_share")) for st in ("104", "416")]
        row = f"| {name} | " + " | ".join(cells) + " |"
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated telemetry row:\n{row}"
    allowed = set()

    def paired(d):
        iv = stats.paired_interval(d)
        allowed.update(f"{abs(x):.3f}" for x in (iv.mean, iv.lo, iv.hi))
    diff = lambda a, b: [x - y for x, y in zip(a, b)]  # noqa: E731
    for st in ("104", "416"):
        paired(diff(seeds("wgrad", "dy", st, "flushed_nonzero"), seeds("dgrad", "dy", st, "flushed_nonzero")))
        paired(diff(seeds("wgrad", "x", st, "flushed_nonzero"), seeds("fprop", "x", st, "flushed_nonzero")))
    for g, o in (("wgrad", "dy"), ("dgrad", "dy"), ("wgrad", "x"), ("fprop", "x")):
        paired(diff(seeds(g, o, "416", "flushed_nonzero"), seeds(g, o, "104", "flushed_nonzero")))
    paired(diff(diff(seeds("wgrad", "dy", "416", "flushed_nonzero"), seeds("dgrad", "dy", "416", "flushed_nonzero")),
                diff(seeds("wgrad", "dy", "104", "flushed_nonzero"), seeds("dgrad", "dy", "104", "flushed_nonzero"))))
    for (g, o) in OPERANDS:  # the prose's single values: a mean of the table
        allowed.update(_mean_pm(seeds(g, o, st, m)).split(" ± ")[0] for st in ("104", "416")
                       for m in ("flushed_nonzero", "had16_flushed_nonzero"))
    prose = section.split("\n\n", 2)[2]  # below the table
    prose = prose[prose.index("- **Token-axis"):]
    missing = {f.lstrip("-") for f in _figures(prose, 3)} - allowed
    assert not missing, f"figures under wgrad_scale_cpu.md's telemetry table that the telemetry does not give: {missing}"


def test_wgrad_scale_h4_bias_table_regenerates_from_the_committed_measurements():
    """The gradient-error table over h4's checkpoints (projection and bias per Wgrad and step, a 95 %
    t interval over seeds) and the paired figures under it, from results/wgrad_scale_cpu_h4_bias.csv."""
    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    section = _section(text, "### Over 4x the training, with seeds (h4's checkpoints", "### Across sizes (exploratory")
    rows = _csv("wgrad_scale_cpu_h4_bias.csv")

    def col(t, step, m):
        return [float(r[m]) for r in sorted(rows, key=lambda r: int(r["seed"])) if (r["treatment"], r["step"]) == (t, str(step))]

    names = {"wgrad_fp8": "FP8", "wgrad_mxfp4": "MXFP4", "wgrad_had16": "MXFP4 + Hadamard", "wgrad_sr": "MXFP4 + SR"}
    for t, name in names.items():
        cells = []
        for st in (104, 208, 312, 416):
            iv = stats.paired_interval(col(t, st, "projection"))
            cells.append(f"{iv.mean:+.4f} ± {iv.half_width:.4f}")
        for st in (104, 416):
            iv = stats.paired_interval(col(t, st, "bias"))
            cells.append(f"{iv.mean:.4f} ± {iv.half_width:.4f}")
        row = f"| {name} | " + " | ".join(cells) + " |"
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated bias row:\n{row}"
    allowed = set()

    def paired(a, b):
        iv = stats.paired_interval([x - y for x, y in zip(a, b)])
        allowed.update(f"{abs(x):.4f}" for x in (iv.mean, iv.lo, iv.hi))
    for t in ("wgrad_mxfp4", "wgrad_had16"):
        paired(col(t, 416, "projection"), col(t, 104, "projection"))
    for st in (104, 208, 312, 416):
        paired(col("wgrad_mxfp4", st, "projection"), col("wgrad_had16", st, "projection"))
        paired(col("wgrad_mxfp4", st, "projection"), col("wgrad_sr", st, "projection"))
    allowed |= {"0.0040", "0.0181"}  # SR's end-of-run validation gap, from the h4 section (its own test)
    prose = section[section.index("- **Plain MXFP4"):]
    missing = {f.lstrip("-") for f in _figures(prose, 4)} - allowed
    assert not missing, f"figures under wgrad_scale_cpu.md's bias table that the measurements do not give: {missing}"


def test_wgrad_scale_per_block_table_per_size_regenerates_from_the_committed_telemetry():
    """The per-block figures per size (flush share and top share, before and after the 16-point
    Hadamard) of each operand at the run's end, mean ± 95 % t half-width over the seeds."""
    section = _section((SWEEPS / "wgrad_scale_cpu.md").read_text(), "### Across sizes at 2 tokens", "## The first-order")
    for name, file, prefix, step in TELEMETRY_BY_SIZE:
        v = _telemetry_by_seed(file, prefix, step)
        for (g, o), label in list(OPERANDS.items())[:4]:  # the activations and gradients, not Fprop's w
            cells = [name.split(" ")[0], label] + [_mean_pm(v[g, o, m]) for m in (
                "flushed_nonzero", "had16_flushed_nonzero", "block_top_share", "had16_block_top_share")]
            _assert_rows(section, [_table_row(cells)], "per-block-by-size")


def test_wgrad_scale_telemetry_by_size_rows_regenerate_from_the_committed_telemetry():
    """The flush-share table at 2 tokens per parameter (TELEMETRY_BY_SIZE: each size's wgrad_mxfp4 runs
    at the end of their runs, 64x2's at step 104 of h4), from the committed telemetry CSVs: seed means
    and 95 % t intervals of the paired differences over the seeds each file holds."""
    section = _section((SWEEPS / "wgrad_scale_cpu.md").read_text(), "### Across sizes at 2 tokens", "## The first-order")
    for name, file, prefix, step in TELEMETRY_BY_SIZE:
        flushed = _telemetry_by_seed(file, prefix, step)
        v = {(g, o): flushed[g, o, "flushed_nonzero"] for g, o in (("wgrad", "dy"), ("dgrad", "dy"), ("wgrad", "x"),
                                                                   ("fprop", "x"))}
        seeds = range(len(v["wgrad", "dy"]))

        def gap(a, b, v=v):
            iv = stats.paired_interval([x - y for x, y in zip(v[a], v[b])])
            return f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]"
        row = (f"| {name} | {len(seeds)} | {sum(v['wgrad', 'dy']) / len(seeds):.3f} | "
               f"{sum(v['dgrad', 'dy']) / len(seeds):.3f} | {gap(('wgrad', 'dy'), ('dgrad', 'dy'))} | "
               f"{gap(('wgrad', 'x'), ('fprop', 'x'))} |")
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated telemetry row:\n{row}"


def _model_params(sizes) -> dict[str, int]:
    """Non-embedding parameters of each model-size config (configs/models/NAME.yaml)."""
    import yaml

    from pretrain.scale_study import non_embedding_params

    return {s: non_embedding_params(yaml.safe_load((SWEEPS.parent / "models" / f"{s}.yaml").read_text()))
            for s in sizes}


def _drift(row: dict, steps: int) -> float:
    """A gradient-error row's drift ratio over ``steps`` steps: bias x sqrt(steps) / one step's noise."""
    return float(row["bias"]) * math.sqrt(steps) / float(row["noise"])


def _drift_by_seed(rows: list[dict], treatment: str, step: int, steps: int) -> dict[int, float]:
    return {int(r["seed"]): _drift(r, steps) for r in sorted(rows, key=lambda r: int(r["seed"]))
            if (r["treatment"], int(r["step"])) == (treatment, step)}


def _bias_by_size(w32: bool = False) -> list[tuple[str, str, list[dict]]]:
    """(model size, its label, its rows) of the committed gradient-error measurements at 2 tokens per
    parameter: with ``w32`` the 8x look's width-32 sizes first (one file, a model_size column), then
    parts 1-2's sizes (likewise), 128x4 (part 3a), 256x2 (part 3b)."""
    small = _csv("wgrad_scale_cpu_w32_bias.csv") if w32 else []
    both = _csv("wgrad_scale_cpu_parts12_bias.csv")
    out = [(size, label, [r for r in small if r["model_size"] == size])
           for size, label in (("scale_w32_d2", "32x2"), ("scale_w32_d4", "32x4")) if w32]
    out += [(size, label, [r for r in both if r["model_size"] == size])
            for size, label in (("scale_w64_d2", "64x2"), ("scale_w64_d4", "64x4"), ("scale_w128_d2", "128x2"))]
    out.append(("scale_w128_d4", "128x4", _csv("wgrad_scale_cpu_part3a_bias.csv")))
    if (RESULTS / "wgrad_scale_cpu_part3b_bias.csv").is_file():
        out.append(("scale_w256_d2", "256x2", _csv("wgrad_scale_cpu_part3b_bias.csv")))
    return out


def test_wgrad_scale_bias_across_sizes_regenerates_from_the_committed_measurements():
    """The first-order predictor at each size (50 % and 100 % of its run): one step's noise, the
    projection of each Wgrad's mean error on G (95 % t over seeds), plain MXFP4 minus the Hadamard
    (paired), plain MXFP4's bias and its drift ratio bias x sqrt(steps) / noise at the run's length."""
    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    section = _section(text, "### Across sizes (exploratory", "## C1 and C2: the slopes")
    for size, label, rows in _bias_by_size(w32=True):
        steps = max(int(r["step"]) for r in rows)  # the last checkpoint is the run's end

        def col(t, st, m, rows=rows):
            return [float(r[m]) for r in sorted(rows, key=lambda r: int(r["seed"]))
                    if (r["treatment"], int(r["step"])) == (t, st)]
        for st in (steps // 2, steps):
            noise = stats.paired_interval(col("wgrad_fp8", st, "noise"))
            cells = [f"{label} ({st})", str(noise.n), f"{noise.mean:.2f}"]
            for t in ("wgrad_fp8", "wgrad_mxfp4", "wgrad_had16", "wgrad_sr"):
                iv = stats.paired_interval(col(t, st, "projection"))
                cells.append(f"{iv.mean:+.4f} ± {iv.half_width:.4f}")
            d = stats.paired_interval([a - b for a, b in zip(col("wgrad_mxfp4", st, "projection"),
                                                              col("wgrad_had16", st, "projection"))])
            cells.append(f"{d.mean:+.4f} [{d.lo:+.4f}, {d.hi:+.4f}]")
            drift = list(_drift_by_seed(rows, "wgrad_mxfp4", st, steps).values())
            had = list(_drift_by_seed(rows, "wgrad_had16", st, steps).values())
            cells += [f"{sum(col('wgrad_mxfp4', st, 'bias')) / noise.n:.4f}", f"{sum(drift) / len(drift):.2f}",
                      f"{sum(had) / len(had):.2f}"]
            row = "| " + " | ".join(cells) + " |"
            assert row in section, f"wgrad_scale_cpu.md lacks the regenerated bias-by-size row:\n{row}"

def _wgrad_md(start: str, end: str) -> str:
    return _section((SWEEPS / "wgrad_scale_cpu.md").read_text(), start, end)


def _table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _assert_rows(section: str, rows: list[str], what: str) -> None:
    for row in rows:
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated {what} row:\n{row}"


def _scale_column(parts12: str, part3: str, w32: bool = False) -> dict[tuple[str, str, int], float]:
    """One per-seed value against the FP8 run of the same seed, per (treatment, size, seed): column
    ``parts12`` of parts 1-2's file (a model_size column), ``part3`` of part 3's pieces (the sweep
    report's per_seed.csv: rows against fp8, the size in ``design``), and with ``w32`` of the 8x
    look's width-32 file (the same form as part 3's)."""
    v = {(r["treatment"], r["model_size"], int(r["seed"])): float(r[parts12])
         for r in _csv("wgrad_scale_cpu_per_seed.csv")}
    pieces = ("part3a", "part3b") + (("w32",) if w32 else ())
    for name in (f"wgrad_scale_cpu_{p}_per_seed.csv" for p in pieces):
        for r in _csv(name):
            if r["against"] == "fp8":
                v[r["treatment"], r["design"].removeprefix("model-size="), int(r["seed"])] = float(r[part3])
    return v


def _scale_effects(w32: bool = False) -> tuple[dict, dict]:
    """Extra tokens (%) against the FP8 run of the same seed, per (treatment, size, seed), from parts
    1-2's per-seed file (a model_size column) and part 3's pieces (the sweep report's per_seed.csv:
    rows against fp8, the size in ``design``), with ``w32`` also the 8x look's width-32 sizes; and
    each size's non-embedding parameters, smallest first."""
    x = _scale_column("extra_tokens_pct", "extra_tokens_pct", w32)
    params = _model_params({s for _, s, _ in x})
    return x, dict(sorted(params.items(), key=lambda kv: kv[1]))


SCALE_CONFIDENCE = 0.99375  # C1/C2 as declared: Bonferroni over the 4 claims and the 2 CPU looks
SCALE_PAIRS = (("wgrad_fp8", "fp8"), ("wgrad_mxfp4", "fp8"), ("wgrad_had16", "fp8"), ("wgrad_sr", "fp8"),
               ("wgrad_mxfp4", "wgrad_fp8"), ("wgrad_mxfp4", "wgrad_had16"), ("wgrad_mxfp4", "wgrad_sr"))


def _regression(lx, means: list[float], confidence: float) -> tuple[float, float, float]:
    """numpy's least-squares slope of ``means`` on ``lx`` (log10 parameters), its intercept, and the
    half-width of the slope's t interval at ``confidence`` (n - 2 degrees of freedom, scipy)."""
    import numpy as np

    slope, icpt = np.polyfit(lx, means, 1)
    resid = np.array(means) - (slope * lx + icpt)
    se = math.sqrt(resid @ resid / (len(lx) - 2) / ((lx - lx.mean()) @ (lx - lx.mean())))
    return slope, icpt, t.ppf(1 - (1 - confidence) / 2, len(lx) - 2) * se


def _valgap_slopes(w32: bool) -> dict[tuple[str, str], tuple[list[float], float, tuple[float, float], float]]:
    """The end-of-run validation gaps' slopes over sizes (``launch/scale_study.py slopes --metric
    val_gap``, 95 %) of C1's and C2's contrasts: per pair the per-size means, the slope, the seed
    bootstrap's interval (pretrain.scale_study) and the regression's half-width (numpy, scipy)."""
    import numpy as np

    from pretrain.scale_study import Record, paired_effects, slope_over_sizes

    gap = _scale_column("val_loss_gap_to_fp8", "val_loss_gap", w32)
    _, params = _scale_effects(w32)
    sizes = list(params)
    recs = [Record(s_, t_, k, 0.0, v) for (t_, s_, k), v in gap.items()]
    lx = np.log10([params[s_] for s_ in sizes])
    out = {}
    for a, b in (("wgrad_mxfp4", "wgrad_fp8"), ("wgrad_mxfp4", "wgrad_had16")):
        means = [float(np.mean([gap[a, s_, k] - gap[b, s_, k] for k in range(3)])) for s_ in sizes]
        slope, _, half = _regression(lx, means, 0.95)
        out[a, b] = (means, slope, slope_over_sizes(paired_effects(recs, a, b, "val_gap"), params).boot, half)
    return out


def _slope_rows(x: dict, params: dict, confidence: float) -> dict[tuple[str, str], dict]:
    """For each of SCALE_PAIRS over the sizes of ``params``: the per-size means of the chained log token
    ratio, the slope against log10 parameters and its regression interval recomputed with numpy and
    scipy, the seed bootstrap with pretrain.scale_study (its fixed seed), the verdict on the union, the
    fit and its prediction at Llama-3.1-8B (checked with numpy), and the write-up's table row."""
    import numpy as np

    from launch.scale_study import LLAMA_8B
    from pretrain.scale_study import Record, non_embedding_params, paired_effects, slope_over_sizes

    sizes = list(params)
    recs = [Record(s, t_, k, v) for (t_, s, k), v in x.items()]
    lx = np.log10([params[s] for s in sizes])
    target = math.log10(non_embedding_params(LLAMA_8B))
    out = {}
    for a, b in SCALE_PAIRS:
        means = [np.mean([math.log1p(x[a, s, k] / 100) - math.log1p(x[b, s, k] / 100) for k in range(3)])
                 for s in sizes]
        slope, icpt, half = _regression(lx, means, confidence)
        res = slope_over_sizes(paired_effects(recs, a, b), params, confidence=confidence)
        boot = res.boot
        lo, hi = min(boot[0], slope - half), max(boot[1], slope + half)
        verdict = "grows with size" if lo > 0 else "shrinks with size" if hi < 0 else "no trend shown"
        point, plo, phi = res.predict(10 ** target, confidence)
        assert math.isclose(point, 100 * math.expm1(icpt + slope * target), rel_tol=1e-9, abs_tol=1e-9)
        row = (f"| {a} vs {b} | {' / '.join(f'{100 * math.expm1(m):+.2f}' for m in means)} | {slope:+.4f} | "
               f"{boot[0]:+.4f}, {boot[1]:+.4f} | {slope - half:+.4f}, {slope + half:+.4f} | {verdict} | "
               f"{point:+.1f} [{plo:+.1f}, {phi:+.1f}] |")
        out[a, b] = {"row": row, "slope": slope, "lo": lo, "hi": hi, "verdict": verdict, "res": res,
                     "means": means, "decades": target - lx[-1]}
    return out


def test_wgrad_scale_c1_c2_slopes_regenerate_from_the_per_seed_values():
    """C1/C2's test over part 3's five sizes, as declared (the union of the seed bootstrap's and the
    regression's 99.375 % intervals): every row of the write-up's tables must be ``_slope_rows``'s,
    and the 512x4 and 8B predictions its fits'."""
    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    section = _section(text, "## C1 and C2: the slopes", "### The predictor against")
    prediction = _section(text, "## The 8B prediction", "| treatment | what | study")
    x, params = _scale_effects()
    sizes = list(params)
    assert len(sizes) == 5
    assert all((t_, s, k) in x for t_ in ("fp8", "wgrad_mxfp4") for s in sizes for k in range(3))
    fits = _slope_rows(x, params, SCALE_CONFIDENCE)
    verdicts = {}
    for (a, b), fit in fits.items():
        assert fit["row"] in section, f"wgrad_scale_cpu.md lacks the regenerated C1/C2 slope row:\n{fit['row']}"
        verdicts[a, b] = (fit["slope"], fit["lo"], fit["hi"], fit["verdict"])
        res = fit["res"]
        cells = [f"`{a}` vs `{b}`"]
        for n in (13631488, 10 ** (math.log10(params[sizes[-1]]) + fit["decades"])):  # 512x4, Llama-3.1-8B
            cells.append("{:+.1f} [{:+.1f}, {:+.1f}]".format(*res.predict(n, SCALE_CONFIDENCE)))
        row = "| " + " | ".join(cells) + " | "
        assert row in prediction, f"wgrad_scale_cpu.md lacks the regenerated prediction row:\n{row}"
    for claim, pair in (("C1 `wgrad_slope`", ("wgrad_mxfp4", "wgrad_fp8")),
                        ("C2 `hadamard_slope`", ("wgrad_mxfp4", "wgrad_had16"))):
        slope, lo, hi, verdict = verdicts[pair]
        supported = "supported" if lo > 0 else "not supported"
        row = (f"| {claim} | {pair[0]} vs {pair[1]} | {slope:+.4f} | {lo:+.4f}, {hi:+.4f} | {verdict} "
               f"| {supported} |")
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated claim row:\n{row}"
    # the prose under the tables: every figure is a cell of the tables, or the slope per decade that
    # would carry the largest size's mean effect to the study's 8B figure (+26-27 % against +10-11 %
    # for C1, against the Hadamard's +8-9 % for C2)
    allowed = {f.lstrip("-") for line in section.splitlines() if line.lstrip().startswith("| ") for f in
               _figures(line, 2) | _figures(line, 4)}
    for b, (lo_b, hi_b) in (("wgrad_fp8", (1.11, 1.10)), ("wgrad_had16", (1.09, 1.08))):
        fit = fits["wgrad_mxfp4", b]
        m, decades = fit["means"][-1], fit["decades"]
        allowed |= {f"{(math.log(1.26 / lo_b) - m) / decades:.3f}",
                    f"{(math.log(1.27 / hi_b) - m) / decades:.3f}"}
    # the crossing section's examples: per-seed values of the committed files
    for r in _csv("wgrad_scale_cpu_part3b_per_seed.csv"):
        if r["against"] == "fp8":
            allowed |= {f"{float(r['extra_tokens_pct']):.2f}", f"{float(r['val_loss_gap']):.4f}"}
    prose = section[section.index("- **C1 `wgrad_slope`"):]
    missing = {f.lstrip("-") for f in _figures(prose, 2) | _figures(prose, 3) | _figures(prose, 4)} - allowed
    assert not missing, f"figures in wgrad_scale_cpu.md's C1/C2 prose that its values do not give: {missing}"
    _assert_headline(text)


# C5-C8 as declared in "The 8x look": (claim, contrast, the bound the union interval must pass)
EIGHT_X_CLAIMS = (("C5 `wgrad_slope_8x`", ("wgrad_mxfp4", "wgrad_fp8"), "above", 0.0),
                  ("C6 `hadamard_slope_8x`", ("wgrad_mxfp4", "wgrad_had16"), "above", 0.0),
                  ("C7 `wgrad_below_study`", ("wgrad_mxfp4", "wgrad_fp8"), "below", 0.035),
                  ("C8 `hadamard_below_study`", ("wgrad_mxfp4", "wgrad_had16"), "below", 0.048))


def test_wgrad_scale_8x_look_regenerates_from_the_per_seed_values():
    """C5-C8 over the seven sizes (part 3's and width 32's), as declared: every row of the look's
    tables from ``_slope_rows`` at 99.375 %, each claim's verdict from its bound, the validation-gap
    slopes (95 %, numpy and scipy beside the bootstrap), and every figure of the prose from the
    committed per-seed files or the declaration."""
    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    declared = _section(text, "### The 8x look: width 32", "### The 8x look: C5-C8")
    section = text[text.index("### The 8x look: C5-C8"):]
    x, params = _scale_effects(w32=True)
    sizes = list(params)
    assert sizes[:2] == ["scale_w32_d2", "scale_w32_d4"] and len(sizes) == 7
    fits = _slope_rows(x, params, SCALE_CONFIDENCE)
    for fit in fits.values():
        assert fit["row"] in section, f"wgrad_scale_cpu.md lacks the regenerated 8x-look slope row:\n{fit['row']}"
    for claim, pair, side, bound in EIGHT_X_CLAIMS:
        fit = fits[pair]
        ok = fit["lo"] > bound if side == "above" else fit["hi"] < bound
        line = next(ln for ln in declared.splitlines() if ln.startswith(f"| {claim} |"))
        contrast = "C1's contrast" if pair[1] == "wgrad_fp8" else "C2's contrast"
        assert contrast in line and line.endswith(
            "lies above 0 |" if side == "above" else f"ends below {bound:+.3f} |"), line
        row = (f"| {claim} | {pair[0]} vs {pair[1]} | {fit['slope']:+.4f} | {fit['lo']:+.4f}, {fit['hi']:+.4f} | "
               f"{side} {'0' if bound == 0 else f'{bound:+.3f}'} | {'supported' if ok else 'not supported'} |")
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated claim row:\n{row}"
    # the validation gap's slopes (exploratory, 95 %)
    allowed = {f.lstrip("-") for line in section.splitlines() if line.lstrip().startswith("| ") for f in
               _figures(line, 2) | _figures(line, 4)}
    for (a, b), (means, slope, boot, half) in _valgap_slopes(w32=True).items():
        if b == "wgrad_fp8":  # C1's contrast, written out in full; C2's after it in short
            cell = (f"{slope:+.4f} per decade [bootstrap {boot[0]:+.4f}, {boot[1]:+.4f}; regression "
                    f"{slope - half:+.4f}, {slope + half:+.4f}]")
        else:
            cell = f"{slope:+.4f} [{boot[0]:+.4f}, {boot[1]:+.4f}; {slope - half:+.4f}, {slope + half:+.4f}]"
        assert cell in section, f"wgrad_scale_cpu.md lacks the regenerated validation-gap slope: {cell}"
        allowed |= {f.lstrip("-") for f in _figures(cell, 4)} | {f"{abs(m):.4f}" for m in means[:2]}
    # the prose: table cells, the declared bounds and the study's recovery (+15.6 to +17.6 %), the
    # union's half-width and the projection made before the runs, part 3's C2 interval, the
    # width-32 runs' per-seed values and their ranges, the look's design figures
    union = fits["wgrad_mxfp4", "wgrad_had16"]
    allowed |= {"0.035", "0.048", "15.6", "17.6", "0.045", "0.1307", "0.0998", "4.53", "1.81",
                f"{(union['hi'] - union['lo']) / 2:.3f}", f"{t.ppf(1 - (1 - SCALE_CONFIDENCE) / 2, 5):.2f}"}
    w32 = [r for r in _csv("wgrad_scale_cpu_w32_per_seed.csv") if r["against"] == "fp8" and r["treatment"] != "fp8"]
    small = [r for r in w32 if r["design"].endswith("w32_d2")]
    allowed |= {f"{min(float(r['extra_tokens_pct']) for r in small):.2f}",
                f"{max(float(r['extra_tokens_pct']) for r in small):.2f}",
                f"{max(float(r['val_loss_gap']) for r in small):.3f}"}
    allowed |= {f"{float(r['extra_tokens_pct']):.2f}".lstrip("-") for r in w32
                if r["design"].endswith("w32_d4") and r["treatment"] in ("wgrad_mxfp4", "wgrad_had16")}
    prose = section[section.index("- **C5 `wgrad_slope_8x`"):]
    missing = {f.lstrip("-") for f in _figures(prose, 2) | _figures(prose, 3) | _figures(prose, 4)} - allowed
    assert not missing, f"figures in wgrad_scale_cpu.md's 8x-look prose that its values do not give: {missing}"
    # the ranges against FP8: width 32's and the larger sizes' per-size means
    treat = [fits[a, "fp8"]["means"] for a in ("wgrad_fp8", "wgrad_mxfp4", "wgrad_had16", "wgrad_sr")]
    for lo_i, hi_i in ((0, 2), (2, 7)):
        vals = [100 * math.expm1(m[i]) for m in treat for i in range(lo_i, hi_i)]
        assert f"{min(vals):+.2f} to {max(vals):+.2f} %" in prose


def _wgrad_scale_valgap_rows() -> list[str]:
    """Per size: the end-of-run validation gap of three contrasts (paired by seed, 95 % t interval),
    and the seeds whose C1 crossings (wgrad_mxfp4 and wgrad_fp8, each against FP8) lie within 0.1
    points of each other."""
    gap = _scale_column("val_loss_gap_to_fp8", "val_loss_gap")
    x, params = _scale_effects()
    labels = {s: f"{s.split('_w')[1].split('_')[0]}x{s[-1]}" for s in params}
    rows = []
    for s in params:
        cells = [labels[s]]
        for a, b in (("wgrad_fp8", "fp8"), ("wgrad_mxfp4", "wgrad_fp8"), ("wgrad_mxfp4", "wgrad_had16")):
            iv = stats.paired_interval([gap[a, s, k] - gap[b, s, k] for k in range(3)])
            cells.append(f"{iv.mean:+.4f} [{iv.lo:+.4f}, {iv.hi:+.4f}]")
        cells.append(str(sum(abs(x["wgrad_mxfp4", s, k] - x["wgrad_fp8", s, k]) < 0.1 for k in range(3))))
        rows.append(_table_row(cells))
    return rows


def test_wgrad_scale_validation_gaps_regenerate_from_the_per_seed_values():
    """The end-of-run validation gaps beside C1/C2 (exploratory), from the committed per-seed files."""
    section = _wgrad_md("### What the crossing measured", "### The predictor against")
    _assert_rows(section, _wgrad_scale_valgap_rows(), "validation-gap")
    # their slopes over sizes (launch/scale_study.py slopes --metric val_gap, 95 %)
    for (a, b), (means, slope, boot, half) in _valgap_slopes(w32=False).items():
        row = (f"| {a} vs {b} | {' / '.join(f'{m:+.4f}' for m in means)} | {slope:+.4f} | {boot[0]:+.4f}, "
               f"{boot[1]:+.4f} | {slope - half:+.4f}, {slope + half:+.4f} |")
        assert row in section, f"wgrad_scale_cpu.md lacks the regenerated validation-gap slope row:\n{row}"


def _wgrad_scale_batch_rows() -> list[str]:
    """The gradient-error figures of 256x2's FP8 checkpoints at step 1664 by tokens per step: 2,048
    (the sweep's batch, part 3b's bias file) and the larger batches of the batch file, for the seeds
    the batch file holds; noise, the bias of plain MXFP4 and of the Hadamard, and their drift ratios
    ``bias x sqrt(1664) / noise``."""
    big = _csv("wgrad_scale_cpu_part3b_bias_batch.csv")
    seeds = sorted({int(r["seed"]) for r in big})
    base = [dict(r, tokens_per_step="2048") for r in _csv("wgrad_scale_cpu_part3b_bias.csv")
            if r["step"] == "1664" and int(r["seed"]) in seeds]
    val = {(int(r["seed"]), int(r["tokens_per_step"]), r["treatment"]): r for r in base + big}
    rows = []
    for seed, tokens in sorted({(k[0], k[1]) for k in val}):
        plain, had = val[seed, tokens, "wgrad_mxfp4"], val[seed, tokens, "wgrad_had16"]
        noise = float(plain["noise"])
        cells = [str(seed), f"{tokens:,}", f"{noise:.2f}", f"{float(plain['bias']):.4f}", f"{float(had['bias']):.4f}",
                 f"{_drift(plain, 1664):.2f}", f"{_drift(had, 1664):.2f}"]
        rows.append(_table_row(cells))
    return rows


def test_wgrad_scale_batch_check_regenerates_from_the_committed_measurements():
    """The 8B prediction's batch check (exploratory): every row of its table from the committed files."""
    section = _wgrad_md("**2. The first-order predictor at the study's batch", "The extrapolation rests on")
    _assert_rows(section, _wgrad_scale_batch_rows(), "batch")
    # the exponent of one step's noise in the batch, 2,048 to 32,768 tokens, per seed (1/sqrt: 0.5)
    noise = {(int(r["seed"]), int(r.get("tokens_per_step") or 2048)): float(r["noise"])
             for r in _csv("wgrad_scale_cpu_part3b_bias.csv") + _csv("wgrad_scale_cpu_part3b_bias_batch.csv")
             if r["step"] == "1664" and r["treatment"] == "wgrad_mxfp4"}
    iv = stats.paired_interval([math.log(noise[k, 2048] / noise[k, 32768]) / math.log(16)
                                for k in sorted({k for k, b in noise if b == 32768})])
    cell = f"{iv.mean:.2f} [{iv.lo:.2f}, {iv.hi:.2f}]"
    assert f"exponent {cell}" in section, f"wgrad_scale_cpu.md lacks the noise's exponent in the batch: {cell}"


def _predictor_rows(w32: bool) -> list[str]:
    """The first-order predictor against the measured effects over the sizes (part 3's five, or with
    ``w32`` the 8x look's seven): per size, the mean C1 and C2 effects (% extra tokens, chained) beside
    plain MXFP4's mean drift ratio at the run's end and plain MXFP4's minus the Hadamard's; then the
    fit with pretrain.scale_study.predictor_fit, its slope checked against numpy and r against scipy,
    and r's 95 % Fisher-z interval."""
    import numpy as np
    from scipy.stats import norm, pearsonr

    from pretrain.scale_study import predictor_fit

    x, _ = _scale_effects(w32)
    pred = {"c1": {}, "c2": {}}
    eff = {"c1": {}, "c2": {}}
    rows = []
    for size, label, bias in _bias_by_size(w32):
        steps = max(int(r["step"]) for r in bias)
        plain = _drift_by_seed(bias, "wgrad_mxfp4", steps, steps)
        had = _drift_by_seed(bias, "wgrad_had16", steps, steps)
        pred["c1"][size] = float(np.mean(list(plain.values())))
        pred["c2"][size] = float(np.mean([plain[k] - had[k] for k in plain]))
        for c, b in (("c1", "wgrad_fp8"), ("c2", "wgrad_had16")):
            eff[c][size] = 100 * math.expm1(np.mean([math.log1p(x["wgrad_mxfp4", size, k] / 100)
                                                     - math.log1p(x[b, size, k] / 100) for k in range(3)]))
        rows.append(f"| {label} | {eff['c1'][size]:+.2f} | {pred['c1'][size]:.2f} | {eff['c2'][size]:+.2f} | "
                    f"{pred['c2'][size]:+.2f} |")
    assert len(pred["c1"]) == (7 if w32 else 5)
    for c, name in (("c1", "C1 effect on plain MXFP4's drift ratio"),
                    ("c2", "C2 effect on plain MXFP4's minus the Hadamard's drift ratio")):
        slope, r, n = predictor_fit(pred[c], eff[c])
        keys = list(pred[c])
        u, v = [pred[c][k] for k in keys], [eff[c][k] for k in keys]
        assert math.isclose(slope, np.polyfit(u, v, 1)[0], rel_tol=1e-9)
        assert math.isclose(r, pearsonr(u, v)[0], rel_tol=1e-9)
        z, h = math.atanh(r), norm.ppf(0.975) / math.sqrt(n - 3)
        rows.append(f"| {name} | {n} | {slope:+.2f} | {r:+.2f} | {math.tanh(z - h):+.2f}, {math.tanh(z + h):+.2f} |")
    return rows


def test_wgrad_scale_predictor_fit_regenerates_from_the_committed_measurements():
    """The predictor against the measured effects over part 3's five sizes (exploratory, declared with
    C1/C2) and over the 8x look's seven (exploratory, declared with C5-C8)."""
    _assert_rows(_wgrad_md("### The predictor against", "## The 8B prediction"), _predictor_rows(False),
                 "predictor (five sizes)")
    text = (SWEEPS / "wgrad_scale_cpu.md").read_text()
    _assert_rows(text[text.index("### The 8x look: C5-C8"):], _predictor_rows(True), "predictor (seven sizes)")


# ---------------------------------------------------------------- moe_rollout.md (true replicates)
def test_moe_rollout_claims_regenerate_from_their_per_replicate_values():
    """The 4 declared claims of moe_rollout.yaml recomputed with scipy from the committed per-replicate
    accuracies (one-sided t of the BF16 arm's gain against +0.10, one-sided t of the NVFP4 arm's
    shortfall, TOST at ±0.03 for the two replay arms; Holm over the 4); the write-up's claims table, its
    per-replicate table and the figures of its results section must follow from them."""
    import numpy as np
    from scipy import stats as sps

    text = (SWEEPS / "moe_rollout.md").read_text()
    rows = _csv("moe_rollout_per_seed.csv")
    by = {(r["treatment"], int(r["replicate"])): r for r in rows}
    arms = list(dict.fromkeys(r["treatment"] for r in rows))
    reps = sorted({int(r["replicate"]) for r in rows})
    assert arms == ["bf16", "nvfp4", "nvfp4_tis", "nvfp4_replay", "nvfp4_replay_tis"] and reps == [0, 1, 2, 3]
    col = lambda arm, key: np.array([float(by[arm, r][key]) for r in reps])  # noqa: E731
    start = col("bf16", "initial_accuracy")
    for arm in arms:  # every arm of a replicate starts from the same policy on the same sample
        assert (col(arm, "initial_accuracy") == start).all(), arm
    final = {arm: col(arm, "final_accuracy") for arm in arms}
    gain = final["bf16"] - start
    p = {"bf16_learns": sps.ttest_1samp(gain, 0.10, alternative="greater").pvalue,
         "nvfp4_behind": sps.ttest_1samp(final["nvfp4"] - final["bf16"], 0.0, alternative="less").pvalue,
         "replay_equivalent": _tost_p(final["nvfp4_replay"] - final["bf16"], 0.03),
         "replay_tis_equivalent": _tost_p(final["nvfp4_replay_tis"] - final["bf16"], 0.03)}
    holm = dict(zip(p, stats.holm_adjust(list(p.values()))))
    means = {"bf16_learns": gain.mean(), "nvfp4_behind": (final["nvfp4"] - final["bf16"]).mean(),
             "replay_equivalent": (final["nvfp4_replay"] - final["bf16"]).mean(),
             "replay_tis_equivalent": (final["nvfp4_replay_tis"] - final["bf16"]).mean()}
    claims = _section(text, "| claim | contrast |", "\n\n")
    for cid in p:
        unit = " gain" if cid == "bf16_learns" else " acc"
        cells = f"| {means[cid]:+.4f}{unit} | {p[cid]:.3g} | {holm[cid]:.3g} | {_verdict(holm[cid])} |"
        line = next((x for x in claims.splitlines() if x.startswith(f"| {cid} |")), "")
        assert line.endswith(cells), f"moe_rollout.md's claim row of {cid} does not match its values:\n{line}\n{cells}"
    for r in reps:  # the per-replicate table: start, each arm's final accuracy
        row = f"| {r} | {by['bf16', r]['initial_accuracy']} | " + " | ".join(by[a, r]["final_accuracy"] for a in arms) + " |"
        assert row in text, f"moe_rollout.md lacks the regenerated replicate row:\n{row}"
    results = _section(text, "### Results", "## What this size")
    allowed = {f"{float(r[k]):.3f}" for r in rows for k in r if k.startswith(("acc_", "initial_", "final_", "rollout_"))
               and r[k]}
    for arm in arms:
        for d in (final[arm] - final["bf16"], final[arm] - start, col(arm, "rollout_accuracy") - final[arm],
                  col(arm, "k3_kl_no_replay") - col(arm, "k3_kl_replay")):
            iv = stats.paired_interval(list(d))
            allowed |= {f"{v:+.3f}".lstrip("+") for v in (iv.mean, iv.lo, iv.hi)} | {f"{iv.half_width:.3f}"}
        for key in ("topk_mismatch", "topk_mismatch_first50", "topk_mismatch_last50", "router_prob_gap",
                    "k3_kl_no_replay", "k3_kl_replay", "k3_kl", "raw_ess", "reward_auc"):
            allowed.add(f"{col(arm, key).mean():.3f}")
    allowed |= {f"{start.mean():.3f}", "0.247"}  # the start: over the 4 samples; on all 1,000 problems (above)
    allowed |= {f"{q:.3g}" for q in (*p.values(), *holm.values())}  # the claims' p-values, as the table prints them
    missing = _figures(results, 3) - allowed
    assert not missing, f"figures in moe_rollout.md's results that its values do not give: {missing}"
    _assert_headline(text)


# ---------------------------------------------------------------- descent studies with declared claims
def _check_descent_claims(study: str, seeds: int) -> None:
    """The declared claims of ``STUDY.yaml`` recomputed with scipy from the committed per-seed log step
    ratios (one-sided t, TOST at log(1 + margin) for an equivalence, Holm over the study's claims), and
    the descent table's row of every claim's contrast and of every treatment against the baseline
    (geometric mean of the per-seed extra steps with its back-transformed 95 % interval): both as
    section 6 of the write-up prints them."""
    import numpy as np
    import yaml
    from scipy import stats as sps

    text = (SWEEPS / f"{study}.md").read_text()
    rows = _csv(f"{study}_per_seed.csv")
    spec = yaml.safe_load((SWEEPS / f"{study}.yaml").read_text())
    tests, baseline = spec["claims"]["tests"], spec["baseline"]
    ps, means, logs = [], [], {}
    for c in tests:
        v = np.array([float(r["log_ratio"]) for r in rows if r["claim"] == c["id"]])
        assert all(r["treatment"] == c["contrast"][0] and r["against"] == c["contrast"][1]
                   for r in rows if r["claim"] == c["id"]), c["id"]
        assert len(v) == seeds, c["id"]
        logs[c["id"]] = v
        if c["direction"] == "equivalent":
            p = _tost_p(v, math.log1p(c["margin"] / 100))
        else:
            p = sps.ttest_1samp(v, 0.0, alternative="greater" if c["direction"] == "worse" else "less").pvalue
        ps.append(p)
        means.append(v.mean())
    ps += [1.0] * (spec["claims"]["study_claims"] - len(tests))  # claims tested elsewhere count as p = 1
    claims = _section(text[text.index("## 6."):], "| claim | contrast |", "\n\n")
    for c, p, a, m in zip(tests, ps, stats.holm_adjust(ps), means):
        cells = f"| {100 * math.expm1(m):+.2f} % | {p:.3g} | {a:.3g} | {_verdict(a)} |"
        line = next((x for x in claims.splitlines() if x.startswith(f"| {c['id']} |")), "")
        assert line.endswith(cells), f"{study}.md's claim row of {c['id']} does not match its values:\n{line}\n{cells}"

    def extra(v, censored: int = 0) -> str:
        iv = stats.paired_interval(list(v))
        pct = lambda x: 100 * math.expm1(x)  # noqa: E731
        if censored:  # a seed never reached a target: its value is a lower bound, and so is the mean
            return f"> {pct(iv.mean):+.2f} (lower bound: {censored} of {seeds} seeds censored, no interval)"
        return f"{pct(iv.mean):+.2f} [{pct(iv.lo):+.2f}, {pct(iv.hi):+.2f}] ({seeds} seeds)"

    descent = _section(text, "## 6.", "**What the result does not say.**")
    for c in tests:  # the contrasts' rows, from the same per-seed values as the claims
        a, b = c["contrast"]
        label = a if b == baseline else f"{a} vs {b}"
        line = next(x for x in descent.splitlines() if x.startswith(f"| {label} | {seeds} |"))
        assert extra(logs[c["id"]]) in line, (label, line, extra(logs[c["id"]]))
    for name in dict.fromkeys(r["treatment"] for r in rows if r["against"] == baseline):
        if name == baseline:
            continue
        mine = [r for r in rows if (r["against"], r["treatment"]) == (baseline, name)]
        v, censored = [float(r["log_ratio"]) for r in mine], sum(int(r.get("censored") or 0) for r in mine)
        line = next(x for x in descent.splitlines() if x.startswith(f"| {name} | {seeds} |"))
        assert extra(v, censored) in line, (name, line, extra(v, censored))
    _assert_headline(text)


def test_fp4_controls_claims_and_descent_rows_regenerate_from_the_per_seed_values():
    _check_descent_claims("fp4_controls_cpu", seeds=6)


def test_fp4_presets_claims_and_descent_rows_regenerate_from_the_per_seed_values():
    """As the controls study; and every 2-decimal figure of the results' prose is a mean or interval
    bound of one of the file's pairs, a ratio of two of its means, or the controls study's (cited)."""
    _check_descent_claims("fp4_presets_cpu", seeds=6)
    text = (SWEEPS / "fp4_presets_cpu.md").read_text()
    prose = _section(text, "- **`four_over_six_beats_nvfp4`: supported.**", "The descent table as the report")
    pct = lambda x: 100 * math.expm1(x)  # noqa: E731
    means, allowed = {}, set()
    for study in ("fp4_presets_cpu", "fp4_controls_cpu"):
        rows = _csv(f"{study}_per_seed.csv")
        for key in dict.fromkeys((r["against"], r["treatment"]) for r in rows):
            iv = stats.paired_interval([float(r["log_ratio"]) for r in rows if (r["against"], r["treatment"]) == key])
            means[study, key] = iv.mean
            allowed |= {f"{abs(pct(x)):.2f}" for x in (iv.mean, iv.lo, iv.hi)}
    gap = means["fp4_presets_cpu", ("fp8", "nvfp4_quartet2")] - means["fp4_presets_cpu", ("fp8", "nvfp4_4over6")]
    allowed.add(f"{abs(pct(gap)):.2f}")
    missing = {f.lstrip("-") for f in _figures(prose, 2)} - allowed
    assert not missing, f"figures in fp4_presets_cpu.md's results that its values do not give: {missing}"

"""A sweep's report: ``collect`` analyses every run and writes ``results.csv`` (one row per run),
``summary.csv`` (one row per grid point), ``results.md`` (the tables, an interval and a verdict
beside every gap) and the plots (``pretrain.sweep.plots``); an RL sweep's go through
``pretrain.rl.sweep_results``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from pretrain.sweep.plots import write_plots
from pretrain.sweep.results import (
    analyse,
    best_points,
    descent_numbers,
    pair_numbers,
    paired_base,
    read_scalars,
    read_val_batches,
    summarize,
    summarize_descent,
)
from pretrain.sweep.runner import read_status, run_dir
from pretrain.sweep.spec import SMOOTH_DEFAULT, Run

__all__ = [
    "COLUMNS",
    "DESCENT_COLUMNS",
    "SUMMARY_COLUMNS",
    "SUMMARY_EXTRA_COLUMNS",
    "collect",
    "collect_rl",
    "descent_table",
    "per_seed_rows",
    "report_sweep",
    "summary_table",
    "write_per_seed",
    "write_tables",
]


def collect(out: Path, runs: list[Run], baseline: str | None, window: int = SMOOTH_DEFAULT,
            margin: float | None = None, descent: list[int] | None = None,
            published: dict | None = None, contrasts: list[list[str]] | None = None) -> list[dict]:
    """Analyse every run, write results.csv / summary.csv / results.md and the plots; return the run
    rows. ``margin``: the sweep's ``equivalence_margin`` (none: no equivalence verdicts);
    ``descent``: its ``descent_steps`` (the runs compared during the descent, ``descent.csv`` and a
    table first in results.md); ``published``: its ``published`` figures, printed beside that table;
    ``contrasts``: its ``[a, b]`` pairs, compared in the end-of-run table (and the descent's) too
    (``a`` against ``b``), inside the same Holm adjustment."""
    if runs and runs[0].script == "rl":
        return collect_rl(out, runs, baseline, margin)
    rows = []
    for r in runs:
        tb = run_dir(out, r) / "tensorboard"
        row = analyse(r.name, read_scalars(tb) if tb.exists() else {}, window)
        row["precision"] = r.precision
        row["status"] = read_status(out, r)
        row["seed"] = r.seed
        row["_run"] = r
        row["_val_batches"] = read_val_batches(tb) if tb.exists() else {}
        rows.append(row)
    pairs = paired_base(rows, baseline, hyper_equal=True)
    for row in rows:
        base = pairs.get(row["run"])
        if base is not None:
            row.update(pair_numbers(row, base))
        else:
            row.update(gap_train_loss=float("nan"), gap_val_loss=float("nan"), extra_tokens_pct=float("nan"),
                       extra_tokens_censored=False, extra_tokens_fit_pct=float("nan"),
                       extra_tokens_fit_extrapolated=False, extra_tokens_fit_censored=False,
                       gap_val_batch_se=float("nan"))
    for row in rows:
        base = pairs.get(row["run"])
        d = descent_numbers(row, base, descent) if descent and base is not None else None
        row["descent_extra_pct"] = d.extra.pct if d else float("nan")
        row["descent_extra_censored"] = d.extra.censored if d else False
        row["descent_excess_loss"] = d.excess_loss if d else float("nan")
    summary = summarize(rows, baseline, margin=margin, contrasts=contrasts)
    grid_summary = [s for s in summary if s["against"] == baseline]
    descent_rows = summarize_descent(rows, baseline, descent, contrasts) if descent else []
    tuned = []
    hyper = sorted({k for r in runs for k in r.point})
    if hyper:
        best = best_points(grid_summary)
        if baseline in best:
            base_runs = {m["_run"].seed: m for m in rows if m["_run"].group == best[baseline]["point"]}
            groups = [best[p]["point"] for p in dict.fromkeys(r.label for r in runs) if p in best]
            tuned = summarize(rows, baseline, groups, base_runs, margin=margin)
    write_tables(out, rows, summary, tuned, baseline, hyper, descent_rows, published)
    write_claims(out, rows, descent)
    write_per_seed(out, rows, baseline, descent, contrasts)
    note_first_table(out, rows)
    write_plots(out, rows, grid_summary, tuned or grid_summary, baseline, base_runs if tuned else None)
    return rows


FIRST_TABLE = "first_table.json"


def note_first_table(out: Path, rows: list[dict]) -> None:
    """Record when this sweep's table was first produced and on which seeds (``first_table.json``);
    when seeds finished since, say so under results.md's title: the table now extends a sample that was
    looked at, so its verdicts are exploratory (a declared claim tests such seeds as a new
    confirmatory run, ``pretrain.sweep.claims``)."""
    import json
    from datetime import datetime, timezone

    seeds = sorted({r["_run"].seed for r in rows if r.get("status") in ("done", "diverged") and r["_run"].seed is not None})
    f = out / FIRST_TABLE
    if not f.is_file():
        if seeds:
            tmp = f.with_suffix(".tmp")
            tmp.write_text(json.dumps({"produced": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                       "seeds": seeds}, indent=1))
            tmp.replace(f)
        return
    first = json.loads(f.read_text())
    added = [s for s in seeds if s not in first["seeds"]]
    if not added:
        return
    md = (out / "results.md").read_text().split("\n", 1)
    note = (f"**Seeds {', '.join(map(str, added))} finished after this table was first produced ({first['produced']}, "
            f"seeds {', '.join(map(str, first['seeds']))}): the table extends a sample that was looked at, so its "
            "verdicts are exploratory; test the added seeds on their own (a claims: section does).**")
    (out / "results.md").write_text("\n".join([md[0], "", note, md[1]]))


def _declared_claims(out: Path) -> dict | None:
    """The ``claims:`` section of the sweep file recorded in ``out/sweep.json`` (None without one)."""
    import json

    info = out / "sweep.json"
    return json.loads(info.read_text()).get("sweep", {}).get("claims") if info.is_file() else None


def write_claims(out: Path, rows: list[dict], descent: list[int] | None) -> None:
    """The study's declared claims (``pretrain.sweep.claims``) from the ``claims:`` section of the sweep
    file recorded in ``sweep.json``: ``claims.csv`` and a first section of results.md. The csv's ``mean``
    is the table's: ``label - against`` (the gain for ``gain``; log(1 + x) for a % metric)."""
    import json

    from pretrain.sweep.claims import FIRST_LOOK, claims_table, evaluate_claims, reported_mean

    claims = _declared_claims(out)
    if not claims:
        return
    results = evaluate_claims(out, rows, claims, descent)
    with open(out / "claims.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["study", "claim", "new_confirmatory_run", "label", "against", "metric", "direction", "margin",
                    "seeds", "mean", "p", "p_holm", "verdict"])
        for r in results:
            w.writerow([claims["study"], r.id, r.new_run, *r.contrast, r.metric, r.direction, r.margin,
                        " ".join(map(str, r.seeds)), reported_mean(r.metric, r.mean), r.p, r.p_holm, r.verdict])
    md = (out / "results.md").read_text().split("\n", 2)
    first = json.loads((out / FIRST_LOOK).read_text()) if (out / FIRST_LOOK).is_file() else None
    rest = md[2].replace("| verdict (Holm over", "| exploratory verdict (Holm over").replace(
        "| final acc gap: verdict (Holm over", "| final acc gap: exploratory verdict (Holm over")
    (out / "results.md").write_text("\n".join([md[0], md[1], *claims_table(results, claims, first), rest]))


PER_SEED = "per_seed.csv"


def per_seed_rows(rows: list[dict], baseline: str | None, descent: list[int] | None = None,
                  contrasts: list[list[str]] | None = None, claims: dict | None = None) -> list[dict]:
    """One row per compared pair and seed: every grid point against the baseline, then every contrast
    ``[a, b]`` and declared claim (``a`` against ``b``) not already listed, each on its finished runs of
    one seed and hyper-parameter point. The value is the one the tables and claims test: the descent's
    extra steps and excess loss with ``descent_steps``, else the end-of-run extra tokens and validation
    loss gap; ``log_ratio`` is ``log(1 + x / 100)`` (``inf`` / ``-inf``: the treatment's / the
    comparator's run diverged); ``censored`` is 1 where the run never reached one of its targets, so
    that its extra steps / tokens are a lower bound (the tables print such a mean as ``> x``);
    ``claim`` names the declared claim the pair is (or is empty); ``design`` the hyper-parameter point
    (empty without one)."""
    from pretrain.evaluation.extra_tokens import log_ratio
    from pretrain.sweep.results import _diverged, partner

    tests = {tuple(t["contrast"]): t["id"] for t in (claims or {}).get("tests", [])}
    labels = list(dict.fromkeys(r["_run"].label for r in rows))
    pairs = [(baseline, a) for a in labels] if baseline else []
    for a, b in [*(contrasts or []), *tests]:
        if (b, a) not in pairs:
            pairs.append((b, a))
    value, gap = ("extra_steps_pct", "excess_loss") if descent else ("extra_tokens_pct", "val_loss_gap")
    finished = ("done", "diverged")
    out = []
    for against, treatment in pairs:
        for m in rows:
            base = partner(rows, against, m) if m["_run"].label == treatment else None
            if base is None or m.get("status", "done") not in finished or base.get("status", "done") not in finished:
                continue
            if descent:
                d = descent_numbers(m, base, descent)
                pct, loss, censored = d.extra.pct, d.excess_loss, d.extra.censored
            else:
                p = pair_numbers(m, base)
                pct, loss, censored = p["extra_tokens_pct"], p["gap_val_loss"], p["extra_tokens_censored"]
            lr = log_ratio(pct) if math.isfinite(pct) else pct
            if _diverged(m) or _diverged(base):
                lr = math.inf if _diverged(m) else -math.inf
            run = m["_run"]
            out.append({"design": " ".join(f"{k}={v}" for k, v in run.point.items()), "against": against,
                        "treatment": treatment, "seed": run.seed, value: pct, "log_ratio": lr, gap: loss,
                        "censored": int(bool(censored)), "claim": tests.get((treatment, against), "")})
    return out


def write_per_seed(out: Path, rows: list[dict], baseline: str | None, descent: list[int] | None = None,
                   contrasts: list[list[str]] | None = None) -> Path | None:
    """``per_seed.csv`` (:func:`per_seed_rows`, the claims from ``sweep.json``): the per-seed results a
    write-up keeps as ``configs/sweeps/results/STUDY_per_seed.csv``, the findings figures' input
    (``pretrain.sweep.findings``) and what a write-up's tables are regenerated from. The ``design``
    column is left out when no run has a hyper-parameter point."""
    table = per_seed_rows(rows, baseline, descent, contrasts, _declared_claims(out))
    if not table:
        return None
    cols = list(table[0])
    if not any(r["design"] for r in table):
        cols.remove("design")
    f = out / PER_SEED
    tmp = f.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in table:
            w.writerow(["" if r[c] is None else f"{r[c]:.10g}" if isinstance(r[c], float) else r[c] for c in cols])
    tmp.replace(f)
    return f


def collect_rl(out: Path, runs: list[Run], baseline: str | None, margin: float | None = None) -> list[dict]:
    """An RL sweep's results (``pretrain.rl.sweep_results``): accuracy, reward AUC, mismatch, speed."""
    from pretrain.rl.sweep_results import analyse_rl, read_summary, summarize_rl, write_rl_results

    rows = []
    for r in runs:
        d = run_dir(out, r)
        tb = d / "tensorboard"
        row = analyse_rl(r.name, read_scalars(tb) if tb.exists() else {},
                         read_summary(d / "checkpoints" / "rl_summary.json"))
        row.update(status=read_status(out, r), label=r.label, seed=r.seed, _run=r)
        rows.append(row)
    write_rl_results(out, rows, summarize_rl(rows, baseline, margin), baseline,
                     sorted({k for r in runs for k in r.point}))
    write_claims(out, rows, None)
    note_first_table(out, rows)
    return rows


COLUMNS = ["run", "status", "precision", "seed", "iterations", "final_train_loss", "final_val_loss",
           "val_loss_sem", "gap_train_loss", "gap_val_loss", "gap_val_batch_se", "extra_tokens_pct",
           "diverged", "spike", "tokens_per_sec", "extra_tokens_censored", "extra_tokens_fit_pct",
           "extra_tokens_fit_extrapolated", "extra_tokens_fit_censored"]
# with descent_steps: per run (results.csv) and per grid point (descent.csv)
RUN_DESCENT_COLUMNS = ["descent_extra_pct", "descent_extra_censored", "descent_excess_loss"]
DESCENT_COLUMNS = ["point", "precision", "seeds", "first_step", "last_step", "baseline_loss_first",
                   "baseline_loss_last", "excess_loss_mean", "excess_loss_lo", "excess_loss_hi", "excess_loss_p",
                   "verdict_excess", "extra_steps_mean", "extra_steps_lo", "extra_steps_hi", "extra_steps_censored",
                   "extra_steps_p", "verdict_extra", "diverged", "published"]
SUMMARY_COLUMNS = ["point", "precision", "seeds", "val_loss_mean", "val_loss_sd", "val_loss_sem",
                   "gap_val_mean", "gap_val_lo", "gap_val_hi", "gap_val_batch_se", "extra_tokens_mean",
                   "extra_tokens_lo", "extra_tokens_hi", "extra_not_reached", "diverged", "verdict"]
# after the hyper-parameter columns, so the columns above keep their places
SUMMARY_EXTRA_COLUMNS = ["gap_val_n", "gap_val_excluded", "gap_val_p", "verdict_unadjusted",
                         "extra_tokens_fit_mean", "extra_tokens_fit_lo", "extra_tokens_fit_hi",
                         "extra_tokens_fit_extrapolated"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "not reached"
        return f"{v:.4f}"
    return str(v)


def _summary_csv_row(s: dict, hyper: list[str]) -> list:
    g, e, f = s["gap_val"], s["extra_tokens"], s["extra_tokens_fit"]
    flat = {**s, "gap_val_mean": g.mean, "gap_val_lo": g.lo, "gap_val_hi": g.hi,
            "extra_tokens_mean": e.mean, "extra_tokens_lo": e.lo, "extra_tokens_hi": e.hi,
            "gap_val_n": g.n, "gap_val_excluded": g.excluded, "gap_val_p": g.p_value(),
            "extra_tokens_fit_mean": f.mean, "extra_tokens_fit_lo": f.lo, "extra_tokens_fit_hi": f.hi}
    return [flat[c] for c in SUMMARY_COLUMNS] + [s.get(h) for h in hyper] + [flat[c] for c in SUMMARY_EXTRA_COLUMNS]


def _mean_sd(mean: float, sd: float) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4f}" if math.isnan(sd) else f"{mean:.4f} ± {sd:.4f}"


def summary_table(summary: list[dict], hyper: list[str]) -> list[str]:
    """Markdown rows: one per grid point, every gap with its interval and noise verdict."""
    k = sum(1 for s in summary if not s["is_baseline"] and s["gap_val"].n >= 2 and not s["gap_val"].excluded)
    head = ["precision", *hyper, "seeds", "val loss (mean ± sd)", "val s.e.",
            "gap to baseline (95% CI, unadjusted)", "gap s.e. (val batches)", "extra tokens % (95% CI)",
            "extra tokens % from fitted L(D)", f"verdict (Holm over {k})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        verdict_text = s["verdict"]
        if s["diverged"] and not s["verdict"].startswith("diverged"):
            verdict_text += f"; {s['diverged']} diverged"
        cells = [s["precision"], *(str(s.get(h)) for h in hyper), str(s["seeds"]),
                 _mean_sd(s["val_loss_mean"], s["val_loss_sd"]), _fmt(s["val_loss_sem"]),
                 s["gap_val"].text(4, seeds=True), _fmt(s["gap_val_batch_se"]), s["_extra"].text(1),
                 s["_extra_fit"].text(1), verdict_text]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def descent_table(descent: list[dict], published: dict | None = None) -> list[str]:
    """Markdown rows: the descent's excess loss and extra steps per grid point, each with its 95%
    interval over seeds and a Holm-adjusted verdict; ``published`` figures in a last column."""
    k = sum(1 for s in descent if not s["is_baseline"] and s["excess_loss"].n >= 2 and not s["excess_loss"].excluded)
    ke = sum(1 for s in descent if not s["is_baseline"] and s["_extra"].interval.n >= 2 and not s["_extra"].censored)
    head = ["precision", "seeds", "excess train loss (95% CI)", f"verdict (Holm over {k})",
            "extra steps % (95% CI)", f"verdict (Holm over {ke})"]
    if published:
        head.append(f"published: {published['source']}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in descent:
        cells = [s["precision"], str(s["seeds"]), s["excess_loss"].text(4, seeds=True), s["verdict_excess"],
                 s["_extra"].text(2), s["verdict_extra"]]
        if published:
            cells.append(str(published["extra_tokens"].get(s["precision"], "baseline" if s["is_baseline"] else "")
                             if s["against"] == descent[0]["against"] else ""))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def _descent_csv_row(s: dict, published: dict | None) -> list:
    e, x = s["excess_loss"], s["_extra"].interval
    return [s["point"], s["precision"], s["seeds"], s["window"][0], s["window"][1], *s["baseline_loss_at"],
            e.mean, e.lo, e.hi, e.p_value(), s["verdict_excess"], x.mean, x.lo, x.hi, s["_extra"].censored,
            s["_extra"].log_interval.p_value(), s["verdict_extra"], s["diverged"],
            (published or {}).get("extra_tokens", {}).get(s["precision"], "")]


def write_tables(out: Path, rows: list[dict], summary: list[dict], tuned: list[dict],
                 baseline: str | None, hyper: list[str], descent: list[dict] | None = None,
                 published: dict | None = None) -> None:
    columns = COLUMNS + (RUN_DESCENT_COLUMNS if descent else [])
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow([row[c] for c in columns])
    if descent:
        with open(out / "descent.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(DESCENT_COLUMNS)
            for s in descent:
                w.writerow(_descent_csv_row(s, published))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_COLUMNS + hyper + SUMMARY_EXTRA_COLUMNS)
        for s in summary:
            w.writerow(_summary_csv_row(s, hyper))
    seeds = max((s["seeds"] for s in summary), default=0)
    points = sum(1 for s in summary if s["against"] == baseline)

    def then_contrasts(table: list[dict]) -> str:
        return ", then each contrast 'a vs b' (a against b)" if any(s["against"] != baseline for s in table) else ""

    lines = [(f"# Sweep results ({len(rows)} runs, {points} grid points x {seeds} seed(s), "
              f"baseline: {baseline or 'none'})"), "",
             ("## Per grid point (gaps paired by seed against the baseline at the same hyper-parameters"
              f"{then_contrasts(summary)})"), ""]
    if descent:
        first, last = descent[0]["window"]
        at = next((s["baseline_loss_at"] for s in descent if s["is_baseline"]), [float("nan")] * 2)
        lines[-2] = (f"## During the descent: steps {first}-{last} (the baseline's training loss "
                     f"{_fmt(at[0])} -> {_fmt(at[1])}), paired by seed against the baseline"
                     + then_contrasts(descent))
        lines += descent_table(descent, published)
        lines += ["", ("excess train loss: the run's unsmoothed training loss minus the baseline's, mean over the "
                       "baseline's logged steps in the window; extra steps: at each of those steps s, the step at "
                       "which the run first reaches the baseline's loss at s, in % more than s (= % more tokens), "
                       "mean over the window ('>': a lower bound, a seed never reached a target), averaged over seeds "
                       "on log(1 + x) and back-transformed (a geometric mean; its interval is asymmetric). "
                       "Intervals: 95% "
                       "Student-t over the seeds' paired values, unadjusted; verdicts Holm-adjusted over the "
                       "column's comparisons. Published figures are the end-of-training extra tokens of the "
                       "source, not a descent measurement."),
                  "", ("## Per grid point at the end (gaps paired by seed against the baseline at the same "
                       f"hyper-parameters{then_contrasts(summary)})"), ""]
    lines += summary_table(summary, hyper)
    if tuned:
        lines += ["", (f"## Each precision at its own best {', '.join(hyper)} (lowest mean val loss), "
                       "paired with the baseline at its best"), "",
                  (f"The best {', '.join(hyper)} was chosen on the same seeds these intervals use, so the "
                   "intervals and verdicts are optimistic (selection and estimation share seeds); confirm a "
                   "choice on seeds not in this sweep."), ""]
        lines += summary_table(tuned, hyper)
    lines += ["", "## Runs", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "/") for c in columns) + " |")
    lines += ["", ("gap: final validation loss minus the baseline's, per seed (same initialization and data "
              "order), mean over the seeds it used ± the half-width of its unadjusted 95% Student-t interval. "
              "verdict: Holm-adjusted over the table's comparisons, so the chance of any false worse/better "
              "in the table stays below 5%; *worse*/*better*: shown to differ; *equivalent (±m)*: two one-sided "
              "tests show the gap inside the sweep's equivalence_margin m (the only verdict that means no cost "
              "beyond m); *not shown to differ*: neither -- it does not mean no cost; *diverged in k of n "
              "seeds*: those seeds are a result, not averaged away (the printed mean is the survivors'); "
              "the verdict before it comes from an exact rank test of the seeds' final validation losses, a "
              "diverged seed ranked worst; with a margin, the equivalence verdict follows the difference "
              "verdict. val s.e.: standard error of the validation "
              "loss over its batches; gap s.e. (val batches): standard error of the gap from the choice of "
              "validation batches (paired per-batch differences). extra tokens: % more training tokens than "
              "the baseline for the same smoothed training loss, paired by seed -- for a worse run, the "
              "baseline's step at the run's final loss; for a better one, the run's step at the baseline's "
              "final loss; averaged and tested over seeds on log(1 + x), shown back-transformed: the geometric "
              "mean [95% interval]. From fitted L(D): the same ratio at the baseline's final loss from E + A*D^-alpha "
              "fitted to each run ('extrapolated': beyond the run; '>': a lower bound, the run's fitted floor E "
              "lies above the baseline's final loss, so it never reaches it; a mean with a lower bound in it "
              "is a lower bound and has no interval). diverged: a NaN/Inf loss; spike: the smoothed loss "
              "rose above 1.5x its early minimum in the second half.")]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def report_sweep(out: Path) -> int:
    """Re-collect a sweep's results from its runs (``sweep.json`` names them) and print its tables."""
    import json

    from pretrain.sweep.spec import Run

    info = json.loads((out / "sweep.json").read_text())
    runs = [Run(**r) for r in info["runs"]]
    sw = info["sweep"]
    collect(out, runs, sw.get("baseline"), window=sw.get("smooth", SMOOTH_DEFAULT), margin=sw.get("equivalence_margin"),
            descent=sw.get("descent_steps"), published=sw.get("published"), contrasts=sw.get("contrasts"))
    print((out / "results.md").read_text().split("\n## Runs")[0])
    plots = ([out / "rl_curves.png"] if runs and runs[0].script == "rl"
             else [out / "loss_curves.png", out / "loss_gap_curves.png", out / "gap.png"])
    print(f"wrote {out / 'results.md'}, {out / 'summary.csv'}, " + ", ".join(map(str, plots)))
    return 0

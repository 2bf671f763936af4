"""The results of a pretraining sweep: TensorBoard reading and the statistics over seeds (the RL
sweep's are ``pretrain.rl.sweep_results``).

Per run, ``analyse`` reads the smoothed training loss, the last validation loss and its standard
error, tokens/s and whether it diverged or spiked. Runs with the same seed share their
initialization and data order, so each run is paired with the baseline at that seed: the loss gaps,
the "extra tokens" both ways and from a fitted ``L(D)`` (``pretrain.evaluation.extra_tokens``) and
the gap's standard error over validation batches. ``summarize`` gives one row per grid point: means
over seeds, paired 95% Student-t intervals and Holm-adjusted verdicts (``pretrain.evaluation.stats``).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from pretrain.evaluation.extra_tokens import (
    DescentGap,
    ExtraTokens,
    crossing_extra_pct,
    descent_gap,
    fit_power_law,
    fitted_extra_pct,
    summarize_extra,
)
from pretrain.evaluation.stats import (
    Interval,
    RankTest,
    gap_verdict,
    paired_batch_se,
    paired_interval,
    rank_test,
    spread,
    table_verdicts,
)
from pretrain.trainer.tags import (  # read_scalars is re-exported: the sweep's readers and tests use it here
    GRAD_NORM,
    LOSS,
    NONFINITE,
    TOKENS_PER_SEC,
    VAL_LOSS,
    VAL_LOSS_SEM,
    read_scalars,
    series,
)

__all__ = ["analyse", "best_points", "descent_numbers", "extra_tokens_pct", "fitted_extra_tokens_pct", "pair_numbers", "paired_base",
           "read_scalars", "read_val_batches", "smooth", "summarize", "summarize_descent", "verdict"]


def read_val_batches(tb_dir: Path) -> dict[int, list[float]]:
    """Per-batch validation losses by iteration (``val_batches.jsonl``; later lines win)."""
    f = tb_dir / "val_batches.jsonl"
    out: dict[int, list[float]] = {}
    if f.exists():
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            out[int(rec["iteration"])] = [float(v) for v in rec["batch_losses"]]
    return out


def smooth(values: list[float], window: int) -> list[float]:
    res, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        res.append(sum(acc) / len(acc))
    return res


def analyse(name: str, scalars: dict, window: int) -> dict:
    loss = series(scalars, LOSS)
    steps = [s for s, _ in loss]
    vals = [v for _, v in loss]
    finite = [v for v in vals if math.isfinite(v)]
    sm = smooth(finite, window) if finite else []
    # pretrain.py logs nonfinite-steps (a running count) every iteration; a diverging step's
    # loss may be finite while its gradient norm is not
    nonfinite = [v for _, v in series(scalars, NONFINITE)]
    norms = [v for _, v in series(scalars, GRAD_NORM)]
    diverged = (len(finite) < len(vals) or (max(nonfinite) > 0 if nonfinite else False)
                or not all(math.isfinite(v) for v in norms))
    spike = False
    if len(sm) > 2 * window:
        best = min(sm[: len(sm) // 2])
        spike = any(v > 1.5 * best for v in sm[len(sm) // 2:])
    val = series(scalars, VAL_LOSS)
    sem = dict(series(scalars, VAL_LOSS_SEM))
    tps = [v for _, v in series(scalars, TOKENS_PER_SEC)]
    return {
        "run": name,
        "iterations": steps[-1] if steps else 0,
        "final_train_loss": sm[-1] if sm else float("nan"),
        "final_val_loss": val[-1][1] if val else float("nan"),
        "val_loss_sem": sem.get(val[-1][0], float("nan")) if val else float("nan"),
        "tokens_per_sec": sum(tps) / len(tps) if tps else float("nan"),
        "diverged": diverged,
        "spike": spike,
        "_curve": (steps[: len(sm)], sm),
        "_raw": (steps, vals),  # unsmoothed: the descent comparison of a noise-free (full-batch) run
        "_val_step": val[-1][0] if val else None,
    }


def extra_tokens_pct(run_curve, base_curve) -> ExtraTokens:
    """% more tokens the run needs than the baseline for the same smoothed loss, measured both ways
    (``pretrain.evaluation.extra_tokens.crossing_extra_pct``): positive for a worse run, negative
    for a better one, ``censored`` (a lower bound) when the crossing lies beyond a run's end."""
    return crossing_extra_pct(run_curve, base_curve)


def fitted_extra_tokens_pct(row: dict, base: dict) -> ExtraTokens:
    """The token ratio at the baseline's final loss from each run's fitted ``L(D) = E + A*D^-alpha``."""
    for r in (row, base):
        if "_fit" not in r:
            r["_fit"] = fit_power_law(*r["_curve"])
    return fitted_extra_pct(row["_fit"], base["_fit"], base["final_train_loss"])


def paired_base(rows: list[dict], baseline: str | None, hyper_equal: bool) -> dict[str, dict]:
    """For each run, the baseline run it is compared with: same seed, and the same hyper-parameters
    (``hyper_equal``) or the baseline's best ones."""
    pairs = {}
    base_rows = [r for r in rows if r["_run"].label == baseline]
    for row in rows:
        run = row["_run"]
        for b in base_rows:
            if b["_run"].seed == run.seed and (not hyper_equal or b["_run"].point == run.point):
                pairs[row["run"]] = b
    return pairs


def partner(rows: list[dict], label: str | None, row: dict) -> dict | None:
    """The run of ``label`` that ``row`` is paired with: the same seed and hyper-parameters."""
    run = row["_run"]
    return next((r for r in rows if r["_run"].label == label and r["_run"].seed == run.seed
                 and r["_run"].point == run.point), None)


def _diverged(row: dict) -> bool:
    return bool(row["diverged"] or row["status"] == "diverged")


def pair_numbers(row: dict, base: dict) -> dict:
    nan = float("nan")
    if _diverged(row) or _diverged(base):  # no finite comparison: a result, reported as diverged
        extra = fit = ExtraTokens(nan)
    elif row is base:
        extra = fit = ExtraTokens(0.0)
    else:
        extra, fit = extra_tokens_pct(row["_curve"], base["_curve"]), fitted_extra_tokens_pct(row, base)
    lost = _diverged(row) or _diverged(base)
    out = {"gap_train_loss": nan if lost else row["final_train_loss"] - base["final_train_loss"],
           "gap_val_loss": nan if lost else row["final_val_loss"] - base["final_val_loss"],
           "extra_tokens_pct": extra.pct, "extra_tokens_censored": extra.censored,
           "extra_tokens_fit_pct": fit.pct, "extra_tokens_fit_extrapolated": fit.extrapolated,
           "extra_tokens_fit_censored": fit.censored, "_extra": extra, "_extra_fit": fit,
           "gap_val_batch_se": nan}
    a, b = row["_val_batches"].get(row["_val_step"]), base["_val_batches"].get(base["_val_step"])
    if a and b:
        out["gap_val_batch_se"] = 0.0 if row is base else paired_batch_se(a, b)
    return out


def summarize(rows: list[dict], baseline: str | None, groups: list[str] | None = None,
              base_group: dict[int | None, dict] | None = None, margin: float | None = None,
              contrasts: list[list[str]] | None = None) -> list[dict]:
    """One row per grid point: mean and spread over seeds, paired gaps with 95% intervals, verdicts
    Holm-adjusted over the rows (``margin``: the sweep's ``equivalence_margin``); then one row per
    contrast ``[a, b]`` of the sweep (``a`` against ``b``, same seed and hyper-parameters), whose
    comparisons count in the same Holm adjustment. Each row's ``against`` names what it is compared
    with.

    ``base_group`` maps a seed to the baseline run that seed's runs are paired with (default: the
    baseline at the same hyper-parameters). A diverged seed's gap is NaN and kept (the verdict
    reports it); a pair whose baseline diverged is left out (the baseline's row reports it)."""
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["_run"].group, []).append(row)
    out = [_summary_row(group, by_group[group], rows, baseline, baseline, base_group, margin)
           for group in groups or list(by_group)]
    for a, b in contrasts or []:
        out += [_summary_row(group, members, rows, b, baseline, None, margin)
                for group, members in by_group.items() if members[0]["_run"].label == a]
    for s, v in zip(out, table_verdicts([s["gap_val"] for s in out], [s["is_baseline"] for s in out],
                                        margin=margin, ranks=[s["_rank"] for s in out])):
        s["verdict"] = v
    return out


def _summary_row(group: str, members: list[dict], rows: list[dict], against: str | None, baseline: str | None,
                 base_group: dict[int | None, dict] | None, margin: float | None) -> dict:
    """One grid point's runs paired by seed with ``against``'s runs (``base_group``'s, when given)."""
    run = members[0]["_run"]
    val_mean, val_sd = spread([m["final_val_loss"] for m in members])
    train_mean, train_sd = spread([m["final_train_loss"] for m in members])
    gaps, extras, fits, ses, outcomes = [], [], [], [], ([], [])
    for m in members:
        if base_group is not None:
            b = base_group.get(m["_run"].seed)
        else:
            b = partner(rows, against, m)
        if b is None or (_diverged(b) and b is not m):
            continue
        p = pair_numbers(m, b)
        if not _diverged(m) and not math.isfinite(p["gap_val_loss"]):
            continue  # no validation loss yet (a pending or failed run): no pair
        gaps.append(p["gap_val_loss"])
        outcomes[0].append(math.inf if _diverged(m) else m["final_val_loss"])
        outcomes[1].append(b["final_val_loss"])
        extras.append(p["_extra"])
        fits.append(p["_extra_fit"])
        ses.append(p["gap_val_batch_se"])
    gap = paired_interval(gaps)
    n_diverged = sum(1 for m in members if _diverged(m))
    extra = summarize_extra(extras, n_diverged)
    fit = summarize_extra(fits, n_diverged)
    ses = [s for s in ses if math.isfinite(s)]
    is_base = run.label == against
    contrast = against != baseline
    rank = rank_test(*outcomes) if gap.excluded and not is_base else None
    return {
        "point": f"{group} vs {against}" if contrast else group,
        "precision": f"{run.label} vs {against}" if contrast else run.label,
        **{k: v for k, v in run.point.items()},
        "against": against,
        "seeds": len(members),
        "val_loss_mean": val_mean, "val_loss_sd": val_sd,
        "train_loss_mean": train_mean, "train_loss_sd": train_sd,
        "val_loss_sem": spread([m["val_loss_sem"] for m in members])[0],
        "gap_val": gap,
        "gap_val_batch_se": sum(ses) / len(ses) if ses else float("nan"),
        "extra_tokens": extra.interval, "_extra": extra,
        "extra_not_reached": extra.censored,
        "extra_tokens_fit": fit.interval, "_extra_fit": fit,
        "extra_tokens_fit_extrapolated": fit.extrapolated,
        "diverged": n_diverged,
        "is_baseline": is_base,
        "_rank": rank,
        "verdict_unadjusted": verdict(gap, is_base, margin, rank),
    }


def descent_numbers(row: dict, base: dict, window: list[int]) -> DescentGap:
    """The run against its paired baseline during the descent (``descent_steps``), on unsmoothed losses."""
    if row is base:
        return DescentGap(ExtraTokens(0.0), 0.0, 0)
    if _diverged(row) or _diverged(base):
        return DescentGap(ExtraTokens(math.nan), math.nan, 0)
    return descent_gap(row["_raw"], base["_raw"], window[0], window[1])


def summarize_descent(rows: list[dict], baseline: str | None, window: list[int],
                      contrasts: list[list[str]] | None = None) -> list[dict]:
    """One row per grid point against the baseline, then one per contrast ``[a, b]`` (``a`` against
    ``b``, the sweep's ``contrasts``): the descent's extra steps and excess loss, paired by seed (same
    hyper-parameters), 95% intervals over seeds, each column Holm-adjusted over all the table's
    comparisons. A censored seed (a target never reached) makes the extra steps a lower bound
    without an interval; a diverged seed is reported, never averaged away."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["_run"].group, []).append(row)
    wanted = [(g, m[0]["_run"].label, baseline, m[0]["_run"].point) for g, m in groups.items()]
    for a, b in contrasts or []:
        wanted += [(g, a, b, m[0]["_run"].point) for g, m in groups.items() if m[0]["_run"].label == a]
    out = []
    for group, label, against, point in wanted:
        members = groups[group]
        extras, excess, n_diverged, outcomes = [], [], 0, ([], [])
        for m in members:
            b = partner(rows, against, m)
            unfinished = any(r.get("status", "done") not in ("done", "diverged") for r in (m, b) if r is not None)
            if b is None or unfinished or (_diverged(b) and b is not m) or not m["_raw"][0]:
                continue  # no pair (yet): a pending, running or failed run, or a diverged baseline
            outcomes[0].append(window_loss(m, window))
            outcomes[1].append(window_loss(b, window))
            if _diverged(m):
                n_diverged += 1
                excess.append(math.nan)
                continue
            d = descent_numbers(m, b, window)
            if not math.isfinite(d.excess_loss):
                continue
            extras.append(d.extra)
            excess.append(d.excess_loss)
        base_row = next((r for r in rows if r["_run"].label == against and r["_run"].point == point), None)
        at = [interpolate_loss(base_row, s) for s in window] if base_row is not None else [math.nan, math.nan]
        is_base = label == against
        name = label if against == baseline else f"{label} vs {against}"
        out.append({"point": group if against == baseline else f"{group} vs {against}", "precision": name,
                    "against": against, "seeds": len(members), "is_baseline": is_base, "window": list(window),
                    "baseline_loss_at": at, "excess_loss": paired_interval(excess),
                    "_extra": summarize_extra(extras, n_diverged), "diverged": n_diverged,
                    "_rank": rank_test(*outcomes) if n_diverged and not is_base else None})
    live = [not s["_extra"].censored for s in out]
    ranks = [s["_rank"] for s in out]
    for s, v in zip(out, table_verdicts([s["excess_loss"] for s in out], [s["is_baseline"] for s in out],
                                        ranks=ranks)):
        s["verdict_excess"] = v
    # tested on log(1 + x) (pretrain.evaluation.extra_tokens); a diverged seed counts in the rank test
    extra_ivs = [replace(s["_extra"].log_interval, excluded=s["diverged"]) if ok or s["diverged"]
                 else Interval(math.nan, math.nan, math.nan, 0, math.nan) for s, ok in zip(out, live)]
    for s, v, ok in zip(out, table_verdicts(extra_ivs, [s["is_baseline"] for s in out], ranks=ranks), live):
        s["verdict_extra"] = v if ok or s["diverged"] else f"lower bound ({s['_extra'].censored} censored)"
    return out


def window_loss(row: dict, window: list[int]) -> float:
    """A run's mean unsmoothed training loss over its logged steps in ``window``; +inf when it
    diverged (the worst outcome, for the rank test)."""
    if _diverged(row):
        return math.inf
    vals = [v for s, v in zip(*row["_raw"]) if window[0] <= s <= window[1]]
    return sum(vals) / len(vals) if vals else math.nan


def interpolate_loss(row: dict, step: float) -> float:
    """A run's unsmoothed training loss at ``step`` (linear between logged steps)."""
    from pretrain.evaluation.extra_tokens import interpolate

    return interpolate(*row["_raw"], step)


def verdict(gap: Interval, is_baseline: bool, margin: float | None = None, rank: RankTest | None = None) -> str:
    """One gap's verdict on its own (unadjusted); tables use ``table_verdicts`` (Holm)."""
    return gap_verdict(gap, is_baseline, margin=margin, rank=rank)  # a validation-loss gap: higher is worse


def best_points(summary: list[dict]) -> dict[str, dict]:
    """Each precision's grid point with the lowest mean validation loss (its best hyper-parameters)."""
    best: dict[str, dict] = {}
    for s in summary:
        cur = best.get(s["precision"])
        if math.isfinite(s["val_loss_mean"]) and (cur is None or s["val_loss_mean"] < cur["val_loss_mean"]):
            best[s["precision"]] = s
    return best

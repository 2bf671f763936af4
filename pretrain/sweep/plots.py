"""The plots of a pretraining sweep (``launch/sweep.py``; written by ``pretrain.sweep.report``):
``loss_curves.png`` (absolute smoothed training-loss curves, a band over seeds),
``loss_gap_curves.png`` (the paired difference to the baseline over iterations, per precision: mean
over seeds with its 95% Student-t band, as low-precision training papers plot it) and ``gap.png``
(final validation-loss gaps with intervals, coloured by verdict)."""

from __future__ import annotations

import math
from pathlib import Path

from pretrain.evaluation.stats import paired_interval

__all__ = ["paired_gap_curve", "write_plots"]


def _diverged(row: dict) -> bool:
    return bool(row["diverged"] or row["status"] == "diverged")


def _mean_curve(members: list[dict]):
    """Mean, min and max smoothed training loss over seeds, on the steps every seed logged."""
    curves = [dict(zip(*m["_curve"])) for m in members if m["_curve"][0]]
    if not curves:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    mean = [sum(c[s] for c in curves) / len(curves) for s in steps]
    return steps, mean, [min(c[s] for c in curves) for s in steps], [max(c[s] for c in curves) for s in steps]


def paired_gap_curve(members: list[dict], base_of) -> tuple[list[int], list[float], list[float], list[float], int]:
    """The paired difference of smoothed training loss to the baseline over iterations: per seed the
    run's curve minus its baseline's (``base_of(member)``) on the steps both logged, then the mean
    over seeds with a 95% Student-t band on the steps every pair logged (no band with one seed).
    Returns ``(steps, mean, lo, hi, pairs)``; diverged runs and baselines are left out."""
    diffs = []
    for m in members:
        b = base_of(m)
        if b is None or b is m or _diverged(m) or _diverged(b) or not m["_curve"][0] or not b["_curve"][0]:
            continue
        bc = dict(zip(*b["_curve"]))
        diffs.append({st: v - bc[st] for st, v in zip(*m["_curve"]) if st in bc})
    if not diffs:
        return [], [], [], [], 0
    steps = sorted(set.intersection(*(set(d) for d in diffs)))
    mean, lo, hi = [], [], []
    for st in steps:
        iv = paired_interval([d[st] for d in diffs])
        mean.append(iv.mean)
        lo.append(iv.lo)
        hi.append(iv.hi)
    return steps, mean, lo, hi, len(diffs)


def write_plots(out: Path, rows: list[dict], summary: list[dict], shown: list[dict], baseline: str | None,
                base_runs: dict | None = None) -> None:
    """``loss_curves.png`` (absolute curves), ``loss_gap_curves.png`` (the paired difference to the
    baseline over iterations, per precision) and ``gap.png`` (final gaps with intervals). ``base_runs``:
    the baseline run of each seed the shown rows are paired with (the tuned table's), else the
    baseline at the same hyper-parameters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["_run"].group, []).append(row)
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in shown:
        steps, mean, lo, hi = _mean_curve(by_group[s["point"]])
        if not steps:
            continue
        (line,) = ax.plot(steps, mean, label=f"{s['point']} ({s['seeds']} seed{'s' * (s['seeds'] > 1)})",
                          linewidth=2.5 if s["precision"] == baseline else 1.2)
        if s["seeds"] > 1:
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (smoothed; band: min-max over seeds)")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)

    base_rows = [r for r in rows if r["_run"].label == baseline]

    def base_of(m: dict) -> dict | None:
        if base_runs is not None:
            return base_runs.get(m["_run"].seed)
        return next((b for b in base_rows if b["_run"].seed == m["_run"].seed and b["_run"].point == m["_run"].point),
                    None)

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in shown:
        if s["precision"] == baseline:
            continue
        steps, mean, lo, hi, pairs = paired_gap_curve(by_group[s["point"]], base_of)
        if not steps:
            continue
        (line,) = ax.plot(steps, mean, label=f"{s['point']} ({pairs} paired seed{'s' * (pairs > 1)})", linewidth=1.2)
        if pairs > 1:
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training loss - {baseline or 'baseline'} (smoothed, paired by seed)")
    ax.set_title("Paired difference to the baseline (mean over seeds; band: 95% t interval)")
    if ax.lines[1:]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_gap_curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [s["point"] for s in shown]
    gaps = [0.0 if math.isnan(s["gap_val"].mean) else s["gap_val"].mean for s in shown]
    err = [0.0 if math.isnan(s["gap_val"].half_width) else s["gap_val"].half_width for s in shown]
    colors = ["tab:red" if s["diverged"] else "tab:blue" if s["verdict"] in ("worse", "better")
              else "tab:green" if s["verdict"].startswith("equivalent") else "tab:gray" for s in shown]
    ax.bar(range(len(shown)), gaps, yerr=err, capsize=3, color=colors)
    ax.set_xticks(range(len(shown)), names, rotation=45, ha="right", fontsize=7)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_ylabel(f"val loss - {baseline or 'baseline'} (paired, 95% CI)")
    ax.set_title("Gap to the baseline (blue: shown to differ, Holm; green: equivalent; gray: not shown to "
                 "differ; red: diverged)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gap.png", dpi=120)
    plt.close(fig)

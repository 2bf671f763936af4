"""The findings figures: one PNG per study write-up, drawn from its per-seed results CSV.

A study ``NAME`` has its write-up ``configs/sweeps/NAME.md``, its sweep file(s) ``NAME*.yaml`` and its
per-seed results ``configs/sweeps/results/NAME_per_seed.csv`` (one row per treatment and seed). The
figure shows each treatment's mean over seeds with its 95 % Student-t interval
(``pretrain.evaluation.stats.paired_interval``, the seeds being paired against the row's baseline):

- ``extra_steps_pct`` / ``extra_tokens_pct`` columns (the extra-tokens ladder): one row per
  ``section``/``design``/``against``/``treatment`` group (a ``model_size`` column counts as the
  design); where the write-up has a Markdown table with a ``study (...)`` column -- the published
  figures beside ours -- and a row of the same treatment against the same baseline, the published
  range is drawn on that row;
- ``val_loss_gap_to_*`` columns: the validation-loss gap per treatment, with the sweep file's
  ``equivalence_margin`` drawn as the band an equivalence claim must fall in;
- RL studies (``treatment``, ``replicate``, ``final_accuracy`` columns): each treatment's final held-out
  accuracy gap to the file's first treatment (its baseline), paired by replicate, with the
  equivalence margin's band.

``python launch/report.py --findings configs/sweeps/results --out docs/figures`` writes them all.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import yaml

from pretrain.evaluation.stats import Interval, paired_interval

__all__ = ["published_figures", "study_rows", "write_findings", "writeup_for"]

_RANGE = re.compile(r"([+-]?\d+(?:\.\d+)?)\s*(?:[–-]\s*(\d+(?:\.\d+)?))?\s*%")


def published_figures(writeup: str) -> tuple[dict[tuple[str, str], tuple[float, float]], str]:
    """``{(baseline, treatment): (lo, hi)}`` in percent from the write-up's tables with a
    ``study (SOURCE)`` column (the row whose cells say ``baseline`` names the baseline), and SOURCE."""
    found: dict[tuple[str, str], tuple[float, float]] = {}
    source = ""
    lines = writeup.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        col = next((j for j, c in enumerate(cells) if c.lower().startswith("study")), None)
        if not line.lstrip().startswith("|") or col is None:
            continue
        m = re.search(r"\((.*?)\)", cells[col])
        source = source or (m.group(1) if m else cells[col])
        rows = []
        for row in lines[i + 2:]:
            if not row.lstrip().startswith("|"):
                break
            rows.append([c.strip() for c in row.strip().strip("|").split("|")])
        base = next((r[0].strip("`") for r in rows if len(r) > 1 and r[1].lower() == "baseline"), None)
        for r in rows:
            if base is None or len(r) <= col or not (m := _RANGE.search(r[col])):
                continue
            lo = float(m.group(1))
            hi = math.copysign(float(m.group(2)), lo) if m.group(2) else lo
            found[(base, r[0].strip("`"))] = (min(lo, hi), max(lo, hi))
    return found, source


def study_rows(csv_path: Path) -> tuple[str, list[tuple[str, tuple[str, str], Interval]]]:
    """(the value's column, [(row label, (baseline, treatment), interval over seeds)]) of a per-seed CSV,
    in the file's order."""
    with open(csv_path, newline="") as f:
        records = list(csv.DictReader(f))
    if not records:
        raise ValueError(f"{csv_path}: no rows")
    value = next((c for c in records[0] if c.startswith(("extra_steps_pct", "extra_tokens_pct", "val_loss_gap"))),
                 None)
    if value is None and {"treatment", "replicate", "final_accuracy"} <= set(records[0]):
        return _accuracy_gap_rows(records)
    if value is None:
        raise ValueError(f"{csv_path}: no extra_steps_pct, extra_tokens_pct, val_loss_gap_to_* or final_accuracy "
                         f"column (columns: {', '.join(records[0])})")
    against = value.removeprefix("val_loss_gap_to_") if value.startswith("val_loss_gap_to_") else None
    groups: dict[tuple, list[float]] = {}
    censored: dict[tuple, int] = {}
    for r in records:
        design = r.get("design") or (f"model-size={r['model_size']}" if r.get("model_size") else "")
        key = (r.get("section", ""), design, r.get("against", against or ""), r["treatment"])
        groups.setdefault(key, []).append(float(r[value]))
        censored[key] = censored.get(key, 0) + int(r.get("censored") or 0)
    rows = []
    for key, vals in groups.items():
        section, design, base, treatment = key
        where = " ".join(p for p in (f"§{section}" if section else "", design) if p)
        label = f"{where}: {treatment} vs {base}" if where else f"{treatment} vs {base}"
        if censored[key]:  # a seed never reached a target: its value, and the mean, are lower bounds
            label += f" (lower bound: {censored[key]} censored)"
        rows.append((label, (base, treatment), paired_interval(vals)))
    return value, rows


def _accuracy_gap_rows(records: list[dict]) -> tuple[str, list[tuple[str, tuple[str, str], Interval]]]:
    """An RL study's rows: each treatment's final held-out accuracy minus the first treatment's, paired by
    replicate (the baseline's own row is its zero gap)."""
    base = records[0]["treatment"]
    ref = {r["replicate"]: float(r["final_accuracy"]) for r in records if r["treatment"] == base}
    groups: dict[str, list[float]] = {}
    for r in records:
        if r["replicate"] in ref:
            groups.setdefault(r["treatment"], []).append(float(r["final_accuracy"]) - ref[r["replicate"]])
    return "final_accuracy_gap", [(f"{t} vs {base}", (base, t), paired_interval(v)) for t, v in groups.items()]


def writeup_for(study: str, sweeps: Path) -> Path | None:
    """The write-up of a per-seed CSV's study: ``STUDY.md``, else that of the longest ``_``-prefix
    that has one (``wgrad_scale_cpu_h4`` -> ``wgrad_scale_cpu.md``: one sweep of a larger study);
    None if there is none."""
    parts = study.split("_")
    for n in range(len(parts), 0, -1):
        f = sweeps / f"{'_'.join(parts[:n])}.md"
        if f.is_file():
            return f
    return None


def _margin(study: str, sweeps: Path) -> float | None:
    for f in sorted(sweeps.glob(f"{study}*.yaml")):
        m = (yaml.safe_load(f.read_text()) or {}).get("equivalence_margin")
        if m is not None:
            return float(m)
    return None


def _figure(study: str, value: str, rows, published, source: str, margin: float | None, out: Path,
            writeup: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pct = value.endswith("_pct")
    fig, ax = plt.subplots(figsize=(8.5, 0.34 * len(rows) + 1.8))
    ys = list(range(len(rows)))[::-1]
    drawn = False
    for y, (label, key, iv) in zip(ys, rows):
        err = [[iv.mean - iv.lo], [iv.hi - iv.mean]] if iv.n > 1 else None
        ax.errorbar(iv.mean, y, xerr=err, fmt="o", color="tab:blue", capsize=3, ms=4,
                    label=None if y != ys[0] else "this study: mean over seeds, 95% t interval (unadjusted)")
        if key in published:
            lo, hi = published[key]
            ax.plot([lo, hi] if hi > lo else [lo - 0.15, lo + 0.15], [y, y], color="tab:orange", lw=6, alpha=0.6,
                    solid_capstyle="butt", label=None if drawn else f"published ({source})")
            drawn = True
    ax.axvline(0.0, color="k", lw=0.8)
    if margin is not None:
        ax.axvspan(-margin, margin, color="tab:gray", alpha=0.15, label=f"equivalence margin ±{margin:g}")
    ax.set_yticks(ys, [r[0] for r in rows], fontsize=7)
    unit = {"extra_steps_pct": "extra steps to the baseline's loss, %",
            "extra_tokens_pct": "extra tokens to the baseline's loss, %",
            "final_accuracy_gap": "final held-out accuracy gap to the baseline, paired by replicate"}
    ax.set_xlabel(unit.get(value, value.replace("_", " ")), fontsize=8)
    where = f"verdicts, Holm-adjusted: configs/sweeps/{writeup}" if writeup else "no write-up"
    ax.set_title(f"{study} ({where})", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    if pct:
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:+g}%"))
    fig.tight_layout()
    path = out / f"{study}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_findings(results: Path, out: Path, sweeps: Path | None = None) -> list[Path]:
    """One PNG per ``results/*_per_seed.csv`` into ``out``; write-ups and sweep files are looked up
    in ``sweeps`` (default: the results directory's parent)."""
    sweeps = results.parent if sweeps is None else sweeps
    files = sorted(results.glob("*_per_seed.csv"))
    if not files:
        raise FileNotFoundError(f"--findings {results}: no *_per_seed.csv files")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        study = f.name.removesuffix("_per_seed.csv")
        writeup = writeup_for(study, sweeps)
        value, rows = study_rows(f)
        # published figures are extra tokens or steps in %: never drawn on a loss-gap axis
        published, source = (published_figures(writeup.read_text()) if writeup and value.endswith("_pct")
                             else ({}, ""))
        written.append(_figure(study, value, rows, published, source, _margin(study, sweeps), out,
                               writeup.name if writeup else None))
    return written

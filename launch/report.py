#!/usr/bin/env python
"""Numerics report of one training run: which GEMM operand of which layer is breaking training?
Or, given a sweep's output directory, the sweep's results with the interval beside every gap.

    python launch/report.py RUN_DIR [--out DIR] [--step N]
    python launch/report.py SWEEP_OUT                 # the directory launch/sweep.py --out wrote

Reads the TensorBoard scalars ``numerics/<layer>/<gemm>/<operand>/<metric>`` written by
``launch/pretrain.py --numerics-interval N`` (under RUN_DIR, searched recursively) and writes, for
each metric, a heatmap PNG of layers x GEMM operands (``numerics_<metric>.png``) and a Markdown
summary naming the worst layers (``numerics.md``). Values are those of the last telemetry step
(or of ``--step``).

For a sweep directory (it holds ``sweep.json``) the results are collected again from the runs'
TensorBoard logs (``launch/sweep.py --collect``) and the per-grid-point table is printed: mean and
spread over seeds, the paired gap to the baseline with its (unadjusted) 95% interval, extra tokens
with theirs, and the table's Holm-adjusted verdicts (worse / better / equivalent within the sweep's
``equivalence_margin`` / not shown to differ / diverged in k of n seeds).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

COLUMNS = ["fprop/x", "fprop/w", "dgrad/dy", "dgrad/w", "wgrad/dy", "wgrad/x"]
# For each metric: is a higher value worse? And a one-line meaning for the summary.
METRICS = {
    "sqnr_db": (False, "quantization SQNR in dB (lower is worse)"),
    "clipped": (True, "fraction of values beyond their scale's range (saturated)"),
    "flushed": (True, "fraction of non-zero values flushed to zero"),
    "amax_ratio": (True, "current amax / the amax the scale came from (> 1: delayed scaling lagged)"),
    "amax": (True, "max |value| of the operand"),
}


def load_numerics(run_dir: Path, step: int | None):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[tuple[str, str, str], dict[int, float]] = {}
    files = sorted(run_dir.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no TensorBoard event files (expected under --tensorboard-dir)")
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if not tag.startswith("numerics/"):
                continue
            parts = tag.split("/")
            layer, col, metric = "/".join(parts[1:-3]), "/".join(parts[-3:-1]), parts[-1]
            for e in acc.Scalars(tag):
                values.setdefault((layer, col, metric), {})[e.step] = e.value
    if not values:
        raise ValueError(f"{run_dir}: no numerics/* scalars; run pretrain with --numerics-interval N")
    steps = sorted({s for v in values.values() for s in v})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(f"--step {step}: no telemetry at that step; steps with telemetry: {steps[:10]}...")
    table = {k: v[chosen] for k, v in values.items() if chosen in v}
    return table, chosen


def layer_sort_key(name: str):
    parts = name.split(".")
    return [int(p) if p.isdigit() else p for p in parts]


def render(table, step: int, out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = sorted({k[0] for k in table}, key=layer_sort_key)
    written = []
    for metric, (higher_worse, meaning) in METRICS.items():
        grid = np.full((len(layers), len(COLUMNS)), np.nan)
        for i, layer in enumerate(layers):
            for j, col in enumerate(COLUMNS):
                v = table.get((layer, col, metric))
                if v is not None and math.isfinite(v):
                    grid[i, j] = v
        if np.all(np.isnan(grid)):
            continue
        fig, ax = plt.subplots(figsize=(7, 0.32 * len(layers) + 2))
        cmap = "magma" if higher_worse else "magma_r"
        im = ax.imshow(grid, aspect="auto", cmap=cmap)
        ax.set_xticks(range(len(COLUMNS)), COLUMNS, rotation=30, ha="right")
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        for i in range(len(layers)):
            for j in range(len(COLUMNS)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=6, color="w")
        fig.colorbar(im, ax=ax, label=metric)
        ax.set_title(f"{title}: {metric} at step {step}\n{meaning}", fontsize=9)
        fig.tight_layout()
        path = out / f"numerics_{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def summary(table, step: int, top: int = 5) -> str:
    lines = [f"# Numerics at step {step}", ""]
    for metric, (higher_worse, meaning) in METRICS.items():
        if metric == "amax":
            continue
        items = [(v, k[0], k[1]) for k, v in table.items() if k[2] == metric and math.isfinite(v)]
        if not items:
            continue
        items.sort(reverse=higher_worse)
        lines += [f"## {metric}: {meaning}", "", "| layer | GEMM operand | value |", "|---|---|---|"]
        lines += [f"| {layer} | {col} | {v:.4g} |" for v, layer, col in items[:top]]
        lines.append("")
    return "\n".join(lines)


def sweep_report(out: Path) -> int:
    """Re-collect a sweep's results and print its tables (intervals beside every gap)."""
    import json

    from pretrain.sweep.report import collect
    from pretrain.sweep.spec import SMOOTH_DEFAULT, Run

    info = json.loads((out / "sweep.json").read_text())
    runs = [Run(**r) for r in info["runs"]]
    collect(out, runs, info["sweep"].get("baseline"), window=info["sweep"].get("smooth", SMOOTH_DEFAULT),
            margin=info["sweep"].get("equivalence_margin"),
            descent=info["sweep"].get("descent_steps"), published=info["sweep"].get("published"),
            contrasts=info["sweep"].get("contrasts"))
    print((out / "results.md").read_text().split("\n## Runs")[0])
    plots = ([out / "rl_curves.png"] if runs and runs[0].script == "rl"
             else [out / "loss_curves.png", out / "loss_gap_curves.png", out / "gap.png"])
    print(f"wrote {out / 'results.md'}, {out / 'summary.csv'}, " + ", ".join(map(str, plots)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (or its TensorBoard directory)")
    ap.add_argument("--out", help="where to write the PNGs and numerics.md (default RUN_DIR/report)")
    ap.add_argument("--step", type=int, help="telemetry step to show (default: the last)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir}: not a directory", file=sys.stderr)
        return 2
    if (run_dir / "sweep.json").is_file():
        return sweep_report(run_dir)
    try:
        table, step = load_numerics(run_dir, args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs = render(table, step, out, run_dir.name)
    md = summary(table, step)
    (out / "numerics.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'numerics.md'} and {len(pngs)} heatmaps: " + ", ".join(p.name for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

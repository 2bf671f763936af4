"""The numerics report of one training run: which GEMM operand of which layer is breaking training?

Reads the TensorBoard scalars ``numerics/<layer>/<gemm>/<operand>/<metric>`` written by
``launch/pretrain.py --numerics-interval N`` and renders, per metric, a heatmap of layers x GEMM
operands and a Markdown summary naming the worst layers (``launch/report.py`` is its entry point).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["COLUMNS", "METRICS", "layer_sort_key", "load_numerics", "render", "summary"]

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

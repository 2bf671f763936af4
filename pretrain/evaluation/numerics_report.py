"""The numerics report of one training run: which GEMM operand of which layer is breaking training?

Reads the TensorBoard scalars ``numerics/<layer>/<gemm>/<operand>/<metric>`` written by
``launch/pretrain.py --numerics-interval N`` and renders, per metric, a heatmap of layers x GEMM
operands and a Markdown summary naming the worst layers (``launch/report.py`` is its entry point).

A heatmap's colour scale is set by the quantized operands: an operand the run's precision plan (the
``precision_plan`` TensorBoard text) leaves in a 16/32-bit float -- e.g. the BF16 output layer, at
55-66 dB SQNR beside MXFP4's 17-19 dB -- is drawn grey with its value written in, outside the
scale, so the quantized layers' differences stay visible. Without a plan in the logs, operands at
or above :data:`UNQUANTIZED_SQNR_DB` count as unquantized.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

__all__ = ["COLUMNS", "METRICS", "UNQUANTIZED_SQNR_DB", "colour_limits", "layer_sort_key", "load_numerics",
           "load_unquantized", "render", "summary", "unquantized_from_plan"]

COLUMNS = ["fprop/x", "fprop/w", "dgrad/dy", "dgrad/w", "wgrad/dy", "wgrad/x"]
# For each metric: is a higher value worse? And a one-line meaning for the summary.
METRICS = {
    "sqnr_db": (False, "quantization SQNR in dB (lower is worse)"),
    "clipped": (True, "fraction of values beyond their scale's range (saturated)"),
    "flushed": (True, "fraction of non-zero values flushed to zero"),
    "amax_ratio": (True, "current amax / the amax the scale came from (> 1: delayed scaling lagged)"),
    "amax": (True, "max |value| of the operand"),
    # per-block figures along the GEMM's contraction axis (precision.block_stats); had16_*: after a Hadamard
    "flushed_nonzero": (True, "share of non-zero elements quantized to zero"),
    "block_max_median": (True, "mean over blocks of max|x| / median|x|"),
    "block_top_share": (True, "mean share of a block's energy in its largest element"),
    "had16_flushed_nonzero": (True, "flushed_nonzero after a 16-point Hadamard along the contraction axis"),
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


WIDE_FORMATS = ("bf16", "fp16", "fp32")
"""Formats that do not quantize below 16 bits (their operands stay out of a heatmap's colour scale)."""
UNQUANTIZED_SQNR_DB = 45.0
"""Without a plan: an operand's SQNR at or above this is a 16-bit rounding (BF16 rounds an FP32
value at ~55 dB; FP8 E4M3, the widest quantized format here, stays near 31 dB)."""
_FENCED = re.compile(r"```\n(.*?)```", re.DOTALL)


def unquantized_from_plan(text: str) -> set[tuple[str, str]]:
    """The ``(layer, column)`` operands a plan table (``PrecisionPlan.table()``: ``layer fprop dgrad
    wgrad rule`` rows, maybe inside a Markdown fence) keeps in :data:`WIDE_FORMATS`. A GEMM's spec
    ``a@b`` gives its two operands in :data:`COLUMNS` order; a spec without ``@`` gives both."""
    m = _FENCED.search(text)
    out: set[tuple[str, str]] = set()
    for line in (m.group(1) if m else text).splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[0] == "layer":
            continue
        for gemm, spec in zip(("fprop", "dgrad", "wgrad"), parts[1:4]):
            sides = spec.split("@")
            sides = sides * 2 if len(sides) == 1 else sides
            cols = [c for c in COLUMNS if c.startswith(gemm + "/")]
            for col, side in zip(cols, sides):
                fmt = re.match(r"[a-z0-9_]+", side)
                if fmt and fmt.group(0) in WIDE_FORMATS:
                    out.add((parts[0], col))
    return out


def load_unquantized(run_dir: Path, step: int) -> set[tuple[str, str]] | None:
    """The operands the run's plan at ``step`` keeps unquantized (the last ``precision_plan`` text
    written at or before ``step``: a schedule writes one per phase), or ``None`` without a plan."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts: dict[int, str] = {}
    for f in sorted(run_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"tensors": 0})
        acc.Reload()
        if "precision_plan/text_summary" in acc.Tags().get("tensors", []):
            for e in acc.Tensors("precision_plan/text_summary"):
                texts[e.step] = e.tensor_proto.string_val[0].decode()
    at = [s for s in texts if s <= step]
    return unquantized_from_plan(texts[max(at)]) if at else None


def colour_limits(table, metric: str, unquantized: set[tuple[str, str]] | None) -> tuple[float, float] | None:
    """(vmin, vmax) of ``metric``'s heatmap: over the quantized operands' finite values (see the module
    docstring; ``unquantized`` ``None``: by :data:`UNQUANTIZED_SQNR_DB` for SQNR), or over every finite
    value where no operand is quantized. ``None``: no finite value."""
    cells = {(k[0], k[1]): v for k, v in table.items() if k[2] == metric and math.isfinite(v)}
    if not cells:
        return None
    if unquantized is None:
        sq = {(k[0], k[1]) for k, v in table.items() if k[2] == "sqnr_db" and v >= UNQUANTIZED_SQNR_DB}
        unquantized = sq
    quantized = [v for k, v in cells.items() if k not in unquantized] or list(cells.values())
    return min(quantized), max(quantized)


def layer_sort_key(name: str):
    parts = name.split(".")
    return [int(p) if p.isdigit() else p for p in parts]


def render(table, step: int, out: Path, title: str, unquantized: set[tuple[str, str]] | None = None) -> list[Path]:
    """One heatmap PNG per metric (``numerics_<metric>.png`` in ``out``); ``unquantized``: the operands
    left out of the colour scale (:func:`colour_limits`)."""
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
        vmin, vmax = colour_limits(table, metric, unquantized)
        wide = unquantized if unquantized is not None else {
            (k[0], k[1]) for k, v in table.items() if k[2] == "sqnr_db" and v >= UNQUANTIZED_SQNR_DB}
        outside = np.array([[(layer, col) in wide for col in COLUMNS] for layer in layers])
        if outside.all():  # nothing quantized: every operand is on the scale
            outside[:] = False
        fig, ax = plt.subplots(figsize=(7, 0.32 * len(layers) + 2))
        # unquantized operands (and missing cells): grey, outside the scale
        cmap = matplotlib.colormaps["magma" if higher_worse else "magma_r"].with_extremes(bad="#d9d9d9")
        im = ax.imshow(np.ma.masked_where(np.isnan(grid) | outside, grid), aspect="auto", cmap=cmap,
                       vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1e-12)
        ax.set_xticks(range(len(COLUMNS)), COLUMNS, rotation=30, ha="right")
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        for i in range(len(layers)):
            for j in range(len(COLUMNS)):
                if not np.isnan(grid[i, j]):
                    r, g, b, _ = (0.85, 0.85, 0.85, 1) if outside[i, j] else cmap(im.norm(grid[i, j]))
                    ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=6,
                            color="k" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "w")
        fig.colorbar(im, ax=ax, label=metric)
        grey = "\ngrey: unquantized in the plan (16/32-bit), outside the colour scale" if outside.any() else ""
        ax.set_title(f"{title}: {metric} at step {step}\n{meaning}{grey}", fontsize=9)
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

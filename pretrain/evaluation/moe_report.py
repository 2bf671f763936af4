"""The mixture-of-experts section of a run's numerics report (``launch/report.py RUN_DIR``).

From the ``moe/...`` TensorBoard scalars (``pretrain.trainer.moe_telemetry``) at the last telemetry step
(or ``--step``): per MoE layer the load imbalance, dropped assignments, router entropy, aux and z losses,
the least- and most-loaded experts, and the expert with the lowest quantization SQNR -- so a reader
sees whether quantized experts starve or the routing collapses.
"""

from __future__ import annotations

import re
from pathlib import Path

from pretrain.trainer.tags import read_scalars

__all__ = ["load_moe", "moe_section"]

_LAYER = re.compile(r"^moe/layer_(\d+)/(.+)$")
_MEG = re.compile(r"^moe/(load_balancing_loss|z_loss|seq_load_balancing_loss)_layer_(\d+)$")


def load_moe(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every ``moe/`` scalar under ``run_dir`` (empty: not a MoE run)."""
    return {tag: dict(points) for tag, points in read_scalars(run_dir, prefix="moe/").items()}


def _at(series: dict[int, float], step: int | None) -> tuple[int, float] | None:
    if not series:
        return None
    if step is None:
        step = max(series)
    return (step, series[step]) if step in series else None


def moe_section(values: dict[str, dict[int, float]], step: int | None = None) -> str:
    """Markdown of the MoE scalars at ``step`` (default: the last routing-telemetry step); '' without any."""
    routing_steps = sorted({s for tag, v in values.items() if tag.endswith("/load_cv") for s in v})
    if not routing_steps:
        return ""
    chosen = routing_steps[-1] if step is None or step not in routing_steps else step
    layers: dict[int, dict] = {}
    for tag, series in values.items():
        got = _at(series, chosen)
        m, meg = _LAYER.match(tag), _MEG.match(tag)
        if meg and got:
            layers.setdefault(int(meg.group(2)), {})[meg.group(1)] = got[1]
        elif m:
            layer, key = int(m.group(1)), m.group(2)
            if key.startswith("tokens_expert_") and got:
                layers.setdefault(layer, {}).setdefault("tokens", {})[int(key.rsplit("_", 1)[1])] = got[1]
            elif key.endswith("/sqnr_db_min"):
                last = _at(series, None)  # SQNR comes at --numerics-interval: its own last step
                if last:
                    layers.setdefault(layer, {}).setdefault("sqnr", {})[int(key.split("/")[0].split("_")[1])] = last[1]
            elif got and "/" not in key:
                layers.setdefault(layer, {})[key] = got[1]
    lines = [f"## Mixture of experts (step {chosen})", "",
             "load CV: std / mean of the tokens routed per expert (0: balanced); dropped: share of top-k "
             "assignments over capacity; entropy: routing distribution's / ln(experts) (1: uniform).", "",
             "| layer | load CV | dropped | entropy | aux loss | z loss | least-loaded expert (tokens) | "
             "most-loaded (tokens) | lowest SQNR expert (dB) |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    for layer in sorted(k for k, v in layers.items() if "load_cv" in v):
        d = layers[layer]
        tokens, sqnr = d.get("tokens", {}), d.get("sqnr", {})
        low = min(tokens, key=tokens.get) if tokens else None
        high = max(tokens, key=tokens.get) if tokens else None
        worst = min(sqnr, key=sqnr.get) if sqnr else None
        lines.append(
            f"| {layer} | {fmt(d.get('load_cv'))} | {fmt(d.get('dropped_fraction'))} | {fmt(d.get('router_entropy'))} "
            f"| {fmt(d.get('load_balancing_loss'))} | {fmt(d.get('z_loss'))} "
            f"| {'-' if low is None else f'{low} ({tokens[low]:.0f})'} | {'-' if high is None else f'{high} ({tokens[high]:.0f})'} "
            f"| {'-' if worst is None else f'{worst} ({sqnr[worst]:.1f})'} |")
    starved = [(layer, e) for layer, d in layers.items() for e, t in d.get("tokens", {}).items() if t == 0]
    lines += ["", f"experts that received no token at step {chosen}: "
              + (", ".join(f"layer {layer} expert {e}" for layer, e in sorted(starved)) or "none")]
    return "\n".join(lines)

"""Per-layer, per-expert telemetry of a mixture-of-experts run in TensorBoard (``moe/...``).

Every ``--log-interval`` iterations (the steps whose losses are logged), for each MoE layer L of the
global batch (all data-parallel ranks; TP ranks route the same tokens and are counted once):

    moe/layer_L/tokens_expert_E    top-k assignments routed to expert E (after capacity dropping)
    moe/layer_L/load_cv            coefficient of variation of those counts (std / mean; 0: balanced)
    moe/layer_L/dropped_fraction   assignments dropped by --moe-expert-capacity-factor (0 without it)
    moe/layer_L/router_entropy     mean entropy of the routing distribution / ln(experts) (1: uniform)
    moe/load_cv, moe/dropped_fraction, moe/router_entropy    the same, averaged over the MoE layers

and the aux and z losses through megatron-core's own tracker (``moe_utils.track_moe_metrics``, the
values the router saved in ``save_to_aux_losses_tracker``, per micro-batch averaged, over data-parallel
ranks averaged): ``moe/load_balancing_loss``, ``moe/z_loss`` (mean over MoE layers, unscaled by their
coefficients) and ``moe/load_balancing_loss_layer_L`` / ``moe/z_loss_layer_L``.

Every ``--numerics-interval`` iterations, from the layers' numerics telemetry (``precision.telemetry``),
each expert's worst quantization SQNR over its GEMM operands, grouped by expert:
``moe/layer_L/expert_E/sqnr_db_min`` (and per GEMM: ``moe/layer_L/expert_E/fc1/fprop/x/sqnr_db``);
with expert parallelism every EP rank's experts, E the global expert id (gathered by
``MetricsLogger.write_layer_scalars`` with ``pretrain.expert_parallel.gather_layer_scalars``, as the
per-linear ``numerics/...`` scalars of the expert linears are).

Off-cost: between telemetry steps a router checks one attribute per forward; the counts stay on the
device and are read once per telemetry step (one all-reduce of a ``layers x (experts + 3)`` tensor).
"""

from __future__ import annotations

import math
import re

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics

from model.moe import PolicyRouter

__all__ = ["MoETelemetry", "expert_sqnr_scalars", "routing_scalars"]

_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_(fc\d)$")


class _Collect:
    """A TensorBoard-writer stand-in that keeps what megatron's ``track_moe_metrics`` writes."""

    def __init__(self):
        self.scalars: list[tuple[str, float]] = []

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.scalars.append((tag if tag.startswith("moe/") else f"moe/{tag}", float(value)))


def routing_scalars(layers: list[int], table: torch.Tensor, experts: int) -> list[tuple[str, float]]:
    """TensorBoard scalars of a ``[layers, experts + 3]`` table (per expert tokens, dropped, entropy
    sum, tokens routed) summed over the global batch."""
    out, summary = [], {"load_cv": [], "dropped_fraction": [], "router_entropy": []}
    for layer, row in zip(layers, table.tolist(), strict=True):
        tokens, dropped, entropy, count = row[:experts], row[experts], row[experts + 1], row[experts + 2]
        mean = sum(tokens) / experts
        cv = math.sqrt(sum((t - mean) ** 2 for t in tokens) / experts) / mean if mean > 0 else 0.0
        assigned = sum(tokens) + dropped
        values = {"load_cv": cv, "dropped_fraction": dropped / assigned if assigned else 0.0,
                  "router_entropy": entropy / count / math.log(experts) if count and experts > 1 else 0.0}
        out += [(f"moe/layer_{layer}/tokens_expert_{e}", t) for e, t in enumerate(tokens)]
        for key, value in values.items():
            out.append((f"moe/layer_{layer}/{key}", value))
            summary[key].append(value)
    out += [(f"moe/{key}", sum(v) / len(v)) for key, v in summary.items() if v]
    return out


def expert_sqnr_scalars(linears) -> list[tuple[str, float]]:
    """Per expert GEMM operand SQNR (dB) of the last telemetry step, grouped by expert, and each
    expert's minimum over its operands (``(plan name, module)`` pairs of policy linears)."""
    out, worst = [], {}
    for name, m in linears:
        match = _EXPERT.search(name)
        if match is None:
            continue
        layer, expert, fc = match.groups()
        for key, numbers in m.quant_state.stats.items():
            if "sqnr_db" not in numbers:
                continue
            value = float(numbers["sqnr_db"])
            out.append((f"moe/layer_{layer}/expert_{expert}/{fc}/{key}/sqnr_db", value))
            k = (int(layer), int(expert))
            worst[k] = min(worst.get(k, value), value)
    out += [(f"moe/layer_{layer}/expert_{expert}/sqnr_db_min", v) for (layer, expert), v in sorted(worst.items())]
    return out


class MoETelemetry:
    """``begin_step(step)`` / ``end_step(step)`` around each training step (``pretrain.train``); all
    ranks call both (the telemetry step's collectives)."""

    def __init__(self, model: torch.nn.Module, linears, metrics, *, log_interval: int, numerics_interval: int,
                 num_micro_batches: int):
        self.routers = [m for m in model.modules() if isinstance(m, PolicyRouter)]
        self.linears, self.metrics = linears, metrics
        self.log_interval, self.numerics_interval = log_interval, numerics_interval
        self.num_micro_batches = num_micro_batches
        cfg = getattr(model, "config", None)
        self.num_layers = getattr(cfg, "num_layers", 0)
        self.moe_layer_freq = getattr(cfg, "moe_layer_freq", 1)
        self._active = False

    @property
    def enabled(self) -> bool:
        """A MoE model and a run that writes scalars (the same on every rank)."""
        return bool(self.routers) and self.metrics.enabled

    def begin_step(self, step: int) -> None:
        self._active = self.enabled and bool(self.log_interval) and step % self.log_interval == 0
        if self._active:
            clear_aux_losses_tracker()  # megatron's tracker adds up every training forward since the last clear
            for r in self.routers:
                r.stats = {}

    def end_step(self, step: int) -> None:
        if not self.enabled:
            return
        scalars = []
        if self._active:
            scalars += self._routing()
            scalars += self._aux_losses(step)
            for r in self.routers:
                r.stats = None
        numerics = bool(self.numerics_interval) and step % self.numerics_interval == 0
        if numerics:
            scalars += self._sqnr()
        if self._active or numerics:  # on every rank alike, even with nothing of its own: a collective
            self.metrics.write_layer_scalars(scalars, step)
        self._active = False

    def _routing(self) -> list[tuple[str, float]]:
        experts = self.routers[0].config.num_moe_experts
        device = self.routers[0].weight.device
        rows = []
        for r in self.routers:
            s = r.stats
            if not s:  # no training forward reached this router (cannot happen in a training step)
                rows.append(torch.zeros(experts + 3, device=device))
                continue
            rows.append(torch.cat([s["tokens"], torch.stack([s["dropped"], s["entropy"], s["count"]])]).float())
        table = torch.stack(rows)
        group = parallel_state.get_data_parallel_group()
        if group.size() > 1:
            torch.distributed.all_reduce(table, group=group)
        return routing_scalars([r.layer_number - 1 for r in self.routers], table.cpu(), experts)

    def _aux_losses(self, step: int) -> list[tuple[str, float]]:
        writer = _Collect()
        track_moe_metrics(loss_scale=1.0 / self.num_micro_batches, iteration=step, writer=writer,
                          per_layer_logging=True, num_layers=self.num_layers,
                          moe_layer_freq=self.moe_layer_freq if isinstance(self.moe_layer_freq, int)
                          else list(self.moe_layer_freq))
        return writer.scalars

    def _sqnr(self) -> list[tuple[str, float]]:
        """This rank's experts; ``metrics.write_layer_scalars`` gathers every EP rank's (global expert ids)."""
        return expert_sqnr_scalars(self.linears)

"""Mismatch attribution: how much of the trainer/rollout gap comes from weights, activations, KV-cache (, router).

A quantized rollout differs from a BF16 one in three places: the linears' weights (``w`` of every
Fprop), their activations (``x``) and the KV-cache. We re-score one batch of rollouts (teacher
forcing: the sampled tokens fed back, the log-prob of each response token read off) under plans
that put **one component at a time back in BF16**, overall and per layer group::

    full        the rollout plan as it is                                  lp_full
    -weights    every linear's w in BF16, the rest as the rollout          lp_-w
    -acts       every linear's x in BF16                                   lp_-x
    -kv         a BF16 KV-cache                                            lp_-kv
    reference   all three in BF16 (the ``bf16`` rollout preset)            lp_ref

For a metric ``M(lp)`` of the gap to the reference -- ``k3_kl`` (``pretrain.rl.mismatch``, with
``lp_ref`` as the trainer's log-probs) or the mean absolute per-token log-prob gap
``mean |lp - lp_ref|`` -- the total is ``T = M(lp_full)`` (``M(lp_ref) = 0``). Two views:

  * **effect** of component c (the direct measurement, "one component back in BF16"):
    ``D_c = M(lp_full) - M(lp_-c)``, what putting it back removes. Neither metric is additive
    (k3 is quadratic in the log-ratio, the gap a mean of absolute values), so the effects need not
    add up to ``T``: the remainder is the **interaction** ``I = T - sum_c D_c``, reported as its own
    row (positive: the components' errors partly cancel or compound non-linearly).
  * **share** of component c: its Shapley value over the 8 plans with every subset of the
    components quantized (the others in BF16) -- the leave-one-out and one-at-a-time plans
    averaged over orderings -- divided by ``T``. Shares add up to 100 % exactly (up to float
    rounding, checked to 1e-9): the interaction is split evenly among the components taking part.

Per layer group g: the effects ``D_{g,c}`` with c back in BF16 in g's layers only, and their
remainder ``I_groups = T - sum_{g,c} D_{g,c}`` as an interaction row. For a rollout where a single
component is quantized, that component's effect and share are exactly ``T`` and the others 0
(tested). Layer groups are no more additive than components (measured on the test model, MXFP4
weights only, 32 tokens: the group interaction is 15 % of ``k3_kl`` and 48 % of the log-prob gap,
and one layer's effect can be negative), so read per-group effects with their interaction row.

A mixture-of-experts policy adds a fourth component, the **router**: the routing decisions alone.
Quantized, every MoE layer replays the expert sets the full rollout plan's recompute chose; back in
BF16, those the reference recompute (all components in BF16) chose (``model.moe_replay``); combine
weights always come from the forward's own router scores at the replayed experts. So the 16 plans
are every subset of the four, the all-quantized plan is the rollout's and the all-BF16 one the
reference: the total is unchanged and the Shapley shares still add up to 100 %. An FP32 operand (the
router GEMM's default) stays FP32 when its component is "back in BF16" (docs/rl.md).

Scoring is a recomputation over whole sequences (``model.generate.forward_logits``, the KV formats
fake-quantized by ``SDPAttention.kv_format``, per-head KV scales calibrated on this batch), so it
attributes the recompute's gap; the engine's cached decode agrees with it except for per-tensor
activation scales (``model.generate``'s module docstring). Log-probs are of the model's own
distribution at ``temperature`` (no top-k / top-p).

    result = attribute_mismatch(model, batch, vocab_size=V, rollout="mxfp4")
    print(result.table())                 # Markdown
    result.plot("attribution.png")
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
from collections.abc import Sequence

import torch

from model.attention import core_attentions
from model.generate import RolloutBatch, attention_mask, forward_logits
from model.gpt import policy_linear_names
from model.kv_cache import KVFormat
from model.moe_replay import RoutingTap, moe_routers
from model.rollout import RolloutModel
from model.rollout_plan import RolloutPlan, resolve_rollout_plan
from precision.policy import PrecisionPlan
from precision.recipe import OperandFormat
from pretrain.rl.mismatch import mismatch_metrics

__all__ = ["COMPONENTS", "MOE_COMPONENTS", "Attribution", "attribute_mismatch", "layer_groups", "score_logprobs", "sequences",
           "shapley"]

COMPONENTS = ("weights", "activations", "kv_cache")
MOE_COMPONENTS = (*COMPONENTS, "router")  # a mixture-of-experts policy: the routing decisions too
METRICS = ("k3_kl", "logprob_gap")
_BF16 = OperandFormat("bf16")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


# ================================================================================================
# Re-scoring a batch
# ================================================================================================


def sequences(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [b, P+R], valid [b, P+R], response_slot [b, R])``: each row's prompt then response,
    right-padded; ``response_slot[i, j]`` the slot of response token j (where the mask is set)."""
    b = batch.prompt_ids.shape[0]
    p_len, r_len = batch.prompt_mask.sum(1), batch.response_mask.sum(1)
    width = int((p_len + r_len).max())
    tokens = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i in range(b):
        row = torch.cat([batch.prompt_ids[i, : p_len[i]], batch.response_ids[i, : r_len[i]]])
        tokens[i, : row.numel()], valid[i, : row.numel()] = row, True
    slot = p_len[:, None] + torch.arange(batch.response_ids.shape[1])[None]
    return tokens, valid, slot.clamp(max=width - 1)


@torch.no_grad()
def score_logprobs(model, batch: RolloutBatch, *, vocab_size: int, rollout: RolloutModel | None = None,
                   kv_overrides: dict[int, KVFormat] | None = None, temperature: float = 1.0,
                   routing: RoutingTap | None = None, replay=None) -> torch.Tensor:
    """Log-probs ``[b, R]`` (0 off the response mask) of the batch's response tokens, teacher-forced
    in one forward: under ``rollout`` (its packed weights and KV format; ``kv_overrides``: layer ->
    another KV format) or, with None, the model's own precision plan -- the trainer's recompute.
    ``routing`` (a MoE policy's ``model.moe_replay.RoutingTap``): records the routing into ``routing.last``
    and, with ``replay`` (per MoE layer ``(experts, mask)``), replays it."""
    tokens, valid, slot = sequences(batch)
    device = next(model.parameters()).device
    tokens, valid = tokens.to(device), valid.to(device)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    mask = attention_mask(valid, tokens.shape[1])
    was_training = model.training
    model.eval()

    def forward():
        return forward_logits(model, tokens, positions, mask)

    stack = contextlib.ExitStack()

    try:
        if routing is not None:
            stack.enter_context(routing.attached(replay=replay))
        if rollout is None:
            logits = forward()
        else:
            if rollout.needs_kv_calibration:
                rollout.calibrate_kv(forward)
            with rollout.active():
                for layer, fmt in (kv_overrides or {}).items():
                    core_attentions(model)[layer].kv_format = fmt
                logits = forward()
    finally:
        stack.close()
        model.train(was_training)
    logp = torch.log_softmax(logits[..., :vocab_size] / temperature, dim=-1).cpu()
    pred = (slot - 1).clamp(min=0)  # the slot whose logits predict response token j
    rows = torch.arange(tokens.shape[0])[:, None]
    lp = logp[rows, pred, batch.response_ids]
    return torch.where(batch.response_mask, lp, torch.zeros_like(lp))


# ================================================================================================
# Plans with components back in BF16
# ================================================================================================


def layer_groups(num_layers: int, n_groups: int = 4) -> dict[str, list[int]]:
    """Contiguous groups of layers (each layer its own group when there are at most ``n_groups``)."""
    n = min(n_groups, num_layers)
    bounds = [round(k * num_layers / n) for k in range(n + 1)]
    return {(f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"): list(range(a, b))
            for a, b in itertools.pairwise(bounds)}


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _variant(plan: RolloutPlan, back: Sequence[str], layers: set[int] | None) -> tuple[RolloutPlan, dict]:
    """``plan`` with the components ``back`` in BF16 in ``layers`` (None: everywhere); returns the
    plan and the KV overrides (layer -> BF16) for a KV-cache back in BF16 in some layers only."""
    kv_overrides = {}
    if "kv_cache" in back:
        if layers is None:
            plan = dataclasses.replace(plan, kv=KVFormat("bf16"), kv_layers=(), kv_rules=())  # every layer's cache
        else:
            kv_overrides = {i: KVFormat("bf16") for i in layers}
    entries = {}
    for name in plan.linears:
        lp = plan.linears[name]
        if layers is None or _layer_of(name) in layers:
            f = lp.fprop
            if "weights" in back and f.b.fmt != "fp32":  # an FP32 operand (the router's) stays the reference
                f = dataclasses.replace(f, b=_BF16)
            if "activations" in back and f.a.fmt != "fp32":
                f = dataclasses.replace(f, a=_BF16)
            lp = dataclasses.replace(lp, fprop=f)
        entries[name] = (lp, plan.linears.rule_for(name))
    return dataclasses.replace(plan, linears=PrecisionPlan(entries)), kv_overrides


def shapley(values: dict[frozenset, float], players: Sequence[str]) -> dict[str, float]:
    """Shapley values of a game given ``values[S]`` for every subset ``S`` of ``players``."""
    n = len(players)
    out = {}
    for c in players:
        others = [p for p in players if p != c]
        total = 0.0
        for k in range(n):
            for sub in itertools.combinations(others, k):
                w = math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n)
                total += w * (values[frozenset(sub) | {c}] - values[frozenset(sub)])
        out[c] = total
    return out


# ================================================================================================
# Attribution
# ================================================================================================


def _metric(lp: torch.Tensor, lp_ref: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    m = mask.to(torch.bool)
    return {"k3_kl": mismatch_metrics(lp_ref, lp, m)["rollout_corr/k3_kl"],
            "logprob_gap": float((lp - lp_ref).abs()[m].double().mean())}


@dataclasses.dataclass
class Attribution:
    """Totals, Shapley shares and leave-one-out effects (module docstring) of one batch."""

    rollout: str
    total: dict[str, float]  # metric -> T
    shapley: dict[str, dict[str, float]]  # component -> metric -> Shapley value (sums to T)
    overall: dict[str, dict[str, float]]  # component -> metric -> D_c
    groups: dict[str, dict[str, dict[str, float]]]  # group -> component -> metric -> D_{g,c}
    tokens: int
    components: tuple[str, ...] = COMPONENTS  # MOE_COMPONENTS for a mixture-of-experts policy

    def interaction(self, metric: str) -> float:
        return self.total[metric] - sum(d[metric] for d in self.overall.values())

    def group_interaction(self, metric: str) -> float:
        return self.total[metric] - sum(d[metric] for g in self.groups.values() for d in g.values())

    def share(self, value: float, metric: str) -> float:
        t = self.total[metric]
        return value / t if t else float("nan")

    def table(self) -> str:
        """Markdown: shares and effects on ``k3_kl`` and the log-prob gap, overall and per group."""
        k3, gap = METRICS
        lines = [(f"Mismatch attribution, rollout `{self.rollout}` against the same batch re-scored all in BF16 "
                 f"({self.tokens} response tokens). Share: Shapley value / total (sums to 100%). Effect: the "
                 "metric minus the metric with that component back in BF16; interaction = total minus the "
                 "effects."), "",
                 "| component | k3_kl share | log-prob gap share | k3_kl effect | log-prob gap effect |",
                 "|---|---|---|---|---|"]
        for c in self.components:
            sh, d = self.shapley[c], self.overall[c]
            lines.append(f"| {c} | {self.share(sh[k3], k3):.1%} | {self.share(sh[gap], gap):.1%} | {d[k3]:.4g} "
                         f"| {d[gap]:.4g} |")
        lines.append(f"| interaction | | | {self.interaction(k3):.4g} | {self.interaction(gap):.4g} |")
        lines.append(f"| **total** | 100% | 100% | {self.total[k3]:.4g} | {self.total[gap]:.4g} |")
        if self.groups:
            lines += ["", "Per layer group (effects with the component back in BF16 in that group only):", "",
                      "| group | component | k3_kl effect | k3_kl share of total | log-prob gap effect |",
                      "|---|---|---|---|---|"]
            for g, comps in self.groups.items():
                for c in self.components:
                    d = comps[c]
                    lines.append(f"| {g} | {c} | {d[k3]:.4g} | {self.share(d[k3], k3):.1%} | {d[gap]:.4g} |")
            lines.append(f"| interaction | | {self.group_interaction(k3):.4g} | "
                         f"{self.share(self.group_interaction(k3), k3):.1%} | {self.group_interaction(gap):.4g} |")
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Bars: Shapley shares per component; crosses: per-group effects as fractions of the total."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for ax, metric in zip(axes, METRICS):
            comps_ = list(self.components)
            ax.bar(comps_, [self.share(self.shapley[c][metric], metric) for c in comps_],
                   color=[f"C{i}" for i in range(len(comps_))], label="share (Shapley)")
            for g_i, (g, comps) in enumerate(self.groups.items()):
                ax.scatter(comps_, [self.share(comps[c][metric], metric) for c in comps_],
                           marker="x", color=f"C{len(comps_) + g_i}", label=f"{g} effect", zorder=3)
            ax.axhline(0, color="k", lw=0.5)
            ax.set_title(f"{metric} (total {self.total[metric]:.3g})")
            ax.legend(fontsize=7)
        fig.suptitle(f"rollout {self.rollout}: trainer/rollout mismatch by component")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _plan(model, rollout: str, rules: Sequence[str]) -> RolloutPlan:
    attns = core_attentions(model)
    head_dim = attns[0].config.kv_channels if attns else 0
    return resolve_rollout_plan(rollout, rules, policy_linear_names(model), len(attns), head_dim)


@torch.no_grad()
def attribute_mismatch(model, batch: RolloutBatch, *, vocab_size: int, rollout: str,
                       rollout_rules: Sequence[str] = (), groups: dict[str, list[int]] | None = None,
                       temperature: float = 1.0) -> Attribution:
    """Re-score ``batch`` under the rollout plan ``rollout`` (``--rollout-precision`` syntax, with
    ``rollout_rules``) with every subset of the components back in BF16, and per layer group
    (``groups``: name -> layer indices; default :func:`layer_groups`; ``{}``: none) with each
    component back in BF16 there. ``8 + 3 * len(groups)`` forwards (a MoE policy: ``2 + 16 + 4 *
    len(groups)``, the router a fourth component, :func:`_routing_game`). Returns the attribution."""
    plan = _plan(model, rollout, rollout_rules)
    groups = groups if groups is not None else layer_groups(len(core_attentions(model)))
    mask = batch.response_mask
    tap = RoutingTap(model) if moe_routers(model) else None
    comps = MOE_COMPONENTS if tap is not None else COMPONENTS
    routings = _routing_game(model, batch, plan, tap, vocab_size, temperature) if tap is not None else None

    def score(back: Sequence[str], layers: set[int] | None = None) -> torch.Tensor:
        p, kv = _variant(plan, [c for c in back if c != "router"], layers)
        replay = None
        if routings is not None:  # the router "quantized": the rollout's routing, else the reference's
            q, ref = routings
            back_in = [_layer_of(n) in layers if layers is not None else True for n, _ in tap.routers]
            replay = [(ref[i] if ("router" in back and b) else q[i], None) for i, b in enumerate(back_in)]
        return score_logprobs(model, batch, vocab_size=vocab_size, rollout=RolloutModel(model, p),
                              kv_overrides=kv, temperature=temperature, routing=tap, replay=replay)

    lp_ref = score(comps)  # everything back in BF16 (a rollout rotation, if any, kept)
    values = {}  # quantized subset -> metric -> value
    for k in range(len(comps) + 1):
        for kept in itertools.combinations(comps, k):
            lp = lp_ref if not kept else score([c for c in comps if c not in kept])
            values[frozenset(kept)] = _metric(lp, lp_ref, mask)
    total = values[frozenset(comps)]
    shap = {m: shapley({s: v[m] for s, v in values.items()}, comps) for m in METRICS}
    overall = {c: {m: total[m] - values[frozenset(comps) - {c}][m] for m in METRICS} for c in comps}

    def effect(component: str, layers: set[int]) -> dict[str, float]:
        v = _metric(score([component], layers), lp_ref, mask)
        return {m: total[m] - v[m] for m in METRICS}

    by_group = {g: {c: effect(c, set(layers)) for c in comps} for g, layers in groups.items()}
    return Attribution(str(rollout), total, {c: {m: shap[m][c] for m in METRICS} for c in comps},
                       overall, by_group, int(mask.sum()), comps)


def _routing_game(model, batch, plan, tap, vocab_size, temperature):
    """The two routings the router component switches between (docs/rl.md): per MoE layer the experts the
    full rollout plan's recompute of ``batch`` chooses (the rollout's routing) and those the reference (every
    component in BF16) chooses, for every position of the right-padded batch."""
    out = []
    for back in ((), COMPONENTS):
        p, kv = _variant(plan, back, None)
        score_logprobs(model, batch, vocab_size=vocab_size, rollout=RolloutModel(model, p), kv_overrides=kv,
                       temperature=temperature, routing=tap)
        out.append([e for e, _ in tap.last])
    return out[0], out[1]

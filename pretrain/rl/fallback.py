"""Automatic rollout precision fallback: move the layers that cause the mismatch back to BF16 / FP8.

``--rollout-fallback METRIC=THRESHOLD[,to=bf16|fp8][,layers=K]`` (e.g. ``k3_kl=0.02``). After each
RL step the loop hands the step's mismatch metrics (``pretrain.rl.mismatch``, verl's keys) to
:meth:`RolloutFallback.triggered`; when ``METRIC`` exceeds ``THRESHOLD``, :meth:`RolloutFallback.choose`
attributes the metric to the decoder layers and moves the ``K`` layers with the largest share
(not moved before) to ``to``; :meth:`RolloutFallback.rollout_rules` gives the loop the extra
``--rollout-precision-rule`` entries (``layers:I-I=bf16``) to append before it rebuilds the
rollout plan (``model.rollout_plan.resolve_rollout_plan``), repacks the engine's weights and, with
``--rollout-qat``, calls ``RolloutQAT.update_plan``. Moves are never undone; the state
(:meth:`state_dict`) is checkpointed with the run.

Attribution (one group per decoder layer, as ``pretrain.rl.attribution``'s per-group effects)::

    ref       the trainer's log-probs of the batch's response tokens (``reference``; default: the
              model's own plan, teacher-forced -- what the trainer recomputes without QAT)
    lp_now    the batch re-scored under the current rollout plan (user rules + earlier moves)
    lp_i      the same with decoder layer i's linears (weights and activations) at ``to``
    total     M(ref, lp_now)         effect_i = total - M(ref, lp_i)       share_i = effect_i / total

``M`` is the metric of the flag (``mismatch_metrics(ref, lp)``: ``ref`` plays the trainer). Layers
whose linears the new rule would not change (already at ``to``, or covered by a user rule that
comes first) are no candidates. Only layers with a positive effect are moved -- moving a layer
whose rollout error partly cancels another's would raise the mismatch -- so a trigger may move
nothing (the event records it). The KV-cache keeps the plan's format: ``--rollout-precision-rule``
addresses linears only. Cost: ``2 + L`` teacher-forced forwards of the batch (``+1`` for the
``after`` value of the event) for ``L`` candidate layers.

Measured (the RL task's starting policy, 3 layers, MXFP4 W4A4 rollout with a BF16 KV-cache, 128
samples; ``k3_kl`` against the BF16 trainer): all layers MXFP4 0.127; layer 0 alone back in BF16
0.061, layer 1 alone 0.297, layer 2 alone 0.261, layers 0+1 0.139, all three 0.0002. Layer errors
are far from additive -- putting one layer back can double the mismatch (the layers' rounding
errors partly cancel) -- so the first trigger moved layer 0 (effect share 52 %) and later triggers
moved nothing; with the MXFP4 KV-cache (``k3`` 0.49, the cache's share) no single layer helps.

Metrics (``METRIC``): verl mismatch keys that grow with the mismatch and are 0 without one, by
their short name or full key -- ``k3_kl`` (``rollout_corr/k3_kl``), ``kl``, ``log_ppl_abs_diff``,
``chi2_token``, ``chi2_seq``, ``rollout_probs_diff_mean``, ``rollout_probs_diff_max``.

    fb = RolloutFallback.parse("k3_kl=0.02,layers=1")
    if fb.triggered(step_metrics):
        fb.choose(model, batch, vocab_size=V, rollout=args.rollout_precision, rules=user_rules, iteration=it)
        plan = resolve_rollout_plan(args.rollout_precision, user_rules + fb.rollout_rules(), ...)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.attention import core_attentions
from model.generate import RolloutBatch
from model.gpt import policy_linear_names
from model.rollout import RolloutModel
from model.rollout_plan import RolloutPlan, resolve_rollout_plan
from precision.recipe import SpecError
from pretrain.rl.attribution import score_logprobs
from pretrain.rl.mismatch import mismatch_metrics

__all__ = ["FALLBACK_METRICS", "FALLBACK_TARGETS", "RolloutFallback"]

FALLBACK_METRICS: dict[str, str] = {  # short name -> verl key
    "k3_kl": "rollout_corr/k3_kl",
    "kl": "rollout_corr/kl",
    "log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
    "chi2_token": "rollout_corr/chi2_token",
    "chi2_seq": "rollout_corr/chi2_seq",
    "rollout_probs_diff_mean": "training/rollout_probs_diff_mean",
    "rollout_probs_diff_max": "training/rollout_probs_diff_max",
}
FALLBACK_TARGETS = ("bf16", "fp8")
_FORM = "METRIC=THRESHOLD[,to=bf16|fp8][,layers=K], e.g. k3_kl=0.02"


def _selector(layer: int) -> str:
    return f"layers:{layer}-{layer}"


@dataclass
class RolloutFallback:
    """``--rollout-fallback`` (module docstring): its settings, the layers moved so far and one
    event per trigger ``{"iteration", "value", "rescored", "moved", "shares", "after"}``."""

    metric: str  # short name (FALLBACK_METRICS)
    threshold: float
    to: str = "bf16"
    layers_per_trigger: int = 1
    moved: list[str] = field(default_factory=list)  # layer selectors (layers:I-I), in order
    events: list[dict] = field(default_factory=list)
    num_layers: int | None = None  # decoder layers of the model (known after the first choose)
    last_value: float | None = None  # the metric as triggered() last saw it

    @property
    def key(self) -> str:
        """The metric's verl key (``rollout_corr/k3_kl``)."""
        return FALLBACK_METRICS[self.metric]

    # ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, value: str, flag: str = "--rollout-fallback") -> RolloutFallback:
        """``METRIC=THRESHOLD[,to=bf16|fp8][,layers=K]``; one-line errors naming ``flag``."""
        parts = [p.strip() for p in str(value).split(",")]
        head, eq, thr = (s.strip() for s in parts[0].partition("="))
        if not eq or not head:
            raise ValueError(f"{flag} {value!r}: expected {_FORM}")
        short = head.split("/", 1)[1] if head in FALLBACK_METRICS.values() else head
        if short not in FALLBACK_METRICS:
            raise ValueError(f"{flag} {value!r}: unknown metric {head!r}; valid (verl mismatch keys that grow with "
                             f"the mismatch): {', '.join(FALLBACK_METRICS)}")
        try:
            threshold = float(thr)
        except ValueError:
            raise ValueError(f"{flag} {value!r}: threshold {thr!r} is not a number; give a positive value, "
                             f"e.g. {short}=0.02") from None
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"{flag} {value!r}: threshold must be a finite number > 0, got {thr}")
        opts: dict[str, str] = {}
        for part in parts[1:]:
            key, eq, val = (s.strip() for s in part.partition("="))
            if not eq or key not in ("to", "layers"):
                raise ValueError(f"{flag} {value!r}: unknown option {part!r}; valid: to=bf16|fp8, layers=K ({_FORM})")
            if key in opts:
                raise ValueError(f"{flag} {value!r}: {key} given twice")
            opts[key] = val
        to = opts.get("to", "bf16")
        if to not in FALLBACK_TARGETS:
            raise ValueError(f"{flag} {value!r}: to={to!r} is not a fallback precision; valid: "
                             f"{', '.join(FALLBACK_TARGETS)}")
        k_text = opts.get("layers", "1")
        if not k_text.isdigit() or int(k_text) < 1:
            raise ValueError(f"{flag} {value!r}: layers={k_text!r} must be an integer >= 1 (layers moved per trigger)")
        return cls(short, threshold, to, int(k_text))

    # ------------------------------------------------------------------------------------------
    def value_of(self, metrics: dict[str, float]) -> float:
        """The metric in a step's metrics (its verl key, ``mismatch/<key>`` or the short name)."""
        for k in (self.key, f"mismatch/{self.key}", self.metric):
            if k in metrics:
                return float(metrics[k])
        raise KeyError(f"--rollout-fallback {self.metric}: the step's metrics have no {self.key} "
                       f"(keys: {', '.join(sorted(metrics))})")

    @property
    def exhausted(self) -> bool:
        return self.num_layers is not None and len(self.moved) >= self.num_layers

    def triggered(self, metrics: dict[str, float]) -> bool:
        """Whether the metric exceeds the threshold (NaN: no; every layer moved already: no)."""
        value = self.value_of(metrics)
        self.last_value = value
        return value > self.threshold and not self.exhausted

    # ------------------------------------------------------------------------------------------
    def _resolve(self, model, rollout: str, rules: Sequence[str]) -> RolloutPlan:
        attns = core_attentions(model)
        head_dim = attns[0].config.kv_channels if attns else 0
        return resolve_rollout_plan(rollout, rules, policy_linear_names(model), len(attns), head_dim)

    def _metric(self, ref: torch.Tensor, lp: torch.Tensor, mask: torch.Tensor) -> float:
        return mismatch_metrics(ref, lp, mask)[self.key]

    @torch.no_grad()
    def choose(self, model, batch: RolloutBatch, *, vocab_size: int, rollout: str, rules: Sequence[str],
               iteration: int, reference: torch.Tensor | None = None, temperature: float = 1.0) -> list[str]:
        """Attribute the metric per decoder layer on ``batch`` and move the ``layers_per_trigger``
        layers with the largest positive effect not yet moved (module docstring). ``rollout``,
        ``rules``: ``--rollout-precision`` and the user's ``--rollout-precision-rule`` values (this
        fallback's own rules are added if absent). ``reference``: the trainer's log-probs ``[b, R]``
        of the batch (default: re-scored under the model's own plan). Records an event; returns
        the selectors moved now (possibly none)."""
        self.num_layers = len(core_attentions(model))
        user = list(rules)
        current = user + [r for r in self.rollout_rules() if r not in user]
        plan_now = self._resolve(model, rollout, current)
        mask = batch.response_mask

        def score(plan: RolloutPlan) -> torch.Tensor:
            return score_logprobs(model, batch, vocab_size=vocab_size, rollout=RolloutModel(model, plan),
                                  temperature=temperature)

        ref = reference.detach().float().cpu() if reference is not None else score_logprobs(
            model, batch, vocab_size=vocab_size, temperature=temperature)
        total = self._metric(ref, score(plan_now), mask)
        effects: dict[str, float] = {}
        for layer in range(self.num_layers):
            sel = _selector(layer)
            if sel in self.moved:
                continue
            try:
                plan_i = self._resolve(model, rollout, current + [f"{sel}={self.to}"])
            except SpecError:  # every linear of the layer is taken by an earlier (user) rule
                continue
            if all(plan_i.fprop(n) == plan_now.fprop(n) for n in plan_now.linears):
                continue  # already at `to`
            effects[sel] = total - self._metric(ref, score(plan_i), mask)
        ranked = sorted((s for s in effects if effects[s] > 0), key=lambda s: -effects[s])
        chosen = ranked[: self.layers_per_trigger]
        after = total
        if chosen:
            self.moved.extend(chosen)
            after = self._metric(ref, score(self._resolve(model, rollout, current + [f"{s}={self.to}" for s in chosen])),
                                 mask)
        self.events.append({
            "iteration": int(iteration),
            "value": float(self.last_value if self.last_value is not None else total),
            "rescored": float(total),
            "moved": list(chosen),
            "shares": {s: (e / total if total else float("nan")) for s, e in effects.items()},
            "after": float(after),
        })
        return chosen

    def rollout_rules(self) -> list[str]:
        """The ``--rollout-precision-rule`` entries of the layers moved so far (``layers:I-I=TO``)."""
        return [f"{sel}={self.to}" for sel in self.moved]

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"metric": self.metric, "threshold": self.threshold, "to": self.to,
                "layers_per_trigger": self.layers_per_trigger, "moved": list(self.moved),
                "events": [dict(e) for e in self.events], "num_layers": self.num_layers}

    def load_state_dict(self, d: dict) -> None:
        """Restore the moved layers and events of a checkpoint (the flag's metric, threshold and
        layers per trigger stay as given now); refuses a checkpoint whose layers went to another
        precision than ``to``."""
        if d.get("to", self.to) != self.to and d.get("moved"):
            raise ValueError(f"--rollout-fallback to={self.to}: the checkpoint moved {', '.join(d['moved'])} to "
                             f"{d['to']}; resume with to={d['to']}")
        self.moved = [str(s) for s in d.get("moved", [])]
        self.events = [dict(e) for e in d.get("events", [])]
        self.num_layers = d.get("num_layers")

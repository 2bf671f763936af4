"""``mismatch.md`` for a generation run: the rollout's log-probs against the trainer's recompute.

``launch/generate.py`` samples with the rollout engine under ``--rollout-precision`` and then
calls :func:`write_generation_mismatch`, which

  1. re-scores the sampled tokens with the *trainer* -- the same model under the training plan
     ``--precision`` (+ ``--precision-rule``), and ``--kv-quant`` if the trainer emulates the
     rollout's KV-cache -- in one teacher-forced forward (``pretrain.rl.attribution.score_logprobs``);
  2. writes ``mismatch.md`` and ``mismatch_by_position.png`` (``pretrain.rl.mismatch``: verl's
     metrics, overall and by response position);
  3. appends the attribution of the rollout's own mismatch to weights / activations / KV-cache
     (``pretrain.rl.attribution``; ``attribution.png``), unless ``attribution=False``.

The trainer scores at the sampling ``temperature`` and, given the sampling's ``top_k`` / ``top_p``,
the same truncated, renormalised distribution the engine's log-probs are of (``pretrain.rl.score``;
a sampled token outside the trainer's own kept set leaves the metrics, its fraction noted). Without
them (``truncated=True`` alone) the trainer scores the full distribution and the report says that
the metrics include the truncation.

    info = write_generation_mismatch("out/", model, generation.rollout_batch(), vocab_size=V,
                                     rollout="mxfp4", trainer_precision="bf16")
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch

from model.attention import core_attentions, set_kv_quant
from model.generate import RolloutBatch
from model.gpt import apply_precision_plan, policy_linear_names, policy_linears
from precision import PrecisionPolicy
from pretrain.rl.attribution import attribute_mismatch, score_logprobs, sequences
from pretrain.rl.mismatch import write_mismatch_report
from pretrain.rl.score import policy_logprobs

__all__ = ["trainer_logprobs", "trainer_precision", "write_generation_mismatch"]


@contextlib.contextmanager
def _attributes_restored(objects, *names: str):
    """Inside: change ``names`` of ``objects`` freely; their values are put back on exit."""
    saved = [(o, {n: getattr(o, n) for n in names}) for o in objects]
    try:
        yield
    finally:
        for o, values in saved:
            for n, v in values.items():
                setattr(o, n, v)


@contextlib.contextmanager
def trainer_precision(model, precision: str | None, rules: Sequence[str] = (), kv_quant: str | None = None):
    """Inside: ``model``'s linears under the training plan ``precision`` (+ ``rules``; None: the plan
    the model already has) and its core attentions fake-quantizing K/V in ``kv_quant`` (None: off);
    the model's own plan and KV settings after."""
    attentions = core_attentions(model)
    with (_attributes_restored([m for _, m in policy_linears(model)], "precision"),
          _attributes_restored(attentions, "kv_format", "kv_amax")):
        if precision is not None:
            names = policy_linear_names(model)
            apply_precision_plan(model, PrecisionPolicy.from_args(precision, list(rules)).resolve(names, len(attentions)))
        set_kv_quant(model, kv_quant)
        yield


def trainer_logprobs(model, batch: RolloutBatch, *, vocab_size: int, precision: str | None = "bf16",
                     rules: Sequence[str] = (), kv_quant: str | None = None, temperature: float = 1.0,
                     top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The trainer's recomputed log-probs ``[b, R]`` of the batch's response tokens (``precision``
    None: under the model's own plan), of the sampling distribution (``top_k`` / ``top_p``: its
    truncation; ``-inf`` for a token outside the trainer's kept set)."""
    with trainer_precision(model, precision, rules, kv_quant):
        if not (top_k or top_p < 1):
            return score_logprobs(model, batch, vocab_size=vocab_size, temperature=temperature)
        device = next(model.parameters()).device
        tokens, valid, slot = (x.to(device) for x in sequences(batch))
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                lp, _, _ = policy_logprobs(model, tokens, valid, slot, batch.response_ids.to(device),
                                           vocab_size=vocab_size, temperature=temperature, top_k=top_k, top_p=top_p)
        finally:
            model.train(was_training)
        return lp.cpu().masked_fill(~batch.response_mask, 0.0)


def write_generation_mismatch(out_dir: str, model, batch: RolloutBatch, *, vocab_size: int, rollout: str,
                              rollout_rules: Sequence[str] = (), trainer_precision: str | None = "bf16",
                              trainer_rules: Sequence[str] = (), trainer_label: str | None = None,
                              kv_quant: str | None = None, temperature: float = 1.0, truncated: bool = False,
                              top_k: int = 0, top_p: float = 1.0,
                              attribution: bool = True, groups: dict[str, list[int]] | None = None) -> dict:
    """Write ``out_dir/mismatch.md`` (+ plots) for ``batch`` sampled under ``rollout``; returns
    ``{"overall", "by_position", "md", "plot", "attribution"}`` (module docstring).
    ``trainer_precision`` None: the trainer is the model under the plan it already has (say which
    in ``trainer_label``)."""
    train_lp = trainer_logprobs(model, batch, vocab_size=vocab_size, precision=trainer_precision,
                                rules=trainer_rules, kv_quant=kv_quant, temperature=temperature, top_k=top_k,
                                top_p=top_p)
    extra, attr = [], None
    mask = batch.response_mask & torch.isfinite(train_lp)
    if top_k or top_p < 1:
        outside = int((batch.response_mask & ~mask).sum())
        extra.append(f"The rollout sampled with top-k {top_k} / top-p {top_p:g}; the trainer scored the same "
                     f"truncated distribution ({outside} of {int(batch.response_mask.sum())} sampled tokens outside "
                     f"the trainer's own kept set, left out).")
        train_lp = train_lp.masked_fill(~mask, 0.0)
    elif truncated:
        extra.append("Note: the rollout sampled with top-k / top-p; its log-probs are of the truncated "
                     "distribution, the trainer's of the full one, so the metrics include the truncation.")
    if attribution:
        attr = attribute_mismatch(model, batch, vocab_size=vocab_size, rollout=rollout, rollout_rules=rollout_rules,
                                  groups=groups, temperature=temperature)
        attr.plot(os.path.join(out_dir, "attribution.png"))
        extra += ["## Where the rollout's mismatch comes from", "", attr.table(), "",
                  "![attribution](attribution.png)"]
    trainer = (trainer_label or trainer_precision or "the model's own plan") + (
        f" (+{', '.join(trainer_rules)})" if trainer_rules else "") + (f", --kv-quant {kv_quant}" if kv_quant else "")
    out = write_mismatch_report(out_dir, train_lp, batch.rollout_logprobs, mask,
                                rollout=rollout, trainer=trainer, extra="\n".join(extra))
    return {**out, "attribution": attr}

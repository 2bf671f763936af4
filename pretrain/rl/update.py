"""The update side of an RL iteration: ``--ppo-epochs`` x ``--ppo-mini-batches`` optimizer steps on
the scored rollouts.

    scalars = update(t, scored)   # t: pretrain.rl.trainer.RLTrainer, scored: pretrain.rl.score.Scored

Each mini-batch (the batch split by prompts): the policy's log-probs over the recompute's support
(``pretrain.rl.score``; inside the rollout-guided QAT forward with --rollout-qat), verl's clipped
surrogate with dual clip (``--clip-ratio-low/high/c``) weighted by the rollout correction, minus
``--entropy-coeff`` x the aggregated entropy, plus ``--kl-coef`` x the KL to the reference; backward
through the trainer's per-GEMM plan; then :func:`optimizer_step`.

Normalisation: every loss is normalised by the global mini-batch -- its token count (token-mean)
or sequence count (seq-mean-*) summed over data-parallel ranks; seq-mean-token-sum-norm by
``--max-new-tokens`` only (verl) -- and each rank's gradient is summed over data parallelism, so
how the batch is split over ranks does not change the update.
"""

from __future__ import annotations

import torch

from pretrain.engine import dp_rank_size, dp_sum
from pretrain.rl.objective import agg_loss, kl_penalty, policy_loss
from pretrain.rl.routing import replaying
from pretrain.rl.score import policy_logprobs

__all__ = ["RLDiverged", "optimizer_step", "update"]


class RLDiverged(RuntimeError):
    """A non-finite step the run's non-finite policy does not skip (``--skip-nonfinite-steps``)."""


def optimizer_step(t) -> tuple[float, float]:
    """Pretraining's one optimizer step (``pretrain.engine``: ``TorchEngine.optimizer_step``) on the
    gradients of this rank's share of the loss: summed over data-parallel ranks, TP-partial
    gradients summed, clipped by the global norm (``--clip-grad``), the lr from the schedule, AdamW
    (FP32 mains copied back with --bf16), every policy linear's delayed-scaling history takes this
    step's amax, and the non-finite policy (``--skip-nonfinite-steps``: a non-finite step rolled
    back; one beyond them, :class:`RLDiverged`). Returns (grad norm, lr)."""
    result = t.train_engine.optimizer_step(t.schedule)
    if result.outcome == "diverged":
        policy = t.train_engine.nonfinite
        raise RLDiverged(f"non-finite gradient norm {float(result.grad_norm)} at RL iteration {t.iteration + 1} "
                         f"({policy.count} non-finite steps, more than --skip-nonfinite-steps {policy.max_skips})")
    return float(result.grad_norm), result.lr


def update(t, s) -> dict[str, float]:
    """The PPO passes over ``s`` (module docstring); returns their scalars (the same on every rank)."""
    c, dev, G = t.cfg, t.device, t.cfg.group_size
    n_local = s.advantages.numel() // G
    per_mb = n_local // c.ppo_mini_batches
    kw = {"vocab_size": t.vocab_size, "temperature": c.temperature}
    pg, kl_refs, ents, clipfracs, ppo_kls, norms, lrs = [], [], [], [], [], [], []
    for _epoch in range(c.ppo_epochs):
        for m in range(c.ppo_mini_batches):
            rows = list(range(m * per_mb * G, (m + 1) * per_mb * G))
            idx = torch.tensor(rows, device=dev)
            mb_mask = s.loss_mask[idx]
            counts = dp_sum(torch.tensor([float(mb_mask.sum()), float(len(rows))], dtype=torch.float64))
            norm_kw = {"global_tokens": counts[0].item(), "global_seqs": counts[1].item(),
                       "norm_length": c.max_new_tokens}
            t.train_engine.begin_step()  # zero the gradients; note what a skipped step restores
            routes = None if t.routing is None or s.batch.routes is None else [s.batch.routes[r] for r in rows]
            with t.qat_forward(s.batch.records, rows), replaying(t.routing, routes, s.tokens.shape[1], dev,
                                                                 c.routing_replay):
                lp, ent, _ = policy_logprobs(t.model, s.tokens[idx], s.valid[idx], s.slot[idx], s.response_ids[idx],
                                             keep=None if s.keep is None else s.keep[idx],
                                             entropy=c.entropy_coeff != 0, entropy_grad=c.entropy_coeff != 0, **kw)
                lp = torch.where(mb_mask, lp, torch.zeros((), device=dev))
                loss, pg_m = policy_loss(lp, s.old_lp[idx], s.advantages[idx].to(dev), mb_mask,
                                         clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
                                         clip_ratio_c=c.clip_ratio_c, is_weights=s.weights[idx].to(dev),
                                         loss_agg_mode=c.loss_agg, **norm_kw)
                pg.append(float(loss.detach()))
                if ent is not None:
                    ent_loss = agg_loss(torch.where(mb_mask, ent, torch.zeros((), device=dev)), mb_mask,
                                        c.loss_agg, **norm_kw)
                    ents.append(float(ent_loss.detach()))
                    loss = loss - c.entropy_coeff * ent_loss
                if s.ref_lp is not None:
                    kl = agg_loss(kl_penalty(lp, s.ref_lp[idx], c.kl_type), mb_mask, c.loss_agg, **norm_kw)
                    kl_refs.append(float(kl.detach()))
                    loss = loss + c.kl_coef * kl
                loss.backward()
            clipfracs.append(pg_m.get("clipfrac", 0.0))
            ppo_kls.append(pg_m.get("ppo_kl", 0.0))
            norm, lr = optimizer_step(t)
            norms.append(norm)
            lrs.append(lr)
    t.optimizer.zero_grad(set_to_none=True)

    # losses: each rank's is its share of the global mini-batch loss
    sums = dp_sum(torch.tensor([sum(pg), sum(kl_refs), sum(clipfracs), sum(ppo_kls), sum(ents)], dtype=torch.float64))
    dp, n = dp_rank_size()[1], len(pg)
    out = {"rl/pg_loss": float(sums[0]) / n, "rl/clipfrac": float(sums[2]) / (n * dp),
           "rl/ppo_kl": float(sums[3]) / (n * dp), "rl/grad_norm": norms[-1], "rl/lr": lrs[-1]}
    if kl_refs:
        out["rl/kl_ref"] = float(sums[1]) / n
    if ents:
        out["rl/entropy_loss"] = float(sums[4]) / n
    return out

"""The scoring side of an RL iteration: rewards, advantages, the trainer's log-probs of the sampled
tokens, the trainer/rollout mismatch and the rollout correction.

    scored = score(t, problems, gen)   # t: pretrain.rl.trainer.RLTrainer

=== Which distribution the trainer scores ===
The engine samples from ``softmax(z / T)`` truncated to top-k, then top-p (``model.generate.sample``),
and its log-probs are of that truncated, renormalised distribution. The trainer scores the same:
:func:`policy_logprobs` divides its logits by ``--temperature``, keeps the tokens the same top-k /
top-p rule keeps *on its own logits* (:func:`support_mask`) and takes the log-softmax over them,
so with identical numerics both sides give the same log-prob (the BF16-vs-BF16 floor is float
rounding) and what remains between them is the rollout's quantization. Scoring the full
distribution instead (what verl's actor does while vLLM, with verl's default
``logprobs_mode: processed_logprobs``, returns the truncated one) measures the truncation as
mismatch: with no quantization at all, top-p 0.8 read as ``k3_kl`` 0.016 and top-k 5 as 0.086.
The kept set of the recompute (pi_old) is held for the iteration: the update's forward and the
reference policy score over it (a fixed support, so the log-prob stays differentiable). A
sampled token outside the trainer's own kept set (its numerics ranked it out) has no finite
log-prob there: it leaves the loss and the mismatch metrics, counted as
``mismatch/outside_support_fraction``.

=== The trainer's own numerics, also under rollout-guided QAT ===
With ``--rollout-qat rtn|replay`` the recompute runs inside the QAT forward, which reproduces the
rollout's numbers; the correction (pi_old / pi_rollout) then is ~1 by construction, as it should
be for the policy the loss trains. The mismatch metrics (``mismatch/*``, what ``--rollout-fallback``
triggers on and what the sweep tables) are of the rollout against the trainer's *own* numerics
(``--precision``, no QAT): one more no-grad forward under QAT. ``qat/k3_kl`` keeps the QAT
recompute's. ``mismatch/ess_raw`` is the raw effective sample size of the token ratio
pi_trainer / pi_rollout of those own numerics (``correction/ess_raw``: of the correction's ratio).

Log-probs: one forward of each right-padded row ``prompt + response`` (``pretrain.rl.attribution.sequences``'s
layout; the positions and visible tokens the engine had), this rank's vocabulary shard over the
temperature, megatron's vocabulary padding masked out (the engine never samples it), and
megatron's ``vocab_parallel_cross_entropy`` -- differentiable and exact under TP. The kept set and
the entropy need the whole vocabulary: the logits are all-gathered over TP for them (with the
gradient, each rank's slice of it, when ``--entropy-coeff`` is set).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from model.generate import attention_mask
from pretrain.rl.attribution import sequences
from pretrain.rl.mismatch import mismatch_metrics
from pretrain.rl.objective import Correction, group_advantages, overlong_reward, rollout_correction
from pretrain.rl.routing import replaying, routing_counts, routing_scalars
from pretrain.rl.task import reward

__all__ = ["Scored", "policy_logprobs", "score", "support_mask", "truncated_entropy"]


def support_mask(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """The tokens ``model.generate.sample`` can draw from temperature-scaled logits ``z [..., V]``:
    the top-k, then the smallest most-likely set reaching ``top_p`` of the top-k distribution (the
    most likely always kept). None when nothing is truncated."""
    keep = None
    if top_k and top_k < z.shape[-1]:
        keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.topk(top_k, -1).indices, True)
        z = z.masked_fill(~keep, float("-inf"))
    if top_p < 1:
        sorted_z, order = z.sort(-1, descending=True)
        probs = sorted_z.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # mass of the more likely tokens
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        keep = ~drop if keep is None else keep & ~drop
    return keep


def truncated_entropy(z: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of softmax(z) over ``keep`` (all tokens: None), float32, finite gradients (a dropped
    or ``-inf`` logit adds nothing)."""
    z = z.float()
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    p = z.softmax(-1)
    finite = torch.where(torch.isfinite(z), z, torch.zeros((), device=z.device))
    return torch.logsumexp(z, -1) - (p * finite).sum(-1)


def policy_logprobs(model, tokens: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor, response_ids: torch.Tensor,
                    *, vocab_size: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    keep: torch.Tensor | None = None, entropy: bool = False, entropy_grad: bool = False):
    """``(logprobs [b, R], entropy [b, R] or None, keep [b, R, V] or None)`` of ``response_ids`` at
    ``slot`` under the sampling distribution (module docstring): ``keep`` given, the support it
    names; else the top-k / top-p set of these logits (None: the full distribution)."""
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    logits = model(tokens, positions, attention_mask(valid, tokens.shape[1]))  # [b, s, V / tp]
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
    logits = logits[rows, (slot - 1).clamp(min=0)].float() / temperature  # [b, R, V / tp]: predicts response j
    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    padded = torch.arange(start, start + shard, device=logits.device) >= vocab_size
    if bool(padded.any()):
        logits = logits.masked_fill(padded, float("-inf"))
    truncating = keep is not None or (top_k and top_k < vocab_size) or top_p < 1
    full = None
    if truncating or entropy:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        src = logits if entropy_grad else logits.detach()
        full = (_GatherVocab.apply(src, parallel_state.get_tensor_model_parallel_group()) if tp > 1
                else src)[..., :vocab_size]
    if keep is None and truncating:
        keep = support_mask(full.detach(), top_k, top_p)
    ent = None
    if entropy:  # before megatron's vocab_parallel_cross_entropy, which overwrites its input in place
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            ent = truncated_entropy(full if entropy_grad else full.detach(), keep)
    if keep is not None:
        pad = torch.zeros(*keep.shape[:-1], start + shard - vocab_size, dtype=torch.bool, device=keep.device) \
            if start + shard > vocab_size else None
        mine = (torch.cat([keep, pad], -1) if pad is not None else keep)[..., start:start + shard]
        logits = logits.masked_fill(~mine, float("-inf"))
    lp = -vocab_parallel_cross_entropy(logits.clone() if entropy_grad else logits, response_ids)
    return lp, ent, keep


class _GatherVocab(torch.autograd.Function):
    """All-gather of vocabulary shards along the last dim, on any device (megatron's gather allocates
    on CUDA); backward: this rank's slice (every TP rank computes the same loss of the whole)."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.width = torch.distributed.get_rank(group), x.shape[-1]
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


def _in_support(keep: torch.Tensor | None, response_ids: torch.Tensor) -> torch.Tensor:
    if keep is None:
        return torch.ones_like(response_ids, dtype=torch.bool)
    return keep.gather(-1, response_ids[..., None].clamp(max=keep.shape[-1] - 1))[..., 0]


# ================================================================================================
# One iteration's scores
# ================================================================================================


@dataclass
class Scored:
    """What the update consumes (this rank's rows) and the iteration's global metrics."""

    batch: object  # model.generate.RolloutBatch
    tokens: torch.Tensor
    valid: torch.Tensor
    slot: torch.Tensor
    response_ids: torch.Tensor
    loss_mask: torch.Tensor  # [B, R] bool: response tokens the loss uses (correction, support, --overlong-filter)
    old_lp: torch.Tensor  # pi_old: the recompute (inside the QAT forward with --rollout-qat)
    ref_lp: torch.Tensor | None
    keep: torch.Tensor | None  # the recompute's kept set (top-k / top-p), the update's support
    advantages: torch.Tensor
    weights: torch.Tensor  # the rollout correction's
    scalars: dict[str, float] = field(default_factory=dict)
    mismatch: dict[str, float] = field(default_factory=dict)  # verl's keys, rollout vs own numerics


def _gather(obj) -> list:
    group = parallel_state.get_data_parallel_group()
    if group.size() == 1:
        return [obj]
    out = [None] * group.size()
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows of ``[b_i, T_i]`` tensors, right-padded with 0 to one width."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


def rewards_of(t, problems, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards [N], truncated [N])``: the task's (or --reward-function's) reward of each response
    plus DAPO's overlong penalty (--overlong-buffer-len); truncated: no stop token."""
    c, G, eod = t.cfg, t.cfg.group_size, t.tokenizer.eod
    fn = t.reward_fn or reward
    rewards = torch.tensor([fn(problems[i // G], t.response_text(toks), t.spec) for i, toks in enumerate(gen.tokens)],
                           dtype=torch.float32)
    lengths = torch.tensor([len(toks) for toks in gen.tokens])
    if c.overlong_buffer_len:
        rewards = rewards + overlong_reward(lengths, c.max_new_tokens, c.overlong_buffer_len, c.overlong_penalty_factor)
    truncated = torch.tensor([not toks or toks[-1] != eod for toks in gen.tokens])
    return rewards, truncated


def _routing_scalars(t, routes, trainer_routing, width, own_lp, other_lp, rollout_lp, in_own, replay) -> dict:
    """``routing/*`` (``pretrain.rl.routing``) over the global batch: top-k set and probability mismatch of the
    trainer routing afresh, and the log-prob mismatch of its own numerics with and without replay."""
    counts = routing_counts(routes, trainer_routing, width)
    with_lp, without_lp = (own_lp, other_lp) if replay else (other_lp, own_lp)
    m = in_own
    diffs = [(lp.masked_fill(~m, 0.0) - rollout_lp.masked_fill(~m, 0.0)) for lp in (with_lp, without_lp)]
    local = torch.cat([counts.flatten(), torch.tensor([float(d.abs().sum()) for d in diffs] + [float(m.sum())],
                                                      dtype=torch.float64)])
    parts = _gather({"local": local, "with": with_lp.detach().cpu(), "without": without_lp.detach().cpu(),
                     "rollout": rollout_lp.detach().cpu(), "mask": m.cpu()})
    total = sum(p["local"] for p in parts)
    n_layers = counts.shape[0]
    out = routing_scalars(total[: 4 * n_layers].view(n_layers, 4), [n for n, _ in t.routing.routers])
    g = {k: _pad_cat([p[k] for p in parts]) for k in ("with", "without", "rollout", "mask")}
    gm = g["mask"].bool()
    for key, lp in (("replay", g["with"]), ("no_replay", g["without"])):
        out[f"routing/k3_kl_{key}"] = mismatch_metrics(lp.masked_fill(~gm, 0.0), g["rollout"].masked_fill(~gm, 0.0),
                                                       gm)["rollout_corr/k3_kl"]
    n = float(total[-1])
    out["routing/logprob_gap_replay"] = float(total[-3]) / max(n, 1.0)
    out["routing/logprob_gap_no_replay"] = float(total[-2]) / max(n, 1.0)
    return out


def score(t, problems, gen) -> Scored:
    """Rewards, advantages, the recompute (and the reference's, and the own-numerics one under QAT),
    mismatch metrics over the global batch and the rollout correction."""
    c, dev = t.cfg, t.device
    batch = gen.rollout_batch()
    rewards, truncated = rewards_of(t, problems, gen)
    advantages = group_advantages(rewards, c.group_size, c.advantage_estimator)
    tokens, valid, slot = (x.to(dev) for x in sequences(batch))
    response_ids = batch.response_ids.to(dev)
    mask = batch.response_mask.to(dev)
    rollout_lp = batch.rollout_logprobs.to(dev)
    kw = {"vocab_size": t.vocab_size, "temperature": c.temperature, "top_k": c.top_k, "top_p": c.top_p}

    t.model.train()
    routes = batch.routes if t.routing is not None else None
    width, replay = tokens.shape[1], c.routing_replay

    def routed(on: bool):  # MoE: record the routing; replay the rollout's with on (pretrain.rl.routing)
        return replaying(t.routing, routes, width, dev, on)

    with torch.no_grad():
        with t.qat_forward(batch.records), routed(replay):
            old_lp, entropy, keep = policy_logprobs(t.model, tokens, valid, slot, response_ids, entropy=True, **kw)
        own_lp, own_keep = old_lp, keep
        if c.rollout_qat != "none":  # the trainer's own numerics: what the mismatch metrics measure
            with routed(replay):
                own_lp, _, own_keep = policy_logprobs(t.model, tokens, valid, slot, response_ids, **kw)
        trainer_routing = list(t.routing.last) if routes is not None else None
        other_lp = None
        if routes is not None:  # own numerics with the routing the run does not use: with / without replay
            with routed(not replay):
                other_lp, _, _ = policy_logprobs(t.model, tokens, valid, slot, response_ids, keep=own_keep, **kw)
            if replay:  # the trainer's routing afresh is this forward's
                trainer_routing = list(t.routing.last)
        ref_lp = None
        if c.kl_coef > 0:
            with t.reference_weights(), routed(replay):
                ref_lp, _, _ = policy_logprobs(t.model, tokens, valid, slot, response_ids, keep=keep, **kw)
    in_old, in_own = mask & _in_support(keep, response_ids), mask & _in_support(own_keep, response_ids)
    old_lp, own_lp = old_lp.masked_fill(~in_old, 0.0), own_lp.masked_fill(~in_own, 0.0)
    entropy = entropy.masked_fill(~in_old, 0.0)
    if ref_lp is not None:
        ref_lp = ref_lp.masked_fill(~in_old, 0.0)
    corr = rollout_correction(old_lp, rollout_lp.masked_fill(~in_old, 0.0), in_old, c.correction)
    loss_mask = corr.mask & in_old
    if c.overlong_filter:
        loss_mask = loss_mask & ~truncated.to(dev)[:, None]

    # === global (all data-parallel ranks) views for metrics ===
    parts = _gather({k: v.detach().cpu() for k, v in (
        ("old", old_lp), ("own", own_lp), ("rollout", rollout_lp), ("mask", mask), ("in_old", in_old),
        ("in_own", in_own), ("entropy", entropy), ("rewards", rewards), ("truncated", truncated))})
    g = {k: _pad_cat([p[k] for p in parts]) for k in ("old", "own", "rollout", "mask", "in_old", "in_own", "entropy")}
    g_rewards, g_trunc = (torch.cat([p[k] for p in parts]) for k in ("rewards", "truncated"))
    g_mask, g_old_m, g_own_m = g["mask"].bool(), g["in_old"].bool(), g["in_own"].bool()
    g_roll = g["rollout"]
    metrics = mismatch_metrics(g["own"], g_roll, g_own_m)
    g_corr = rollout_correction(g["old"], g_roll.masked_fill(~g_old_m, 0.0), g_old_m, c.correction)
    own_raw = rollout_correction(g["own"], g_roll.masked_fill(~g_own_m, 0.0), g_own_m, Correction()).metrics
    n_tokens = float(g_mask.sum())
    scalars = {
        "rl/reward_mean": float(g_rewards.mean()),
        "rl/response_length": float(g_mask.sum(1).double().mean()),
        "rl/entropy": float((g["entropy"] * g_old_m).sum() / g_old_m.sum().clamp(min=1)),
        "rl/truncated_fraction": float(g_trunc.float().mean()),
        "mismatch/outside_support_fraction": float((g_mask & ~g_own_m).sum()) / max(n_tokens, 1.0),
        "mismatch/ess_raw": own_raw["ess_raw"],
        **{f"mismatch/{k.split('/', 1)[1]}": v for k, v in metrics.items()},
        **{f"correction/{k}": float(v) for k, v in g_corr.metrics.items()},
    }
    if c.rollout_qat != "none":
        qat = mismatch_metrics(g["old"], g_roll, g_old_m)
        scalars["qat/k3_kl"] = qat["rollout_corr/k3_kl"]
    if routes is not None:
        scalars.update(_routing_scalars(t, routes, trainer_routing, width, own_lp, other_lp, rollout_lp, in_own, replay))
    return Scored(batch, tokens, valid, slot, response_ids, loss_mask, old_lp, ref_lp, keep, advantages,
                  corr.weights, scalars, metrics)

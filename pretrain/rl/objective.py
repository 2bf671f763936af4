r"""The RL objective: group advantages, rollout corrections, the clipped policy loss, KL, entropy.

Definitions follow verl (``verl/trainer/ppo/core_algos.py``: ``compute_grpo_outcome_advantage``,
``agg_loss``, ``compute_policy_loss_vanilla``, ``kl_penalty``; ``rollout_corr_helper.py`` for the
importance-sampling and rejection corrections), with slime / TRL names for the corrections. Three
policies take part (verl's *decoupled* mode)::

    pi_rollout   the engine that sampled (``--rollout-precision``): rollout_logprobs (RolloutBatch)
    pi_old       the trainer's recompute of the same tokens before the update (``--precision``, no grad)
    pi_theta     the trainer being updated: logprobs (with grad)

Shapes: ``[B, T]`` response tokens (B = prompts x G responses, grouped consecutively), ``mask`` True
(or 1) on real response tokens.

=== Advantages: one scalar per response ===
    grpo      A_i = (r_i - mean_g r) / (std_g r + eps)     std unbiased (n - 1), as torch.std / verl
    dr_grpo   A_i =  r_i - mean_g r                          (Dr. GRPO, arXiv 2503.20783: no std)
A group whose rewards are all equal gets A = 0 (no signal). ``A`` is broadcast over the tokens.

=== Overlong responses (DAPO, arXiv 2503.14476; verl's DAPO reward manager) ===
    overlong_reward(n) = min(-(n - (L_max - L_buf)) / L_buf * factor, 0)    added to the reward
with n the response's length, L_max = --max-new-tokens, L_buf = --overlong-buffer-len and factor
= --overlong-penalty-factor (verl's reward_model.overlong_buffer.{len, penalty_factor}): 0 up to
L_max - L_buf tokens, then falling linearly to -factor at L_max. ``--overlong-filter`` (DAPO's
overlong filtering) instead drops the loss of every truncated response (no stop token).

=== Rollout correction: weights w [B, T] and a rejection mask, from rho = pi_old / pi_rollout ===
    log rho_t = old_logprobs_t - rollout_logprobs_t            (exp of log ratios clamped to +-20)
    rho_seq   = exp(sum_t log rho_t)                  rho_geo = exp(mean_t log rho_t)
    none      w = 1
    tis       w_t = min(rho_t, C)                        C = --rollout-is-threshold (2.0)
    mis       w_t = rho_t, token rejected unless L <= rho_t <= U        (IcePop; U = --rollout-rs-threshold
                                                           2.0, L = --rollout-rs-threshold-lower 1/U = 0.5)
    seq_tis   w_i = min(rho_seq, C)                      C = 2.0
    seq_mis   w_i = rho_seq, sequence rejected unless L <= rho_seq <= U   (U 2.0, L 1/U)
    geo_mis   w = 1, sequence rejected unless L <= rho_geo <= U           (U 1.001, L 1/U: verl's
                                                           geometric RS; typical 1.0001 - 1.001)
Lower bounds default to 1/U (verl's rule). Weights are detached and 1 outside the returned mask.

Bounds and verl's. Ours bound rho = pi_old / pi_rollout: --rollout-rs-threshold U and
--rollout-rs-threshold-lower L keep L <= rho <= U, the meaning verl's ``rollout_rs_threshold_lower``
had until verl removed it (PR #4544, January 2026). Current verl (``rollout_corr_helper.py``,
``compute_rollout_rejection_mask``) bounds the k1 statistic ``-log rho``, i.e. pi_rollout / pi_old,
by a ``"LOWER_UPPER"`` string: verl's ``"0.8_2.0"`` keeps rho in [1/2.0, 1/0.8] = [0.5, 1.25].
``--rollout-rs-threshold`` accepts that string with verl's meaning (:meth:`Correction.from_args`
turns it into our U = 1/LOWER, L = 1/UPPER); a single number U means [1/U, U] in both.

Metrics, as verl's ``compute_is_metrics`` (``rollout_corr_helper.py``) defines them, with the
kind's ratio r (rho_t for tis / mis, rho_seq for seq_tis / seq_mis, rho_geo for geo_mis) and its
bounds [lo, hi] ([1/C, C] for tis / seq_tis, [L, U] for the rejecting kinds):
    ess                 1 / mean((w / mean w)^2) over the valid tokens, w = clamp(r, lo, hi): verl's
                        rollout_is_eff_sample_size, of the weights *before* rejection (1 for none and
                        geo_mis, which weigh nothing)
    ess_raw             the same of the unclamped token ratio rho_t, every kind: the informative one
                        (``none`` and the QAT modes have w = 1, so their ess is 1 by construction)
    is_weight_mean      verl's rollout_is_mean: the token mean of r *before* truncation
    is_weight_max/min   max / min of r over the valid tokens (sequences), before truncation
    ratio_fraction_high valid tokens (sequence-level kinds: sequences) with r > hi
    ratio_fraction_low  ... with r < lo (verl's rollout_is_ratio_fraction_low: also for tis / seq_tis)
    masked_fraction     valid tokens rejected (verl's rollout_rs_masked_fraction)
    seq_masked_fraction sequences with a rejected token (rollout_rs_seq_masked_fraction)
(Until this release ess weighed the truncated weights with rejected tokens as 0, is_weight_* were
taken after truncation over the kept tokens and ratio_fraction_low was 0 for tis / seq_tis.)

=== Policy loss (verl vanilla PPO, dual-clip, IS weights applied after clipping) ===
    r_t  = exp(clamp(logprobs - old_logprobs, -20, 20))
    l_t  = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
    l_t  = min(l_t, -A c)      where A < 0                  (dual clip, c = --clip-ratio-c 3.0; None: off)
    l_t *= w_t                                               (rollout-correction weights)
    loss = agg_loss(l, mask, loss_agg_mode) [- entropy_coeff agg_loss(H, mask, loss_agg_mode)]
    clipfrac = token mean of [-A clip(r) > -A r]; ppo_kl = token mean of (old_logprobs - logprobs)

=== Loss aggregation (verl's agg_loss; S = sequences with a token in mask, T_i their tokens) ===
    token-mean                sum_it l m / sum_it m               (global_tokens replaces sum_it m)
    seq-mean-token-mean       sum_i (sum_t l m / T_i) / S         (global_seqs replaces S)
    seq-mean-token-sum        sum_i (sum_t l m) / S               (global_seqs replaces S)
    seq-mean-token-sum-norm   sum_i (sum_t l m) / norm_length     (Dr. GRPO's constant length; default:
                                                                   the width T; no sequence count)
seq-mean-token-sum-norm is verl's ``agg_loss`` (``core_algos.py``): the token sums divided by its
``loss_scale_factor`` only. verl divided it by the sequence count too for two weeks (PR #4510,
December 2025), then reverted that (PR #4769, January 2026); before and after, no division by S.
With ``global_tokens`` / ``global_seqs`` the counts of the whole global batch (every micro-batch of
every data-parallel rank), the micro-batch losses *sum* to the global-batch loss (sum-norm needs no
count: its micro-batch losses sum to the batch's as they are); a DDP that averages gradients over
ranks then needs the loss multiplied by the DP size (verl's dp_size; verl does not multiply
sum-norm by it, so at DP > 1 its averaged update is 1/DP of this sum's -- our trainer sums
gradients over ranks, so the split of the batch over ranks never changes the update).
verl passes the mini-batch's sequence count as its global_batch_size; without global_seqs the
local S counts only sequences with a token in mask (a sequence rejected whole does not count).

=== KL to a reference (Schulman's estimators, per token, verl's kl_penalty) ===
    k1 / kl          log p - log p_ref
    abs              |log p - log p_ref|
    mse / k2         (log p - log p_ref)^2 / 2
    low_var_kl / k3  clamp(exp(d) - d - 1, -10, 10),  d = clamp(log p_ref - log p, -20, 20)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "Correction",
    "CorrectionResult",
    "agg_loss",
    "entropy_from_logits",
    "group_advantages",
    "kl_penalty",
    "overlong_reward",
    "policy_loss",
    "rollout_correction",
]

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_mis")
KL_KINDS = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3")
SAFETY_BOUND = 20.0  # |log ratio| clamp before exp (verl's)

_TRUNCATING = ("tis", "seq_tis")
_REJECTING = ("mis", "seq_mis", "geo_mis")
_DEFAULT_IS = 2.0
_DEFAULT_RS = {"mis": 2.0, "seq_mis": 2.0, "geo_mis": 1.001}


# ================================================================================================
# Advantages
# ================================================================================================


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages ``[N]`` of ``rewards [N]``, groups of ``group_size`` consecutive responses (see the
    module docstring); float32."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator {estimator!r}: unknown; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"--group-size {group_size}: a group needs at least 2 responses per prompt")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"--group-size {group_size}: rewards of shape {tuple(rewards.shape)} are not whole groups "
                         f"(expected [prompts * {group_size}])")
    r = rewards.detach().float().view(-1, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def overlong_reward(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (module docstring) of response ``lengths [N]``: ``[N]`` float32,
    <= 0; verl's ``DAPORewardManager`` arithmetic."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"--overlong-buffer-len {buffer_len}: must be in [1, --max-new-tokens {max_len}]")
    exceed = lengths.float() - (max_len - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)


# ================================================================================================
# Loss aggregation
# ================================================================================================


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, norm_length: int | None = None,
             global_tokens=None, global_seqs=None) -> torch.Tensor:
    """Scalar loss from ``loss_mat [B, T]`` over ``mask`` (see the module docstring)."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"--loss-agg-mode {mode!r}: unknown; valid: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(f"agg_loss: loss {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must be equal [B, T]")
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    if mode == "token-mean":
        denom = m.sum() if global_tokens is None else global_tokens
        return masked.sum() / _positive(denom, "global_tokens")
    seq_sum = masked.sum(-1)
    if mode == "seq-mean-token-sum-norm":  # verl: sum of the token sums / loss_scale_factor, no count
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise ValueError(f"agg_loss: norm_length must be a positive integer, got {norm_length!r}")
        return seq_sum.sum() / length
    tokens = m.sum(-1)
    has = tokens > 0
    per_seq = seq_sum / tokens.clamp(min=1) if mode == "seq-mean-token-mean" else seq_sum
    denom = has.sum().to(loss_mat.dtype) if global_seqs is None else global_seqs
    return (per_seq * has).sum() / _positive(denom, "global_seqs")


def _positive(denom, name: str):
    """``denom`` clamped below at 1: an empty micro-batch, or a global batch whose every token a
    rejection (e.g. ``geo_mis`` under a large mismatch) masked, gives a zero loss -- no update --
    never a NaN or an error; a negative count is a bug."""
    if isinstance(denom, torch.Tensor):
        return denom.clamp(min=1)
    if denom < 0:
        raise ValueError(f"agg_loss: {name} must be >= 0, got {denom}")
    return max(denom, 1)


# ================================================================================================
# Rollout corrections
# ================================================================================================


@dataclass(frozen=True)
class Correction:
    """How the trainer corrects for the rollout's mismatch (``--rollout-correction`` and thresholds).

    Resolved on construction: thresholds the kind uses are filled with their defaults, thresholds it
    does not use are refused (one line naming the flag)."""

    kind: str = "none"
    """One of CORRECTIONS."""
    is_threshold: float | None = None
    """Truncation cap C of tis / seq_tis (> 1; default 2.0)."""
    rs_threshold: float | None = None
    """Upper rejection bound U of mis / seq_mis / geo_mis (> 1; default 2.0, geo_mis 1.001)."""
    rs_threshold_lower: float | None = None
    """Lower rejection bound L (0 <= L < 1; default 1 / U)."""

    def __post_init__(self):
        if self.kind not in CORRECTIONS:
            raise ValueError(f"--rollout-correction {self.kind!r}: unknown; valid: {', '.join(CORRECTIONS)}")
        given = {"--rollout-is-threshold": self.is_threshold, "--rollout-rs-threshold": self.rs_threshold,
                 "--rollout-rs-threshold-lower": self.rs_threshold_lower}
        uses = {"--rollout-is-threshold": _TRUNCATING, "--rollout-rs-threshold": _REJECTING,
                "--rollout-rs-threshold-lower": _REJECTING}
        for flag, value in given.items():
            if value is None:
                continue
            if self.kind not in uses[flag]:
                raise ValueError(f"{flag} {value}: applies to --rollout-correction {' / '.join(uses[flag])} only, "
                                 f"not {self.kind}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{flag} {value!r}: must be a finite number")
        if self.kind in _TRUNCATING:
            cap = _DEFAULT_IS if self.is_threshold is None else float(self.is_threshold)
            if cap <= 1:
                raise ValueError(f"--rollout-is-threshold {cap:g}: the truncation cap must be > 1 (e.g. 2.0)")
            object.__setattr__(self, "is_threshold", cap)
        if self.kind in _REJECTING:
            upper = _DEFAULT_RS[self.kind] if self.rs_threshold is None else float(self.rs_threshold)
            if upper <= 1:
                raise ValueError(f"--rollout-rs-threshold {upper:g}: the upper bound must be > 1 "
                                 f"(e.g. {_DEFAULT_RS[self.kind]:g} for {self.kind})")
            lower = 1.0 / upper if self.rs_threshold_lower is None else float(self.rs_threshold_lower)
            if not 0 <= lower < 1:
                raise ValueError(f"--rollout-rs-threshold-lower {lower:g}: the lower bound must be in [0, 1) "
                                 f"(default 1 / --rollout-rs-threshold)")
            object.__setattr__(self, "rs_threshold", upper)
            object.__setattr__(self, "rs_threshold_lower", lower)

    @classmethod
    def from_args(cls, kind, is_threshold=None, rs_threshold=None, rs_threshold_lower=None) -> Correction:
        """From the flag values (None: not given); ValueError naming the flag on a bad one.
        ``rs_threshold`` may be verl's ``"LOWER_UPPER"`` string (bounds on pi_rollout / pi_old,
        module docstring): it becomes U = 1/LOWER, L = 1/UPPER on rho."""
        if isinstance(rs_threshold, str):
            text = rs_threshold.strip()
            if "_" in text:
                if rs_threshold_lower is not None:
                    raise ValueError(f"--rollout-rs-threshold {text}: verl's LOWER_UPPER form already sets the lower "
                                     f"bound; drop --rollout-rs-threshold-lower")
                low_s, _, up_s = text.partition("_")
                try:
                    low, up = float(low_s), float(up_s)
                except ValueError:
                    raise ValueError(f"--rollout-rs-threshold {text!r}: expected a number U or verl's LOWER_UPPER "
                                     f"(e.g. 0.8_2.0)") from None
                if not (math.isfinite(low) and math.isfinite(up) and 0 < low < 1 < up):
                    raise ValueError(f"--rollout-rs-threshold {text}: verl's LOWER_UPPER bounds pi_rollout / pi_trainer "
                                     f"and needs 0 < LOWER < 1 < UPPER (e.g. 0.8_2.0: rho in [0.5, 1.25])")
                rs_threshold, rs_threshold_lower = 1.0 / low, 1.0 / up
            else:
                try:
                    rs_threshold = float(text)
                except ValueError:
                    raise ValueError(f"--rollout-rs-threshold {text!r}: expected a number U or verl's LOWER_UPPER "
                                     f"(e.g. 0.8_2.0)") from None
        return cls(kind, is_threshold, rs_threshold, rs_threshold_lower)

    @property
    def bounds(self) -> tuple[float, float] | None:
        """``(lo, hi)`` of the kind's ratio: [1/C, C] truncating, [L, U] rejecting, None for none."""
        if self.kind in _TRUNCATING:
            return 1.0 / self.is_threshold, self.is_threshold
        if self.kind in _REJECTING:
            return self.rs_threshold_lower, self.rs_threshold
        return None

    @property
    def sequence_level(self) -> bool:
        return self.kind in ("seq_tis", "seq_mis", "geo_mis")


@dataclass
class CorrectionResult:
    weights: torch.Tensor  # [B, T] float32, detached; 1 where no correction applies (and outside mask)
    mask: torch.Tensor  # [B, T] the response mask after rejection (dtype of the input mask)
    metrics: dict[str, float] = field(default_factory=dict)


def _ess(w: torch.Tensor, valid: torch.Tensor) -> float:
    """verl's normalized effective sample size 1 / mean((w / mean w)^2) over ``valid`` (0 if all w = 0)."""
    n = valid.sum()
    if n == 0:
        return 1.0
    w = w[valid].double()
    sq = (w * w).sum()
    return float(w.sum() ** 2 / (n * sq)) if sq > 0 else 0.0


@torch.no_grad()
def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       corr: Correction) -> CorrectionResult:
    """Weights and rejection mask for ``corr`` from rho = exp(old_logprobs - rollout_logprobs) (see the
    module docstring). ``old_logprobs``: the trainer's recompute (no grad), ``[B, T]`` like the rest.
    The metrics are verl's (``rollout_corr_helper.py``: ``compute_is_metrics``,
    ``compute_rollout_rejection_mask``), of the kind's ratio before truncation and rejection."""
    if not (old_logprobs.shape == rollout_logprobs.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(f"rollout_correction: old {tuple(old_logprobs.shape)}, rollout "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} log-probs must be equal [B, T]")
    valid = mask.bool()
    log_rho = torch.where(valid, old_logprobs.float() - rollout_logprobs.float(), 0.0)
    rho = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    tokens = valid.sum(-1)
    has = tokens > 0
    seq_log = log_rho.sum(-1)
    if corr.kind == "geo_mis":
        seq_log = seq_log / tokens.clamp(min=1)
    seq_rho = seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()[:, None].expand_as(rho)

    weights = torch.ones_like(rho)
    accept = torch.ones_like(valid)
    ratio = seq_rho if corr.sequence_level else rho
    bounds = corr.bounds
    if corr.kind in _TRUNCATING:
        weights = ratio.clamp(max=corr.is_threshold)
    elif corr.kind in _REJECTING:
        accept = ~((ratio > corr.rs_threshold) | (ratio < corr.rs_threshold_lower))
        if corr.kind != "geo_mis":
            weights = ratio.clone()
    kept = valid & accept
    weights = torch.where(kept, weights, torch.ones_like(weights))
    new_mask = (mask & accept) if mask.dtype == torch.bool else mask * accept.to(mask.dtype)

    n_valid = int(valid.sum())
    n_seq = int(has.sum())
    weighs = corr.kind not in ("none", "geo_mis")  # kinds with IS weights (verl's rollout_is set)
    if bounds is None:
        frac_high = frac_low = 0.0
    elif corr.sequence_level:  # per sequence, in log space (verl)
        lo, hi = math.log(bounds[0]) if bounds[0] > 0 else -math.inf, math.log(bounds[1])
        frac_high = float((seq_log[has] > hi).float().mean()) if n_seq else 0.0
        frac_low = float((seq_log[has] < lo).float().mean()) if n_seq else 0.0
    else:
        frac_high = float((ratio[valid] > bounds[1]).float().mean()) if n_valid else 0.0
        frac_low = float((ratio[valid] < bounds[0]).float().mean()) if n_valid else 0.0
    if weighs and n_valid:
        r = ratio[valid]
        if corr.sequence_level:
            logs = seq_log[has]
            w_max, w_min = math.exp(min(float(logs.max()), SAFETY_BOUND)), math.exp(float(logs.min()))
        else:
            w_max, w_min = float(r.max()), float(r.min())
        w_mean = float(r.double().mean())
        ess = _ess(ratio.clamp(bounds[0], bounds[1]), valid)
    else:
        w_mean = w_max = w_min = ess = 1.0
    rejected_seq = ((valid & ~accept).sum(-1) > 0)[has]
    metrics = {
        "ess": ess,
        "ess_raw": _ess(rho, valid),
        "masked_fraction": float((valid & ~accept).sum()) / n_valid if n_valid else 0.0,
        "seq_masked_fraction": float(rejected_seq.float().mean()) if n_seq else 0.0,
        "is_weight_mean": w_mean,
        "is_weight_max": w_max,
        "is_weight_min": w_min,
        "ratio_fraction_high": frac_high,
        "ratio_fraction_low": frac_low,
    }
    return CorrectionResult(weights.detach(), new_mask, metrics)


# ================================================================================================
# Policy loss, KL, entropy
# ================================================================================================


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    m = m.to(x.dtype)
    n = float(m.sum())
    return float((x * m).sum()) / n if n else 0.0


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0,
                is_weights: torch.Tensor | None = None, loss_agg_mode: str = "token-mean",
                **agg_kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's vanilla PPO clipped surrogate with dual clip (see the module docstring): ``(loss, metrics)``,
    metrics ``clipfrac``, ``clipfrac_lower``, ``ppo_kl``. ``advantages``: ``[B]`` (broadcast over
    tokens) or ``[B, T]``; ``agg_kwargs`` go to :func:`agg_loss`."""
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"--clip-ratio-low {clip_ratio_low}: must be in [0, 1)")
    if clip_ratio_high < 0:
        raise ValueError(f"--clip-ratio-high {clip_ratio_high}: must be >= 0")
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"--clip-ratio-c {clip_ratio_c}: the dual-clip bound must be > 1 (verl: 3.0)")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"policy_loss: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must be equal [B, T]")
    adv = advantages.detach().to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    neg_kl = (logprobs - old_logprobs.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = neg_kl.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    metrics = {"clipfrac": _masked_mean((loss2 > loss1).float(), mask), "ppo_kl": _masked_mean(-neg_kl.detach(), mask)}
    if clip_ratio_c is not None:
        loss3 = -adv * clip_ratio_c
        metrics["clipfrac_lower"] = _masked_mean(((clipped > loss3) & (adv < 0)).float(), mask)
        clipped = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
    else:
        metrics["clipfrac_lower"] = 0.0
    if is_weights is not None:
        if is_weights.shape != logprobs.shape:
            raise ValueError(f"policy_loss: is_weights {tuple(is_weights.shape)} must match logprobs "
                             f"{tuple(logprobs.shape)}")
        clipped = clipped * is_weights.detach().to(clipped.dtype)
    return agg_loss(clipped, mask, loss_agg_mode, **agg_kwargs), metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of the policy to the reference (see the module docstring)."""
    if kind in ("k1", "kl"):
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind in ("low_var_kl", "k3"):
        d = (ref_logprobs - logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        return (d.exp() - d - 1).clamp(-10, 10)
    raise ValueError(f"--kl-type {kind!r}: unknown; valid: {', '.join(KL_KINDS)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z (float32; a
    ``-inf`` logit, a token that cannot be drawn, adds nothing)."""
    z = logits.float()
    p = z.softmax(-1)
    return torch.logsumexp(z, -1) - torch.where(p > 0, p * z, torch.zeros((), device=z.device)).sum(-1)

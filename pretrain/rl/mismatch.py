"""Trainer/rollout mismatch metrics, under verl's names.

An RL step samples responses with the rollout engine (here: FP4 weights, activations, KV-cache) and
keeps the log-prob of every sampled token under the distribution it was sampled from,
``rollout_logprobs`` = log pi_rollout(y_t | y_<t). The trainer recomputes the same tokens' log-probs
under its own numerics, ``train_logprobs`` = log pi_train(y_t | y_<t). Both are ``[batch, T]``
with a ``mask`` (1 = a response token, 0 = prompt or padding). With the token log-ratio
``r_t = train_logprobs - rollout_logprobs`` (log of the importance weight rho_t = pi_train / pi_rollout)
and ``mean_i`` the masked mean over sequence i's tokens:

=====================================  =============================================================
key                                    definition
=====================================  =============================================================
``rollout_corr/kl``                    mean over all tokens of ``-r_t``: the k1 estimate of
                                       KL(pi_rollout || pi_train) (tokens are drawn from pi_rollout)
``rollout_corr/k3_kl``                 mean over all tokens of ``exp(r_t) - r_t - 1`` (k3: >= 0 per
                                       token, lower variance for small KL)
``rollout_corr/training_ppl``          mean over sequences of ``exp(-mean_i train_logprobs)``
``rollout_corr/training_log_ppl``      mean over sequences of ``-mean_i train_logprobs``
``rollout_corr/rollout_ppl``           the same for ``rollout_logprobs``
``rollout_corr/rollout_log_ppl``       the same for ``rollout_logprobs``
``rollout_corr/log_ppl_diff``          mean over sequences of ``d_i = mean_i rollout - mean_i train``
                                       (= log(training_ppl_i / rollout_ppl_i))
``rollout_corr/log_ppl_abs_diff``      mean over sequences of ``|d_i|``
``rollout_corr/log_ppl_diff_max/min``  max / min over sequences of ``d_i``
``rollout_corr/ppl_ratio``             mean over sequences of ``exp(d_i)``
``rollout_corr/chi2_token``            mean over all tokens of ``rho_t^2``, minus 1
                                       (rho_t = exp(clamp(r_t, -20, 20)))
``rollout_corr/chi2_seq``              mean over sequences of ``exp(2 clamp(sum_i r_t, -20, 20))``,
                                       minus 1 (the sequence-level IS weight's second moment)
``training/rollout_probs_diff_mean``   mean over all tokens of ``|p_train - p_rollout|``,
                                       ``p = exp(logprob)`` (*probabilities*, not log-probs)
``training/rollout_probs_diff_max``    max of the same; ``..._std``: its standard deviation
``training/rollout_actor_probs_        Pearson correlation of ``p_train`` and ``p_rollout`` over all
pearson_corr``                         tokens (NaN with fewer than 2 tokens or a constant side)
=====================================  =============================================================

Source of the definitions: verl (github.com/volcengine/verl), ``compute_offpolicy_metrics`` in
``verl/trainer/ppo/rollout_corr_helper.py`` (the ``rollout_corr/`` keys, its ±20 ``SAFETY_BOUND``
clamp for chi²) and ``calculate_debug_metrics`` in ``verl/utils/debug/metrics.py`` (the
``training/`` keys). Two deliberate differences, both only for degenerate input: a sequence with no
response token is left out of the sequence-level means (verl's ``masked_mean`` divides by
``count + 1e-8`` and so counts it with perplexity 1), and we compute in float64 without verl's 1e-8.

**By response position** (:func:`mismatch_by_position`): the KV-cache error of a quantized cache
grows with context, so every metric is also reported per bucket of response position ``t``
(``t`` = how many response tokens of the sequence precede this one: 0 for the first). A bucket's
sequence-level metrics use each sequence's tokens inside the bucket only (sequences with none there
are left out): ``chi2_seq`` of a bucket is the second moment of that stretch's IS weight.

:func:`write_mismatch_report` writes ``mismatch.md`` (overall table + per-position table) and a
plot (``mismatch_by_position.png``) into a directory; ``launch/generate.py`` calls it.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "DEFAULT_POSITION_EDGES",
    "METRIC_KEYS",
    "SAFETY_BOUND",
    "format_mismatch_table",
    "mismatch_by_position",
    "mismatch_metrics",
    "response_positions",
    "write_mismatch_report",
]

SAFETY_BOUND = 20.0  # verl's clamp on log IS weights before exponentiating (chi²)
DEFAULT_POSITION_EDGES = (0, 16, 64, 256, 1024, 4096)

_CORR = "rollout_corr/"
METRIC_KEYS = tuple(_CORR + k for k in (
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")) + (
    "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "training/rollout_probs_diff_std",
    "training/rollout_actor_probs_pearson_corr")


def _check(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor):
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != mask.shape:
        raise ValueError(f"mismatch metrics: train_logprobs {tuple(train_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape")
    if train_logprobs.dim() != 2:
        raise ValueError(f"mismatch metrics: log-probs must be [batch, tokens], got {tuple(train_logprobs.shape)}")
    m = mask.to(torch.bool)
    if not m.any():
        raise ValueError("mismatch metrics: the mask selects no response token")
    zero = torch.zeros((), dtype=torch.float64)  # masked entries may hold anything (padding, -inf, NaN)
    return torch.where(m, train_logprobs.double(), zero), torch.where(m, rollout_logprobs.double(), zero), m


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """verl's mismatch metrics (module docstring) of ``[batch, T]`` log-probs on the same tokens."""
    lt, lr, m = _check(train_logprobs, rollout_logprobs, mask)
    mf = m.double()
    n_tok = mf.sum()
    count = mf.sum(dim=1)
    has = count > 0  # sequences with at least one response token

    def tok_mean(v: torch.Tensor) -> float:
        return float((v * mf).sum() / n_tok)

    def seq_mean(v: torch.Tensor) -> torch.Tensor:  # per-sequence masked mean, [batch] (rows with tokens)
        return ((v * mf).sum(dim=1) / count.clamp(min=1))[has]

    r = lt - lr  # 0 off the mask
    mean_t, mean_r = seq_mean(lt), seq_mean(lr)
    d = mean_r - mean_t
    rho = torch.exp(r.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    r_seq = r.sum(dim=1)[has].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    pt, pr = torch.exp(lt[m]), torch.exp(lr[m])
    pdiff = (pt - pr).abs()
    out = {
        "kl": tok_mean(-r),
        "k3_kl": tok_mean(torch.exp(r) - r - 1),
        "training_ppl": float(torch.exp(-mean_t).mean()),
        "training_log_ppl": float((-mean_t).mean()),
        "rollout_ppl": float(torch.exp(-mean_r).mean()),
        "rollout_log_ppl": float((-mean_r).mean()),
        "log_ppl_diff": float(d.mean()),
        "log_ppl_abs_diff": float(d.abs().mean()),
        "log_ppl_diff_max": float(d.max()),
        "log_ppl_diff_min": float(d.min()),
        "ppl_ratio": float(torch.exp(d).mean()),
        "chi2_token": tok_mean(rho.square()) - 1.0,
        "chi2_seq": float(torch.exp(2.0 * r_seq).mean()) - 1.0,
    }
    metrics = {_CORR + k: v for k, v in out.items()}
    metrics["training/rollout_probs_diff_mean"] = float(pdiff.mean())
    metrics["training/rollout_probs_diff_max"] = float(pdiff.max())
    metrics["training/rollout_probs_diff_std"] = float(pdiff.std()) if pdiff.numel() > 1 else 0.0
    metrics["training/rollout_actor_probs_pearson_corr"] = _pearson(pt, pr)
    return metrics


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() < 2:
        return float("nan")
    a, b = a - a.mean(), b - b.mean()
    den = torch.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


def response_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's response position: the number of response tokens of its row before it
    (int64, ``[batch, T]``; meaningful where ``mask`` is set)."""
    m = mask.to(torch.int64)
    return m.cumsum(dim=1) - m


def mismatch_by_position(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         edges=DEFAULT_POSITION_EDGES) -> list[dict]:
    """The metrics per response-position bucket ``[edges[k], edges[k+1])`` (the last bucket open:
    ``[edges[-1], inf)``); empty buckets are left out. Each entry: ``{"lo", "hi" (None = open),
    "tokens", "sequences", **metrics}``."""
    edges = list(edges)
    if not edges or edges != sorted(set(edges)) or edges[0] < 0:
        raise ValueError(f"position buckets: edges must be increasing and >= 0, got {edges}")
    m = mask.to(torch.bool)
    pos = response_positions(m)
    rows = []
    for k, lo in enumerate(edges):
        hi = edges[k + 1] if k + 1 < len(edges) else None
        sel = m & (pos >= lo) & (pos < hi if hi is not None else True)
        if not sel.any():
            continue
        rows.append({"lo": lo, "hi": hi, "tokens": int(sel.sum()), "sequences": int(sel.any(dim=1).sum()),
                     **mismatch_metrics(train_logprobs, rollout_logprobs, sel)})
    return rows


# ================================================================================================
# Report
# ================================================================================================

_SHORT = {k: k.split("/", 1)[1] for k in METRIC_KEYS}
_TABLE_KEYS = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "rollout_corr/ppl_ratio",
               "rollout_corr/chi2_token", "rollout_corr/chi2_seq", "training/rollout_probs_diff_mean",
               "training/rollout_probs_diff_max", "training/rollout_actor_probs_pearson_corr")


def _fmt(v: float) -> str:
    return "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.4g}"


def format_mismatch_table(overall: dict[str, float], by_position: list[dict]) -> str:
    """Markdown: one row per metric (overall), then one row per position bucket."""
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| `{k}` | {_fmt(overall[k])} |" for k in METRIC_KEYS]
    lines += ["", "By response position:", "",
              "| positions | tokens | " + " | ".join(_SHORT[k] for k in _TABLE_KEYS) + " |",
              "|---|---|" + "---|" * len(_TABLE_KEYS)]
    for row in by_position:
        span = f"{row['lo']}-{row['hi'] - 1}" if row["hi"] is not None else f"{row['lo']}+"
        lines.append(f"| {span} | {row['tokens']} | " + " | ".join(_fmt(row[k]) for k in _TABLE_KEYS) + " |")
    return "\n".join(lines)


def _plot_by_position(by_position: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['lo']}-{r['hi'] - 1}" if r["hi"] is not None else f"{r['lo']}+" for r in by_position]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key in zip(axes, ("rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff",
                              "training/rollout_probs_diff_mean")):
        ax.plot(range(len(labels)), [r[key] for r in by_position], marker="o")
        ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set_xlabel("response position")
        ax.set_title(_SHORT[key])
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_mismatch_report(out_dir: str, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                          mask: torch.Tensor, *, rollout: str, trainer: str, edges=DEFAULT_POSITION_EDGES,
                          extra: str = "") -> dict:
    """Write ``out_dir/mismatch.md`` and ``out_dir/mismatch_by_position.png`` comparing the rollout
    (``rollout``: its precision, for the title) with the trainer's recomputed log-probs
    (``trainer``: the ``--precision`` it ran). ``extra``: Markdown appended (e.g. attribution).
    Returns ``{"overall", "by_position", "md", "plot"}``."""
    os.makedirs(out_dir, exist_ok=True)
    overall = mismatch_metrics(train_logprobs, rollout_logprobs, mask)
    by_pos = mismatch_by_position(train_logprobs, rollout_logprobs, mask, edges)
    title = f"rollout {rollout} vs trainer {trainer}"
    plot = os.path.join(out_dir, "mismatch_by_position.png")
    _plot_by_position(by_pos, plot, title)
    md = os.path.join(out_dir, "mismatch.md")
    n_tok, n_seq = int(mask.to(torch.bool).sum()), int(mask.to(torch.bool).any(dim=1).sum())
    with open(md, "w") as f:
        f.write(f"# Trainer/rollout mismatch: {title}\n\n"
                f"{n_seq} sequences, {n_tok} response tokens. Definitions: verl's `compute_offpolicy_metrics` "
                "and `calculate_debug_metrics` (see `pretrain/rl/mismatch.py`).\n\n"
                + format_mismatch_table(overall, by_pos)
                + "\n\n![mismatch by response position](mismatch_by_position.png)\n"
                + (f"\n{extra}\n" if extra else ""))
    return {"overall": overall, "by_position": by_pos, "md": md, "plot": plot}

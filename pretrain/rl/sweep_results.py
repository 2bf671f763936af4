"""Results of an RL sweep (``launch/sweep.py`` with ``script: rl``): one table row per treatment
(a pretraining sweep's are ``pretrain.sweep.results``).

Each run of ``launch/rl.py`` logs TensorBoard scalars (``rl/reward_mean``, ``rl/heldout_accuracy``,
``mismatch/k3_kl``, ``correction/ess``, ``rollout/tokens_per_sec``, ...) and writes
``<--save>/rl_summary.json`` at the end. Per run this module reads:

=======================  ==========================================================================
``final_accuracy``       the last held-out accuracy (greedy, the trainer's own numerics: the policy)
``gain``                 ``final_accuracy`` minus the first evaluation's (iteration 0: the starting
                         policy) -- what RL learned, with its interval over seeds
``reward_auc``           area under the training-reward curve: the mean of ``rl/reward_mean`` over
                         every iteration (1.0 = every response right from the first step)
``accuracy_auc``         the same for the held-out accuracy, over its evaluation points
``rollout_accuracy``     the last held-out accuracy of the rollout engine (its plan, packed weights)
``k3_kl``                mean over iterations of ``mismatch/k3_kl`` (trainer vs rollout log-probs)
``ess``, ``masked``      mean effective sample size and masked fraction of the correction
``tokens_per_sec``       mean rollout tokens/s (emulated FP4 on CPU: a label, not a speed)
``memory_bytes``         peak rollout memory (KV + packed weights on CPU, CUDA peak on GPUs)
``topk_mismatch``        MoE policies: mean over iterations of ``routing/topk_mismatch_fraction`` (positions
                         x MoE layers whose top-k expert set differs between rollout and trainer)
``router_prob_gap``      MoE: mean of ``routing/router_prob_gap``
``k3_kl_no_replay``      MoE: mean of ``routing/k3_kl_no_replay`` and ``routing/k3_kl_replay`` (the log-prob
``k3_kl_replay``         mismatch without / with routing replay, whichever the run trained with)
``collapse_iteration``   the first evaluation at which the held-out accuracy is more than 0.10 below the
                         starting policy's (NaN: none) -- when a run collapses
=======================  ==========================================================================

Runs with the same seed start from the same weights and see the same prompts (unless the task file
gives each a ``replicate:``, ``pretrain.rl.task``: then its own prompts and evaluation share), so each treatment's
gap to the baseline (``baseline:``, e.g. BF16 rollouts) is paired by seed, with a 95% Student-t
interval over seeds (``pretrain.evaluation.stats``); higher accuracy and reward are better. The
verdict (on the final held-out accuracy gap) is Holm-adjusted over the table's treatments: *worse* /
*better* when shown to differ, *equivalent (±m)* when two one-sided tests put the gap inside the
sweep's ``equivalence_margin`` m, otherwise *not shown to differ* (which never means "no cost").
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from pretrain.evaluation.stats import gap_verdict, paired_interval, spread, table_verdicts

__all__ = ["RL_COLUMNS", "analyse_rl", "rl_summary_table", "summarize_rl", "write_rl_results"]

RL_COLUMNS = ["run", "status", "label", "seed", "iterations", "final_accuracy", "gain", "rollout_accuracy", "accuracy_auc",
              "reward_auc",
              "final_reward", "k3_kl", "ess", "masked", "tokens_per_sec", "memory_bytes"]
SUMMARY_METRICS = ["final_accuracy", "gain", "rollout_accuracy", "accuracy_auc", "reward_auc", "k3_kl", "ess", "masked", "tokens_per_sec",
                   "memory_bytes"]
GAPS = ("final_accuracy", "accuracy_auc", "reward_auc")  # paired by seed against the baseline
MOE_METRICS = ["topk_mismatch", "router_prob_gap", "k3_kl_no_replay", "k3_kl_replay", "collapse_iteration"]
RL_COLUMNS += MOE_METRICS
SUMMARY_METRICS += MOE_METRICS
COLLAPSE_DROP = 0.10  # held-out accuracy below the start's by more than this: collapsed


def _values(scalars: dict, tag: str) -> list[float]:
    return [v for _, v in scalars.get(tag, []) if math.isfinite(v)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def analyse_rl(name: str, scalars: dict[str, list[tuple[int, float]]], summary: dict | None = None) -> dict:
    """One run's row from its TensorBoard scalars; ``rl_summary.json`` (``summary``) wins where it
    has the number (it is written once the run finished)."""
    summary = summary or {}
    reward = scalars.get("rl/reward_mean", [])
    acc = _values(scalars, "rl/heldout_accuracy")
    rollout_acc = _values(scalars, "rl/heldout_accuracy_rollout")
    memory = _values(scalars, "rollout/peak_memory_bytes")
    row = {
        "run": name,
        "iterations": reward[-1][0] if reward else 0,
        "final_accuracy": acc[-1] if acc else math.nan,
        "initial_accuracy": acc[0] if len(acc) > 1 else math.nan,
        "rollout_accuracy": rollout_acc[-1] if rollout_acc else math.nan,
        "accuracy_auc": _mean(acc),
        "reward_auc": _mean(_values(scalars, "rl/reward_mean")),
        "final_reward": _mean(_values(scalars, "rl/reward_mean")[-5:]),
        "k3_kl": _mean(_values(scalars, "mismatch/k3_kl")),
        # the raw ESS of pi_trainer / pi_rollout (own numerics); runs logged before it: the correction's
        "ess": _mean(_values(scalars, "mismatch/ess_raw") or _values(scalars, "correction/ess_raw")
                     or _values(scalars, "correction/ess")),
        "masked": _mean(_values(scalars, "correction/masked_fraction")),
        "tokens_per_sec": _mean(_values(scalars, "rollout/tokens_per_sec")),
        "memory_bytes": max(memory) if memory else math.nan,
        "_curves": {tag: scalars.get(tag, []) for tag in
                    ("rl/reward_mean", "rl/heldout_accuracy", "mismatch/k3_kl")},
    }
    keys = {"final_accuracy": "final_heldout_accuracy", "rollout_accuracy": "final_heldout_accuracy_rollout",
            "reward_auc": "reward_auc", "k3_kl": "mean_k3_kl",
            "tokens_per_sec": "rollout_tokens_per_sec", "memory_bytes": "rollout_memory_bytes",
            "iterations": "iterations"}
    keys["initial_accuracy"] = "initial_heldout_accuracy"
    for ours, theirs in keys.items():
        v = summary.get(theirs)
        if isinstance(v, (int, float)) and math.isfinite(v):
            row[ours] = v
    row["gain"] = row["final_accuracy"] - row["initial_accuracy"]  # NaN without an evaluation at the start
    for ours, tag in (("topk_mismatch", "routing/topk_mismatch_fraction"), ("router_prob_gap", "routing/router_prob_gap"),
                      ("k3_kl_no_replay", "routing/k3_kl_no_replay"), ("k3_kl_replay", "routing/k3_kl_replay")):
        row[ours] = _mean(_values(scalars, tag))
    evals = [(i, v) for i, v in scalars.get("rl/heldout_accuracy", []) if math.isfinite(v)]
    start = evals[0][1] if evals else math.nan
    row["collapse_iteration"] = next((float(i) for i, v in evals[1:] if v < start - COLLAPSE_DROP), math.nan)
    row["_curves"]["routing/topk_mismatch_fraction"] = scalars.get("routing/topk_mismatch_fraction", [])
    return row


def read_summary(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def summarize_rl(rows: list[dict], baseline: str | None, margin: float | None = None) -> list[dict]:
    """One row per grid point (treatment x hyper-parameters): means and spreads over seeds, and the
    accuracy and reward-AUC gaps to the baseline at the same hyper-parameters, paired by seed; the
    verdict Holm-adjusted over the rows (``margin``: the sweep's ``equivalence_margin``, an accuracy
    gap). A diverged seed's gap is kept as NaN (the verdict reports it); a run with no final result
    (failed, pending, or still running: its TensorBoard holds a partial curve) is no pair, and the
    row says how many of each."""
    finished = ("done", "diverged")
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["_run"].group, []).append(row)
    out = []
    for group, every in groups.items():
        run = every[0]["_run"]
        members = [m for m in every if m["status"] in finished]
        s = {"point": group, "label": run.label, **run.point, "seeds": len(members),
             "failed": sum(1 for m in every if m["status"] == "failed"),
             "unfinished": sum(1 for m in every if m["status"] in ("pending", "running"))}
        for metric in SUMMARY_METRICS:
            s[metric], s[metric + "_sd"] = spread([m[metric] for m in members])
        for metric in GAPS:
            diffs = []
            for m in members:
                b = next((r for r in rows if r["_run"].label == baseline and r["_run"].seed == m["_run"].seed
                          and r["_run"].point == m["_run"].point and r["status"] in finished), None)
                if b is None or (b["status"] == "diverged" and b is not m):
                    continue
                d = m[metric] - b[metric]
                if m["status"] == "diverged" and b is not m:
                    d = math.nan
                elif not math.isfinite(d):
                    continue
                diffs.append(d)
            s["gap_" + metric] = paired_interval(diffs)
        s["gain_interval"] = paired_interval([m["gain"] for m in members if math.isfinite(m["gain"])])
        s["_collapses"] = [m.get("collapse_iteration", math.nan) for m in members]
        s["is_baseline"] = run.label == baseline
        s["verdict_unadjusted"] = gap_verdict(s["gap_final_accuracy"], s["is_baseline"], higher_is_better=True,
                                              margin=margin)
        out.append(s)
    verdicts = table_verdicts([s["gap_final_accuracy"] for s in out], [s["is_baseline"] for s in out],
                              higher_is_better=True, margin=margin)
    for s, v in zip(out, verdicts):
        s["verdict"] = v
    return out


def _f(v: float, digits: int = 3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _msd(mean: float, sd: float, digits: int = 3) -> str:
    if math.isnan(mean):
        return "n/a"
    return _f(mean, digits) if math.isnan(sd) else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def _gain_text(g) -> str:
    """The learning gain with its interval and whether it is shown (one-sample t over seeds, unadjusted)."""
    if g.n < 2:
        return g.text(3, seeds=True)
    shown = "shown > 0" if g.lo > 0 else ("shown < 0" if g.hi < 0 else "not shown")
    return f"{g.text(3)}; {shown}"


def rl_summary_table(summary: list[dict], hyper: list[str]) -> list[str]:
    k = sum(1 for s in summary if not s["is_baseline"] and s["gap_final_accuracy"].n >= 2
            and not s["gap_final_accuracy"].excluded)
    head = ["treatment", *hyper, "seeds", "final held-out acc", "gap to baseline (95% CI, unadjusted)",
            "acc under rollout plan",
            "held-out acc AUC gap (95% CI)", "reward AUC",
            "reward AUC gap (95% CI)", "mean k3_kl (BF16 floor)", "raw ESS", "masked", "rollout tok/s (emulated)",
            "rollout memory (MiB)", "gain over start (95% CI)", f"final acc gap: verdict (Holm over {k})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    floor = next((s["k3_kl"] for s in summary if s["is_baseline"]), math.nan)  # the BF16-rollout baseline's
    for s in summary:
        mib = s["memory_bytes"] / 2**20 if math.isfinite(s["memory_bytes"]) else math.nan
        verdict = (s["verdict"] + (f"; {s['failed']} failed" if s["failed"] else "")
                   + (f"; {s['unfinished']} not finished" if s.get("unfinished") else ""))
        cells = [s["label"], *(str(s.get(h)) for h in hyper), str(s["seeds"]),
                 _msd(s["final_accuracy"], s["final_accuracy_sd"]), s["gap_final_accuracy"].text(3, seeds=True),
                 _msd(s["rollout_accuracy"], s["rollout_accuracy_sd"]), s["gap_accuracy_auc"].text(3),
                 _msd(s["reward_auc"], s["reward_auc_sd"]), s["gap_reward_auc"].text(3),
                 f"{_f(s['k3_kl'], 5)} ({_f(floor, 5)})", _f(s["ess"]), _f(s["masked"]), _f(s["tokens_per_sec"], 1), _f(mib, 2),
                 _gain_text(s["gain_interval"]), verdict]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if any(math.isfinite(s["topk_mismatch"]) for s in summary):  # a mixture-of-experts policy
        lines += ["", ("Mixture of experts (means over iterations, then over seeds; collapse: the held-out accuracy "
                       f"more than {COLLAPSE_DROP:g} below the start at an evaluation):"), "",
                  ("| treatment | top-k set mismatch | router prob gap | k3_kl without replay | k3_kl with replay "
                   "| seeds collapsed (first iteration) |"), "|---|---|---|---|---|---|"]
        for s in summary:
            members = s.get("_collapses", [])
            collapsed = [c for c in members if math.isfinite(c)]
            when = f" ({int(min(collapsed))})" if collapsed else ""
            lines.append(f"| {s['label']} | {_msd(s['topk_mismatch'], s['topk_mismatch_sd'], 4)} | "
                         f"{_msd(s['router_prob_gap'], s['router_prob_gap_sd'], 4)} | {_f(s['k3_kl_no_replay'], 5)} | "
                         f"{_f(s['k3_kl_replay'], 5)} | {len(collapsed)} of {len(members)}{when} |")
    return lines


def write_rl_results(out: Path, rows: list[dict], summary: list[dict], baseline: str | None,
                     hyper: list[str]) -> None:
    """``results.csv`` (runs), ``summary.csv`` (grid points), ``results.md`` and ``rl_curves.png``."""
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RL_COLUMNS)
        for row in rows:
            w.writerow([row.get(c) for c in RL_COLUMNS])
    cols = ["point", "label", *hyper, "seeds", *[c for m in SUMMARY_METRICS for c in (m, m + "_sd")],
            *[f"gap_{m}_{k}" for m in GAPS for k in ("mean", "lo", "hi")], "verdict", "verdict_unadjusted",
            "gap_final_accuracy_n", "gap_final_accuracy_p"]
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for s in summary:
            flat = dict(s)
            for m in GAPS:
                g = s["gap_" + m]
                flat.update({f"gap_{m}_mean": g.mean, f"gap_{m}_lo": g.lo, f"gap_{m}_hi": g.hi})
            flat.update(gap_final_accuracy_n=s["gap_final_accuracy"].n,
                        gap_final_accuracy_p=s["gap_final_accuracy"].p_value())
            w.writerow([flat.get(c) for c in cols])
    seeds = max((s["seeds"] for s in summary), default=0)
    lines = [(f"# RL sweep results ({len(rows)} runs, {len(summary)} grid points x {seeds} seed(s), "
              f"baseline: {baseline or 'none'})"), ""]
    lines += rl_summary_table(summary, hyper)
    lines += ["", "## Runs", "", "| " + " | ".join(RL_COLUMNS) + " |", "|" + "---|" * len(RL_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_f(row.get(c), 4) if isinstance(row.get(c), float) else str(row.get(c))
                                       for c in RL_COLUMNS) + " |")
    lines += ["", ("final held-out acc: greedy accuracy on the task's held-out prompts at the last evaluation, "
                   "with the trainer's own numerics (--precision): the policy, not the rollout engine (acc under "
                   "rollout plan: the same prompts generated by the engine). "
                   "gain over start: final held-out acc minus the same policy's at iteration 0 (the starting "
                   "policy), mean ± half-width of the 95% Student-t interval over seeds; 'shown > 0' when the "
                   "interval excludes 0 (unadjusted). "
                   "held-out acc AUC: its mean over all evaluations (less noisy than the last one). "
                   "reward AUC: mean training reward over all iterations (of the rollouts, so under the rollout "
                   "plan's numerics). "
                   "gaps: treatment minus baseline per seed (same start and prompts), mean ± half-width of the "
                   "95% Student-t interval over seeds (unadjusted). verdict: on the final held-out accuracy "
                   "gap, Holm-adjusted over the table's treatments (worse/better: shown to differ; equivalent "
                   "(±m): inside the sweep's equivalence_margin by two one-sided tests; not shown to differ: "
                   "neither, which bounds nothing; with a margin both verdicts print). Replicates: seeds of a "
                   "task seed file without 'replicate:' share one prompt stream and one held-out set, so the "
                   "intervals are over response sampling only and leave out the evaluation sample's error (an "
                   "accuracy p on n problems has binomial s.e. sqrt(p(1-p)/n)); with 'replicate:' per run "
                   "(pretrain.rl.task) each seed draws its own prompts and evaluation share, and the interval "
                   "carries both. mean k3_kl: trainer-vs-rollout log-prob mismatch "
                   "(verl's k3) of the rollout against the trainer's own numerics (--precision; also under --rollout-qat), "
                   "averaged over iterations; in brackets the baseline's (BF16 rollouts: the floor that sampling "
                   "and float rounding leave). raw ESS: effective sample size of the unclipped token ratio "
                   "pi_trainer / pi_rollout (mismatch/ess_raw); the correction's own ESS (correction/ess, of "
                   "its clamped weights) is 1 for 'none' and every QAT row by construction. Rollout speed on CPU is emulated: the FP4 GEMMs run "
                   "as FP32 arithmetic, so tokens/s says nothing about FP4 hardware.")]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    write_rl_plots(out, rows, summary, baseline)


def _mean_curve(members: list[dict], tag: str, window: int):
    curves = []
    for m in members:
        pts = m["_curves"].get(tag) or []
        vals, acc = [], []
        for step, v in pts:
            acc = (acc + [v])[-window:]
            vals.append((step, sum(acc) / len(acc)))
        if vals:
            curves.append(dict(vals))
    if not curves:
        return [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [sum(c[s] for c in curves) / len(curves) for s in steps]


def write_rl_plots(out: Path, rows: list[dict], summary: list[dict], baseline: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["_run"].group, []).append(row)
    panels = [("rl/reward_mean", "training reward (smoothed, mean over seeds)", 5),
              ("rl/heldout_accuracy", "held-out accuracy (mean over seeds)", 1),
              ("mismatch/k3_kl", "trainer vs rollout k3_kl (smoothed)", 5)]
    if any(r["_curves"].get("routing/topk_mismatch_fraction") for r in rows):  # a mixture-of-experts policy
        panels.append(("routing/topk_mismatch_fraction", "MoE: top-k expert sets differing (smoothed)", 5))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.3 * len(panels), 4.5))
    for ax, (tag, title, window) in zip(axes, panels):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more treatments than the default 10 colours
        for s in summary:
            steps, mean = _mean_curve(groups[s["point"]], tag, window)
            if steps:
                ax.plot(steps, mean, label=s["point"], linewidth=2.5 if s["label"] == baseline else 1.2)
        ax.set_xlabel("RL iteration")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if tag == "mismatch/k3_kl":
            ax.set_yscale("symlog", linthresh=1e-5)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rl_curves.png", dpi=110)
    plt.close(fig)

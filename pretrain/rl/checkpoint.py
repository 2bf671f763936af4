"""What an RL run leaves on disk: its checkpoints (save, exact resume, the starting policy) and
``rl_summary.json``; ``t`` is the :class:`pretrain.rl.trainer.RLTrainer`.

Checkpoints (``pretrain.checkpointing``, atomic): pretraining's keys, plus ``rl``: the RL iteration,
the per-iteration history (for ``rl_summary.json``), the fallback state and the reference policy's
weights (--kl-coef). A checkpoint ``launch/rl.py`` wrote resumes exactly (weights, optimizer, lr
schedule, RNG, quantization state, fallback, iteration); any other ``--load`` gives weights only
and starts at iteration 0. If ``--save`` already holds an RL checkpoint, the run resumes from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from pretrain.checkpointing import (
    TRACKER,
    CheckpointError,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from pretrain.runtime import is_rank0, rank0_print

__all__ = ["SUMMARY_FILE", "load", "model_state", "save", "summary", "write_summary"]

SUMMARY_FILE = "rl_summary.json"


def model_state(t) -> dict:
    state = t.model.state_dict()
    return state if t.main is None else t.main.state_dict_into(state)


def save(t) -> str:
    """An atomic checkpoint of the run at its iteration (``pretrain.checkpointing``); its path."""
    t0 = time.perf_counter()
    state = {
        "model": model_state(t),
        "optimizer": t.optimizer.state_dict(),
        "opt_param_scheduler": t.schedule.state_dict(),
        "consumed_train_samples": t.iteration * t.cfg.sequences_per_step,
        "precision_plan": t.plan.to_dict(),
        "model_config": dataclasses.asdict(t.model_config),
        "tokenizer_model": getattr(t.tokenizer, "path", None),
        "args": dict(t.flags),
        "rl": {
            "iteration": t.iteration,
            "history": t.history,
            "evals": t.evals,
            "fallback": t.fallback.state_dict() if t.fallback is not None else None,
            "rollout_plan": t.rollout_plan.to_dict(),
            "reference_model": t.ref_state,
        },
    }
    path = save_checkpoint(t.run.checkpoint.save, t.iteration, state, retain=t.run.checkpoint.save_retain)
    rank0_print(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f}s)")
    t.last_saved = t.iteration
    return path


def load(t) -> None:
    """Resume from an RL checkpoint (``--save`` first, then ``--load``), else the starting weights
    from ``--load`` (weights only, iteration 0), else keep the random initialisation."""

    a = t.run.checkpoint
    source = None
    for d in (a.save, a.load):
        if d and os.path.isfile(os.path.join(d, TRACKER)):
            source = d
            break
    if source is None:
        rank0_print("no --load checkpoint: training a randomly initialised policy")
        return
    tp = t.run.parallel.tensor_model_parallel_size
    ckpt = load_checkpoint(source, tp, reshard_model=True, iteration=a.ckpt_step if source == a.load else None)
    is_rl = "rl" in ckpt or "rl_iters" in ckpt.get("args", {})
    if source == a.save and not is_rl and a.load and source != a.load:  # --save holds no RL run: start from --load
        ckpt = load_checkpoint(a.load, tp, reshard_model=True, iteration=a.ckpt_step)
        source, is_rl = a.load, "rl" in ckpt or "rl_iters" in ckpt.get("args", {})
    if is_rl and ckpt.get("resharded"):
        raise CheckpointError(f"--load: {ckpt['path']} is an RL checkpoint saved with --tensor-model-parallel-size "
                              f"{ckpt['args'].get('tensor_model_parallel_size')}; resume with that size")
    try:
        t.model.load_state_dict(ckpt["model"], strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"--load: {ckpt['path']} does not fit this model: "
                              f"{' '.join(str(e).split())[:300]}") from None
    if t.main is not None:
        t.main.load(ckpt["model"])
    if not is_rl:
        rank0_print(f"starting policy: weights of {ckpt['path']} (iteration {ckpt.get('iteration')}); "
                    f"RL iteration 0")
        return
    rl = ckpt["rl"]
    t.optimizer.load_state_dict(ckpt["optimizer"])
    t.schedule.load_state_dict(ckpt["opt_param_scheduler"])
    t.iteration = int(rl["iteration"])
    t.history = list(rl["history"])
    t.evals = [tuple(e) for e in rl["evals"]]
    t.ref_state = rl.get("reference_model")
    if t.fallback is not None and rl.get("fallback") is not None:
        t.fallback.load_state_dict(rl["fallback"])
    if not restore_rng_state(ckpt):
        rank0_print("note: data-parallel size differs from the checkpoint's: RNG states not restored")
    t.last_saved = t.iteration
    rank0_print(f"resumed from {ckpt['path']}: RL iteration {t.iteration}")


def summary(t) -> dict:
    """``rl_summary.json``'s content (``pretrain.rl.trainer``'s docstring)."""
    h = t.history

    def mean(key, warm=False):  # warm: leave out the run's first iteration (warm-up) if there are more
        rows = h[1:] if warm and len(h) > 1 else h
        vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None

    return {
        "final_heldout_accuracy": t.evals[-1][1] if t.evals else None,
        "initial_heldout_accuracy": t.evals[0][1] if t.evals else None,
        "final_heldout_accuracy_rollout": t.evals[-1][2] if t.evals else None,
        "initial_heldout_accuracy_rollout": t.evals[0][2] if t.evals else None,
        "reward_auc": mean("rl/reward_mean"),
        "mean_k3_kl": mean("mismatch/k3_kl"),
        "tokens_per_sec": mean("rollout/tokens_per_sec", warm=True),
        "peak_memory_bytes": max((r["rollout/peak_memory_bytes"] for r in h), default=None),
        "kv_bytes_per_token": h[-1]["rollout/kv_bytes_per_token"] if h else None,
        "packed_weight_bytes": h[-1]["rollout/packed_weight_bytes"] if h else None,
        "seconds_per_iteration": mean("time/seconds_per_iteration", warm=True),
        "iterations": t.iteration,
        "heldout_accuracy": [list(e) for e in t.evals],
        "reward_mean": [r["rl/reward_mean"] for r in h],
        "k3_kl": [r["mismatch/k3_kl"] for r in h],
        "fallback": {"moved": list(t.fallback.moved), "events": t.fallback.events}
        if t.fallback is not None else None,
        "rollout_plan": t.rollout_plan.to_dict(),
        "args": dict(t.flags),
    }


def write_summary(t) -> str | None:
    """Rank 0 writes ``<--save>/rl_summary.json`` (atomically); its path, or None."""
    save = t.run.checkpoint.save
    if not (save and is_rank0()):
        return None
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, SUMMARY_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary(t), f, indent=1, default=str)
    os.replace(tmp, path)
    return path

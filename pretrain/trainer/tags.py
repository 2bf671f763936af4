"""The scalar names the trainer logs: Megatron-LM's (``megatron/training/training.py``'s
``training_log`` and ``evaluate_and_print_results``) and ours beside them, plus the names event files
of earlier versions used (:data:`LEGACY_TAGS`), which :func:`series` still reads; and
:func:`read_scalars`, the one reader of a run's event files.

Light on purpose (no torch): the sweep and report readers import it.
"""

from __future__ import annotations

from pathlib import Path

LOSS, VAL_LOSS, LR, GRAD_NORM, BATCH_SIZE = "lm loss", "lm loss validation", "learning-rate", "grad-norm", "batch-size"
ITERATION_TIME, THROUGHPUT, TOKENS_PER_SEC, MFU = "iteration-time", "throughput", "tokens-per-sec", "mfu"
VAL_LOSS_SEM, NONFINITE, PHASE = "lm loss validation sem", "nonfinite-steps", "precision/phase"
VS_SAMPLES, VS_TOKENS = " vs samples", " vs tokens"
"""Suffixes of the scalars whose step is the samples / tokens consumed (Megatron's ``lm loss vs samples``)."""

LEGACY_TAGS = {LOSS: "train/loss", VAL_LOSS: "val/loss", LR: "train/lr", GRAD_NORM: "train/grad_norm",
               TOKENS_PER_SEC: "train/tokens_per_sec", THROUGHPUT: "train/tflops_per_device",
               NONFINITE: "train/nonfinite_steps", VAL_LOSS_SEM: "val/loss_sem"}
"""Each scalar's name in event files written before the Megatron names (read, never written)."""


def read_scalars(tb_dir: str | Path, prefix: str = "") -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of every scalar (whose tag starts with ``prefix``) in the event
    files under ``tb_dir``, by step; a later file wins a step (resumed runs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith(prefix):
                for e in acc.Scalars(tag):
                    out.setdefault(tag, {})[e.step] = e.value
    return {t: sorted(v.items()) for t, v in out.items()}


def series(scalars: dict[str, list], tag: str) -> list:
    """``scalars[tag]`` (:func:`read_scalars`'s form), or the same scalar under its
    :data:`LEGACY_TAGS` name in an older run's events; ``[]`` if neither is there."""
    return scalars.get(tag) or scalars.get(LEGACY_TAGS.get(tag, ""), None) or []

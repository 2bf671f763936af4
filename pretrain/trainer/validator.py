"""Held-out evaluation: the validator, which owns the ``--eval-interval`` cadence.

Evaluation draws Fprop calls from the same quantization streams as training, so it must happen at
the same iterations in a resumed run as in the straight one: it depends only on the iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pretrain.data import batches


@dataclass(frozen=True)
class ValidationResult:
    """One evaluation: the mean loss over ``--eval-iters`` global batches and its sampling noise."""

    loss: float
    sem: float  # standard error of the mean over batches (0 with one batch)
    batch_losses: list[float]

    @classmethod
    def of(cls, batch_losses: list[float]) -> ValidationResult:
        n = len(batch_losses)
        mean = sum(batch_losses) / n
        var = sum((v - mean) ** 2 for v in batch_losses) / (n - 1) if n > 1 else 0.0
        return cls(mean, math.sqrt(var / n), list(batch_losses))


class Validator:
    """Per-token loss over the first ``--eval-iters`` global batches of the validation set, every
    ``--eval-interval`` iterations (:meth:`maybe_validate`) and at the end."""

    def __init__(self, model: torch.nn.Module, engine, valid_ds, *, eval_interval: int, eval_iters: int,
                 micro_batch_size: int, num_micro_batches: int, dp: tuple[int, int]):
        self.model, self.engine, self.valid_ds = model, engine, valid_ds
        self.eval_interval, self.eval_iters = eval_interval, eval_iters
        self.micro_batch_size, self.num_micro_batches, self.dp = micro_batch_size, num_micro_batches, dp
        self.last: int | None = None  # the iteration of the last evaluation

    def should_validate(self, step: int) -> bool:
        """Whether ``step`` is an ``--eval-interval`` step."""
        return bool(self.eval_interval) and step % self.eval_interval == 0

    def maybe_validate(self, step: int, metrics) -> None:
        """At an ``--eval-interval``: evaluate and log (``metrics.validation``)."""
        if self.should_validate(step):
            self.validate(step, metrics)

    def validate(self, step: int, metrics) -> None:
        metrics.validation(step, self.evaluate())
        self.last = step

    def evaluate(self) -> ValidationResult | None:
        """Per-token loss over the first ``--eval-iters`` global batches of the validation set.

        Every global batch is evaluated on its own, so the result carries its sampling noise: the
        standard error of the mean over batches (``sem``) and the per-batch losses, which the sweep
        pairs across runs (same batches, so the paired difference has a much smaller noise)."""
        if self.valid_ds is None or self.eval_iters == 0:
            return None
        self.model.eval()
        data = batches(self.valid_ds, 0, self.micro_batch_size, *self.dp)
        per_batch = []
        for _ in range(self.eval_iters):
            loss = self.engine.eval_loss([mb for _, mb in zip(range(self.num_micro_batches), data)])
            if loss is not None:
                per_batch.append(loss)
        self.model.train()
        return ValidationResult.of(per_batch) if per_batch else None

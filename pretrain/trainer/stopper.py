"""When a training loop stops early: SIGTERM on any rank, or ``--exit-interval``.

Both loops (pretraining, ``pretrain.train``; RL, ``pretrain.rl.trainer``) ask after every step::

    if (reason := stopper.should_stop(step)) is not None:   # "SIGTERM" or "--exit-interval N"
        save, then stop with exit status 0

``signals.any_rank()`` is a collective: every rank calls it after every step, so all ranks stop
after the same one.
"""

from __future__ import annotations


class Stopper:
    """SIGTERM (``pretrain.runtime.Signals``) and ``--exit-interval`` before ``last_step``."""

    def __init__(self, signals, exit_interval: int | None, last_step: int):
        self.signals, self.exit_interval, self.last_step = signals, exit_interval, last_step

    def exits_at(self, step: int) -> bool:
        """Whether ``--exit-interval`` stops the run after ``step`` (not after the last step: that is the end)."""
        return bool(self.exit_interval) and step % self.exit_interval == 0 and step < self.last_step

    def should_stop(self, step: int) -> str | None:
        """The reason to stop after ``step`` (``"SIGTERM"``, ``"--exit-interval N"``), or None."""
        if self.signals.any_rank():
            return "SIGTERM"
        return f"--exit-interval {self.exit_interval}" if self.exits_at(step) else None

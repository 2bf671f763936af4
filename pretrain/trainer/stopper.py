"""When a training loop stops early: SIGTERM on any rank, ``--exit-interval`` or ``--exit-duration-in-mins``.

Both loops (pretraining, ``pretrain.train``; RL, ``pretrain.rl.trainer``) ask after every step::

    if (reason := stopper.should_stop(step)) is not None:   # "SIGTERM", "--exit-interval N", ...
        save, then stop with exit status 0

``signals.any_rank()`` is a collective: every rank calls it after every step, so all ranks stop
after the same one. ``--exit-duration-in-mins`` (Megatron-LM's flag) is one too: each rank compares
its own clock with the deadline and the ranks agree (any rank past it stops all), after every step.
"""

from __future__ import annotations

import time


class Stopper:
    """SIGTERM (``pretrain.runtime.Signals``), ``--exit-interval`` and ``--exit-duration-in-mins``
    before ``last_step``. ``started``: the ``time.monotonic()`` the duration counts from (the process's
    start; default: now)."""

    def __init__(self, signals, exit_interval: int | None, last_step: int,
                 exit_duration_in_mins: float | None = None, started: float | None = None):
        self.signals, self.exit_interval, self.last_step = signals, exit_interval, last_step
        self.exit_duration_in_mins = exit_duration_in_mins
        self.deadline = None if exit_duration_in_mins is None else \
            (time.monotonic() if started is None else started) + 60.0 * exit_duration_in_mins

    def exits_at(self, step: int) -> bool:
        """Whether ``--exit-interval`` stops the run after ``step`` (not after the last step: that is the end)."""
        return bool(self.exit_interval) and step % self.exit_interval == 0 and step < self.last_step

    def time_is_up(self, step: int) -> bool:
        """Whether ``--exit-duration-in-mins`` has passed on any rank (a collective when it is set)."""
        if self.deadline is None or step >= self.last_step:
            return False
        from pretrain.runtime import any_rank

        return any_rank(time.monotonic() >= self.deadline)

    def should_stop(self, step: int) -> str | None:
        """The reason to stop after ``step`` (``"SIGTERM"``, ``"--exit-interval N"``,
        ``"--exit-duration-in-mins M"``), or None."""
        if self.signals.any_rank():
            return "SIGTERM"
        if self.exits_at(step):
            return f"--exit-interval {self.exit_interval}"
        if self.time_is_up(step):
            return f"--exit-duration-in-mins {self.exit_duration_in_mins:g}"
        return None

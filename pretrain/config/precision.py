"""The run's precision, parsed once: its schedule and each quantized phase's policy.

    rp = RunPrecision.parse(precision, precision_schedule, qat_warmup_iters, precision_rule)
    rp.schedule                      # precision.schedule.PrecisionSchedule (one phase without a schedule)
    rp.policy("wgrad_hadamard")      # precision.PrecisionPolicy of a phase's precision + --precision-rule
    rp.precisions                    # the distinct precisions of the quantized phases, in order

``pretrain.arguments`` parses ``--precision`` / ``--precision-schedule`` / ``--qat-warmup-iters`` /
``--precision-rule`` into a :class:`RunPrecision` once while it validates; the frozen
``PrecisionRunConfig`` carries it, and the trainer (``pretrain.trainer.plans``) resolves each phase's
policy by the model's layer names without parsing a string again. Every refusal is a ``ValueError``
of one line naming the flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from precision import PrecisionPolicy
from precision.policy import Rule
from precision.schedule import PrecisionSchedule


def precision_schedule(args) -> PrecisionSchedule:
    """The schedule of ``args``'s flags: ``--precision-schedule``, or ``--precision`` with
    ``--qat-warmup-iters N`` spelled ``0:observe,N:PRECISION`` (one phase without a warm-up). Raises
    ``SpecError`` (one line naming the flag). ``args`` may lack the schedule flags (callers with their
    own parsers): then it is ``--precision`` alone."""
    text = getattr(args, "precision_schedule", None)
    if text is not None:
        return PrecisionSchedule.parse(text)
    return PrecisionSchedule.qat_warmup(getattr(args, "qat_warmup_iters", 0) or 0, args.precision or "bf16")


def phase_precisions(schedule: PrecisionSchedule) -> list[str]:
    """The distinct precisions of a schedule's quantized phases, in order (observe phases hold the next
    phase's plan)."""
    return list(dict.fromkeys(p.precision for p in schedule.phases if not p.observe))


def _rule_problem(rule: str) -> str | None:
    try:
        Rule.parse(rule)
    except ValueError as e:
        msg = str(e)
        return msg if msg.startswith("--precision-rule") else f"--precision-rule {rule!r}: {msg}"
    return None


@dataclass(frozen=True)
class RunPrecision:
    """The precision flags, parsed: the schedule and, per quantized phase precision, its policy (the
    precision as every linear's default, ``--precision-rule`` first, the preset's own rules after)."""

    schedule: PrecisionSchedule
    policies: Mapping[str, PrecisionPolicy]
    """Phase precision (what ``--precision`` takes) -> its policy; one entry per distinct precision."""

    @classmethod
    def parse(cls, precision: str | None, schedule: str | None = None, qat_warmup_iters: int = 0,
              rules=(), train_iters: int | None = None, num_layers: int | None = None) -> RunPrecision:
        """Parse the flags once. ``ValueError`` (one line naming the flag) for a precision, schedule or
        rule that does not parse, a schedule phase at or after ``train_iters``, or a rule naming a
        layer beyond ``num_layers`` (given)."""
        rules = list(rules)
        if schedule is None:
            sched = PrecisionSchedule.qat_warmup(qat_warmup_iters or 0, precision or "bf16")
        else:
            sched = PrecisionSchedule.parse(schedule)
            if train_iters is not None:
                sched.check_train_iters(train_iters)
        policies = {}
        for p in phase_precisions(sched):
            try:
                policies[p] = PrecisionPolicy.from_args(p, rules)
            except ValueError as e:
                problem = next(filter(None, map(_rule_problem, rules)), None)
                if problem is not None and schedule is not None:  # the schedule parsed its precisions
                    raise ValueError(problem) from None
                try:  # which one failed: the precision (named by --precision) or a rule
                    PrecisionPolicy.from_args(p)
                except ValueError as bad:  # SpecError, or an unknown preset named by base=; a file names itself
                    msg = str(bad)
                    raise ValueError(msg if msg.startswith("--precision") else f"--precision: {msg}") from None
                raise ValueError(problem or str(e)) from None
            if num_layers is not None:  # layer numbers beyond the model; rules that match no layer: at build
                policies[p].check_rules(num_layers)
        return cls(sched, policies)

    @property
    def precisions(self) -> list[str]:
        """The distinct precisions of the quantized phases, in order."""
        return list(self.policies)

    def policy(self, precision: str) -> PrecisionPolicy:
        """The policy of one of the schedule's phase precisions."""
        return self.policies[precision]

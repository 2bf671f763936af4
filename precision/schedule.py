"""Precision schedules: which precision plan trains which iterations.

A schedule is a list of phases, each a start and a precision -- anything ``--precision`` takes (a
preset, a per-GEMM spec, a YAML/JSON file; parsed by ``PrecisionPolicy.from_args``) or ``observe``::

    --precision-schedule "0:fp8,200:wgrad_hadamard,900:bf16"
    --precision-schedule "0:nvfp4,900:bf16"            # the NVFP4 paper: BF16 for the last part
    --precision-schedule "0:fp8,100:mxfp4"             # an FP8-to-MXFP4 warm start
    --precision-schedule "0:observe,500:hif8_w8a8"     # = --precision hif8_w8a8 --qat-warmup-iters 500
    --precision-schedule "0:bf16,100:base=fp8,wgrad=mxfp4+had16"   # a per-GEMM spec as a phase

**Iteration numbers.** ``START:PRECISION`` means: after ``START`` iterations have completed, the
next one -- iteration ``START + 1`` as the training log counts them (1, 2, ...) -- and all up to the
next phase's start run ``PRECISION``. So ``200:wgrad_hadamard`` first trains iteration 201, and
the phase ``[START, NEXT)`` trains iterations ``START+1 .. NEXT`` (``phase_at(k)`` is the phase of
the step taken when ``k`` iterations are done, i.e. of iteration ``k + 1``). This is
``--qat-warmup-iters N``'s convention: iterations 1..N warm up, N+1 is the first quantized one, and
``--qat-warmup-iters N`` is exactly the schedule ``0:observe,N:PRECISION``. The first phase
starts at 0; starts strictly increase.

**observe.** BF16 GEMMs that fill the amax histories of the *next* phase's plan: the layers hold
that plan (its recipes say which operands keep delayed-scaling histories and how they are rotated)
and run with ``LayerQuantState.observe_only`` set, so every GEMM is a BF16 GEMM while its
delayed-scaling operands record one amax per optimizer step. ``observe`` cannot be the last phase
and cannot follow another ``observe`` (merge the two).

Per-layer ``--precision-rule`` values apply within every phase (the phase's precision is the
policy's default; a preset's own rules come after the user's, as for ``--precision``). A schedule
replaces ``--precision``: ``pretrain.py`` refuses the two together, and ``--precision-schedule``
with ``--qat-warmup-iters`` (write the warm-up as an ``observe`` phase). A start at or beyond
``--train-iters`` is refused too (the phase would never run).

What the switch keeps (``pretrain.trainer.phases.PrecisionPhases.maybe_switch_phase``): each layer's quantization state.
SR call counters carry on; an amax history survives a switch if the previous phase recorded it (that
operand in delayed scaling, same rotation on its GEMM; an ``observe`` phase records for the next
phase's plan) and is dropped otherwise, so an operand whose delayed scaling first appears in a later
phase starts with an empty history (its own current amax until its first step ends) unless an
``observe`` phase right before it filled the history.

In a comma-separated schedule a new phase begins at a top-level comma followed by ``DIGITS:``;
other commas belong to the phase's per-GEMM spec (``base=fp8,wgrad=mxfp4+had16``) and commas inside
parentheses to its modifiers (``delayed(max,64)``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from precision.recipe import SpecError

__all__ = ["OBSERVE", "Phase", "PrecisionSchedule"]

OBSERVE = "observe"
FLAG = "--precision-schedule"
EXAMPLE = "0:fp8,200:wgrad_hadamard,900:bf16"
_START = re.compile(r"^\s*([^=:()]*?)\s*:(.*)$", re.DOTALL)  # "START:REST" with no '=' or '(' before the colon


@dataclass(frozen=True)
class Phase:
    """One phase: from ``start`` completed iterations on (iteration ``start + 1`` first), train with
    ``precision`` (what ``--precision`` takes) or ``observe``."""

    start: int
    """Iterations completed before this phase's first step (its first iteration is ``start + 1``)."""
    precision: str
    """A preset name, a per-GEMM spec or a spec/plan file, as ``--precision`` takes it; or ``observe``."""

    @property
    def observe(self) -> bool:
        return self.precision == OBSERVE

    def __str__(self) -> str:
        return f"{self.start}:{self.precision}"


def _problem(phases: tuple[Phase, ...]) -> str | None:
    """What is wrong with the phases' order and kinds (not their precisions), or None."""
    if not phases:
        return f"no phases; expected START:PRECISION,... e.g. {EXAMPLE}"
    if phases[0].start != 0:
        return f"the first phase starts at {phases[0].start}; it must start at 0 (e.g. 0:{phases[0].precision})"
    for k, (a, b) in enumerate(itertools.pairwise(phases), start=1):
        if b.start == a.start:
            return f"phases {k - 1} ({a}) and {k} ({b}) both start at {a.start}: give each start once"
        if b.start < a.start:
            return f"phase {k} ({b}) starts before phase {k - 1} ({a}): starts must increase"
        if a.observe and b.observe:
            return f"phases {k - 1} ({a}) and {k} ({b}) are both observe: merge them into one"
    if phases[-1].observe:
        return (f"the last phase ({phases[-1]}) is observe: observe fills the amax histories of the next "
                f"phase's plan, so a quantized phase must follow it (e.g. {phases[-1]},N:hif8_w8a8)")
    return None


def _check_precision(value: str) -> str | None:
    """Why ``value`` is not something ``--precision`` takes, or None (``PrecisionPolicy.from_args``)."""
    from precision.policy import PrecisionPolicy  # the policy module does not import this one

    try:
        PrecisionPolicy.from_args(value)
    except ValueError as e:  # SpecError, or an unknown preset named by base=
        return str(e)
    return None


def _split_phases(text: str) -> list[str]:
    """``text`` cut at top-level commas followed by ``DIGITS:`` (the module docstring)."""
    parts, depth, cur = [], 0, ""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0 and re.match(r"\s*[^=,:()]*:", text[i + 1:]):
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


@dataclass(frozen=True)
class PrecisionSchedule:
    """Phases in order of their starts (the module docstring); validated on construction."""

    phases: tuple[Phase, ...]

    def __post_init__(self):
        object.__setattr__(self, "phases", tuple(self.phases))
        if not all(isinstance(p, Phase) for p in self.phases):
            raise SpecError(f"precision schedule: expected Phase values, got {[type(p).__name__ for p in self.phases]}")
        if problem := _problem(self.phases):
            raise SpecError(f"precision schedule {self}: {problem}")

    # ---------------------------------------------------------------- construction
    @classmethod
    def parse(cls, text: str, flag: str = FLAG) -> PrecisionSchedule:
        """``"0:fp8,200:wgrad_hadamard,900:bf16"``; every problem is a ``SpecError`` of one line
        naming ``flag``: syntax, starts (not integers, not from 0, not increasing), precisions that
        ``--precision`` would refuse (its message, with the valid presets), observe misplaced."""
        where = f"{flag} {text!r}"
        if not text or not text.strip():
            raise SpecError(f"{where}: empty; expected START:PRECISION,... e.g. {EXAMPLE}")
        phases = []
        for part in _split_phases(text):
            m = _START.match(part)
            if m is None:
                raise SpecError(f"{where}: {part.strip()!r} is not START:PRECISION (START an iteration count, "
                                f"e.g. {EXAMPLE})")
            start, value = m.group(1), m.group(2).strip()
            if not start.isdigit():
                raise SpecError(f"{where}: {part.strip()!r}: START {start!r} must be a non-negative integer "
                                f"(iterations completed before the phase), e.g. {EXAMPLE}")
            if not value:
                raise SpecError(f"{where}: phase {start}: no precision after '{start}:'; give a preset, a per-GEMM "
                                f"spec, a file or observe")
            if value != OBSERVE and (bad := _check_precision(value)):
                raise SpecError(f"{where}: phase {start}:{value}: {bad}")
            phases.append(Phase(int(start), value))
        if problem := _problem(tuple(phases)):
            raise SpecError(f"{where}: {problem}")
        return cls(tuple(phases))

    @classmethod
    def single(cls, precision: str) -> PrecisionSchedule:
        """One phase: ``--precision PRECISION`` for the whole run."""
        return cls((Phase(0, precision),))

    @classmethod
    def qat_warmup(cls, iters: int, precision: str) -> PrecisionSchedule:
        """``--precision PRECISION --qat-warmup-iters ITERS``: ``0:observe,ITERS:PRECISION``
        (one phase without a warm-up)."""
        if iters < 0:
            raise SpecError(f"--qat-warmup-iters {iters}: must be >= 0")
        if iters == 0:
            return cls.single(precision)
        return cls((Phase(0, OBSERVE), Phase(iters, precision)))

    # ---------------------------------------------------------------- queries
    def index_at(self, iteration: int) -> int:
        """The phase of the step taken when ``iteration`` iterations are done (log iteration
        ``iteration + 1``): the last phase whose start is ``<= iteration``."""
        if iteration < 0:
            raise ValueError(f"iteration {iteration}: must be >= 0")
        k = 0
        while k + 1 < len(self.phases) and self.phases[k + 1].start <= iteration:
            k += 1
        return k

    def phase_at(self, iteration: int) -> Phase:
        """:meth:`index_at`'s phase."""
        return self.phases[self.index_at(iteration)]

    def plan_index(self, k: int) -> int:
        """The phase whose plan the layers hold during phase ``k``: ``k``, or for an observe phase the
        next one (whose histories it fills)."""
        return k + 1 if self.phases[k].observe else k

    def iterations(self, k: int, train_iters: int) -> tuple[int, int]:
        """``(first, last)`` log iteration of phase ``k`` in a run of ``train_iters`` (last < first: none)."""
        end = self.phases[k + 1].start if k + 1 < len(self.phases) else train_iters
        return self.phases[k].start + 1, min(end, train_iters)

    def check_train_iters(self, train_iters: int, flag: str = FLAG) -> None:
        """Refuse a phase that would never run: a start at or beyond ``train_iters``."""
        late = next((p for p in self.phases[1:] if p.start >= train_iters), None)
        if late is not None:
            raise SpecError(f"{flag} {str(self)!r}: phase {late} starts after iteration {late.start}, but "
                            f"--train-iters is {train_iters}: it would never run (starts must be < --train-iters)")

    def describe(self, train_iters: int) -> str:
        """One line: each phase with the iterations it trains, e.g.
        ``phase 0 fp8 (iterations 1..200) | phase 1 bf16 (iterations 201..300)``."""
        out = []
        for k, p in enumerate(self.phases):
            first, last = self.iterations(k, train_iters)
            what = f"observe for phase {k + 1}" if p.observe else p.precision
            out.append(f"phase {k} {what} (iterations {first}..{last})")
        return " | ".join(out)

    def __len__(self) -> int:
        return len(self.phases)

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.phases)

    # ---------------------------------------------------------------- checkpoints
    def to_dict(self) -> dict:
        return {"phases": [{"start": p.start, "precision": p.precision} for p in self.phases]}

    @classmethod
    def from_dict(cls, d: Mapping) -> PrecisionSchedule:
        """The inverse of :meth:`to_dict`; unknown keys are errors."""
        if not isinstance(d, Mapping) or set(d) != {"phases"}:
            raise SpecError(f"precision schedule: expected {{'phases': [...]}}, got {d!r}")
        phases: Iterable = d["phases"]
        out = []
        for item in phases:
            if not isinstance(item, Mapping) or set(item) != {"start", "precision"}:
                raise SpecError(f"precision schedule: a phase must have exactly start and precision, got {item!r}")
            out.append(Phase(int(item["start"]), str(item["precision"])))
        return cls(tuple(out))

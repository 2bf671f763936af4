"""The precision phases of a run and the numerics telemetry of its layers: one component, ``maybe_*(step)``.

``maybe_switch_phase(iteration)`` (before every step, and once at the end of setup) makes the layers
hold the plan of the next step's schedule phase; ``begin_step(step)`` switches the layers' telemetry
on for ``--numerics-interval`` steps and to BF16 observation during an ``observe`` phase;
``end_step(step)`` writes what the layers collected (``numerics/...`` every ``--numerics-interval``,
``qat/...`` of delayed-scaling operands every ``--log-interval``) and switches it off.

Precision schedules (``--precision-schedule``, ``precision.schedule``; ``--qat-warmup-iters N`` is
``0:observe,N:--precision``): every phase's whole-model plan is resolved once at setup
(``pretrain.trainer.plans.build_scheduled_model``: rules checked, GEMM backends checked and printed
per phase), so a bad phase is refused before training. The switch happens between steps: before the
step taken when ``START`` iterations are done (log iteration ``START + 1``),
``PrecisionPhases.maybe_switch_phase`` applies the phase's stage plan (``model.gpt.apply_precision_plan``; the layers' ``LayerQuantState`` is kept,
amax histories the previous phase did not record are dropped -- see ``maybe_switch_phase``) and rank 0
logs ``iteration N: precision phase K -> PLAN`` with the plan table (TensorBoard: text
``precision_plan`` at N, scalar ``precision/phase`` every iteration). ``Trainer.plan`` and the
checkpoints' ``precision_plan`` are the plan in force (a checkpoint at ``START`` holds the phase
that trained iteration ``START``); checkpoints also hold ``precision_schedule`` and
``precision_phase``. The phase is a function of the iteration alone, so a resume -- at a switch or
within a phase -- repeats the straight run bit for bit; a checkpoint saved under another schedule is
noted and this run's schedule followed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model.gpt import apply_precision_plan, policy_linears
from precision import Gemm
from precision.telemetry import METRICS
from pretrain.runtime import rank0_print

if TYPE_CHECKING:
    from precision import PrecisionPlan
    from precision.schedule import PrecisionSchedule
    from pretrain.trainer.plans import SchedulePlans


class PrecisionPhases:
    """Which schedule phase's plan the layers hold, and their per-operand telemetry."""

    def __init__(self, model: torch.nn.Module, plans: SchedulePlans, *, train_iters: int, numerics_interval: int,
                 log_interval: int, metrics):
        self.model, self.plans, self.metrics = model, plans, metrics  # metrics: its TensorBoard writer
        self.train_iters, self.numerics_interval, self.log_interval = train_iters, numerics_interval, log_interval
        self.phase: int | None = None  # the schedule phase whose plan the layers hold; None before the first
        self.plan: PrecisionPlan = plans.stage[0]  # the plan in force
        self.delayed_scaling = plans.delayed_scaling(0)  # some operand of the plan in force uses delayed scaling
        self._linears = None
        self._collect = False

    @property
    def schedule(self) -> PrecisionSchedule:
        return self.plans.schedule

    @property
    def observing(self) -> bool:
        """Whether the phase in force is ``observe`` (BF16 GEMMs filling the next phase's histories)."""
        return self.phase is not None and self.schedule.phases[self.phase].observe

    def policy_linears(self) -> list[tuple[str, torch.nn.Module]]:
        """(plan name, module) of this stage's policy linears (plan names number layers globally)."""
        if self._linears is None:
            self._linears = policy_linears(self.model)
        return self._linears

    # ---------------------------------------------------------------- the phase switch
    def maybe_switch_phase(self, iteration: int) -> None:
        """Before the step taken when ``iteration`` iterations are done (log iteration ``iteration + 1``):
        make the layers hold the plan of that step's schedule phase (``precision.schedule``); a no-op
        within a phase.

        At a phase's start (a switch, or a resume exactly there) each layer keeps the amax history of
        an operand that the previous phase's plan recorded (delayed scaling with the same rotation on
        that GEMM; an ``observe`` phase records for its next phase's plan) and drops the others, so
        a history never scales by amaxes recorded before a gap: an operand whose delayed scaling
        starts in this phase starts empty (scaled by its own amax until its first step ends), unless
        an ``observe`` phase filled it. SR call counters carry on. Rank 0 logs the switch
        (``iteration N: precision phase K -> PLAN``; after an observe phase ``iteration N: QAT warm-up
        done (...): precision phase K -> PLAN``), the plan table and TensorBoard text."""
        sched = self.schedule
        k = sched.index_at(iteration)
        if k == self.phase:
            return
        before, self.phase = self.phase, k
        at_start = sched.phases[k].start == iteration
        if at_start and k > 0:
            self._keep_recorded_histories(self.plans.stage[k - 1], self.plans.stage[k])
        apply_precision_plan(self.model, self.plans.stage[k])
        self.plan = self.plans.stage[k]
        self.delayed_scaling = self.plans.delayed_scaling(k)
        if len(sched) == 1:
            return
        phase, nxt = sched.phases[k], iteration + 1
        first, last = sched.iterations(k, self.train_iters)
        what = (f"observe (BF16 GEMMs fill the amax histories of phase {k + 1}'s plan, "
                f"{sched.phases[k + 1].precision})" if phase.observe else phase.precision)
        note = f"iterations {first}..{last}" + ("" if at_start else "; resumed within the phase")
        warmed = ""  # the end of an observe phase keeps --qat-warmup-iters' words
        if at_start and k > 0 and sched.phases[k - 1].observe:
            n = phase.start - sched.phases[k - 1].start
            warmed = f"QAT warm-up done ({n} BF16 iteration{'s' * (n != 1)} filled the amax histories): "
        rank0_print(f"iteration {nxt}: {warmed}precision phase {k} -> {what} ({note})")
        if before is None or self.plans.whole[k] != self.plans.whole[before]:
            rank0_print(self.plans.whole[k].table())
        if self.metrics.tb is not None:
            self.metrics.tb.add_text("precision_plan", f"phase {k} ({phase}) from iteration {nxt}:\n\n```\n"
                                     + self.plans.whole[k].table() + "\n```", nxt)

    def _keep_recorded_histories(self, before: PrecisionPlan, after: PrecisionPlan) -> None:
        """Drop every layer's amax histories that ``before`` (the previous phase's plan) did not record
        into with the rotation ``after`` uses (``maybe_switch_phase``)."""
        for name, m in self.policy_linears():
            for g in Gemm:
                old, new = before[name].recipe(g), after[name].recipe(g)
                for operand, fmt in zip(g.operands, (old.a, old.b)):
                    if fmt.amax_algo == "current" or old.rotation != new.rotation:
                        m.quant_state.amax.pop(f"{g.value}/{operand}", None)

    # ---------------------------------------------------------------- telemetry around a step
    def set_telemetry(self, collect: bool, observe_only: bool) -> None:
        """This iteration: collect per-operand numerics (``--numerics-interval``); run BF16 while
        the amax histories fill (an ``observe`` phase; ``--qat-warmup-iters``)."""
        for _, m in self.policy_linears():
            m.quant_state.collect_stats = collect
            m.quant_state.observe_only = observe_only

    def begin_step(self, step: int) -> None:
        """Before step ``step`` (1-based): telemetry on at ``--numerics-interval``, observation in an
        observe phase."""
        self._collect = bool(self.numerics_interval) and step % self.numerics_interval == 0
        self._warm = self.observing
        self.set_telemetry(self._collect, self._warm)

    def end_step(self, step: int) -> None:
        """After step ``step``: write what the layers collected (device telemetry is read at log
        intervals only), then telemetry off."""
        if self._collect and self.metrics.enabled:
            self.log_numerics(step)
        if not self._warm and self.delayed_scaling and self.metrics.enabled and step % self.log_interval == 0:
            self.log_delayed_scaling(step)
        self.set_telemetry(False, False)

    def log_numerics(self, step: int) -> None:
        """TensorBoard ``numerics/<layer>/<gemm>/<operand>/<metric>`` from the last micro-batch of
        this iteration (each layer's TP rank 0 shard of each operand)."""
        scalars = [
            (f"numerics/{name}/{key}/{metric}", float(numbers[metric]))
            for name, m in self.policy_linears()
            for key, numbers in m.quant_state.stats.items()
            for metric in METRICS
            if metric in numbers
        ]
        self.metrics.write_layer_scalars(scalars, step)

    def log_delayed_scaling(self, step: int) -> None:
        """Every ``--log-interval`` iterations, for each per-tensor delayed-scaling operand (e.g. HiF8
        QAT): the fraction of values clipped by the delayed scale and current amax / the scale's amax
        of the iteration's last micro-batch -- the failures a loss curve hides
        (``qat/<layer>/<gemm>/<operand>/...``)."""
        scalars = []
        for name, m in self.policy_linears():
            st = m.quant_state
            for key in st.amax:
                numbers = st.stats.get(key)
                if not numbers or "num_clipped" not in numbers:
                    continue
                frac = numbers["num_clipped"] / max(numbers.get("numel", 1), 1)
                ratio = numbers["amax"] / numbers["scale_amax"] if numbers["scale_amax"] > 0 else 1.0
                scalars.append((f"qat/{name}/{key}/clipped_fraction", float(frac)))
                scalars.append((f"qat/{name}/{key}/amax_ratio", float(ratio)))
        self.metrics.write_layer_scalars(scalars, step)

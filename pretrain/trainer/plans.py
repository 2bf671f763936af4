"""The precision plans of a run, resolved once before training, and the model built with them.

``build_scheduled_model(run, vocab_size, device)`` builds this rank's model and resolves every phase
of the run's precision schedule (``--precision`` / ``--precision-schedule`` / ``--qat-warmup-iters``,
with ``--precision-rule``, ``--amax-*`` and ``--fp8-margin``) by global layer names into a
:class:`SchedulePlans`; each phase's GEMM backends are checked and printed, a phase that quantizes
nothing on this model is refused in one line, and phase 0's plan is applied. The phases component
(``pretrain.trainer.phases``) switches between the plans during training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from kernels.backends import BackendError, select_backend
from kernels.probe import startup_report
from model.gpt import apply_precision_plan, build_gpt, policy_linear_names, policy_linears
from model.grouped_experts import describe_grouped_paths
from precision import FORMATS, PrecisionPlan, SpecError
from precision.schedule import PrecisionSchedule
from pretrain import expert_parallel
from pretrain.arguments import ConfigError
from pretrain.config import RunConfig
from pretrain.runtime import rank0_print


def _override_tensor_operands(plan, change, note: str):
    """``plan`` with ``change(op)`` applied to every per-tensor operand (FP8, HiF8) of every GEMM; block
    formats and BF16 are left alone. A linear that changed has ``note`` added to its rule label."""
    def operand(op):
        return change(op) if FORMATS[op.fmt].scaling == "tensor" else op

    def recipe(r):
        return dataclasses.replace(r, a=operand(r.a), b=operand(r.b))

    entries = {}
    for name, p in plan.items():
        q = dataclasses.replace(p, fprop=recipe(p.fprop), dgrad=recipe(p.dgrad), wgrad=recipe(p.wgrad))
        entries[name] = (q, plan.rule_for(name) + ("" if q == p else f" + {note}"))
    return PrecisionPlan(entries)


def override_amax(plan, algo: str | None, history_len: int | None):
    """``--amax-algo`` / ``--amax-history-len``: new delayed-scaling settings for every per-tensor
    operand (FP8, HiF8) of the plan; block formats and BF16 are left alone."""

    def change(op):
        new_algo = algo or op.amax_algo
        n = history_len or (op.amax_history_len if op.amax_algo != "current" else 64)
        return dataclasses.replace(op, amax_algo=new_algo, amax_history_len=1 if new_algo == "current" else n)

    return _override_tensor_operands(plan, change, "--amax-algo/--amax-history-len")


def override_margin(plan, margin: int):
    """``--fp8-margin N``: ``margin=N`` on every per-tensor operand (FP8, HiF8) of the plan, so its
    scale is the format's scale target / amax / 2^N; block formats and BF16 are left alone."""
    def change(op):
        try:  # the range depends on the format: FP8 >= 0, HiF8 >= -12
            return dataclasses.replace(op, margin=margin)
        except SpecError as e:
            raise ConfigError(f"--fp8-margin {margin}: {e}") from None

    return _override_tensor_operands(plan, change, f"--fp8-margin {margin}")


def check_gemm_backends(plan, device: torch.device, requested: str, label: str = "") -> None:
    """Refuse (one line) a forced hardware backend that cannot run some layer's GEMM here, and print
    once which GEMM of which layer runs on what (after ``label:``, e.g. a schedule's phase)."""
    if requested in ("fp8_scaled_mm", "mx_scaled_mm"):
        for name, p in plan.items():
            try:
                select_backend(p, device, requested, layer=name)
            except BackendError as e:
                raise ConfigError(f"--gemm-backend {requested}: {e}" + (f" ({label})" if label else "")) from None
    rank0_print((f"{label}: " if label else "") + startup_report(plan, device, requested))


@dataclass(frozen=True)
class SchedulePlans:
    """Every phase's precision plan, resolved once at setup (``build_scheduled_model``).

    ``stage[k]`` / ``whole[k]``: what the layers of this pipeline stage / of the whole model hold
    during phase ``k`` of ``schedule`` -- for an ``observe`` phase the next phase's plan (its GEMMs
    run in BF16 meanwhile, filling that plan's amax histories)."""

    schedule: PrecisionSchedule
    stage: tuple[PrecisionPlan, ...]
    whole: tuple[PrecisionPlan, ...]

    def __post_init__(self):
        n = len(self.schedule)
        if len(self.stage) != n or len(self.whole) != n:
            raise ValueError(f"SchedulePlans: {n} phases, {len(self.stage)} stage and {len(self.whole)} whole plans")

    def delayed_scaling(self, k: int) -> bool:
        """Whether some operand of phase ``k``'s whole-model plan uses delayed scaling."""
        plan = self.whole[k]
        return any(op.amax_algo != "current" for name in plan
                   for recipe in (plan[name].fprop, plan[name].dgrad, plan[name].wgrad) for op in (recipe.a, recipe.b))


def _resolve_plan(run, precision: str, every: list[str], names: list[str], label: str | None):
    """``(stage plan, whole plan)`` of ``precision`` with ``--precision-rule`` (and ``--amax-*``);
    ``label`` replaces the default's rule label ``--precision P`` (a schedule's phase)."""
    # resolved once over the whole model's names, so first:/last: rules mean the whole model's layers
    p, num_layers = run.precision, run.model.num_layers
    policy = p.resolved.policy(precision)  # parsed once, when the flags were validated
    try:  # a --precision-rule that selects no layer of this model is refused, naming the layers
        policy.check_rules(num_layers, every)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    plan = policy.resolve(every, num_layers)
    if label is not None:
        plan = PrecisionPlan({n: (plan[n], label if plan.rule_for(n) == policy.default_label else plan.rule_for(n))
                              for n in plan})
    if p.amax_algo or p.amax_history_len:
        plan = override_amax(plan, p.amax_algo, p.amax_history_len)
    if p.fp8_margin is not None:
        plan = override_margin(plan, p.fp8_margin)
    return PrecisionPlan({n: (plan[n], plan.rule_for(n)) for n in names}), plan


def quantized_linears(plan) -> tuple[int, int]:
    """``(N, M)``: how many of the plan's ``M`` linears run some GEMM operand quantized."""
    return sum(not (p.fprop.is_high_precision and p.dgrad.is_high_precision and p.wgrad.is_high_precision)
               for p in (plan[n] for n in plan)), len(plan)


def _amax_window(plan) -> int:
    """The longest delayed-scaling window (steps) of the plan's ``max`` operands (0: none)."""
    return max((op.amax_history_len for n in plan for r in (plan[n].fprop, plan[n].dgrad, plan[n].wgrad)
                for op in (r.a, r.b) if op.amax_algo == "max"), default=0)


def check_quantized_plans(run, schedule, whole: dict) -> None:
    """Print ``N of M linears quantized`` for every quantized phase's whole-model plan; refuse (one
    line, naming the flag) a phase whose precision quantizes something but whose plan, on this
    model, quantizes no linear (``hif8_w8a8`` keeps the first 3 / last 2 layers, attention and the
    output layer in BF16: on <= 5 layers nothing is left); warn when an observe phase (the QAT
    warm-up) is shorter than the next plan's ``max`` amax window."""
    p = run.precision
    scheduled = p.precision_schedule is not None
    for k, phase in enumerate(schedule.phases):
        if phase.observe:
            continue
        n, m = quantized_linears(whole[k][1])
        label = f"precision phase {k} ({phase.precision})" if len(schedule) > 1 else f"--precision {phase.precision}"
        ste = p.qat_backward == "ste" and n
        rank0_print(f"{label}: {n} of {m} linears quantized"
                    + ("; --qat-backward ste: Dgrad / Wgrad consume Fprop's Q(w), Q(x)" if ste else ""))
        lp = p.resolved.policy(phase.precision).default  # a plan file's: its default (its rules decide the rest)
        quantizes = not (lp.fprop.is_high_precision and lp.dgrad.is_high_precision and lp.wgrad.is_high_precision)
        if n == 0 and quantizes:
            flag = (f"--precision-schedule {p.precision_schedule}" if scheduled
                    else f"--precision {phase.precision}")
            raise ConfigError(f"{flag}: the plan quantizes none of the {m} linears of this {run.model.num_layers}-layer "
                              "model (its rules keep them in BF16); use more layers or a --precision-rule, e.g. "
                              f"--precision-rule 'kind:mlp={phase.precision}'")
        if k > 0 and schedule.phases[k - 1].observe:
            warmup = phase.start - schedule.phases[k - 1].start
            window = _amax_window(whole[k][1])
            if warmup < window:
                flag = "--qat-warmup-iters" if not scheduled else "--precision-schedule's observe phase"
                rank0_print(f"warning: {flag} {warmup} is shorter than the amax window ({window} steps of max): "
                            f"QAT starts with histories of {warmup} step{'s' * (warmup != 1)}, not {window}")


def whole_model_names(run: RunConfig, names: list[str]) -> list[str]:
    """Plan names of the whole model's linears, from this rank's ``names`` (all ranks call this): with
    pipeline parallelism every stage's (gathered over the pipeline group: stages may differ, e.g. with
    a ``--moe-layer-freq`` that mixes dense and MoE layers), with expert parallelism every expert of each
    MoE layer (``pretrain.expert_parallel.every_expert``: a rank holds ``num_experts / EP`` of them)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        parts = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(parts, names, group=parallel_state.get_pipeline_model_parallel_group())
        names = list(dict.fromkeys(n for part in parts for n in part))
    return expert_parallel.every_expert(names, run.model.num_experts)


def build_scheduled_model(run: RunConfig, vocab_size: int, device: torch.device):
    """This rank's model and every phase's plan (``(model, SchedulePlans)``): each quantized phase of
    the run's schedule (``pretrain.arguments.precision_schedule``) resolved by global layer names and
    its GEMM backends checked, so a bad phase is refused before training; phase 0's plan applied."""
    p = run.precision
    sequence_parallel = run.parallel.sequence_parallel and run.parallel.tensor_model_parallel_size > 1
    model = build_gpt(run.model_config(vocab_size), sequence_parallel=sequence_parallel, seed=run.training.seed,
                      params_dtype=torch.bfloat16 if run.memory.bf16 else torch.float32,
                      recompute=run.memory.recompute())
    names = policy_linear_names(model)  # this rank's, layers and experts numbered globally
    every = whole_model_names(run, names)
    shown = expert_parallel.every_expert(names, run.model.num_experts)  # this stage's, with every EP rank's experts
    schedule = p.schedule()
    scheduled = p.precision_schedule is not None
    resolved = {}
    for k, phase in enumerate(schedule.phases):
        if phase.observe:
            continue
        label = f"--precision-schedule {phase}" if scheduled else None
        resolved[k] = _resolve_plan(run, phase.precision, every, names, label)
        many = len(schedule) > 1
        where = f"precision phase {k} ({phase})" if many else ""
        whole = resolved[k][1]
        check_gemm_backends(PrecisionPlan({n: (whole[n], whole.rule_for(n)) for n in shown}), device, p.gemm_backend,
                            label=where)
        if run.model.moe_grouped_gemm:  # which grouped kernel (or per-expert loop) each expert format takes
            rank0_print(describe_grouped_paths(resolved[k][0], device, p.gemm_backend))
    check_quantized_plans(run, schedule, resolved)
    plans = SchedulePlans(schedule, tuple(resolved[schedule.plan_index(k)][0] for k in range(len(schedule))),
                          tuple(resolved[schedule.plan_index(k)][1] for k in range(len(schedule))))
    apply_precision_plan(model, plans.stage[0])
    for _, module in policy_linears(model):
        module.gemm_backend = p.gemm_backend
        module.backward_operands = p.qat_backward
    return model.to(device), plans


def build_model(run: RunConfig, vocab_size: int, device: torch.device):
    """This rank's model with the resolved precision plan applied; returns ``(model, stage plan,
    whole-model plan)`` (the two plans are the same without pipeline parallelism). With a schedule:
    phase 0's plans (``build_scheduled_model`` has every phase's)."""
    model, plans = build_scheduled_model(run, vocab_size, device)
    return model, plans.stage[0], plans.whole[0]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(whole model over all TP ranks and pipeline stages, this rank's part)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    local = sum(p.numel() for p in model.parameters())
    total = torch.tensor(
        sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters()),
        dtype=torch.float64,
    )
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage holds other layers
        total = total.to(next(model.parameters()).device)
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return int(total.item()), local


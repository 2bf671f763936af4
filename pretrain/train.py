"""The pretraining loop behind ``launch/pretrain.py``: setup, train, evaluate, log, checkpoint.

    torchrun --nproc-per-node 2 launch/pretrain.py --model-size tiny --precision wgrad_hadamard \\
        --tensor-model-parallel-size 2 --train-iters 200 --save runs/tiny/ckpt --tensorboard-dir runs/tiny/tb

Order of events (every rank):

1. ``parse_args`` / ``validate_args`` (``pretrain.arguments``): bad input exits 2 with one line,
   before model, data or parallel state are touched. Under torchrun every rank validates and the
   ranks agree (one ``all_gather_object``) before rank 0 prints the line and all exit, so the line
   is printed once and always reaches the user (torchrun kills the other ranks when one exits).
2. ``torch.distributed`` from torchrun's environment (a world of one without torchrun): gloo on
   CPU, NCCL on CUDA; megatron ``parallel_state.initialize_model_parallel(TP, PP)``; seeds
   (python, numpy, torch; megatron's CUDA RNG tracker on GPU) -- the same on every rank, so every
   rank draws the same master weights and keeps its TP shard of its pipeline stage (``model.gpt``).
3. Tokenizer and datasets (``pretrain.data``; the built-in stdlib corpus without ``--data-path``),
   the model, the precision plan (``PrecisionPolicy.from_args(...).resolve(...)``, by global layer
   names, applied and printed once), the engine (``pretrain.engine``: torch DDP + our AdamW, or
   megatron-core's DDP, optimizer and pipeline schedules on CUDA) and the lr schedule, then
   ``--load`` (``pretrain.checkpointing``) or, while ``--load`` holds nothing yet,
   ``--pretrained-checkpoint`` (``pretrain.pretrained``).
4. Each iteration consumes one global batch, ``micro_batch_size * dp * num_micro_batches``
   samples, in megatron's sample order (``pretrain.data.gpt_data``), and hands its micro-batches
   to the engine: forward/backward of each (pipelined over stages with PP > 1), gradients reduced
   over data parallelism once, the loss normalized **per token over the whole global batch**
   (Megatron-LM's ``--calculate-per-token-loss``), so losses and gradients do not depend on how
   the batch is split over micro-batches and data-parallel ranks; TP-partial gradients summed
   (sequence parallelism), the global norm clipped, the lr set and Adam steps.
5. After the iteration: evaluation every ``--eval-interval``, checkpoint every ``--save-interval``;
   SIGTERM (on any rank) or ``--exit-interval``: save and exit 0. At the end: save, final
   evaluation. No step reads a tensor to the host: the steps' losses and gradient norms are read
   together when the loop *settles* them -- every ``--log-interval``, before an evaluation, a
   checkpoint or a stop, and at the end -- and then logged (progress line and TensorBoard scalars
   of every iteration, rank 0; ``_Progress.settle``).
6. A non-finite loss or gradient norm (``--check-for-nan-in-loss-and-grad``, on by default) is
   found when its step is settled (the steps after it, already taken, are discarded with the run;
   with ``--skip-nonfinite-steps`` or without the check every step is read at once instead) and
   skipped -- no parameter, optimizer or schedule update, the layers' quantization state restored --
   up to ``--skip-nonfinite-steps`` times; the next one is divergence: logged (TensorBoard
   ``train/loss`` NaN, ``train/nonfinite_steps``, the progress line), ``--save/run_status.json``
   written, one line naming the iteration and the last good checkpoint, exit status 3 on every rank
   (``pretrain.status``: the contract with ``launch/sweep.py``). The diverged state is never saved.
   A checkpoint that cannot be written (a full disk) is one line and exit status 4.

Precision schedules (``--precision-schedule``, ``precision.schedule``; ``--qat-warmup-iters N`` is
``0:observe,N:--precision``): every phase's whole-model plan is resolved once at setup
(``build_scheduled_model``: rules checked, GEMM backends checked and printed per phase), so a bad
phase is refused before training. The switch happens between steps: before the step taken when
``START`` iterations are done (log iteration ``START + 1``), ``Trainer.enter_phase`` applies the
phase's stage plan (``model.gpt.apply_precision_plan``; the layers' ``LayerQuantState`` is kept,
amax histories the previous phase did not record are dropped -- see ``enter_phase``) and rank 0
logs ``iteration N: precision phase K -> PLAN`` with the plan table (TensorBoard: text
``precision_plan`` at N, scalar ``precision/phase`` every iteration). ``Trainer.plan`` and the
checkpoints' ``precision_plan`` are the plan in force (a checkpoint at ``START`` holds the phase
that trained iteration ``START``); checkpoints also hold ``precision_schedule`` and
``precision_phase``. The phase is a function of the iteration alone, so a resume -- at a switch or
within a phase -- repeats the straight run bit for bit; a checkpoint saved under another schedule is
noted and this run's schedule followed.

Exact resume: the iteration's data are a function of the samples consumed; the model's
``state_dict`` holds every linear's quantization state (SR call counters, amax histories); RNG
states are restored; nothing else is random. So on CPU a resumed run repeats the uninterrupted run
bit for bit (stochastic rounding included). Evaluation draws Fprop calls from the same quantization
streams, so it must happen at the same iterations in both runs (it does: it depends only on the
iteration number).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.arguments import (
    PROG,
    ConfigError,
    model_config,
    parse_args_or_raise,
    precision_schedule,
    recompute_config,
    validate_args,
)
from pretrain.status import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_SAVE_FAILED,
    clear_run_status,
    write_run_status,
)

if TYPE_CHECKING:
    from model.gpt import ModelConfig
    from precision import PrecisionPlan
    from precision.schedule import PrecisionSchedule
    from pretrain.engine import MegatronEngine, TorchEngine
    from pretrain.optim import LRSchedule

# Flags that fix parameter shapes: a checkpoint must agree with the run on all of them.
SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "swiglu",
    "normalization", "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
    "add_qkv_bias",
)  # fmt: skip

# ================================================================================================
# Setup
# ================================================================================================


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ERROR_WAIT_S = 30  # how long a rank that failed waits for the others to fail alike (_refuse)
_error_group = None  # gloo group on which failing ranks meet before exiting (_refuse)
_host_group = None  # gloo group for host-side agreement (SIGTERM), whatever the device


def init_process_group() -> None:
    """torch.distributed from torchrun's environment (a world of one without it), once, and the
    gloo group on which ranks that fail meet before they exit (:func:`_refuse`)."""
    global _error_group, _host_group
    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python launch/pretrain.py`: a world of one
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    _error_group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ERROR_WAIT_S))
    _host_group = torch.distributed.new_group(backend="gloo") if cuda else None  # None: the (gloo) world


def init_distributed(args) -> torch.device:
    """Process group (:func:`init_process_group`), parallel state, seeds."""
    from megatron.core import parallel_state

    init_process_group()
    cuda = torch.cuda.is_available()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def override_amax(plan, algo: str | None, history_len: int | None):
    """``--amax-algo`` / ``--amax-history-len``: new delayed-scaling settings for every per-tensor
    operand (FP8, HiF8) of the plan; block formats and BF16 are left alone."""
    from precision import FORMATS, PrecisionPlan

    def operand(op):
        if FORMATS[op.fmt].scaling != "tensor":
            return op
        new_algo = algo or op.amax_algo
        n = history_len or (op.amax_history_len if op.amax_algo != "current" else 64)
        return dataclasses.replace(op, amax_algo=new_algo, amax_history_len=1 if new_algo == "current" else n)

    def recipe(r):
        return dataclasses.replace(r, a=operand(r.a), b=operand(r.b))

    entries = {}
    for name, p in plan.items():
        q = dataclasses.replace(p, fprop=recipe(p.fprop), dgrad=recipe(p.dgrad), wgrad=recipe(p.wgrad))
        entries[name] = (q, plan.rule_for(name) + ("" if q == p else " + --amax-algo/--amax-history-len"))
    return PrecisionPlan(entries)


def override_margin(plan, margin: int):
    """``--fp8-margin N``: ``margin=N`` on every per-tensor operand (FP8, HiF8) of the plan, so its
    scale is the format's scale target / amax / 2^N; block formats and BF16 are left alone."""
    from precision import FORMATS, PrecisionPlan, SpecError

    def operand(op):
        if FORMATS[op.fmt].kind != "tensor":
            return op
        try:  # the range depends on the format: FP8 >= 0, HiF8 >= -12
            return dataclasses.replace(op, margin=margin)
        except SpecError as e:
            raise ConfigError(f"--fp8-margin {margin}: {e}") from None

    def recipe(r):
        return dataclasses.replace(r, a=operand(r.a), b=operand(r.b))

    entries = {}
    for name, p in plan.items():
        q = dataclasses.replace(p, fprop=recipe(p.fprop), dgrad=recipe(p.dgrad), wgrad=recipe(p.wgrad))
        entries[name] = (q, plan.rule_for(name) + ("" if q == p else f" + --fp8-margin {margin}"))
    return PrecisionPlan(entries)


def check_gemm_backends(plan, device: torch.device, requested: str, label: str = "") -> None:
    """Refuse (one line) a forced hardware backend that cannot run some layer's GEMM here, and print
    once which GEMM of which layer runs on what (after ``label:``, e.g. a schedule's phase)."""
    from kernels.backends import BackendError, describe_backends, select_backend

    if requested in ("fp8_scaled_mm", "mx_scaled_mm"):
        for name, p in plan.items():
            try:
                select_backend(p, device, requested, layer=name)
            except BackendError as e:
                raise ConfigError(f"--gemm-backend {requested}: {e}" + (f" ({label})" if label else "")) from None
    rank0_print((f"{label}: " if label else "") + describe_backends(plan, device, requested))


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


def _resolve_plan(args, precision: str, every: list[str], names: list[str], label: str | None):
    """``(stage plan, whole plan)`` of ``precision`` with ``--precision-rule`` (and ``--amax-*``);
    ``label`` replaces the default's rule label ``--precision P`` (a schedule's phase)."""
    from precision import PrecisionPlan, PrecisionPolicy, SpecError

    # resolved once over the whole model's names, so first:/last: rules mean the whole model's layers
    policy = PrecisionPolicy.from_args(precision, args.precision_rule)
    try:  # a --precision-rule that selects no layer of this model is refused, naming the layers
        policy.check_rules(args.num_layers, every)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    plan = policy.resolve(every, args.num_layers)
    if label is not None:
        plan = PrecisionPlan({n: (plan[n], label if plan.rule_for(n) == policy.default_label else plan.rule_for(n))
                              for n in plan})
    if args.amax_algo or args.amax_history_len:
        plan = override_amax(plan, args.amax_algo, args.amax_history_len)
    if getattr(args, "fp8_margin", None) is not None:
        plan = override_margin(plan, args.fp8_margin)
    return PrecisionPlan({n: (plan[n], plan.rule_for(n)) for n in names}), plan


def quantized_linears(plan) -> tuple[int, int]:
    """``(N, M)``: how many of the plan's ``M`` linears run some GEMM operand quantized."""
    return sum(not (p.fprop.is_high_precision and p.dgrad.is_high_precision and p.wgrad.is_high_precision)
               for p in (plan[n] for n in plan)), len(plan)


def _amax_window(plan) -> int:
    """The longest delayed-scaling window (steps) of the plan's ``max`` operands (0: none)."""
    return max((op.amax_history_len for n in plan for r in (plan[n].fprop, plan[n].dgrad, plan[n].wgrad)
                for op in (r.a, r.b) if op.amax_algo == "max"), default=0)


def check_quantized_plans(args, schedule, whole: dict) -> None:
    """Print ``N of M linears quantized`` for every quantized phase's whole-model plan; refuse (one
    line, naming the flag) a phase whose precision quantizes something but whose plan, on this
    model, quantizes no linear (``hif8_w8a8`` keeps the first 3 / last 2 layers, attention and the
    output layer in BF16: on <= 5 layers nothing is left); warn when an observe phase (the QAT
    warm-up) is shorter than the next plan's ``max`` amax window."""
    from precision import parse_precision

    scheduled = getattr(args, "precision_schedule", None) is not None
    for k, phase in enumerate(schedule.phases):
        if phase.observe:
            continue
        n, m = quantized_linears(whole[k][1])
        label = f"precision phase {k} ({phase.precision})" if len(schedule) > 1 else f"--precision {phase.precision}"
        ste = getattr(args, "qat_backward", "hp") == "ste" and n
        rank0_print(f"{label}: {n} of {m} linears quantized"
                    + ("; --qat-backward ste: Dgrad / Wgrad consume Fprop's Q(w), Q(x)" if ste else ""))
        try:
            lp = parse_precision(phase.precision)
            quantizes = not (lp.fprop.is_high_precision and lp.dgrad.is_high_precision and lp.wgrad.is_high_precision)
        except ValueError:  # a plan file: its own rules decide; the count above says what it does
            quantizes = True
        if n == 0 and quantizes:
            flag = (f"--precision-schedule {args.precision_schedule}" if scheduled
                    else f"--precision {phase.precision}")
            raise ConfigError(f"{flag}: the plan quantizes none of the {m} linears of this {args.num_layers}-layer "
                              "model (its rules keep them in BF16); use more layers or a --precision-rule, e.g. "
                              f"--precision-rule 'kind:mlp={phase.precision}'")
        if k > 0 and schedule.phases[k - 1].observe:
            warmup = phase.start - schedule.phases[k - 1].start
            window = _amax_window(whole[k][1])
            if warmup < window:
                flag = "--qat-warmup-iters" if not scheduled else "--precision-schedule's observe phase"
                rank0_print(f"warning: {flag} {warmup} is shorter than the amax window ({window} steps of max): "
                            f"QAT starts with histories of {warmup} step{'s' * (warmup != 1)}, not {window}")


def build_scheduled_model(args, vocab_size: int, device: torch.device):
    """This rank's model and every phase's plan (``(model, SchedulePlans)``): each quantized phase of
    the run's schedule (``pretrain.arguments.precision_schedule``) resolved by global layer names and
    its GEMM backends checked, so a bad phase is refused before training; phase 0's plan applied."""
    from model.gpt import apply_precision_plan, build_gpt, policy_linear_names, policy_linears

    sequence_parallel = args.sequence_parallel and args.tensor_model_parallel_size > 1
    model = build_gpt(model_config(args, vocab_size), sequence_parallel=sequence_parallel, seed=args.seed,
                      params_dtype=torch.bfloat16 if args.bf16 else torch.float32, recompute=recompute_config(args))
    names = policy_linear_names(model)  # this pipeline stage's, layers numbered globally
    layer_linears = list(dict.fromkeys(n.split(".", 3)[3] for n in names if n.startswith("decoder.layers.")))
    every = [f"decoder.layers.{i}.{s}" for i in range(args.num_layers) for s in layer_linears] + ["output_layer"]
    schedule = precision_schedule(args)
    scheduled = getattr(args, "precision_schedule", None) is not None
    resolved = {}
    for k, phase in enumerate(schedule.phases):
        if phase.observe:
            continue
        label = f"--precision-schedule {phase}" if scheduled else None
        resolved[k] = _resolve_plan(args, phase.precision, every, names, label)
        many = len(schedule) > 1
        where = f"precision phase {k} ({phase})" if many else ""
        check_gemm_backends(resolved[k][0], device, args.gemm_backend, label=where)
    check_quantized_plans(args, schedule, resolved)
    plans = SchedulePlans(schedule, tuple(resolved[schedule.plan_index(k)][0] for k in range(len(schedule))),
                          tuple(resolved[schedule.plan_index(k)][1] for k in range(len(schedule))))
    apply_precision_plan(model, plans.stage[0])
    for _, module in policy_linears(model):
        module.gemm_backend = args.gemm_backend
        module.backward_operands = getattr(args, "qat_backward", "hp")
    return model.to(device), plans


def build_model(args, vocab_size: int, device: torch.device):
    """This rank's model with the resolved precision plan applied; returns ``(model, stage plan,
    whole-model plan)`` (the two plans are the same without pipeline parallelism). With a schedule:
    phase 0's plans (``build_scheduled_model`` has every phase's)."""
    model, plans = build_scheduled_model(args, vocab_size, device)
    return model, plans.stage[0], plans.whole[0]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(whole model over all TP ranks and pipeline stages, this rank's part)."""
    from megatron.core import parallel_state

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


# ================================================================================================
# Training state
# ================================================================================================


VAL_BATCHES_FILE = "val_batches.jsonl"  # in --tensorboard-dir: one line per evaluation


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


@dataclass
class Trainer:
    """Everything one rank trains with; ``iteration`` and ``consumed_samples`` are the position."""

    args: object  # argparse.Namespace
    model: torch.nn.Module  # unwrapped (state dicts, parameter names); this pipeline stage's part
    engine: TorchEngine | MegatronEngine  # forward/backward, gradient reduction, optimizer (pretrain.engine)
    schedule: LRSchedule
    plan: PrecisionPlan
    model_config: ModelConfig  # saved with checkpoints (for evaluation tools)
    tokenizer_model: str  # the tokenizer file used (also the built-in one, without --tokenizer-model)
    train_ds: torch.utils.data.Dataset
    valid_ds: torch.utils.data.Dataset | None
    device: torch.device
    iteration: int = 0
    consumed_samples: int = 0
    last_saved: int | None = None  # iteration of the last checkpoint written or loaded
    last_checkpoint: str | None = None  # its directory (the last good one, should the run diverge)
    tb: object = None  # rank 0's SummaryWriter with --tensorboard-dir
    delayed_scaling: bool = False  # some operand of the whole model's plan in force uses delayed scaling
    plans: SchedulePlans | None = None  # every schedule phase's plans (None: ``plan`` for the whole run)
    phase: int | None = None  # the schedule phase whose plan the layers hold (``enter_phase``); None before

    def __post_init__(self):
        if self.plans is None:  # one phase: the plan given
            from precision.schedule import PrecisionSchedule

            self.plans = SchedulePlans(PrecisionSchedule.single(getattr(self.args, "precision", None) or "bf16"),
                                       (self.plan,), (self.plan,))

    @property
    def nonfinite_steps(self) -> int:
        """Non-finite steps met so far (skipped, or the one that diverged): the engine's count."""
        return self.engine.nonfinite.count

    @nonfinite_steps.setter
    def nonfinite_steps(self, n: int) -> None:
        self.engine.nonfinite.count = n

    # ---------------------------------------------------------------- precision schedule
    @property
    def precision_schedule(self) -> PrecisionSchedule:
        """The run's precision schedule (``schedule`` is the lr schedule)."""
        return self.plans.schedule

    @property
    def observing(self) -> bool:
        """Whether the phase in force is ``observe`` (BF16 GEMMs filling the next phase's histories)."""
        return self.phase is not None and self.precision_schedule.phases[self.phase].observe

    def enter_phase(self, iteration: int) -> None:
        """Before the step taken when ``iteration`` iterations are done (log iteration ``iteration + 1``):
        make the layers hold the plan of that step's schedule phase (``precision.schedule``). Called at
        the end of setup and before every step; a no-op within a phase.

        At a phase's start (a switch, or a resume exactly there) each layer keeps the amax history of
        an operand that the previous phase's plan recorded (delayed scaling with the same rotation on
        that GEMM; an ``observe`` phase records for its next phase's plan) and drops the others, so
        a history never scales by amaxes recorded before a gap: an operand whose delayed scaling
        starts in this phase starts empty (scaled by its own amax until its first step ends), unless
        an ``observe`` phase filled it. SR call counters carry on. Rank 0 logs the switch
        (``iteration N: precision phase K -> PLAN``; after an observe phase ``iteration N: QAT warm-up
        done (...): precision phase K -> PLAN``), the plan table and TensorBoard text."""
        from model.gpt import apply_precision_plan

        sched = self.precision_schedule
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
        first, last = sched.iterations(k, self.args.train_iters)
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
        if self.tb is not None:
            self.tb.add_text("precision_plan", f"phase {k} ({phase}) from iteration {nxt}:\n\n```\n"
                             + self.plans.whole[k].table() + "\n```", nxt)

    def _keep_recorded_histories(self, before: PrecisionPlan, after: PrecisionPlan) -> None:
        """Drop every layer's amax histories that ``before`` (the previous phase's plan) did not record
        into with the rotation ``after`` uses (``enter_phase``)."""
        from precision import Gemm

        for name, m in self.policy_linears():
            for g in Gemm:
                old, new = before[name].recipe(g), after[name].recipe(g)
                for operand, fmt in zip(g.operands, (old.a, old.b)):
                    if fmt.amax_algo == "current" or old.rotation != new.rotation:
                        m.quant_state.amax.pop(f"{g.value}/{operand}", None)

    # ---------------------------------------------------------------- distributed helpers
    @property
    def dp(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    @property
    def num_micro_batches(self) -> int:
        a = self.args
        return a.global_batch_size // (a.micro_batch_size * self.dp[1])

    # ---------------------------------------------------------------- numerics telemetry, QAT
    def policy_linears(self) -> list[tuple[str, torch.nn.Module]]:
        """(plan name, module) of this stage's policy linears (plan names number layers globally)."""
        from model.gpt import policy_linears

        if not hasattr(self, "_linears"):
            self._linears = policy_linears(self.model)
        return self._linears

    def set_telemetry(self, collect: bool, observe_only: bool) -> None:
        """This iteration: collect per-operand numerics (``--numerics-interval``); run BF16 while
        the amax histories fill (an ``observe`` phase; ``--qat-warmup-iters``)."""
        for _, m in self.policy_linears():
            m.quant_state.collect_stats = collect
            m.quant_state.observe_only = observe_only

    def _write_layer_scalars(self, scalars: list[tuple[str, float]]) -> None:
        """Write per-layer scalars to rank 0's TensorBoard. With pipeline parallelism every stage
        contributes its own layers (gathered over the pipeline group; all ranks call this)."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            parts = [None] * parallel_state.get_pipeline_model_parallel_world_size()
            torch.distributed.all_gather_object(
                parts, scalars, group=parallel_state.get_pipeline_model_parallel_group()
            )
            scalars = [item for part in parts for item in part]
        if self.tb is not None:
            for tag, value in scalars:
                self.tb.add_scalar(tag, value, self.iteration)

    def log_numerics(self) -> None:
        """TensorBoard ``numerics/<layer>/<gemm>/<operand>/<metric>`` from the last micro-batch of
        this iteration (each layer's TP rank 0 shard of each operand)."""
        from precision.telemetry import METRICS

        scalars = [
            (f"numerics/{name}/{key}/{metric}", float(numbers[metric]))
            for name, m in self.policy_linears()
            for key, numbers in m.quant_state.stats.items()
            for metric in METRICS
            if metric in numbers
        ]
        self._write_layer_scalars(scalars)

    def log_delayed_scaling(self) -> None:
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
        self._write_layer_scalars(scalars)

    # ---------------------------------------------------------------- one iteration
    def train_step(self, data) -> tuple[float | torch.Tensor, float | torch.Tensor, float, str]:
        """One global batch: returns (loss, grad norm before clipping, lr, outcome), the engine's
        ``optimizer_step`` result (``pretrain.engine``: ``"pending"`` -- 0-d device tensors that
        ``_Progress.settle`` reads later, a non-finite one being divergence -- ``"ok"``,
        ``"skipped"`` -- rolled back within ``--skip-nonfinite-steps``, only the data position moved
        -- or ``"diverged"``). Loss and norm are global, so all ranks reach the same outcome."""
        micro = [next(data) for _ in range(self.num_micro_batches)]
        return tuple(self.engine.train_step(micro, self.schedule))

    def diverged(self, loss: float, norm: float, iteration: int | None = None) -> int:
        """Divergence at ``iteration`` (default: the last; see the module docstring, 6): rank 0 writes
        ``--save/run_status.json`` and prints one line; nothing is saved. Returns ``EXIT_DIVERGED``."""
        a = self.args
        if iteration is not None:
            self.iteration = iteration
        skip = (f", {self.nonfinite_steps} non-finite steps (--skip-nonfinite-steps {a.skip_nonfinite_steps})"
                if a.skip_nonfinite_steps else "")
        reason = f"loss {loss}, grad norm {norm}{skip}"
        if is_rank0():
            where = ""
            if a.save:
                status = write_run_status(a.save, state="diverged", iteration=self.iteration,
                                          last_good_checkpoint=self.last_checkpoint, reason=reason)
                where = f"; status in {status}"
            good = self.last_checkpoint or "none (nothing saved yet)"
            resume = f", then resume with --load {os.path.dirname(self.last_checkpoint)}" if self.last_checkpoint else ""
            print(f"{PROG}: error: diverged at iteration {self.iteration}: {reason} "
                  f"(--check-for-nan-in-loss-and-grad); last good checkpoint: {good}{where}; lower --lr or keep "
                  f"more layers in higher precision (--precision-rule){resume}", file=sys.stderr, flush=True)
            if self.tb is not None:
                self.tb.flush()
        return EXIT_DIVERGED

    def evaluate(self) -> ValidationResult | None:
        """Per-token loss over the first ``--eval-iters`` global batches of the validation set.

        Every global batch is evaluated on its own, so the result carries its sampling noise: the
        standard error of the mean over batches (``sem``) and the per-batch losses, which the sweep
        pairs across runs (same batches, so the paired difference has a much smaller noise)."""
        from pretrain.data import batches

        if self.valid_ds is None or self.args.eval_iters == 0:
            return None
        self.model.eval()
        data = batches(self.valid_ds, 0, self.args.micro_batch_size, *self.dp)
        per_batch = []
        for _ in range(self.args.eval_iters):
            loss = self.engine.eval_loss([mb for _, mb in zip(range(self.num_micro_batches), data)])
            if loss is not None:
                per_batch.append(loss)
        self.model.train()
        return ValidationResult.of(per_batch) if per_batch else None

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> str:
        from pretrain.checkpointing import save_checkpoint

        t0 = time.perf_counter()
        state = {
            "model": self.engine.model_state_dict(),  # FP32 main weights with --bf16 (torch engine)
            "optimizer": self.engine.optimizer_state_dict(),
            "opt_param_scheduler": self.schedule.state_dict(),
            "consumed_train_samples": self.consumed_samples,
            "precision_plan": self.plan.to_dict(),  # the plan in force (its phase's)
            "precision_schedule": self.precision_schedule.to_dict(),
            "precision_phase": self.phase,  # the phase that trained the last iteration
            "model_config": dataclasses.asdict(self.model_config),
            "tokenizer_model": self.tokenizer_model,
            "args": dict(vars(self.args)),
            "nonfinite_steps": self.nonfinite_steps,
        }
        path = save_checkpoint(self.args.save, self.iteration, state, write_beside=self.engine.save_extra,
                               retain=self.args.save_retain)
        rank0_print(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f}s)")
        self.last_saved, self.last_checkpoint = self.iteration, path
        return path

    def load_pretrained(self) -> None:
        """``--pretrained-checkpoint`` (``--load`` holds no checkpoint yet): initial model weights."""
        from pretrain.pretrained import PretrainedError, load_pretrained_weights, read_pretrained

        t0 = time.perf_counter()
        try:
            pre = read_pretrained(self.args.pretrained_checkpoint)
            with self.engine.full_precision_weights():  # --bf16: the FP32 mains get the file's FP32 values
                load_pretrained_weights(self.model, pre, self.args.tensor_model_parallel_size)
                self.engine.weights_loaded()
        except PretrainedError as e:
            raise ConfigError(str(e)) from None
        rank0_print(
            f"--pretrained-checkpoint: initial weights from {pre.path} ({pre.kind}"
            + (f", iteration {pre.iteration}" if pre.iteration is not None else "")
            + f"); starting at iteration 0 ({time.perf_counter() - t0:.1f}s)"
        )

    def _check_saved_schedule(self, ckpt: dict, saved_args: dict, iteration: int) -> bool:
        """Whether the checkpoint was saved under this run's precision schedule; if not, a note says
        which phase each schedule puts the resumed iterations in (this run's schedule is followed)."""
        from precision.schedule import PrecisionSchedule

        try:
            if "precision_schedule" in ckpt:
                theirs = PrecisionSchedule.from_dict(ckpt["precision_schedule"])
            else:  # saved before schedules: --precision with --qat-warmup-iters
                theirs = PrecisionSchedule.qat_warmup(int(saved_args.get("qat_warmup_iters") or 0),
                                                      saved_args.get("precision") or "bf16")
        except (ValueError, TypeError, KeyError):
            rank0_print(f"note: {ckpt['path']} holds no readable precision schedule; following this run's "
                        f"({self.precision_schedule})")
            return False
        ours = self.precision_schedule
        if str(theirs) == str(ours):
            return True
        past = [str(p) for p in ours.phases if p.start < iteration] == [str(p) for p in theirs.phases
                                                                          if p.start < iteration]
        k = ours.index_at(iteration)
        rank0_print(
            f"note: {ckpt['path']} was saved under precision schedule {theirs}, this run's is {ours}"
            + (f" (the same for iterations 1..{iteration})" if past else
               f" (iterations 1..{iteration} trained under another schedule: not this schedule's straight run)")
            + f"; iteration {iteration + 1} on follows this run's: phase {k} ({ours.phases[k]})"
        )
        return False

    def load(self) -> bool:
        """``--load``: everything (resume), or model weights only (``--finetune``); False if
        ``--load`` holds no checkpoint yet. A checkpoint saved under another precision schedule is
        noted (this run's schedule is followed from the saved iteration on)."""
        from pretrain.checkpointing import CheckpointError, load_checkpoint, restore_rng_state, this_rank_file

        args = self.args
        # --finetune takes model weights only, so a checkpoint of another TP size is resharded
        ckpt = load_checkpoint(args.load, args.tensor_model_parallel_size, reshard_model=args.finetune,
                               iteration=args.ckpt_step)
        if ckpt is None:
            rank0_print(
                f"--load {args.load}: no checkpoint yet ({os.path.basename(args.load)}/latest_checkpointed_"
                f"iteration.txt missing): starting "
                + ("from --pretrained-checkpoint" if args.pretrained_checkpoint else "from scratch")
            )
            return False
        saved = ckpt.get("args", {})
        for key in SHAPE_ARGS:
            if key in saved and saved[key] != getattr(args, key):
                flag = "--" + key.replace("_", "-")
                raise CheckpointError(
                    f"--load: {ckpt['path']} has {flag} {saved[key]}, this run {getattr(args, key)}"
                )
        try:
            self.model.load_state_dict(ckpt["model"], strict=True)
        except RuntimeError as e:
            raise CheckpointError(
                f"--load: {ckpt['path']} does not fit this model: {' '.join(str(e).split())[:300]}"
            ) from None
        self.engine.weights_loaded(ckpt["model"])
        saved_iter = int(ckpt["iteration"]) if ckpt["iteration"] != "release" else 0
        same_schedule = args.finetune or self._check_saved_schedule(ckpt, saved, saved_iter)
        # the plan that trained the checkpoint's last iteration, in this run's schedule
        ours = self.plan if args.finetune or saved_iter == 0 else self.plans.stage[self.precision_schedule.index_at(saved_iter - 1)]
        changed = [
            n
            for n, v in ckpt.get("precision_plan", {}).items()
            if n in ours and ours.to_dict()[n]["precision"] != v["precision"]
        ]
        if changed and same_schedule:
            rank0_print(
                f"note: the precision of {len(changed)} linear layer(s) differs from the checkpoint's plan "
                f"(e.g. {changed[0]}); using this run's --precision / --precision-rule"
            )
        if args.finetune:
            rank0_print(f"--finetune: loaded model weights of {ckpt['path']}; starting at iteration 0")
            return True
        if self.engine.name == "megatron" and bool(saved.get("bf16", False)) != bool(args.bf16):
            raise CheckpointError(  # megatron's FP32 and mixed-precision optimizers hold different states
                f"--load: {ckpt['path']} was saved with{'' if saved.get('bf16') else 'out'} --bf16 on the megatron "
                f"engine; resume with the same setting (or load its weights with --finetune)"
            )
        self.engine.load_optimizer(ckpt["optimizer"], os.path.dirname(this_rank_file(ckpt["path"])))
        self.schedule.load_state_dict(ckpt["opt_param_scheduler"])
        for note in self.schedule.load_notes:  # a schedule value the flags changed (or kept from --load)
            rank0_print(f"note: --load {ckpt['path']}: {note}")
        self.iteration = int(ckpt["iteration"]) if ckpt["iteration"] != "release" else 0
        self.consumed_samples = int(
            ckpt.get("consumed_train_samples", self.iteration * args.global_batch_size)
        )
        if not restore_rng_state(ckpt):
            rank0_print("note: data-parallel size differs from the checkpoint's: RNG states not restored")
        self.last_saved, self.last_checkpoint = self.iteration, ckpt["path"]
        self.nonfinite_steps = int(ckpt.get("nonfinite_steps", 0))
        rank0_print(
            f"resumed from {ckpt['path']}: iteration {self.iteration}, "
            f"{self.consumed_samples} samples consumed"
        )
        return True


# ================================================================================================
# Logging
# ================================================================================================


def is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def rank0_print(*a) -> None:
    if is_rank0():
        print(*a, flush=True)


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


class _Progress:
    """Progress lines every ``--log-interval`` and TensorBoard scalars for every iteration (rank 0).

    Steps are recorded as they end and logged when the loop *settles* them (:meth:`settle`: at
    every ``--log-interval``, evaluation, checkpoint and stop), so a training step reads nothing
    to the host in between; every iteration still gets its TensorBoard scalars.

    A line shows the loss averaged since the previous line, the last iteration's lr and grad norm,
    and tokens/s, model TFLOP/s per device (``model.gpt.training_flops_per_token``; Megatron-LM's
    "throughput per GPU") and ETA from the time per iteration since the previous line -- not
    counting the run's first iteration, which includes torch.compile's compilation.
    """

    def __init__(self, trainer: Trainer):
        from model.gpt import padded_vocab_size, training_flops_per_token

        self.t, self.start = trainer, time.perf_counter()
        cfg, a = trainer.model_config, trainer.args
        vocab = padded_vocab_size(cfg, a.tensor_model_parallel_size)
        self.flops_per_token = training_flops_per_token(cfg, a.seq_length, vocab)
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.rate_start, self.rate_iters, self.compiling = self.start, 0, True
        self.window_iters, self.window_loss = 0, 0.0
        self.pending: list[tuple] = []  # steps recorded, not yet read to the host (settle)

    def record(self, loss, norm, lr: float, seconds: float, outcome: str) -> None:
        """The step just taken (``Trainer.train_step``'s results; loss and norm may be device
        tensors), logged when the loop next calls :meth:`settle`."""
        self.pending.append((self.t.iteration, loss, norm, lr, seconds, outcome, time.perf_counter()))

    def settle(self) -> tuple[int, float, float] | None:
        """Read the recorded steps' losses and norms to the host in one transfer and log them in
        order. With ``--check-for-nan-in-loss-and-grad`` a non-finite ``"pending"`` step is the
        divergence: it is counted and logged, the steps after it are not, and ``(iteration, loss,
        norm)`` is returned (the loop ends the run; those later steps trained on a diverged model)."""
        if not self.pending:
            return None
        device = self.t.device
        values = torch.stack([torch.stack([torch.as_tensor(r[1], dtype=torch.float32, device=device).reshape(()),
                                           torch.as_tensor(r[2], dtype=torch.float32, device=device).reshape(())])
                              for r in self.pending]).tolist()  # the one device read of the window
        records, self.pending = self.pending, []
        now = time.perf_counter()
        check = self.t.args.check_for_nan_in_loss_and_grad
        for k, ((it, _, _, lr, seconds, outcome, end), (loss, norm)) in enumerate(zip(records, values)):
            if outcome == "pending":
                finite = math.isfinite(loss) and math.isfinite(norm)
                outcome = "ok" if finite or not check else "diverged"
                if outcome == "diverged":
                    self.t.nonfinite_steps += 1
            self.iteration(it, loss, norm, lr, seconds, outcome, now if k == len(records) - 1 else end)
            if outcome == "diverged":
                return it, loss, norm
        return None

    def iteration(self, it: int, loss: float, norm: float, lr: float, seconds: float, outcome: str,
                  now: float) -> None:
        """Log iteration ``it`` (ended at ``now``). ``outcome``: a skipped step's loss stays out of
        ``train/loss`` and the averages; a diverged step's NaN/Inf is logged;
        ``train/nonfinite_steps`` counts both."""
        t, a = self.t, self.t.args
        tokens = a.global_batch_size * a.seq_length
        if outcome != "ok":
            if t.tb is not None:
                t.tb.add_scalar("train/nonfinite_steps", t.nonfinite_steps, it)
                if outcome == "diverged":  # the values that ended the run (a skipped step's are left out)
                    t.tb.add_scalar("train/loss", loss, it)
                    t.tb.add_scalar("train/grad_norm", norm, it)
                t.tb.flush()
            what = ("diverged" if outcome == "diverged" else
                    f"skipped ({t.nonfinite_steps} of --skip-nonfinite-steps {a.skip_nonfinite_steps})")
            rank0_print(f"iteration {it:>{len(str(a.train_iters))}}/{a.train_iters} | loss {loss:.4f}"
                        f" | lr {lr:.3e} | grad norm {norm:.3f} | non-finite: {what}")
            return
        self.window_iters += 1
        self.window_loss += loss
        if t.tb is not None:
            for tag, value in (
                ("train/loss", loss),
                ("train/nonfinite_steps", t.nonfinite_steps),
                ("train/lr", lr),
                ("train/grad_norm", norm),
                ("train/tokens_per_sec", tokens / max(seconds, 1e-9)),
                ("train/tflops_per_device", self.tflops(tokens / max(seconds, 1e-9))),
                ("precision/phase", t.precision_schedule.index_at(it - 1)),  # the schedule phase that trained it
            ):
                t.tb.add_scalar(tag, value, it)
        if self.compiling:  # the run's first iteration compiles: leave it out of the rate
            self.rate_start, self.compiling = now, False
        else:
            self.rate_iters += 1
        if it % a.log_interval == 0 or it == a.train_iters:
            per_iter = (now - self.rate_start) / self.rate_iters if self.rate_iters else seconds
            width = len(str(a.train_iters))
            rank0_print(
                f"iteration {it:>{width}}/{a.train_iters}"
                f" | loss {self.window_loss / self.window_iters:.4f}"
                f" | lr {lr:.3e} | grad norm {norm:.3f} | {tokens / per_iter:,.0f} tokens/s"
                f" | {self.tflops(tokens / per_iter):.3g} TFLOP/s/device"
                f" | elapsed {_hms(now - self.start)} | ETA {_hms(per_iter * (a.train_iters - it))}"
                + (f" | non-finite steps skipped {t.nonfinite_steps}" if t.nonfinite_steps else "")
            )
            self.rate_start, self.rate_iters = now, 0
            self.window_iters, self.window_loss = 0, 0.0
            if t.tb is not None:
                t.tb.flush()

    def tflops(self, tokens_per_sec: float) -> float:
        """Model TFLOP/s per device at ``tokens_per_sec`` (whole run)."""
        return self.flops_per_token * tokens_per_sec / self.world / 1e12

    def validation(self, result: ValidationResult | None) -> None:
        if result is None:
            return
        loss = result.loss
        ppl = np.exp(min(loss, 50.0))
        rank0_print(f"validation at iteration {self.t.iteration} | val loss {loss:.4f} "
                    f"(± {result.sem:.4f} s.e. over {len(result.batch_losses)} batches) | val ppl {ppl:.2f}")
        if self.t.tb is not None:
            self.t.tb.add_scalar("val/loss", loss, self.t.iteration)
            self.t.tb.add_scalar("val/loss_sem", result.sem, self.t.iteration)
            self.t.tb.flush()
            # Per-batch losses beside the event files: launch/sweep.py pairs them across runs.
            with open(os.path.join(self.t.args.tensorboard_dir, VAL_BATCHES_FILE), "a") as f:
                f.write(json.dumps({"iteration": self.t.iteration, "batch_losses": result.batch_losses}) + "\n")


# ================================================================================================
# Main
# ================================================================================================


class _SigtermFlag:
    """Set by SIGTERM (during setup too); ranks agree on it after every iteration (all-reduce MAX)."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def any_rank(self) -> bool:
        """Whether any rank got SIGTERM: a host-memory all-reduce on the gloo group of
        :func:`init_process_group` (no device synchronisation); no collective in a world of one."""
        if torch.distributed.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=_host_group)
        return bool(flag.item())


def setup(args) -> Trainer:
    """Steps 2-3 of the module docstring; returns a ready Trainer (after ``--load``)."""
    from megatron.core import parallel_state

    from model.gpt import padded_vocab_size
    from pretrain.data import build_train_valid_datasets, load_tokenizer
    from pretrain.engine import build_engine
    from pretrain.optim import LRSchedule

    device = init_distributed(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = parallel_state.get_data_parallel_world_size()
    rank0_print(
        f"world size {torch.distributed.get_world_size()} = TP {tp} x PP {pp} x DP {dp} | device {device.type} "
        f"({torch.distributed.get_backend()}) | gemm backend {args.gemm_backend} | seed {args.seed}"
    )

    t0 = time.perf_counter()
    try:
        tokenizer = load_tokenizer(
            args.tokenizer_model, args.data_cache_dir, tokenizer_type=args.tokenizer_type
        )
        train_ds, valid_ds = build_train_valid_datasets(
            args.data_path,
            tokenizer,
            args.seq_length,
            args.seed,
            train_samples=args.train_iters * args.global_batch_size,
            valid_samples=max(args.eval_iters, 1) * args.global_batch_size,
            cache_dir=args.data_cache_dir,
            split=args.split,
            valid_data_path=args.valid_data_path,
            fixed_train_set=getattr(args, "fixed_train_set", None),
        )
    except (ValueError, FileNotFoundError) as e:  # the data module's one-line messages name the flag
        raise ConfigError(str(e)) from None
    source = " ".join(args.data_path) if args.data_path else f"built-in stdlib corpus ({args.data_cache_dir})"
    vocab_size = tokenizer.vocab_size
    if args.pretrained_vocab_size is not None:  # the pretrained embedding table fixes the vocabulary
        if tokenizer.vocab_size > args.pretrained_vocab_size:
            raise ConfigError(
                f"--tokenizer-model {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                f"{args.pretrained_vocab_size} of --pretrained-checkpoint {args.pretrained_checkpoint}"
            )
        vocab_size = args.pretrained_vocab_size
    cfg = model_config(args, vocab_size)
    rank0_print(
        f"data: {source} | tokenizer {tokenizer.path} (vocab {tokenizer.vocab_size}, padded to "
        f"{padded_vocab_size(cfg, tp)}) | {len(train_ds)} train / {len(valid_ds) if valid_ds else 0} "
        f"valid samples of {args.seq_length} tokens | {time.perf_counter() - t0:.1f}s"
    )

    model, plans = build_scheduled_model(args, vocab_size, device)
    engine = build_engine(model, args, device)  # the non-finite policy of the run's flags
    trainer = Trainer(
        args, model, engine, LRSchedule.from_args(engine.optimizer, args), plans.stage[0], cfg, tokenizer.path,
        train_ds, valid_ds, device, plans=plans,
    )  # fmt: skip
    trainer.delayed_scaling = plans.delayed_scaling(0)
    if not (args.load and trainer.load()) and args.pretrained_checkpoint:
        trainer.load_pretrained()
    engine.wrap()
    rank0_print(
        f"engine: {engine.name} (--ddp-impl {args.ddp_impl}): "
        + ("megatron-core DDP, " + ("distributed optimizer, " if args.use_distributed_optimizer else "")
           + ("1F1B pipeline schedule" if pp > 1 else "no-pipelining schedule")
           if engine.name == "megatron" else "torch DDP, AdamW, micro-batch loop")
        + (" | --bf16: BF16 parameters and activations, FP32 main parameters and gradients" if args.bf16
           else " | FP32 parameters and activations (--no-bf16)")
        + (f" | recompute {args.recompute_granularity}" if args.recompute_granularity else "")
    )

    total, local = count_parameters(model)
    rank0_print(model)
    rank0_print(f"parameters: {total:,} ({local:,} on each of {tp * pp} model-parallel rank(s))")
    given = (f"--precision-schedule {args.precision_schedule}" if getattr(args, "precision_schedule", None)
             else f"--precision {args.precision}" + (f" --qat-warmup-iters {args.qat_warmup_iters}"
                                                     if args.qat_warmup_iters else ""))
    given += "".join(f" --precision-rule {r}" for r in args.precision_rule)
    schedule = plans.schedule
    if len(schedule) == 1:
        rank0_print(f"precision plan ({given}):\n{plans.whole[0].table()}")
    else:  # each phase's plan table is printed when the phase begins (Trainer.enter_phase)
        rank0_print(f"precision schedule ({given}): {schedule.describe(args.train_iters)}")
    if args.tensorboard_dir and is_rank0():
        from torch.utils.tensorboard import SummaryWriter

        trainer.tb = SummaryWriter(
            args.tensorboard_dir, purge_step=trainer.iteration + 1 if trainer.iteration else None
        )
        if len(schedule) == 1:
            trainer.tb.add_text("precision_plan", "```\n" + plans.whole[0].table() + "\n```", trainer.iteration)
        else:
            trainer.tb.add_text("precision_schedule", f"`{schedule}`: {schedule.describe(args.train_iters)}",
                                trainer.iteration)
        trainer.tb.add_text(
            "args",
            "```\n" + "\n".join(f"{k}: {v}" for k, v in sorted(vars(args).items())) + "\n```",
            trainer.iteration,
        )
    trainer.enter_phase(trainer.iteration)  # the plan of the next step's phase (logged with a schedule)
    return trainer


def train(trainer: Trainer, sigterm: _SigtermFlag) -> int:
    """The loop (step 4-5 of the module docstring); returns the exit status."""
    from pretrain.data import batch_loader

    args = trainer.args
    if trainer.iteration >= args.train_iters:
        rank0_print(
            f"nothing to do: already at iteration {trainer.iteration} of --train-iters {args.train_iters}"
        )
        return 0
    data = batch_loader(trainer.train_ds, trainer.consumed_samples, args.micro_batch_size, *trainer.dp,
                        num_workers=args.num_workers or 0, pin_memory=trainer.device.type == "cuda")
    progress = _Progress(trainer)
    last_eval = None
    rank0_print(
        f"training iterations {trainer.iteration + 1}..{args.train_iters}: global batch "
        f"{args.global_batch_size} = micro {args.micro_batch_size} x DP {trainer.dp[1]} x "
        f"{trainer.num_micro_batches} micro-batches, {args.global_batch_size * args.seq_length:,} tokens"
    )
    if args.save and is_rank0() and clear_run_status(args.save):
        rank0_print(f"note: removed {args.save}/run_status.json of an earlier attempt")
    while trainer.iteration < args.train_iters:
        t0 = time.perf_counter()
        nxt = trainer.iteration + 1
        collect = bool(args.numerics_interval) and nxt % args.numerics_interval == 0
        trainer.enter_phase(trainer.iteration)  # a schedule's switch happens here, between steps
        warm = trainer.observing  # an observe phase (--qat-warmup-iters): BF16 GEMMs, histories fill
        trainer.set_telemetry(collect, warm)
        try:
            loss, norm, lr, outcome = trainer.train_step(data)
        except StopIteration:
            raise RuntimeError(f"the training data ran out at iteration {trainer.iteration + 1}") from None
        trainer.iteration += 1
        trainer.consumed_samples += args.global_batch_size
        if collect and args.tensorboard_dir:
            trainer.log_numerics()
        it = trainer.iteration
        logs = it % args.log_interval == 0  # device telemetry is read at log intervals only
        if not warm and trainer.delayed_scaling and args.tensorboard_dir and logs:
            trainer.log_delayed_scaling()
        trainer.set_telemetry(False, False)
        progress.record(loss, norm, lr, time.perf_counter() - t0, outcome)
        evaluate = bool(args.eval_interval) and it % args.eval_interval == 0
        save = bool(args.save and args.save_interval) and it % args.save_interval == 0
        exits = bool(args.exit_interval) and it % args.exit_interval == 0
        # the steps are read to the host (and a divergence found) only here: before anything that
        # logs, evaluates or saves, and at the end
        settle = outcome != "pending" or logs or evaluate or save or exits or it == args.train_iters
        if settle and (bad := progress.settle()) is not None:
            return trainer.diverged(*bad[1:], iteration=bad[0])

        if evaluate:
            progress.validation(trainer.evaluate())
            last_eval = it
        if save:
            trainer.save()
        stop = "SIGTERM" if sigterm.any_rank() else None
        if stop is None and exits and it < args.train_iters:
            stop = f"--exit-interval {args.exit_interval}"
        if stop:
            if (bad := progress.settle()) is not None:
                return trainer.diverged(*bad[1:], iteration=bad[0])
            if args.save and trainer.last_saved != it:
                trainer.save()
            rank0_print(
                f"{stop}: stopping after iteration {it}"
                + ("" if args.save else " (no --save: nothing saved)")
            )
            return 0

    if args.save and trainer.last_saved != trainer.iteration:
        trainer.save()
    if last_eval != trainer.iteration:
        progress.validation(trainer.evaluate())
    rank0_print(f"done: {args.train_iters} iterations in {_hms(time.perf_counter() - progress.start)}")
    if args.tensorboard_dir:
        rank0_print(
            f"TensorBoard logs: {os.path.abspath(args.tensorboard_dir)}  "
            f"(view: tensorboard --logdir {args.tensorboard_dir})"
        )
    if args.save:
        rank0_print(
            f"checkpoint: {os.path.abspath(args.save)} (latest_checkpointed_iteration.txt -> "
            f"{trainer.iteration}; resume with --load {args.save})"
        )
    return 0


def _agree_on_input(problem: str | None) -> str | None:
    """Under torchrun: every rank's validation result, gathered once (the process group is started
    for it), so that all ranks learn of a problem found by any and none exits before rank 0 prints."""
    init_process_group()
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, problem)
    first = next((r for r, p in enumerate(found) if p), None)
    return None if first is None else found[first] + ("" if first == 0 else f" (found on rank {first})")


def _refuse(message: str, status: int):
    """Print ``pretrain.py: error: message`` once (rank 0) and exit with ``status`` on every rank.

    With a process group the ranks then meet (a gloo ``monitored_barrier``) before exiting, so no
    rank's exit lets torchrun kill rank 0 before its line is out. A rank that waits
    ``ERROR_WAIT_S`` in vain (the error was not every rank's) prints the line itself."""
    initialized = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    if initialized and torch.distributed.get_world_size() > 1 and _error_group is not None:
        try:
            torch.distributed.monitored_barrier(_error_group, timeout=datetime.timedelta(seconds=ERROR_WAIT_S))
        except RuntimeError:  # some rank never came: rank 0 may not have printed
            if rank != 0:
                print(f"{PROG}: error: {message} (rank {rank})", file=sys.stderr, flush=True)
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    """``launch/pretrain.py``: parse, validate, set up, train; returns the exit status
    (``pretrain.status``: 0 done, 2 bad input, 3 diverged, 4 a checkpoint could not be written)."""
    from pretrain import runtime
    from pretrain.checkpointing import CheckpointError, CheckpointSaveError

    runtime.start(PROG)  # (launch/pretrain.py already did, before megatron was imported)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problem = None
    try:
        args = parse_args_or_raise(argv)
        validate_args(args, world, torch.cuda.is_available())
    except ConfigError as e:
        problem = str(e)
    if world > 1 and "RANK" in os.environ:  # launched by torchrun (or srun): agree first
        problem = _agree_on_input(problem)
    if problem:
        _refuse(problem, EXIT_BAD_INPUT)
    sigterm = _SigtermFlag()  # from here on SIGTERM means: finish the iteration, save, exit 0
    trainer = None
    try:
        trainer = setup(args)
        status = train(trainer, sigterm)
    except (ConfigError, CheckpointError) as e:  # found after setup started (e.g. a checkpoint mismatch)
        _refuse(str(e), EXIT_BAD_INPUT)
    except CheckpointSaveError as e:  # every rank raises it alike
        if trainer is not None and trainer.tb is not None:
            trainer.tb.close()
        _refuse(str(e), EXIT_SAVE_FAILED)
    if trainer.tb is not None:
        trainer.tb.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return status

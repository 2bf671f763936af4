"""The pretraining loop behind ``launch/pretrain.py``: setup, train, evaluate, log, checkpoint.

    torchrun --nproc-per-node 2 launch/pretrain.py --model-size tiny --precision wgrad_hadamard \\
        --tensor-model-parallel-size 2 --train-iters 200 --save runs/tiny/ckpt --tensorboard-dir runs/tiny/tb

Order of events (every rank):

1. ``parse_run_config`` (``pretrain.arguments``: parse, validate, freeze into the typed
   ``pretrain.config.RunConfig`` that everything below reads): bad input exits 2 with one line,
   before model, data or parallel state are touched. Under torchrun every rank validates and the
   ranks agree (one ``all_gather_object``) before rank 0 prints the line and all exit, so the line
   is printed once and always reaches the user (torchrun kills the other ranks when one exits).
2. ``torch.distributed`` from torchrun's environment (a world of one without torchrun): gloo on
   CPU, NCCL on CUDA; megatron ``parallel_state.initialize_model_parallel(TP, PP)``; seeds
   (python, numpy, torch; megatron's CUDA RNG tracker on GPU; ``pretrain.runtime``) -- the same on every rank, so every
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
   of every iteration, rank 0; ``MetricsLogger.settle``).
6. A non-finite loss or gradient norm (``--check-for-nan-in-loss-and-grad``, on by default) is
   found when its step is settled (the steps after it, already taken, are discarded with the run;
   with ``--skip-nonfinite-steps`` or without the check every step is read at once instead) and
   skipped -- no parameter, optimizer or schedule update, the layers' quantization state restored --
   up to ``--skip-nonfinite-steps`` times; the next one is divergence: logged (TensorBoard
   ``lm loss`` NaN, ``nonfinite-steps``, the progress line), ``--save/run_status.json``
   written, one line naming the iteration and the last good checkpoint, exit status 3 on every rank
   (``pretrain.status``: the contract with ``launch/sweep.py``). The diverged state is never saved.
   A checkpoint that cannot be written (a full disk) is one line and exit status 4.

Precision schedules (``--precision-schedule``, ``--qat-warmup-iters``): ``pretrain.trainer.phases``.
Exact resume (a resumed run repeats the straight one bit for bit): ``pretrain.trainer.checkpointer``.

The loop is a skeleton of components (``pretrain.trainer``), each owning its cadence::

    for step in range(trainer.iteration + 1, train_iters + 1):
        phases.maybe_switch_phase(step - 1); phases.begin_step(step)
        loss, norm, lr, outcome = trainer.train_step(data)      # the engine's optimizer_step
        phases.end_step(step); metrics.record(step, ...)
        metrics.maybe_log(step)        # settles at its interval and before the others act: divergence found here
        validator.maybe_validate(step, metrics); checkpointer.save(step)
        if stopper.should_stop(step): checkpointer.save(step, last_step=True); stop    # SIGTERM, --exit-interval

``pretrain.runtime.run`` is the process around it (process groups, SIGTERM, refusals and exit codes,
rank-0 printing); nothing in the loop reads an argparse Namespace.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from model.gpt import padded_vocab_size
from pretrain import expert_parallel, runtime
from pretrain.arguments import PROG, ConfigError, parse_run_config
from pretrain.checkpointing import CheckpointError, CheckpointSaveError
from pretrain.config import RunConfig
from pretrain.data import batch_loader, build_train_valid_datasets, load_tokenizer
from pretrain.engine import build_engine
from pretrain.optim import LRSchedule
from pretrain.runtime import init_process_group, is_rank0, rank0_print
from pretrain.status import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_SAVE_FAILED,
    clear_run_status,
    record_ending,
    save_dir_of,
)
from pretrain.trainer.checkpointer import Checkpointer, Progress
from pretrain.trainer.metrics import VAL_BATCHES_FILE, MetricsLogger, hms, open_tensorboard  # noqa: F401 - re-exported
from pretrain.trainer.moe_telemetry import MoETelemetry
from pretrain.trainer.phases import PrecisionPhases
from pretrain.trainer.plans import (  # noqa: F401 - re-exported (RL, tools, tests)
    SchedulePlans,
    build_model,
    build_scheduled_model,
    check_gemm_backends,
    count_parameters,
    override_amax,
    override_margin,
)
from pretrain.trainer.stopper import Stopper
from pretrain.trainer.validator import ValidationResult, Validator  # noqa: F401 - re-exported

_SigtermFlag = runtime.Signals  # the names these had before they moved to pretrain.runtime
_agree_on_input = runtime.agree_on_input


def __getattr__(name: str):  # the groups and wait that pretrain.train held before pretrain.runtime did
    if name in ("_error_group", "_host_group"):
        return runtime._groups.get(name[1:].split("_")[0])
    if name == "ERROR_WAIT_S":
        return runtime.ERROR_WAIT_S
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _refuse(message: str, status: int):
    """``runtime.refuse`` under this module's ``PROG``."""
    runtime.refuse(message, status, PROG)


def init_distributed(run: RunConfig) -> torch.device:
    """Process group (``runtime.init_process_group``), parallel state, seeds."""
    init_process_group()
    expert_parallel.check_layout(run, torch.distributed.get_world_size(), ConfigError)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=run.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=run.parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=run.model.expert_model_parallel_size,
    )
    device = seed_everything(run.training.seed)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(run.training.seed)
    return device


def seed_everything(seed: int) -> torch.device:
    """Seed python, numpy and torch; returns this process's device (its CUDA device, else the CPU)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ================================================================================================
# The trainer: state and components
# ================================================================================================


@dataclass
class Trainer:
    """Everything one rank trains with; ``iteration`` and ``consumed_samples`` are the position.
    Components (``pretrain.trainer``): ``phases``, ``metrics``, ``validator``, ``checkpointer``."""

    run: RunConfig
    model: torch.nn.Module  # unwrapped (state dicts, parameter names); this pipeline stage's part
    engine: object  # pretrain.engine.TorchEngine | MegatronEngine: forward/backward, reduction, optimizer
    schedule: object  # pretrain.optim.LRSchedule
    plans: SchedulePlans  # every schedule phase's plans
    model_config: object  # model.gpt.ModelConfig, saved with checkpoints (for evaluation tools)
    tokenizer_model: str  # the tokenizer file used (also the built-in one, without --tokenizer-model)
    train_ds: torch.utils.data.Dataset
    valid_ds: torch.utils.data.Dataset | None
    device: torch.device
    progress: Progress = field(default_factory=Progress)  # iterations done, samples consumed
    metrics: MetricsLogger = field(init=False)
    phases: PrecisionPhases = field(init=False)
    validator: Validator = field(init=False)
    checkpointer: Checkpointer = field(init=False)
    moe_telemetry: MoETelemetry = field(init=False)

    def __post_init__(self):
        r = self.run
        self.metrics = MetricsLogger(r, self.model_config, self.device, self.engine.nonfinite, self.plans.schedule)
        self.phases = PrecisionPhases(self.model, self.plans, train_iters=r.training.train_iters,
                                      numerics_interval=r.precision.numerics_interval,
                                      log_interval=r.logging.log_interval, metrics=self.metrics)
        self.validator = Validator(self.model, self.engine, self.valid_ds, eval_interval=r.logging.eval_interval,
                                   eval_iters=r.logging.eval_iters, micro_batch_size=r.training.micro_batch_size,
                                   num_micro_batches=self.num_micro_batches, dp=self.dp)
        self.checkpointer = Checkpointer(r, self.model, self.engine, self.schedule, self.phases, self.progress,
                                         model_config=self.model_config, tokenizer_model=self.tokenizer_model)
        self.metrics.settle_before(self.validator.should_validate, self.checkpointer.should_save)
        self.moe_telemetry = MoETelemetry(self.model, self.phases.policy_linears(), self.metrics,
                                          log_interval=r.logging.log_interval, numerics_interval=r.precision.numerics_interval,
                                          num_micro_batches=self.num_micro_batches)

    @property
    def iteration(self) -> int:
        """Iterations done (``progress``)."""
        return self.progress.iteration

    @iteration.setter
    def iteration(self, n: int) -> None:
        self.progress.iteration = n

    @property
    def consumed_samples(self) -> int:
        """Training samples consumed (``progress``)."""
        return self.progress.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, n: int) -> None:
        self.progress.consumed_samples = n

    # the state the components keep, read where it was before they existed
    plan = property(lambda self: self.phases.plan, doc="The precision plan in force (its phase's).")
    precision_schedule = property(lambda self: self.plans.schedule, doc="The run's precision schedule.")
    tb = property(lambda self: self.metrics.tb, doc="Rank 0's TensorBoard writer (None without --tensorboard-dir).")
    last_checkpoint = property(lambda self: self.checkpointer.last_checkpoint)
    last_saved = property(lambda self: self.checkpointer.last_saved)

    @property
    def nonfinite_steps(self) -> int:
        """Non-finite steps met so far (skipped, or the one that diverged): the engine's count."""
        return self.engine.nonfinite.count

    @nonfinite_steps.setter
    def nonfinite_steps(self, n: int) -> None:
        self.engine.nonfinite.count = n

    @property
    def dp(self):
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    @property
    def num_micro_batches(self) -> int:
        t = self.run.training
        return t.global_batch_size // (t.micro_batch_size * self.dp[1])

    def train_step(self, data) -> tuple[float | torch.Tensor, float | torch.Tensor, float, str]:
        """One global batch: returns (loss, grad norm before clipping, lr, outcome), the engine's
        ``optimizer_step`` result (``pretrain.engine``: ``"pending"`` -- 0-d device tensors that
        ``MetricsLogger.settle`` reads later, a non-finite one being divergence -- ``"ok"``,
        ``"skipped"`` -- rolled back within ``--skip-nonfinite-steps``, only the data position moved
        -- or ``"diverged"``). Loss and norm are global, so all ranks reach the same outcome."""
        micro = [next(data) for _ in range(self.num_micro_batches)]
        return tuple(self.engine.train_step(micro, self.schedule))

    def diverged(self, loss: float, norm: float, iteration: int | None = None) -> int:
        """Divergence at ``iteration`` (default: the last; see the module docstring, 6): rank 0 writes
        ``--save/run_status.json`` and prints one line; nothing is saved. Returns ``EXIT_DIVERGED``."""
        save, skips = self.run.checkpoint.save, self.run.training.skip_nonfinite_steps
        if iteration is not None:
            self.iteration = iteration
        skip = f", {self.nonfinite_steps} non-finite steps (--skip-nonfinite-steps {skips})" if skips else ""
        reason = f"loss {loss}, grad norm {norm}{skip}"
        if is_rank0():
            where, last = "", self.last_checkpoint
            if save:
                status = record_ending(save, "diverged", EXIT_DIVERGED, iteration=self.iteration,
                                       last_good_checkpoint=last, reason=reason)
                where = f"; status in {status}" if status else ""
            good = last or "none (nothing saved yet)"
            resume = f", then resume with --load {os.path.dirname(last)}" if last else ""
            print(f"{PROG}: error: diverged at iteration {self.iteration}: {reason} "
                  f"(--check-for-nan-in-loss-and-grad); last good checkpoint: {good}{where}; lower --lr or keep "
                  f"more layers in higher precision (--precision-rule){resume}", file=sys.stderr, flush=True)
            if self.tb is not None:
                self.tb.flush()
        return EXIT_DIVERGED


# ================================================================================================
# Setup, the loop, main
# ================================================================================================


def setup(run: RunConfig) -> Trainer:
    """Steps 2-3 of the module docstring; returns a ready Trainer (after ``--load``)."""
    m, p, par, t, d, c = run.model, run.precision, run.parallel, run.training, run.data, run.checkpoint
    device = init_distributed(run)
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = parallel_state.get_data_parallel_world_size()
    rank0_print(
        f"world size {torch.distributed.get_world_size()} = TP {tp} x PP {pp} x DP {dp}"
        f"{f' (EP {m.expert_model_parallel_size})' if m.expert_model_parallel_size > 1 else ''} | device {device.type} "
        f"({torch.distributed.get_backend()}) | gemm backend {p.gemm_backend} | seed {t.seed}"
    )

    t0 = time.perf_counter()
    try:
        tokenizer = load_tokenizer(d.tokenizer_model, d.data_cache_dir, tokenizer_type=d.tokenizer_type)
        train_ds, valid_ds = build_train_valid_datasets(
            list(d.data_path) if d.data_path else None, tokenizer, m.seq_length, t.seed,
            train_samples=t.train_iters * t.global_batch_size,
            valid_samples=max(run.logging.eval_iters, 1) * t.global_batch_size,
            cache_dir=d.data_cache_dir, split=d.split,
            valid_data_path=list(d.valid_data_path) if d.valid_data_path else None,
            fixed_train_set=d.fixed_train_set,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as e:  # the data module's one-line messages name the flag
        raise ConfigError(str(e)) from None
    source = " ".join(d.data_path) if d.data_path else f"built-in stdlib corpus ({d.data_cache_dir})"
    vocab_size = tokenizer.vocab_size
    if run.pretrained_vocab_size is not None:  # the pretrained embedding table fixes the vocabulary
        if tokenizer.vocab_size > run.pretrained_vocab_size:
            raise ConfigError(
                f"--tokenizer-model {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                f"{run.pretrained_vocab_size} of --pretrained-checkpoint {c.pretrained_checkpoint}"
            )
        vocab_size = run.pretrained_vocab_size
    cfg = run.model_config(vocab_size)
    rank0_print(
        f"data: {source} | tokenizer {tokenizer.path} (vocab {tokenizer.vocab_size}, padded to "
        f"{padded_vocab_size(cfg, tp)}) | {len(train_ds)} train / {len(valid_ds) if valid_ds else 0} "
        f"valid samples of {m.seq_length} tokens | {time.perf_counter() - t0:.1f}s"
    )

    model, plans = build_scheduled_model(run, vocab_size, device)
    engine = build_engine(model, run, device)  # the non-finite policy of the run's flags
    trainer = Trainer(run, model, engine, LRSchedule.from_training(engine.optimizer, t), plans, cfg, tokenizer.path,
                      train_ds, valid_ds, device)
    if not (c.load and trainer.checkpointer.load()) and c.pretrained_checkpoint:
        trainer.checkpointer.load_pretrained()
    engine.wrap()
    mem = run.memory
    rank0_print(
        f"engine: {engine.name} (--ddp-impl {par.ddp_impl}): "
        + ("megatron-core DDP, " + ("distributed optimizer, " if par.use_distributed_optimizer else "")
           + ("1F1B pipeline schedule" if pp > 1 else "no-pipelining schedule")
           if engine.name == "megatron" else "torch DDP, AdamW, micro-batch loop")
        + (" | --bf16: BF16 parameters and activations, FP32 main parameters and gradients" if mem.bf16
           else " | FP32 parameters and activations (--no-bf16)")
        + (f" | recompute {mem.recompute_granularity}" if mem.recompute_granularity else "")
    )

    total, local = count_parameters(model)
    if run.logging.print_model:
        rank0_print(model)
    rank0_print(f"parameters: {total:,} ({local:,} on each of {tp * pp} model-parallel rank(s))"
                + ("" if run.logging.print_model else "; the module tree: --print-model"))
    given = (f"--precision-schedule {p.precision_schedule}" if p.precision_schedule
             else f"--precision {p.precision}" + (f" --qat-warmup-iters {p.qat_warmup_iters}"
                                                  if p.qat_warmup_iters else ""))
    given += "".join(f" --precision-rule {r}" for r in p.precision_rule)
    if p.megatron_flags:  # which plan Megatron-LM's flags became (pretrain.config.megatron_flags)
        rank0_print(p.megatron_flags)
    schedule = plans.schedule
    if len(schedule) == 1:
        rank0_print(f"precision plan ({given}), by rule (per layer: TensorBoard text precision_plan, "
                    f"checkpoints):\n{plans.whole[0].summary()}")
    else:  # each phase's plan table is printed when the phase begins (PrecisionPhases.maybe_switch_phase)
        rank0_print(f"precision schedule ({given}): {schedule.describe(t.train_iters)}")
    texts = ({"precision_plan": "```\n" + plans.whole[0].table() + "\n```"} if len(schedule) == 1 else
             {"precision_schedule": f"`{schedule}`: {schedule.describe(t.train_iters)}"})
    texts["args"] = "```\n" + "\n".join(f"{k}: {v}" for k, v in sorted(run.to_dict().items())) + "\n```"
    trainer.metrics.open(trainer.iteration, texts)
    trainer.phases.maybe_switch_phase(trainer.iteration)  # the plan of the next step's phase (logged with a schedule)
    return trainer


def train(trainer: Trainer, signals: runtime.Signals, started: float | None = None) -> int:
    """The loop (step 4-5 of the module docstring); returns the exit status. ``started``: the
    ``time.monotonic()`` of the process's start (``--exit-duration-in-mins`` counts from it; default now)."""
    t, run = trainer, trainer.run
    n, gbs, save = run.training.train_iters, run.training.global_batch_size, run.checkpoint.save
    phases, metrics, validator, checkpointer = t.phases, t.metrics, t.validator, t.checkpointer
    stopper = Stopper(signals, run.training.exit_interval, n, run.training.exit_duration_in_mins, started)
    metrics.settle_before(stopper.exits_at)
    if t.iteration >= n:
        rank0_print(f"nothing to do: already at iteration {t.iteration} of --train-iters {n}")
        _record(t, "done", 0)
        return 0
    data = batch_loader(t.train_ds, t.consumed_samples, run.training.micro_batch_size, *t.dp,
                        num_workers=run.data.num_workers or 0, pin_memory=t.device.type == "cuda")
    metrics.begin()
    rank0_print(
        f"training iterations {t.iteration + 1}..{n}: global batch {gbs} = micro {run.training.micro_batch_size} "
        f"x DP {t.dp[1]} x {t.num_micro_batches} micro-batches, {gbs * run.model.seq_length:,} tokens"
    )
    if save and is_rank0() and clear_run_status(save):
        rank0_print(f"note: removed {save}/run_status.json of an earlier attempt")
    while t.iteration < n:
        t0 = time.perf_counter()
        step = t.iteration + 1
        phases.maybe_switch_phase(t.iteration)  # a schedule's switch happens here, between steps
        phases.begin_step(step)
        t.moe_telemetry.begin_step(step)
        try:
            loss, norm, lr, outcome = t.train_step(data)
        except StopIteration:
            raise RuntimeError(f"the training data ran out at iteration {step}") from None
        t.iteration, t.consumed_samples = step, t.consumed_samples + gbs
        phases.end_step(step)
        t.moe_telemetry.end_step(step)  # MoE models: routing per layer and expert (pretrain.trainer.moe_telemetry)
        metrics.record(step, loss, norm, lr, time.perf_counter() - t0, outcome)
        # the steps are read to the host (and a divergence found) only here: at a log interval, before
        # a component that evaluates, saves or stops acts (metrics.settle_before), and at the end
        if (bad := metrics.maybe_log(step, force=outcome != "pending")) is not None:
            return t.diverged(*bad[1:], iteration=bad[0])
        validator.maybe_validate(step, metrics)
        checkpointer.save(step)
        if stop := stopper.should_stop(step):
            if (bad := metrics.settle()) is not None:
                return t.diverged(*bad[1:], iteration=bad[0])
            checkpointer.save(step, last_step=True)
            rank0_print(f"{stop}: stopping after iteration {step}" + ("" if save else " (no --save: nothing saved)"))
            _record(t, "stopped", 0, reason=stop)
            return 0

    checkpointer.save(t.iteration, last_step=True)
    if validator.last != t.iteration:
        validator.validate(t.iteration, metrics)
    rank0_print(f"done: {n} iterations in {hms(time.perf_counter() - metrics.start)}")
    tb_dir = run.logging.tensorboard_dir
    if tb_dir:
        rank0_print(f"TensorBoard logs: {os.path.abspath(tb_dir)}  (view: tensorboard --logdir {tb_dir})")
    if save:
        rank0_print(f"checkpoint: {os.path.abspath(save)} (latest_checkpointed_iteration.txt -> "
                    f"{t.iteration}; resume with --load {save})")
    _record(t, "done", 0)
    return 0


def _record(trainer: Trainer, state: str, exit_status: int, **fields) -> None:
    """Rank 0 records how the run ended in ``--save/run_status.json`` (``pretrain.status``)."""
    if is_rank0():
        record_ending(trainer.run.checkpoint.save, state, exit_status, iteration=trainer.iteration,
                      last_good_checkpoint=trainer.last_checkpoint, **fields)


def _pretrain(run: RunConfig, signals: runtime.Signals, started: float | None = None) -> int:
    trainer = None
    try:
        trainer = setup(run)
        return train(trainer, signals, started)
    except (ConfigError, CheckpointError) as e:  # refused after setup began (runtime.run prints it)
        if is_rank0():
            fields = {"iteration": trainer.iteration, "last_good_checkpoint": trainer.last_checkpoint} if trainer else {}
            record_ending(run.checkpoint.save, "refused", EXIT_BAD_INPUT, reason=str(e), **fields)
        raise
    except CheckpointSaveError as e:
        if trainer is not None:
            _record(trainer, "save_failed", EXIT_SAVE_FAILED, reason=str(e))
        raise
    finally:
        if trainer is not None:
            trainer.metrics.close()


def _parse(argv: list[str] | None, world: int, cuda: bool) -> RunConfig:
    """``parse_run_config``; a refusal is also recorded in ``--save/run_status.json`` when the command
    line names a ``--save`` that takes it (rank 0)."""
    try:
        return parse_run_config(argv, world, cuda)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            record_ending(save_dir_of(sys.argv[1:] if argv is None else argv), "refused", EXIT_BAD_INPUT,
                          reason=str(e))
        raise


def main(argv: list[str] | None = None) -> int:
    """``launch/pretrain.py``: parse, validate, set up, train; returns the exit status
    (``pretrain.status``: 0 done, 2 bad input, 3 diverged, 4 a checkpoint could not be written)."""
    started = time.monotonic()  # --exit-duration-in-mins counts from here, as Megatron-LM's from pretrain()
    return runtime.run(lambda run, signals: _pretrain(run, signals, started), prog=PROG,
                       parse=lambda world, cuda: _parse(argv, world, cuda))

"""Progress lines, TensorBoard scalars under Megatron-LM's names, and an optional W&B logger.

Steps are recorded as they end (:meth:`MetricsLogger.record`) and logged when the loop *settles*
them (:meth:`MetricsLogger.maybe_log`: at every ``--log-interval``, before an evaluation, a
checkpoint or a stop, and at the end), so a training step reads nothing to the host in between;
every iteration still gets its scalars.

Scalar names are Megatron-LM's (``megatron/training/training.py``), so a Megatron user's dashboards
and scripts read our runs unchanged:

==============================  =============================================================
``lm loss``                     training loss of the iteration (also ``... vs samples``, ``... vs tokens``)
``learning-rate``, ``grad-norm`` the same three x-axes
``batch-size``                  global batch (samples)
``iteration-time``              seconds of the iteration
``tokens-per-sec``              tokens of the global batch over ``iteration-time`` (torchtitan's tps)
``throughput``, ``mfu``         ``--log-throughput``: model TFLOP/s per device
                                (``model.gpt.training_flops_per_token``; Megatron's "throughput per GPU")
                                and its percentage of the device's dense BF16 peak (known GPUs only)
``mem-*``                       ``--log-memory-to-tensorboard``: CUDA's ``mem-reserved-bytes``,
                                ``mem-allocated-bytes``, ``mem-max-allocated-bytes``,
                                ``mem-allocated-count``; on a CPU ``mem-max-rss-bytes`` (host peak RSS)
``lm loss validation``          held-out loss (also ``vs samples``/``vs tokens``); ``... sem`` its
                                standard error over the evaluation's batches
``nonfinite-steps``             running count of non-finite steps (skipped or diverged)
``precision/phase``, ``numerics/...``  our own precision telemetry, under its own prefixes
==============================  =============================================================

"vs samples" and "vs tokens" scalars take consumed samples / tokens as their step (TensorBoard's
x-axis). Event files of earlier versions used ``train/loss``-style names (``pretrain.trainer.tags``);
the readers (``pretrain.trainer.tags.series``) take either.

A progress line starts with its wall-clock time (Megatron's ``[YYYY-MM-DD HH:MM:SS]``) and shows
the loss averaged since the previous line, the last iteration's lr and grad norm, tokens/s, the
time per iteration and ETA from the iterations since the previous line (not counting the run's
first iteration, which includes torch.compile's compilation), and the peak memory (CUDA's max
allocated, or the host's peak RSS on a CPU); ``--log-throughput`` adds TFLOP/s per device and MFU.

With ``--wandb-project`` rank 0 also logs every scalar to Weights & Biases (``pip install
lowprec-pretrain[wandb]``), in offline mode unless ``WANDB_MODE`` says otherwise; the "vs samples"
and "vs tokens" scalars go there as ``samples vs steps`` / ``tokens vs steps`` (W&B has one step
axis; pick either as the x-axis in its UI), as Megatron-LM does.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
from megatron.core import parallel_state

from model.gpt import padded_vocab_size, training_flops_per_token
from pretrain.expert_parallel import gather_layer_scalars
from pretrain.runtime import is_rank0, rank0_print

VAL_BATCHES_FILE = "val_batches.jsonl"  # in --tensorboard-dir: one line per evaluation

from pretrain.trainer.tags import (  # noqa: F401 - re-exported
    BATCH_SIZE,
    GRAD_NORM,
    ITERATION_TIME,
    LEGACY_TAGS,
    LOSS,
    LR,
    MFU,
    NONFINITE,
    PHASE,
    THROUGHPUT,
    TOKENS_PER_SEC,
    VAL_LOSS,
    VAL_LOSS_SEM,
    VS_SAMPLES,
    VS_TOKENS,
)

# dense BF16 datasheet peak TFLOP/s per device (MFU's denominator), matched in the CUDA device name
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "GB200": 2500.0, "A100": 312.0}


def hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def timestamp() -> str:
    """Megatron-LM's progress-line prefix: the wall-clock time, ``[YYYY-MM-DD HH:MM:SS]``."""
    return datetime.datetime.now().strftime("[%Y-%m-%d %H:%M:%S]")


def peak_tflops(device: torch.device) -> float | None:
    """The dense BF16 peak of ``device`` (TFLOP/s) where :data:`PEAK_BF16_TFLOPS` knows it, else ``None``."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).replace(" ", "")
    return next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def host_peak_rss_bytes() -> int:
    """This process's peak resident set (``getrusage``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): CUDA's max allocated on a GPU, the host's peak RSS otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "CUDA max allocated"
    return host_peak_rss_bytes(), "host RSS"


def memory_scalars(device: torch.device) -> list[tuple[str, float]]:
    """``--log-memory-to-tensorboard``'s scalars: Megatron-LM's four from ``torch.cuda.memory_stats``
    on a GPU; on a CPU the host's peak RSS (``mem-max-rss-bytes``)."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return [("mem-reserved-bytes", s.get("reserved_bytes.all.current", 0)),
                ("mem-allocated-bytes", s.get("allocated_bytes.all.current", 0)),
                ("mem-max-allocated-bytes", s.get("allocated_bytes.all.peak", 0)),
                ("mem-allocated-count", s.get("allocation.all.current", 0))]
    return [("mem-max-rss-bytes", host_peak_rss_bytes())]


def open_tensorboard(directory: str, iteration: int):
    """A ``SummaryWriter`` on ``directory`` for a run at ``iteration`` (a resumed run's later events
    replace those of the steps it repeats)."""
    from torch.utils.tensorboard import SummaryWriter  # tensorboard loads only for runs that write events

    return SummaryWriter(directory, purge_step=iteration + 1 if iteration else None)


def open_wandb(logging_config, save: str | None, config: dict):
    """Rank 0's W&B run for ``--wandb-project`` (offline unless ``WANDB_MODE`` is set), or ``None``."""
    lg = logging_config
    if not lg.wandb_project or not is_rank0():
        return None
    import wandb

    directory = lg.wandb_save_dir or os.path.join(save or lg.tensorboard_dir, "wandb")
    os.makedirs(directory, exist_ok=True)
    mode = None if os.environ.get("WANDB_MODE") else "offline"
    return wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, dir=directory, config=config, mode=mode)


class ScalarWriter:
    """Rank 0's scalar sinks behind ``SummaryWriter``'s calls: TensorBoard (``--tensorboard-dir``)
    and W&B (``--wandb-project``). W&B has one step axis: a step's scalars are held until
    :meth:`flush` and logged in step order; "vs samples"/"vs tokens" scalars stay out of it (their
    step is not the iteration), ``samples vs steps``/``tokens vs steps`` stand for them."""

    def __init__(self, tb=None, wandb_run=None):
        self.writer, self.wandb = tb, wandb_run
        self.held: dict[int, dict[str, float]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)
        if self.wandb is not None and not tag.endswith((VS_SAMPLES, VS_TOKENS)):
            self.held.setdefault(int(step), {})[tag] = float(value)

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()
        if self.wandb is not None:
            for step in sorted(self.held):
                self.wandb.log(self.held[step], step=step)
            self.held = {}

    def close(self) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


class MetricsLogger:
    """Progress lines every ``--log-interval`` and scalars for every iteration (rank 0)."""

    def __init__(self, run, model_config, device: torch.device, nonfinite, precision_schedule):
        self.run, self.device, self.nonfinite, self.precision_schedule = run, device, nonfinite, precision_schedule
        t, lg = run.training, run.logging
        self.train_iters, self.log_interval, self.tensorboard_dir = t.train_iters, lg.log_interval, lg.tensorboard_dir
        self.samples, self.seq_length = t.global_batch_size, run.model.seq_length
        self.tokens = t.global_batch_size * run.model.seq_length
        self.log_throughput, self.log_memory = lg.log_throughput, lg.log_memory_to_tensorboard
        self.peak = peak_tflops(device)
        vocab = padded_vocab_size(model_config, run.parallel.tensor_model_parallel_size)
        self.flops_per_token = training_flops_per_token(model_config, run.model.seq_length, vocab)
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.tb = None  # rank 0's ScalarWriter with --tensorboard-dir or --wandb-project (open)
        self.readers: list = []  # should_*(step) of the components that read the trained state at a step
        self.begin()

    def settle_before(self, *should) -> None:
        """Components that read the trained state at the steps their ``should(step)`` names (an
        evaluation, a checkpoint, a stop): the recorded steps are settled before they act."""
        self.readers.extend(should)

    @property
    def enabled(self) -> bool:
        """Whether the run writes scalars (TensorBoard or W&B; on every rank: layer scalars are gathered)."""
        return bool(self.tensorboard_dir or self.run.logging.wandb_project)

    def open(self, iteration: int, texts: dict[str, str]) -> None:
        """Rank 0's writer: TensorBoard (events after ``iteration`` of an earlier attempt purged) and
        W&B, with ``texts`` written at ``iteration``."""
        if not (self.enabled and is_rank0()):
            return
        tb = open_tensorboard(self.tensorboard_dir, iteration) if self.tensorboard_dir else None
        self.tb = ScalarWriter(tb, open_wandb(self.run.logging, self.run.checkpoint.save, self.run.to_dict()))
        for tag, text in texts.items():
            self.tb.add_text(tag, text, iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()

    def begin(self) -> None:
        """The training loop starts: the clocks of the elapsed time and the rate start."""
        self.start = time.perf_counter()
        self.rate_start, self.rate_iters, self.compiling = self.start, 0, True
        self.window_iters, self.window_loss = 0, 0.0
        self.pending: list[tuple] = []  # steps recorded, not yet read to the host (maybe_log)

    def record(self, step: int, loss, norm, lr: float, seconds: float, outcome: str) -> None:
        """The step just taken (the engine's results; loss and norm may be device tensors), logged
        when the loop next settles the steps."""
        self.pending.append((step, loss, norm, lr, seconds, outcome, time.perf_counter()))

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a ``--log-interval`` step, the last one, or one after which a component
        reads the trained state (:meth:`settle_before`)."""
        return step % self.log_interval == 0 or step == self.train_iters or any(r(step) for r in self.readers)

    def maybe_log(self, step: int, force: bool = False) -> tuple[int, float, float] | None:
        """When :meth:`should_log` (or ``force``: a step already read at once), settle the recorded
        steps (:meth:`settle`)."""
        return self.settle() if force or self.should_log(step) else None

    def settle(self) -> tuple[int, float, float] | None:
        """Read the recorded steps' losses and norms to the host in one transfer and log them in
        order. With ``--check-for-nan-in-loss-and-grad`` a non-finite ``"pending"`` step is the
        divergence: it is counted and logged, the steps after it are not, and ``(iteration, loss,
        norm)`` is returned (the loop ends the run; those later steps trained on a diverged model)."""
        if not self.pending:
            return None
        device = self.device
        values = torch.stack([torch.stack([torch.as_tensor(r[1], dtype=torch.float32, device=device).reshape(()),
                                           torch.as_tensor(r[2], dtype=torch.float32, device=device).reshape(())])
                              for r in self.pending]).tolist()  # the one device read of the window
        records, self.pending = self.pending, []
        now = time.perf_counter()
        check = self.nonfinite.check
        for k, ((it, _, _, lr, seconds, outcome, end), (loss, norm)) in enumerate(zip(records, values)):
            if outcome == "pending":
                finite = math.isfinite(loss) and math.isfinite(norm)
                outcome = "ok" if finite or not check else "diverged"
                if outcome == "diverged":
                    self.nonfinite.count += 1
            self.iteration(it, loss, norm, lr, seconds, outcome, now if k == len(records) - 1 else end)
            if outcome == "diverged":
                return it, loss, norm
        return None

    def add_vs(self, tag: str, value: float, it: int) -> None:
        """``tag`` at iteration ``it`` and against the samples and tokens consumed by then."""
        tb, samples = self.tb, it * self.samples
        tb.add_scalar(tag, value, it)
        tb.add_scalar(tag + VS_SAMPLES, value, samples)
        tb.add_scalar(tag + VS_TOKENS, value, samples * self.seq_length)

    def iteration(self, it: int, loss: float, norm: float, lr: float, seconds: float, outcome: str,
                  now: float) -> None:
        """Log iteration ``it`` (ended at ``now``). ``outcome``: a skipped step's loss stays out of
        ``lm loss`` and the averages; a diverged step's NaN/Inf is logged; ``nonfinite-steps``
        counts both."""
        tokens, tb, count, n = self.tokens, self.tb, self.nonfinite.count, self.train_iters
        if outcome != "ok":
            if tb is not None:
                tb.add_scalar(NONFINITE, count, it)
                if outcome == "diverged":  # the values that ended the run (a skipped step's are left out)
                    self.add_vs(LOSS, loss, it)
                    self.add_vs(GRAD_NORM, norm, it)
                tb.flush()
            what = ("diverged" if outcome == "diverged" else
                    f"skipped ({count} of --skip-nonfinite-steps {self.nonfinite.max_skips})")
            rank0_print(f"{timestamp()} iteration {it:>{len(str(n))}}/{n} | loss {loss:.4f}"
                        f" | lr {lr:.3e} | grad norm {norm:.3f} | non-finite: {what}")
            return
        self.window_iters += 1
        self.window_loss += loss
        if tb is not None:
            self.add_vs(LOSS, loss, it)
            self.add_vs(LR, lr, it)
            self.add_vs(GRAD_NORM, norm, it)
            rate = tokens / max(seconds, 1e-9)
            scalars = [(BATCH_SIZE, self.samples), (ITERATION_TIME, seconds), (TOKENS_PER_SEC, rate),
                       (NONFINITE, count),
                       (PHASE, self.precision_schedule.index_at(it - 1))]  # the schedule phase that trained it
            if self.log_throughput:
                scalars.append((THROUGHPUT, self.tflops(rate)))
                if self.peak:
                    scalars.append((MFU, self.mfu(rate)))
            if self.log_memory:
                scalars.extend(memory_scalars(self.device))
            if self.tb.wandb is not None:  # W&B's stand-ins for the "vs samples"/"vs tokens" x-axes
                scalars += [("samples vs steps", it * self.samples), ("tokens vs steps", it * tokens)]
            for tag, value in scalars:
                tb.add_scalar(tag, value, it)
        if self.compiling:  # the run's first iteration compiles: leave it out of the rate
            self.rate_start, self.compiling = now, False
        else:
            self.rate_iters += 1
        if it % self.log_interval == 0 or it == n:
            per_iter = (now - self.rate_start) / self.rate_iters if self.rate_iters else seconds
            rate = tokens / per_iter
            throughput = ""
            if self.log_throughput:
                throughput = f" | {self.tflops(rate):.3g} TFLOP/s/device" + (
                    f" | MFU {self.mfu(rate):.1f}%" if self.peak else "")
            mem, kind = peak_memory(self.device)
            rank0_print(
                f"{timestamp()} iteration {it:>{len(str(n))}}/{n}"
                f" | loss {self.window_loss / self.window_iters:.4f}"
                f" | lr {lr:.3e} | grad norm {norm:.3f} | {rate:,.0f} tokens/s{throughput}"
                f" | {per_iter * 1e3:.1f} ms/iteration | peak mem {mem / 2**30:.2f} GiB ({kind})"
                f" | elapsed {hms(now - self.start)} | ETA {hms(per_iter * (n - it))}"
                + (f" | non-finite steps skipped {count}" if count else "")
            )
            self.rate_start, self.rate_iters = now, 0
            self.window_iters, self.window_loss = 0, 0.0
            if tb is not None:
                tb.flush()

    def tflops(self, tokens_per_sec: float) -> float:
        """Model TFLOP/s per device at ``tokens_per_sec`` (whole run)."""
        return self.flops_per_token * tokens_per_sec / self.world / 1e12

    def mfu(self, tokens_per_sec: float) -> float:
        """Model FLOPs utilisation at ``tokens_per_sec``: :meth:`tflops` over the device's dense BF16
        peak, in percent (``None`` peak: not called)."""
        return 100.0 * self.tflops(tokens_per_sec) / self.peak

    def validation(self, step: int, result) -> None:
        """A ``pretrain.trainer.validator.ValidationResult`` at ``step``: a line, scalars and
        its per-batch losses in ``val_batches.jsonl`` (the sweep pairs them across runs)."""
        if result is None:
            return
        loss = result.loss
        ppl = np.exp(min(loss, 50.0))
        rank0_print(f"{timestamp()} validation at iteration {step} | val loss {loss:.4f} "
                    f"(± {result.sem:.4f} s.e. over {len(result.batch_losses)} batches) | val ppl {ppl:.2f}")
        if self.tb is not None:
            self.add_vs(VAL_LOSS, loss, step)
            self.tb.add_scalar(VAL_LOSS_SEM, result.sem, step)
            self.tb.flush()
        if self.tb is not None and self.tensorboard_dir:
            # Per-batch losses beside the event files: launch/sweep.py pairs them across runs.
            with open(os.path.join(self.tensorboard_dir, VAL_BATCHES_FILE), "a") as f:
                f.write(json.dumps({"iteration": step, "batch_losses": result.batch_losses}) + "\n")

    def write_layer_scalars(self, scalars: list[tuple[str, float]], step: int) -> None:
        """Write per-layer scalars to rank 0's TensorBoard / W&B. With pipeline parallelism every stage
        contributes its own layers (gathered over the pipeline group), with expert parallelism every EP
        rank its own experts (``pretrain.expert_parallel.gather_layer_scalars``); all ranks call this."""
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            parts = [None] * parallel_state.get_pipeline_model_parallel_world_size()
            torch.distributed.all_gather_object(
                parts, scalars, group=parallel_state.get_pipeline_model_parallel_group()
            )
            scalars = [item for part in parts for item in part]
        scalars = gather_layer_scalars(scalars)
        if self.tb is not None:
            for tag, value in scalars:
                self.tb.add_scalar(tag, value, step)

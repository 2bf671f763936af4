"""Progress lines and TensorBoard scalars: the metrics logger, which owns the logging cadence.

Steps are recorded as they end (:meth:`MetricsLogger.record`) and logged when the loop *settles*
them (:meth:`MetricsLogger.maybe_log`: at every ``--log-interval``, before an evaluation, a
checkpoint or a stop, and at the end), so a training step reads nothing to the host in between;
every iteration still gets its TensorBoard scalars.

A line shows the loss averaged since the previous line, the last iteration's lr and grad norm,
and tokens/s, model TFLOP/s per device (``model.gpt.training_flops_per_token``; Megatron-LM's
"throughput per GPU") and ETA from the time per iteration since the previous line -- not
counting the run's first iteration, which includes torch.compile's compilation.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time

import numpy as np
import torch
from megatron.core import parallel_state

from model.gpt import padded_vocab_size, training_flops_per_token
from pretrain.runtime import is_rank0, rank0_print

VAL_BATCHES_FILE = "val_batches.jsonl"  # in --tensorboard-dir: one line per evaluation


def hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))



def open_tensorboard(directory: str, iteration: int):
    """A ``SummaryWriter`` on ``directory`` for a run at ``iteration`` (a resumed run's later events
    replace those of the steps it repeats)."""
    from torch.utils.tensorboard import SummaryWriter  # tensorboard loads only for runs that write events

    return SummaryWriter(directory, purge_step=iteration + 1 if iteration else None)


class MetricsLogger:
    """Progress lines every ``--log-interval`` and TensorBoard scalars for every iteration (rank 0)."""

    def __init__(self, run, model_config, device: torch.device, nonfinite, precision_schedule):
        self.run, self.device, self.nonfinite, self.precision_schedule = run, device, nonfinite, precision_schedule
        t, lg = run.training, run.logging
        self.train_iters, self.log_interval, self.tensorboard_dir = t.train_iters, lg.log_interval, lg.tensorboard_dir
        self.tokens = t.global_batch_size * run.model.seq_length
        vocab = padded_vocab_size(model_config, run.parallel.tensor_model_parallel_size)
        self.flops_per_token = training_flops_per_token(model_config, run.model.seq_length, vocab)
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.tb = None  # rank 0's SummaryWriter with --tensorboard-dir (open)
        self.readers: list = []  # should_*(step) of the components that read the trained state at a step
        self.begin()

    def settle_before(self, *should) -> None:
        """Components that read the trained state at the steps their ``should(step)`` names (an
        evaluation, a checkpoint, a stop): the recorded steps are settled before they act."""
        self.readers.extend(should)

    @property
    def enabled(self) -> bool:
        """Whether the run writes TensorBoard events (on every rank: layer scalars are gathered)."""
        return bool(self.tensorboard_dir)

    def open(self, iteration: int, texts: dict[str, str]) -> None:
        """Rank 0's TensorBoard writer (events after ``iteration`` of an earlier attempt purged) with
        ``texts`` written at ``iteration``."""
        if not (self.tensorboard_dir and is_rank0()):
            return
        self.tb = open_tensorboard(self.tensorboard_dir, iteration)
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

    def iteration(self, it: int, loss: float, norm: float, lr: float, seconds: float, outcome: str,
                  now: float) -> None:
        """Log iteration ``it`` (ended at ``now``). ``outcome``: a skipped step's loss stays out of
        ``train/loss`` and the averages; a diverged step's NaN/Inf is logged;
        ``train/nonfinite_steps`` counts both."""
        tokens, tb, count, n = self.tokens, self.tb, self.nonfinite.count, self.train_iters
        if outcome != "ok":
            if tb is not None:
                tb.add_scalar("train/nonfinite_steps", count, it)
                if outcome == "diverged":  # the values that ended the run (a skipped step's are left out)
                    tb.add_scalar("train/loss", loss, it)
                    tb.add_scalar("train/grad_norm", norm, it)
                tb.flush()
            what = ("diverged" if outcome == "diverged" else
                    f"skipped ({count} of --skip-nonfinite-steps {self.nonfinite.max_skips})")
            rank0_print(f"iteration {it:>{len(str(n))}}/{n} | loss {loss:.4f}"
                        f" | lr {lr:.3e} | grad norm {norm:.3f} | non-finite: {what}")
            return
        self.window_iters += 1
        self.window_loss += loss
        if tb is not None:
            for tag, value in (
                ("train/loss", loss),
                ("train/nonfinite_steps", count),
                ("train/lr", lr),
                ("train/grad_norm", norm),
                ("train/tokens_per_sec", tokens / max(seconds, 1e-9)),
                ("train/tflops_per_device", self.tflops(tokens / max(seconds, 1e-9))),
                ("precision/phase", self.precision_schedule.index_at(it - 1)),  # the schedule phase that trained it
            ):
                tb.add_scalar(tag, value, it)
        if self.compiling:  # the run's first iteration compiles: leave it out of the rate
            self.rate_start, self.compiling = now, False
        else:
            self.rate_iters += 1
        if it % self.log_interval == 0 or it == n:
            per_iter = (now - self.rate_start) / self.rate_iters if self.rate_iters else seconds
            rank0_print(
                f"iteration {it:>{len(str(n))}}/{n}"
                f" | loss {self.window_loss / self.window_iters:.4f}"
                f" | lr {lr:.3e} | grad norm {norm:.3f} | {tokens / per_iter:,.0f} tokens/s"
                f" | {self.tflops(tokens / per_iter):.3g} TFLOP/s/device"
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

    def validation(self, step: int, result) -> None:
        """A ``pretrain.trainer.validator.ValidationResult`` at ``step``: a line, TensorBoard scalars and
        its per-batch losses in ``val_batches.jsonl`` (the sweep pairs them across runs)."""
        if result is None:
            return
        loss = result.loss
        ppl = np.exp(min(loss, 50.0))
        rank0_print(f"validation at iteration {step} | val loss {loss:.4f} "
                    f"(± {result.sem:.4f} s.e. over {len(result.batch_losses)} batches) | val ppl {ppl:.2f}")
        if self.tb is not None:
            self.tb.add_scalar("val/loss", loss, step)
            self.tb.add_scalar("val/loss_sem", result.sem, step)
            self.tb.flush()
            # Per-batch losses beside the event files: launch/sweep.py pairs them across runs.
            with open(os.path.join(self.tensorboard_dir, VAL_BATCHES_FILE), "a") as f:
                f.write(json.dumps({"iteration": step, "batch_losses": result.batch_losses}) + "\n")

    def write_layer_scalars(self, scalars: list[tuple[str, float]], step: int) -> None:
        """Write per-layer scalars to rank 0's TensorBoard. With pipeline parallelism every stage
        contributes its own layers (gathered over the pipeline group; all ranks call this)."""
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            parts = [None] * parallel_state.get_pipeline_model_parallel_world_size()
            torch.distributed.all_gather_object(
                parts, scalars, group=parallel_state.get_pipeline_model_parallel_group()
            )
            scalars = [item for part in parts for item in part]
        if self.tb is not None:
            for tag, value in scalars:
                self.tb.add_scalar(tag, value, step)

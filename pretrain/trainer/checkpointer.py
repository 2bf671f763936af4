"""The checkpointer: ``--save`` / ``--load`` / ``--finetune`` / ``--pretrained-checkpoint`` of a
training run; it owns the ``--save-interval`` cadence (``save(step)`` saves when one is due,
``save(step, last_step=True)`` at the end or a stop unless ``step`` is saved already).

It is handed only what it saves and restores: the model, the engine (optimizer, FP32 mains, the
non-finite count), the lr schedule, the precision phases, the run's position (:class:`Progress`),
the run's config, the model config and the tokenizer file.

What a checkpoint holds (``pretrain.checkpointing`` writes and reads the files): the model (FP32
mains with ``--bf16`` on the torch engine), the optimizer, the lr schedule, the samples consumed, the
precision plan in force, the precision schedule and phase, the model config, the tokenizer, the run's
arguments (``RunConfig.to_dict``: every flag's value under its ``dest``) and the non-finite steps met.
A resume restores all of it and the RNG states.

Exact resume: the iteration's data are a function of the samples consumed; the model's
``state_dict`` holds every linear's quantization state (SR call counters, amax histories); RNG
states are restored; nothing else is random. So on CPU a resumed run repeats the uninterrupted run
bit for bit (stochastic rounding included). Evaluation draws Fprop calls from the same quantization
streams, so it must happen at the same iterations in both runs (it does: it depends only on the
iteration number).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from kernels.probe import last_paths
from precision.schedule import PrecisionSchedule
from pretrain.arguments import ConfigError
from pretrain.checkpointing import (
    CheckpointError,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    this_rank_file,
)
from pretrain.config import SHAPE_FLAGS, RunConfig, flag_name
from pretrain.dist_checkpoint import load_dist_state, save_dist_checkpoint
from pretrain.pretrained import PretrainedError, load_pretrained_weights, read_pretrained
from pretrain.runtime import rank0_print


@dataclass
class Progress:
    """Where a run is: iterations done and samples consumed (saved, and restored by a resume)."""

    iteration: int = 0
    consumed_samples: int = 0


class Checkpointer:
    """Saves and loads a run's state; ``last_saved`` / ``last_checkpoint``: the iteration and
    directory of the last checkpoint written or loaded."""

    def __init__(self, run: RunConfig, model: torch.nn.Module, engine, lr_schedule, phases, progress: Progress, *,
                 model_config, tokenizer_model: str):
        self.run, self.cfg = run, run.checkpoint
        self.model, self.engine, self.lr_schedule, self.phases = model, engine, lr_schedule, phases
        self.progress, self.model_config, self.tokenizer_model = progress, model_config, tokenizer_model
        self.last_saved: int | None = None
        self.last_checkpoint: str | None = None  # the last good one, should the run diverge

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a ``--save-interval`` step (with ``--save``)."""
        return bool(self.cfg.save and self.cfg.save_interval) and step % self.cfg.save_interval == 0

    def save(self, step: int, last_step: bool = False) -> str | None:
        """Save the state after ``step`` if it is a ``--save-interval`` step, or, with ``last_step``
        (the end or a stop), unless it is saved already; with ``--save`` only. Returns the path."""
        if not self.cfg.save or (self.last_saved == step if last_step else not self.should_save(step)):
            return None
        return self._write()

    def _write(self) -> str:
        t0 = time.perf_counter()
        iteration = self.progress.iteration
        legacy = self.cfg.ckpt_format != "torch_dist"
        state = {
            "model": self.engine.model_state_dict() if legacy else None,  # FP32 mains with --bf16 (torch engine)
            "optimizer": self.engine.optimizer_state_dict() if legacy else None,
            "opt_param_scheduler": self.lr_schedule.state_dict(),
            "consumed_train_samples": self.progress.consumed_samples,
            "precision_plan": self.phases.plan.to_dict(),  # the plan in force (its phase's)
            "precision_schedule": self.phases.schedule.to_dict(),
            "precision_phase": self.phases.phase,  # the phase that trained the last iteration
            "model_config": dataclasses.asdict(self.model_config),
            "tokenizer_model": self.tokenizer_model,
            "args": self.run.to_dict(),
            "nonfinite_steps": self.engine.nonfinite.count,
            "gemm_paths": last_paths(),  # which path each format's GEMMs took here, probe refusals included
        }
        if self.cfg.ckpt_format == "torch_dist":  # model and optimizer as megatron's sharded state dicts
            del state["model"], state["optimizer"]
            path = save_dist_checkpoint(self.cfg.save, iteration, state, self.model, self.engine,
                                        retain=self.cfg.save_retain)
        else:
            path = save_checkpoint(self.cfg.save, iteration, state, write_beside=self.engine.save_extra,
                                   retain=self.cfg.save_retain)
        rank0_print(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f}s)")
        self.last_saved, self.last_checkpoint = iteration, path
        return path

    def load_pretrained(self) -> None:
        """``--pretrained-checkpoint`` (``--load`` holds no checkpoint yet): initial model weights."""
        t0 = time.perf_counter()
        try:
            pre = read_pretrained(self.cfg.pretrained_checkpoint)
            with self.engine.full_precision_weights():  # --bf16: the FP32 mains get the file's FP32 values
                load_pretrained_weights(self.model, pre, self.run.parallel.tensor_model_parallel_size)
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
        try:
            if "precision_schedule" in ckpt:
                theirs = PrecisionSchedule.from_dict(ckpt["precision_schedule"])
            else:  # saved before schedules: --precision with --qat-warmup-iters
                theirs = PrecisionSchedule.qat_warmup(int(saved_args.get("qat_warmup_iters") or 0),
                                                      saved_args.get("precision") or "bf16")
        except (ValueError, TypeError, KeyError):
            rank0_print(f"note: {ckpt['path']} holds no readable precision schedule; following this run's "
                        f"({self.phases.schedule})")
            return False
        ours = self.phases.schedule
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
        c, run, engine, pos = self.cfg, self.run, self.engine, self.progress
        # --finetune takes model weights only, so a checkpoint of another TP size is resharded
        # (a torch_dist checkpoint loads at any TP size, training state included)
        ckpt = load_checkpoint(c.load, run.parallel.tensor_model_parallel_size, reshard_model=c.finetune,
                               iteration=c.ckpt_step, model_entry=False)
        if ckpt is None:
            rank0_print(
                f"--load {c.load}: no checkpoint yet ({os.path.basename(c.load)}/latest_checkpointed_"
                f"iteration.txt missing): starting "
                + ("from --pretrained-checkpoint" if c.pretrained_checkpoint else "from scratch")
            )
            return False
        saved = ckpt.get("args", {})
        for key in SHAPE_FLAGS:
            ours = getattr(run.model, key)
            if key in saved and saved[key] != ours:
                raise CheckpointError(f"--load: {ckpt['path']} has {flag_name(key)} {saved[key]}, this run {ours}")
        load_optim = not (c.finetune or c.no_load_optim)
        if load_optim and engine.name == "megatron" and bool(saved.get("bf16", False)) != bool(run.memory.bf16):
            raise CheckpointError(  # megatron's FP32 and mixed-precision optimizers hold different states
                f"--load: {ckpt['path']} was saved with{'' if saved.get('bf16') else 'out'} --bf16 on the megatron "
                f"engine; resume with the same setting (or load its weights with --finetune or --no-load-optim)"
            )
        dist = ckpt.get("checkpoint_format") == "torch_dist"
        if dist:  # model (and optimizer, RNG) through megatron-core's dist_checkpointing.load
            ckpt["rng_state"] = load_dist_state(ckpt, self.model, engine, optimizer=load_optim,
                                                rng=not (c.finetune or c.no_load_rng))["rng_state"]
        else:
            try:
                self.model.load_state_dict(ckpt["model"], strict=True)
            except RuntimeError as e:
                raise CheckpointError(
                    f"--load: {ckpt['path']} does not fit this model: {' '.join(str(e).split())[:300]}"
                ) from None
            engine.weights_loaded(ckpt["model"])
        saved_iter = int(ckpt["iteration"]) if ckpt["iteration"] != "release" else 0
        same_schedule = c.finetune or self._check_saved_schedule(ckpt, saved, saved_iter)
        # the plan that trained the checkpoint's last iteration, in this run's schedule
        phases = self.phases
        ours = phases.plan if c.finetune or saved_iter == 0 else phases.plans.stage[phases.schedule.index_at(saved_iter - 1)]
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
        if c.finetune:
            rank0_print(f"--finetune: loaded model weights of {ckpt['path']}; starting at iteration 0")
            return True
        if load_optim and not dist:
            engine.load_optimizer(ckpt["optimizer"], os.path.dirname(this_rank_file(ckpt["path"])))
        elif not load_optim:
            rank0_print(f"--no-load-optim: the optimizer state of {ckpt['path']} was not loaded (fresh Adam moments)")
        self.lr_schedule.load_state_dict(ckpt["opt_param_scheduler"])
        for note in self.lr_schedule.load_notes:  # a schedule value the flags changed (or kept from --load)
            rank0_print(f"note: --load {ckpt['path']}: {note}")
        pos.iteration = int(ckpt["iteration"]) if ckpt["iteration"] != "release" else 0
        pos.consumed_samples = int(
            ckpt.get("consumed_train_samples", pos.iteration * run.training.global_batch_size)
        )
        if c.no_load_rng:
            rank0_print("--no-load-rng: RNG states not restored")
        elif not restore_rng_state(ckpt):
            rank0_print("note: the parallel layout differs from the checkpoint's (data-parallel size, or tensor/"
                        "pipeline size of a torch_dist checkpoint): RNG states not restored")
        self.last_saved, self.last_checkpoint = pos.iteration, ckpt["path"]
        engine.nonfinite.count = int(ckpt.get("nonfinite_steps", 0))
        rank0_print(
            f"resumed from {ckpt['path']}: iteration {pos.iteration}, "
            f"{pos.consumed_samples} samples consumed"
        )
        return True


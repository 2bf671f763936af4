"""The checkpointer: ``--save`` / ``--load`` / ``--finetune`` / ``--pretrained-checkpoint`` of a
training run, and the ``--save-interval`` cadence (:meth:`Checkpointer.maybe_save`).

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

from pretrain.arguments import ConfigError
from pretrain.config import SHAPE_FLAGS, flag_name
from pretrain.runtime import rank0_print


class Checkpointer:
    """Saves and loads the state of ``trainer`` (``pretrain.train.Trainer``); ``last_saved`` /
    ``last_checkpoint``: the iteration and directory of the last checkpoint written or loaded."""

    def __init__(self, trainer, ckpt):
        self.t, self.cfg = trainer, ckpt  # ckpt: the run's pretrain.config.CheckpointConfig
        self.last_saved: int | None = None
        self.last_checkpoint: str | None = None  # the last good one, should the run diverge

    def due(self, step: int) -> bool:
        return bool(self.cfg.save and self.cfg.save_interval) and step % self.cfg.save_interval == 0

    def maybe_save(self, step: int) -> None:
        """At a ``--save-interval``: save."""
        if self.due(step):
            self.save()

    def save_if_new(self) -> None:
        """At the end or a stop: save unless the last iteration is saved already (with ``--save``)."""
        if self.cfg.save and self.last_saved != self.t.iteration:
            self.save()

    def save(self) -> str:
        from kernels.probe import last_paths
        from pretrain.checkpointing import save_checkpoint

        t = self.t
        t0 = time.perf_counter()
        state = {
            "model": t.engine.model_state_dict(),  # FP32 main weights with --bf16 (torch engine)
            "optimizer": t.engine.optimizer_state_dict(),
            "opt_param_scheduler": t.schedule.state_dict(),
            "consumed_train_samples": t.consumed_samples,
            "precision_plan": t.plan.to_dict(),  # the plan in force (its phase's)
            "precision_schedule": t.precision_schedule.to_dict(),
            "precision_phase": t.phases.phase,  # the phase that trained the last iteration
            "model_config": dataclasses.asdict(t.model_config),
            "tokenizer_model": t.tokenizer_model,
            "args": t.run.to_dict(),
            "nonfinite_steps": t.nonfinite_steps,
            "gemm_paths": last_paths(),  # which path each format's GEMMs took here, probe refusals included
        }
        path = save_checkpoint(self.cfg.save, t.iteration, state, write_beside=t.engine.save_extra,
                               retain=self.cfg.save_retain)
        rank0_print(f"saved checkpoint {path} ({time.perf_counter() - t0:.1f}s)")
        self.last_saved, self.last_checkpoint = t.iteration, path
        return path

    def load_pretrained(self) -> None:
        """``--pretrained-checkpoint`` (``--load`` holds no checkpoint yet): initial model weights."""
        from pretrain.pretrained import PretrainedError, load_pretrained_weights, read_pretrained

        t = self.t
        t0 = time.perf_counter()
        try:
            pre = read_pretrained(self.cfg.pretrained_checkpoint)
            with t.engine.full_precision_weights():  # --bf16: the FP32 mains get the file's FP32 values
                load_pretrained_weights(t.model, pre, t.run.parallel.tensor_model_parallel_size)
                t.engine.weights_loaded()
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
                        f"({self.t.precision_schedule})")
            return False
        ours = self.t.precision_schedule
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

        t, c = self.t, self.cfg
        # --finetune takes model weights only, so a checkpoint of another TP size is resharded
        ckpt = load_checkpoint(c.load, t.run.parallel.tensor_model_parallel_size, reshard_model=c.finetune,
                               iteration=c.ckpt_step)
        if ckpt is None:
            rank0_print(
                f"--load {c.load}: no checkpoint yet ({os.path.basename(c.load)}/latest_checkpointed_"
                f"iteration.txt missing): starting "
                + ("from --pretrained-checkpoint" if c.pretrained_checkpoint else "from scratch")
            )
            return False
        saved = ckpt.get("args", {})
        for key in SHAPE_FLAGS:
            ours = getattr(t.run.model, key)
            if key in saved and saved[key] != ours:
                raise CheckpointError(f"--load: {ckpt['path']} has {flag_name(key)} {saved[key]}, this run {ours}")
        try:
            t.model.load_state_dict(ckpt["model"], strict=True)
        except RuntimeError as e:
            raise CheckpointError(
                f"--load: {ckpt['path']} does not fit this model: {' '.join(str(e).split())[:300]}"
            ) from None
        t.engine.weights_loaded(ckpt["model"])
        saved_iter = int(ckpt["iteration"]) if ckpt["iteration"] != "release" else 0
        same_schedule = c.finetune or self._check_saved_schedule(ckpt, saved, saved_iter)
        # the plan that trained the checkpoint's last iteration, in this run's schedule
        ours = t.plan if c.finetune or saved_iter == 0 else t.plans.stage[t.precision_schedule.index_at(saved_iter - 1)]
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
        if t.engine.name == "megatron" and bool(saved.get("bf16", False)) != bool(t.run.memory.bf16):
            raise CheckpointError(  # megatron's FP32 and mixed-precision optimizers hold different states
                f"--load: {ckpt['path']} was saved with{'' if saved.get('bf16') else 'out'} --bf16 on the megatron "
                f"engine; resume with the same setting (or load its weights with --finetune)"
            )
        t.engine.load_optimizer(ckpt["optimizer"], os.path.dirname(this_rank_file(ckpt["path"])))
        t.schedule.load_state_dict(ckpt["opt_param_scheduler"])
        for note in t.schedule.load_notes:  # a schedule value the flags changed (or kept from --load)
            rank0_print(f"note: --load {ckpt['path']}: {note}")
        t.iteration = int(ckpt["iteration"]) if ckpt["iteration"] != "release" else 0
        t.consumed_samples = int(
            ckpt.get("consumed_train_samples", t.iteration * t.run.training.global_batch_size)
        )
        if not restore_rng_state(ckpt):
            rank0_print("note: data-parallel size differs from the checkpoint's: RNG states not restored")
        self.last_saved, self.last_checkpoint = t.iteration, ckpt["path"]
        t.nonfinite_steps = int(ckpt.get("nonfinite_steps", 0))
        rank0_print(
            f"resumed from {ckpt['path']}: iteration {t.iteration}, "
            f"{t.consumed_samples} samples consumed"
        )
        return True


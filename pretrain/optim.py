"""Optimizer, learning-rate schedule and gradient clipping, as Megatron-LM does them.

* AdamW with two parameter groups: weight decay on matrices, none on biases and norm weights
  (Megatron's default ``no_weight_decay_cond``: 1-D parameters and ``*.bias``).
* The learning-rate (and weight-decay) schedule is megatron-core's ``OptimizerParamScheduler``
  (:class:`LRSchedule` is it, plus a return value and old-checkpoint keys), configured from
  Megatron-LM's flags by :class:`LRScheduleConfig`: linear warm-up from ``--lr-warmup-init`` to
  ``--lr`` over ``--lr-warmup-iters`` (or ``--lr-warmup-fraction`` of ``--lr-decay-iters``), then
  ``--lr-decay-style`` (cosine / linear / constant / inverse-square-root / WSD) down to ``--min-lr``
  at ``--lr-decay-iters``, ``--min-lr`` after. WSD holds ``--lr`` until the last
  ``--lr-wsd-decay-iters`` of ``--lr-decay-iters`` and anneals those by ``--lr-wsd-decay-style``.
  The scheduler counts optimizer steps (one per iteration; Megatron-LM counts samples, the same
  schedule in other units) and :meth:`LRSchedule.step` is called *before* the optimizer steps, so
  step 1 of a 10-step warm-up uses ``lr / 10`` (Megatron-LM's first step uses ``--lr-warmup-init``).
* ``MainParams`` (``--bf16`` on the torch engine): FP32 main copies of the BF16 parameters. Each
  BF16 gradient is added into its main's FP32 ``grad`` as soon as backward produces it (a
  post-accumulate-grad hook; the BF16 ``grad`` is then dropped), so gradients accumulate over
  micro-batches in FP32; AdamW, clipping and weight decay act on the mains, and after each step
  the BF16 parameters are the mains rounded to nearest. Checkpoints hold the mains
  (``state_dict_into``), so a resumed run continues from the FP32 values, bit for bit.
* ``clip_grad_norm``: the global L2 norm over all parameters of the *whole* model, summed over
  tensor-parallel ranks with each TP-sharded parameter counted once per shard and each replicated
  parameter once (on TP rank 0 only, megatron's ``param_is_not_tensor_parallel_duplicate``). Data
  parallel ranks hold identical, already averaged gradients, so they need no reduction.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import (
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
)

from pretrain.config import TrainingConfig


class MainParams:
    """FP32 main copies of a (BF16) model's trainable parameters; see the module docstring.

        main = MainParams(model)            # before the first backward
        ... loss.backward() ...              # main.grad (FP32) accumulates, p.grad stays None
        optimizer.step()                     # an optimizer over main.named_parameters()
        main.copy_to_model()                 # p = bf16(main), round to nearest even
    """

    def __init__(self, model: torch.nn.Module):
        self.model_params: list[torch.nn.Parameter] = []
        self.named: list[tuple[str, torch.nn.Parameter]] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            main = torch.nn.Parameter(p.detach().float().clone())
            copy_tensor_model_parallel_attributes(main, p)
            main.sequence_parallel = getattr(p, "sequence_parallel", False)
            main.allreduce = getattr(p, "allreduce", True)  # False: an expert-parallel expert's (EP > 1)
            p.register_post_accumulate_grad_hook(self._accumulate_into(main))
            self.model_params.append(p)
            self.named.append((name, main))

    @staticmethod
    def _accumulate_into(main: torch.nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            if main.grad is None:
                main.grad = p.grad.float()
            else:
                main.grad.add_(p.grad)
            p.grad = None

        return hook

    def named_parameters(self):
        return iter(self.named)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [m for _, m in self.named]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, (_, main) in zip(self.model_params, self.named, strict=True):
            p.copy_(main)

    @torch.no_grad()
    def load(self, state: dict | None = None) -> None:
        """Mains from ``state`` (a model ``state_dict``, FP32 in our checkpoints) where it has the
        parameter, else from the model's current values; then the model from the mains."""
        for p, (name, main) in zip(self.model_params, self.named, strict=True):
            main.copy_(state[name] if state is not None and name in state else p)
        self.copy_to_model()

    def state_dict_into(self, state: dict) -> dict:
        """``state`` (the model's ``state_dict``) with every parameter replaced by its FP32 main."""
        for name, main in self.named:
            if name in state:
                state[name] = main.detach().clone()
        return state


def build_optimizer(model: torch.nn.Module, training: TrainingConfig, main: MainParams | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters (or their FP32 mains), weight decay on matrices only; lr is
    set per step. ``training``: the run's ``pretrain.config.TrainingConfig``."""
    t = training
    decay, no_decay = [], []
    for name, p in (main or model).named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},  # the schedule's weight decay x wd_mult
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


# old (pre-megatron-core) checkpoint key -> OptimizerParamScheduler key
_OLD_SCHEDULE_KEYS = {"warmup_iters": "lr_warmup_steps", "decay_iters": "lr_decay_steps", "decay_style": "lr_decay_style"}


@dataclass(frozen=True)
class LRScheduleConfig:
    """The lr / weight-decay schedule of a run, in optimizer steps (Megatron-LM's flags, resolved)."""

    max_lr: float
    """``--lr``: the peak, reached at the end of the warm-up."""
    min_lr: float
    """``--min-lr``: the floor the decay reaches at ``decay_iters`` and keeps after."""
    warmup_iters: float
    """``--lr-warmup-iters``, or ``--lr-warmup-fraction`` x ``--lr-decay-iters`` (may be fractional)."""
    decay_iters: int
    """``--lr-decay-iters`` (default ``--train-iters``): the step at which the decay reaches ``min_lr``."""
    decay_style: str = "cosine"
    """``--lr-decay-style``, one of :data:`LR_DECAY_STYLES`."""
    init_lr: float = 0.0
    """``--lr-warmup-init``: the warm-up starts here (at step 0)."""
    wsd_decay_iters: int | None = None
    """``--lr-wsd-decay-iters``: WSD's annealing length, the last steps before ``decay_iters``."""
    wsd_decay_style: str = "exponential"
    """``--lr-wsd-decay-style``, one of :data:`LR_WSD_DECAY_STYLES`."""
    start_wd: float = 0.0
    """``--start-weight-decay`` (``--weight-decay`` with the constant style)."""
    end_wd: float = 0.0
    """``--end-weight-decay`` (``--weight-decay`` with the constant style)."""
    wd_incr_iters: int = 1
    """Steps over which weight decay goes from ``start_wd`` to ``end_wd`` (``--train-iters``)."""
    wd_incr_style: str = "constant"
    """``--weight-decay-incr-style``, one of :data:`WD_INCR_STYLES`."""
    use_checkpoint: bool = False
    """``--use-checkpoint-opt_param-scheduler``: a resumed run takes the checkpoint's schedule values
    (peak and floor lr, warm-up and decay lengths, decay style, weight decay); by default (and with
    ``--override-opt_param-scheduler``) this run's flags win and a note names what changed."""

    @classmethod
    def from_training(cls, training: TrainingConfig) -> LRScheduleConfig:
        """The schedule of the run's validated ``pretrain.config.TrainingConfig``."""
        t = training
        fraction = t.lr_warmup_fraction
        warmup = fraction * t.lr_decay_iters if fraction is not None else t.lr_warmup_iters
        incr = t.weight_decay_incr_style
        start_wd = t.weight_decay if incr == "constant" else t.start_weight_decay
        end_wd = t.weight_decay if incr == "constant" else t.end_weight_decay
        return cls(
            max_lr=t.lr, min_lr=t.min_lr, warmup_iters=warmup, decay_iters=t.lr_decay_iters,
            decay_style=t.lr_decay_style, init_lr=t.lr_warmup_init,
            wsd_decay_iters=t.lr_wsd_decay_iters, wsd_decay_style=t.lr_wsd_decay_style,
            start_wd=start_wd, end_wd=end_wd, wd_incr_iters=max(1, t.train_iters), wd_incr_style=incr,
            use_checkpoint=bool(t.use_checkpoint_opt_param_scheduler),
        )  # fmt: skip



class LRSchedule(OptimizerParamScheduler):
    """megatron-core's ``OptimizerParamScheduler`` counting one step per iteration.

        schedule = LRSchedule.from_training(optimizer, run.training)
        lr = schedule.step()          # before optimizer.step(): sets every group's lr and weight decay

    Weight decay is ``schedule weight decay x group["wd_mult"]`` (megatron's convention;
    :func:`build_optimizer` gives matrices 1 and biases / norms 0). Without ``start_wd`` each group
    keeps the weight decay it was built with. ``load_state_dict`` also reads the state this project's
    own schedule saved before megatron-core's (``warmup_iters`` / ``decay_iters`` / ``decay_style``)."""

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_iters: float,
        decay_iters: int,
        decay_style: str,
        init_lr: float = 0.0,
        wsd_decay_iters: int | None = None,
        wsd_decay_style: str = "exponential",
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_iters: int = 1,
        wd_incr_style: str = "constant",
        use_checkpoint: bool = False,
    ):
        if start_wd is None:  # each group keeps its own (constant) weight decay
            for group in optimizer.param_groups:
                group.setdefault("start_wd", group["weight_decay"])
                group.setdefault("end_wd", group["weight_decay"])
            start_wd = end_wd = 0.0
        self.load_notes: list[str] = []  # what a resume changed (``load_state_dict``), for the log
        # a loaded optimizer state replaces its groups' keys: one saved before these existed lacks them
        self._group_keys = [{k: g[k] for k in ("wd_mult", "start_wd", "end_wd") if k in g}
                            for g in optimizer.param_groups]
        # megatron-core asserts warm-up < decay; a warm-up as long as the decay (a run that only warms
        # up, as smoke tests do) is well defined by its get_lr all the same: warm-up, then min_lr
        whole = warmup_iters == decay_iters
        super().__init__(
            optimizer, init_lr=init_lr, max_lr=max_lr, min_lr=min_lr,
            lr_warmup_steps=warmup_iters - 1 if whole else warmup_iters,
            lr_decay_steps=decay_iters, lr_decay_style=decay_style, start_wd=start_wd,
            end_wd=start_wd if end_wd is None else end_wd, wd_incr_steps=wd_incr_iters,
            wd_incr_style=wd_incr_style, use_checkpoint_opt_param_scheduler=use_checkpoint,
            override_opt_param_scheduler=not use_checkpoint, wsd_decay_steps=wsd_decay_iters,
            lr_wsd_decay_style=wsd_decay_style,
        )  # fmt: skip
        if whole:
            self.lr_warmup_steps = warmup_iters
            super().step(0)

    @classmethod
    def from_config(cls, optimizer, cfg: LRScheduleConfig) -> LRSchedule:
        return cls(
            optimizer, max_lr=cfg.max_lr, min_lr=cfg.min_lr, warmup_iters=cfg.warmup_iters,
            decay_iters=cfg.decay_iters, decay_style=cfg.decay_style, init_lr=cfg.init_lr,
            wsd_decay_iters=cfg.wsd_decay_iters, wsd_decay_style=cfg.wsd_decay_style, start_wd=cfg.start_wd,
            end_wd=cfg.end_wd, wd_incr_iters=cfg.wd_incr_iters, wd_incr_style=cfg.wd_incr_style,
            use_checkpoint=cfg.use_checkpoint,
        )  # fmt: skip

    @classmethod
    def from_training(cls, optimizer, training: TrainingConfig) -> LRSchedule:
        """The schedule of the run's ``pretrain.config.TrainingConfig``."""
        return cls.from_config(optimizer, LRScheduleConfig.from_training(training))

    def lr_at(self, iteration: int) -> float:
        """Learning rate of (1-based) ``iteration``, without moving the schedule."""
        saved, self.num_steps = self.num_steps, iteration
        try:
            return self.get_lr({})
        finally:
            self.num_steps = saved

    def step(self, increment: int = 1) -> float:
        """Advance ``increment`` steps, set every group's lr and weight decay; returns the lr."""
        for group, keys in zip(self.optimizer.param_groups, self._group_keys, strict=False):
            for key, value in keys.items():
                group.setdefault(key, value)
        super().step(increment)
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        """megatron-core's keys, plus WSD's (which megatron-core does not save) and the warm-up start."""
        sd = super().state_dict()
        sd.update(wsd_decay_steps=self.wsd_decay_steps, lr_wsd_decay_style=self.lr_wsd_decay_style,
                  init_lr=self.init_lr)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the saved step count. The schedule's values come from this run's flags (a note in
        ``load_notes`` for each that differs), or from the checkpoint with ``use_checkpoint``."""
        sd = {_OLD_SCHEDULE_KEYS.get(k, k): v for k, v in state_dict.items()}
        ours = self.state_dict()
        names = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                 "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                 "wsd_decay_steps": "--lr-wsd-decay-iters", "lr_wsd_decay_style": "--lr-wsd-decay-style",
                 "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
                 "wd_incr_style": "--weight-decay-incr-style"}  # fmt: skip
        keep = "the checkpoint's" if self.use_checkpoint_opt_param_scheduler else "this run's"
        self.load_notes = [
            f"{flag}: the checkpoint's lr schedule has {sd[key]}, this run {ours[key]}; using {keep}"
            for key, flag in names.items()
            if key in sd and sd[key] != ours[key]
        ]
        if self.use_checkpoint_opt_param_scheduler:
            for key, attr in (("wsd_decay_steps", "wsd_decay_steps"), ("lr_wsd_decay_style", "lr_wsd_decay_style"),
                              ("init_lr", "init_lr")):
                if key in sd:
                    setattr(self, attr, sd[key])
        self.num_steps = 0
        with _quiet(logging.getLogger(OptimizerParamScheduler.__module__)):
            super().load_state_dict(sd)  # megatron-core's checks and values; steps to sd["num_steps"]


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """Silence ``logger``'s INFO lines (megatron-core logs every value it loads) for a block."""
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def grad_norm(parameters, tp_group=None, expert_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (float32 scalar tensor), TP shards and replicas counted once.

    ``expert_group`` (expert parallelism, ``pretrain.expert_parallel.expert_norm_group``): the expert
    parameters' squares are summed over it (expert TP x EP: every rank holds other experts), the dense
    ones over ``tp_group``, as megatron's ``clip_grad_norm_fp32`` does."""
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    params = [p for p in parameters if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        target = expert_sq if expert_group is not None and not getattr(p, "allreduce", True) else sq
        target += p.grad.detach().float().square().sum()
    if tp_group is not None and tp_group.size() > 1:
        torch.distributed.all_reduce(sq, group=tp_group)
    if expert_group is not None:
        if expert_group.size() > 1:
            torch.distributed.all_reduce(expert_sq, group=expert_group)
        sq += expert_sq
    return sq.sqrt()


def clip_grad_norm(parameters, max_norm: float, tp_group=None, expert_group=None) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm`` (0: no clipping); returns the
    norm before clipping, a 0-d float32 tensor on the gradients' device.

    Nothing is read to the host: the coefficient ``min(max_norm / (norm + 1e-6), 1)`` is computed
    on the device in float64 from the FP32 norm and rounded to FP32 -- the numbers a Python-float
    coefficient gives (a factor of exactly 1 leaves a gradient unchanged). ``expert_group``: :func:`grad_norm`."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = grad_norm(parameters, tp_group, expert_group)
    if max_norm > 0:
        numerator = torch.full((), max_norm, dtype=torch.float64, device=norm.device)  # a fill, not a copy
        coeff = torch.div(numerator, norm.double() + 1e-6)  # a true division (a / t would be a * (1 / t))
        coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff)).float()
        for p in parameters:
            p.grad.detach().mul_(coeff)
    return norm

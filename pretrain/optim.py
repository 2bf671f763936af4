"""Optimizer, learning-rate schedule and gradient clipping, as Megatron-LM does them.

* AdamW with two parameter groups: weight decay on matrices, none on biases and norm weights
  (Megatron's default ``no_weight_decay_cond``: 1-D parameters and ``*.bias``).
* ``lr_at(iteration)``: linear warm-up from 0 to ``--lr`` over ``--lr-warmup-iters``, then
  ``--lr-decay-style`` (cosine / linear / constant) down to ``--min-lr`` at ``--lr-decay-iters``,
  constant after. ``iteration`` is the 1-based number of the step being taken, so step 1 of a
  10-step warm-up uses ``lr / 10`` (Megatron's first warm-up step uses 0). The schedule is a pure
  function of the iteration; :class:`LRSchedule` keeps the step count for checkpoints.
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

import math

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
)


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


def build_optimizer(model: torch.nn.Module, args, main: MainParams | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters (or their FP32 mains), weight decay on matrices only; lr is
    set per step."""
    decay, no_decay = [], []
    for name, p in (main or model).named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)


class LRSchedule:
    """Warm-up then decay; ``step()`` sets the optimizer's lr for the next iteration and returns it."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str,
    ):
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup_iters, self.decay_iters, self.decay_style = warmup_iters, decay_iters, decay_style
        self.num_steps = 0  # optimizer steps taken

    @classmethod
    def from_args(cls, optimizer, args) -> LRSchedule:
        return cls(
            optimizer,
            max_lr=args.lr,
            min_lr=args.min_lr,
            warmup_iters=args.lr_warmup_iters,
            decay_iters=args.lr_decay_iters,
            decay_style=args.lr_decay_style,
        )

    def lr_at(self, iteration: int) -> float:
        """Learning rate of (1-based) ``iteration``."""
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        ratio = (iteration - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if self.decay_style == "cosine" else 1.0 - ratio
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self) -> float:
        """Set the lr of the next optimizer step; call once per iteration before ``optimizer.step()``."""
        self.num_steps += 1
        lr = self.lr_at(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore the step count; the schedule's shape comes from the current flags (as in Megatron-LM)."""
        self.num_steps = int(sd["num_steps"])


def grad_norm(parameters, tp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (float32 scalar tensor), TP shards and replicas counted once."""
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    grads = [p.grad for p in parameters if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.detach().float().square().sum()
    if tp_group is not None and tp_group.size() > 1:
        torch.distributed.all_reduce(sq, group=tp_group)
    return sq.sqrt()


def clip_grad_norm(parameters, max_norm: float, tp_group=None) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm`` (0: no clipping); returns the
    norm before clipping, a 0-d float32 tensor on the gradients' device.

    Nothing is read to the host: the coefficient ``min(max_norm / (norm + 1e-6), 1)`` is computed
    on the device in float64 from the FP32 norm and rounded to FP32 -- the numbers a Python-float
    coefficient gives (a factor of exactly 1 leaves a gradient unchanged)."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = grad_norm(parameters, tp_group)
    if max_norm > 0:
        numerator = torch.full((), max_norm, dtype=torch.float64, device=norm.device)  # a fill, not a copy
        coeff = torch.div(numerator, norm.double() + 1e-6)  # a true division (a / t would be a * (1 / t))
        coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff)).float()
        for p in parameters:
            p.grad.detach().mul_(coeff)
    return norm

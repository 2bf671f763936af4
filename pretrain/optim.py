"""Optimizer, learning-rate schedule and gradient clipping, as Megatron-LM does them.

* AdamW with two parameter groups: weight decay on matrices, none on biases and norm weights
  (Megatron's default ``no_weight_decay_cond``: 1-D parameters and ``*.bias``).
* ``lr_at(iteration)``: linear warm-up from 0 to ``--lr`` over ``--lr-warmup-iters``, then
  ``--lr-decay-style`` (cosine / linear / constant) down to ``--min-lr`` at ``--lr-decay-iters``,
  constant after. ``iteration`` is the 1-based number of the step being taken, so step 1 of a
  10-step warm-up uses ``lr / 10`` (Megatron's first warm-up step uses 0). The schedule is a pure
  function of the iteration; :class:`LRSchedule` keeps the step count for checkpoints.
* ``clip_grad_norm``: the global L2 norm over all parameters of the *whole* model, summed over
  tensor-parallel ranks with each TP-sharded parameter counted once per shard and each replicated
  parameter once (on TP rank 0 only, megatron's ``param_is_not_tensor_parallel_duplicate``). Data
  parallel ranks hold identical, already averaged gradients, so they need no reduction.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, weight decay on matrices only; lr is set per step."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
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


def clip_grad_norm(parameters, max_norm: float, tp_group=None) -> float:
    """Scale all gradients so their global norm is at most ``max_norm`` (0: no clipping); returns the norm."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = grad_norm(parameters, tp_group)
    total = norm.item()
    if max_norm > 0:
        coeff = max_norm / (total + 1e-6)
        if coeff < 1.0:
            for p in parameters:
                p.grad.detach().mul_(coeff)
    return total

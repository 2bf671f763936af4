"""Expert parallelism (EP) in the training loop: the layout, the gradient reduction, the norm.

Megatron's layout (``parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)``): the
routed experts of every MoE layer are split over EP ranks taken from the data-parallel ranks; the
experts keep the dense layers' tensor parallelism (expert TP = TP). For a world of W ranks, TP and PP:

    dense parameters   replicated over DP = W / (TP x PP) ranks        gradients summed over DP
    expert parameters  replicated over expert-DP = DP / EP ranks       gradients summed over expert-DP

Each EP rank runs its experts on the tokens of all EP ranks (the all-gather dispatcher,
``model.moe``), so an expert's gradient on its owner already holds every EP rank's tokens: summed over
the expert-data-parallel group it is the gradient over the whole global batch, like a dense one summed
over DP. Megatron marks these parameters ``allreduce=False`` (``tensor_parallel.layers``,
``moe.experts``); megatron-core's DDP reduces them over the expert-data-parallel group, and
:func:`reduce_grads` does the same for the torch engine.

The gradient norm: megatron's ``clip_grad_norm_fp32`` sums the dense squares over the model-parallel
group and the expert squares over the expert-tensor-model-pipeline group; :func:`expert_norm_group`
is the second group (``pretrain.optim.grad_norm``).

Sampling: EP ranks are data-parallel ranks for the dense part, so each reads its own micro-batches
(``get_data_parallel_rank``, which EP leaves unchanged).

Checkpoints: the legacy per-TP-rank files (``pretrain.checkpointing``) are written by data-parallel
rank 0 only, which holds ``num_experts / EP`` of the experts; with EP > 1 ``--save`` and ``--load``
need a sharded format (``--ckpt-format torch_dist``), refused otherwise (:func:`check_layout`).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

__all__ = ["check_layout", "ep_size", "expert_norm_group", "is_expert_param", "reduce_grads"]


class _LayoutError(ValueError):
    pass


def check_layout(run, world_size: int, error=_LayoutError) -> None:
    """One-line refusals (``error``) for ``--expert-model-parallel-size`` with this run's layout."""
    ep = run.model.expert_model_parallel_size
    if ep == 1:
        return
    tp, pp = run.parallel.tensor_model_parallel_size, run.parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    if ep < 1 or dp % ep:
        raise error(f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} (world {world_size} "
                    f"/ (--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp})): experts are split "
                    "over data-parallel ranks")
    if not run.model.num_experts:
        raise error(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model (--num-experts)")
    fmt = getattr(run.checkpoint, "ckpt_format", None)
    for flag in ("save", "load"):
        if getattr(run.checkpoint, flag) and fmt != "torch_dist":
            raise error(f"--{flag} with --expert-model-parallel-size {ep} needs --ckpt-format torch_dist: the legacy "
                        "checkpoint files hold data-parallel rank 0's experts only")


def ep_size() -> int:
    return parallel_state.get_expert_model_parallel_world_size()


def is_expert_param(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is an expert-parallel parameter (megatron's ``allreduce=False``)."""
    return not getattr(p, "allreduce", True)


def reduce_grads(params) -> None:
    """Sum each gradient in place over its replicas: dense ones over the data-parallel group, expert
    ones (EP > 1) over the expert-data-parallel group."""
    dense = parallel_state.get_data_parallel_group()
    expert = parallel_state.get_expert_data_parallel_group() if ep_size() > 1 else dense
    for p in params:
        if p.grad is None:
            continue
        group = expert if is_expert_param(p) else dense
        if group.size() > 1:
            torch.distributed.all_reduce(p.grad, group=group)


def expert_norm_group():
    """The group over which expert gradients' squared norms add up (expert TP x EP x PP), or None
    without expert parallelism (experts are then ordinary TP-sharded parameters)."""
    if ep_size() == 1:
        return None
    return parallel_state.get_expert_tensor_model_pipeline_parallel_group()

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

What a run reports covers every rank's experts: the precision plan lists every expert's GEMMs by
global expert id (:func:`every_expert` completes a rank's names; ``pretrain.trainer.plans``), and the
per-layer TensorBoard scalars (``numerics/...``, ``moe/layer_L/expert_E/...``) are gathered over the
expert-parallel group onto the reporting rank (:func:`gather_layer_scalars`).
"""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state

__all__ = ["check_layout", "ep_size", "every_expert", "expert_norm_group", "gather_layer_scalars", "is_expert_param",
           "reduce_grads"]

_EXPERT_NAME = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$")


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


def every_expert(names: list[str], num_experts: int | None) -> list[str]:
    """Plan names of a rank's linears (``model.gpt.policy_linear_names``: experts by global id) with each
    MoE layer's experts completed to all ``num_experts`` of them, in expert order, where the layer's
    first expert stood: under expert parallelism a rank holds ``num_experts / EP`` of a layer's experts,
    and a plan printed from one rank should still list every expert's GEMMs. Other names keep their
    place; without experts (or at EP=1) the names come back unchanged."""
    if not num_experts:
        return list(names)
    linears: dict[str, list[str]] = {}  # a layer's expert prefix -> its per-expert linears (fc1, fc2)
    for name in names:
        m = _EXPERT_NAME.match(name)
        if m and m.group(3) not in linears.setdefault(m.group(1), []):
            linears[m.group(1)].append(m.group(3))
    out = []
    for name in names:
        m = _EXPERT_NAME.match(name)
        if m is None:
            out.append(name)
        elif m.group(1) in linears:  # the layer's first expert linear: all of them here
            prefix, per_expert = m.group(1), linears.pop(m.group(1))
            out += [f"{prefix}{e}.{linear}" for e in range(num_experts) for linear in per_expert]
    return out


def gather_layer_scalars(scalars: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Per-layer scalars of every EP rank's experts on each rank (all ranks call this; a no-op at EP=1).

    A tag names one linear by its plan name (``numerics/decoder.layers.L.mlp.experts.local_experts.E...``)
    or one expert (``moe/layer_L/expert_E/...``), E global, so the EP ranks' experts do not collide.
    A tag that several EP ranks write -- a dense layer's, which each EP rank (a data-parallel rank)
    measures on its own micro-batch -- keeps EP rank 0's value, as without expert parallelism the
    report keeps data-parallel rank 0's."""
    if ep_size() <= 1:  # 0: no process group (a world of one outside torch.distributed)
        return scalars
    parts = [None] * ep_size()
    torch.distributed.all_gather_object(parts, scalars, group=parallel_state.get_expert_model_parallel_group())
    out: dict[str, float] = {}
    for part in parts:
        for tag, value in part:
            out.setdefault(tag, value)
    return list(out.items())

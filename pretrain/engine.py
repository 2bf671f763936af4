"""How one iteration runs: forward/backward over the micro-batches, gradient reduction, the step.

Two engines behind one interface (``--ddp-impl``):

``TorchEngine`` (``torch``; the only one on CPU)
    torch ``DistributedDataParallel`` over the data-parallel group, AdamW and clipping from
    ``pretrain.optim``, a plain loop over the micro-batches (DDP all-reduces on the last one), then
    the TP-partial gradients (sequence parallelism) summed. Pipeline parallelism: no.
    ``--bf16``: BF16 model, FP32 main parameters and gradients (``pretrain.optim.MainParams``); the
    FP32 gradients are summed over data-parallel ranks here (no torch DDP: it would reduce BF16).
    Expert parallelism (``--expert-model-parallel-size``): no torch DDP either; dense gradients are
    summed over the data-parallel group, the routed experts' over the expert-data-parallel group,
    and the norm adds the experts' squares over expert TP x EP (``pretrain.expert_parallel``).
    No host synchronisation: loss and gradient norm stay on the device (``train_step`` returns
    0-d tensors), and the step is taken whatever they are unless the engine's
    :class:`NonFinitePolicy` reads each step (then one read per step decides: with
    ``--skip-nonfinite-steps`` and ``--no-check-for-nan-in-loss-and-grad``, which need a non-finite
    step to leave the model alone).

``MegatronEngine`` (``megatron``; the default on CUDA)
    megatron-core's ``DistributedDataParallel`` (contiguous FP32 gradient buckets; with ``--bf16``
    megatron's mixed-precision optimizer keeps FP32 main parameters beside the BF16 model),
    ``get_megatron_optimizer`` (Adam with decoupled weight decay, no decay on biases and 1-D
    parameters, clipping by the global norm over the model-parallel group; with
    ``--use-distributed-optimizer`` the optimizer state is sharded over data-parallel ranks, ZeRO-1)
    and megatron's schedules from ``get_forward_backward_func``: 1F1B pipelining when
    ``--pipeline-model-parallel-size`` > 1, the no-pipelining schedule otherwise. These need CUDA
    in megatron-core 0.16.1 (their buffers, streams and token counters live on the GPU).

Both compute the same thing: the loss is the masked per-token cross entropy summed over the global
batch and divided by its token count (Megatron-LM's ``--calculate-per-token-loss``: torch DDP
averages over DP ranks and the loop rescales by DP / tokens; megatron's ``finalize_model_grads``
sums over DP and divides by the all-reduced token count), so losses and gradients do not depend on
how the batch is split into micro-batches, data-parallel ranks or pipeline stages. The learning
rate of the step is set (``LRSchedule.step``) before the optimizer steps.

Each engine returns the global loss on every rank: with pipelining only the last stage computes it,
and it is broadcast over the pipeline group so that rank 0 can log it. ``stepped`` says whether the
last step updated the parameters: when the policy reads each step the torch engine steps only when
loss and gradient norm are finite, the megatron engine always only when the loss is (a non-finite
norm behind a finite loss is found after megatron's optimizer has stepped), so a skipped non-finite
step changes nothing. Otherwise (the default loop: a non-finite step ends the run, found when the
loop next reads its steps) the torch engine steps without reading anything.
megatron-core's optimizer reads its gradient norm and found-inf flag to the host every step
(its design; not changed here).

One optimizer step, whatever computed the gradients: ``optimizer_step``
    Pretraining's ``train_step`` is ``begin_step()``, forward/backward over the micro-batches, then
    ``optimizer_step(schedule, loss=loss)``. RL calls the same two around its own losses (the
    gradients of a policy loss that the caller backpropagated)::

        engine = TorchEngine(model, run, device)  # run: pretrain.config.RunConfig
        engine.begin_step()                      # zero the gradients; snapshot what a skip restores
        loss.backward()                          # any loss whose gradients are this rank's share
        result = engine.optimizer_step(schedule) # reduce, clip, set the lr, step, end the quant step
        result.loss, result.grad_norm, result.lr, result.outcome

    ``optimizer_step`` sums the gradients over data-parallel ranks unless torch DDP already did
    (``wrap``), sums the TP-partial gradients, clips by the global norm, advances the lr schedule
    and steps the optimizer (copying the FP32 mains back with ``--bf16``); then every policy
    linear's delayed-scaling history takes this step's amax (``LayerQuantState.end_step``). The
    non-finite policy (:class:`NonFinitePolicy`: ``--check-for-nan-in-loss-and-grad``,
    ``--skip-nonfinite-steps``) decides the outcome: ``"pending"`` (nothing read to the host; the
    caller settles the device tensors later), ``"ok"``, ``"skipped"`` (the step rolled back: no
    parameter or optimizer update, the lr schedule rewound, the layers' quantization state as
    ``begin_step`` found it) or ``"diverged"``.

megatron-core 0.16.1 facts this relies on (found by running it):
  - ``config.calculate_per_token_loss`` must be set before megatron's DDP is built (DDP fixes its
    gradient scaling then); ``finalize_model_grads`` then divides by the all-reduced token count.
  - ``TransformerConfig`` refuses pipeline parallelism without ``pipeline_dtype``
    (``model.gpt.transformer_config`` sets it). Each stage draws only its own layers' initial
    weights, so PP=2 and PP=1 start alike only from the same loaded weights.
  - What ties DDP, the optimizer and the schedules to CUDA is mostly ``device="cuda"``
    allocations: ``tests/pretrain/_megatron_on_cpu.py`` points them at the CPU and runs this
    engine on gloo in the CPU tests. Gradient clipping and the distributed optimizer assert
    ``torch.cuda.FloatTensor`` and are tested on GPUs only (``tests/pretrain/test_megatron_engine.py``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as MegatronDDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from model.gpt import allreduce_tp_partial_grads, policy_linears
from model.moe import set_aux_loss_scale
from pretrain import expert_parallel
from pretrain.checkpointing import CheckpointError
from pretrain.config import RunConfig
from pretrain.optim import MainParams, build_optimizer, clip_grad_norm

DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"  # Megatron-LM's name, beside model_optim_rng.pt


def batch_to_device(mb: dict, device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        mb["tokens"].to(device, non_blocking=True),
        mb["labels"].to(device, non_blocking=True),
        mb["position_ids"].to(device, non_blocking=True),
        mb["loss_mask"].to(device, non_blocking=True).float(),
    )


def dp_rank_size() -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed in place over the data-parallel ranks (returned)."""
    group = parallel_state.get_data_parallel_group()
    if group.size() > 1:
        torch.distributed.all_reduce(t, group=group)
    return t


# ================================================================================================
# One optimizer step: the outcome and the non-finite rollback (both engines)
# ================================================================================================


@dataclass
class NonFinitePolicy:
    """What a non-finite loss or gradient norm does (``--check-for-nan-in-loss-and-grad``,
    ``--skip-nonfinite-steps``); ``count`` is the number met so far (saved in checkpoints)."""

    check: bool = True
    """Whether a non-finite step is an error (skipped up to ``max_skips`` times, then divergence)."""
    max_skips: int = 0
    """How many non-finite steps are skipped (rolled back) before the next one is divergence."""
    count: int = 0
    """Non-finite steps met so far: skipped ones and the one that diverged."""

    @classmethod
    def of(cls, training) -> NonFinitePolicy:
        """The policy of a ``pretrain.config.TrainingConfig``'s flags."""
        return cls(check=bool(training.check_for_nan_in_loss_and_grad), max_skips=int(training.skip_nonfinite_steps or 0))

    @property
    def reads_each_step(self) -> bool:
        """Whether each step reads its loss and norm to the host: a skip must be undone at once, and
        without the check a non-finite step must not be taken. Otherwise nothing is read until the
        caller settles the steps (outcome ``"pending"``)."""
        return bool(self.max_skips) or not self.check


@dataclass
class StepResult:
    """One optimizer step: loss and norm are 0-d device tensors while ``outcome`` is ``"pending"``,
    floats otherwise; ``lr`` is the learning rate the step used (or would have)."""

    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    lr: float
    outcome: str  # "pending", "ok", "skipped" or "diverged"

    def __iter__(self):  # (loss, grad norm, lr, outcome)
        return iter((self.loss, self.grad_norm, self.lr, self.outcome))


@dataclass
class _Rollback:
    """What a skipped step restores: every policy linear's quantization state and the groups' lr."""

    quant: list[dict] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)


class _StepMixin:
    """``begin_step`` / ``optimizer_step`` around each engine's own gradient reduction and step."""

    nonfinite: NonFinitePolicy
    _rollback: _Rollback | None = None

    def policy_linears(self) -> list[tuple[str, torch.nn.Module]]:
        """(plan name, module) of this stage's policy linears (their quantization state)."""
        if getattr(self, "_linears", None) is None:
            self._linears = policy_linears(self.model)
        return self._linears

    def begin_step(self) -> None:
        """Before the forward passes of a step: zero the gradients and, with skips allowed, note
        what a skipped step restores (the layers' quantization state changes in the forward)."""
        self._zero_grad()
        self._rollback = None
        if self.nonfinite.max_skips:
            self._rollback = _Rollback([copy.deepcopy(m.quant_state.state_dict()) for _, m in self.policy_linears()],
                                       [group["lr"] for group in self.optimizer.param_groups])

    def end_quant_step(self) -> None:
        """An optimizer step ended: every layer's delayed-scaling histories take this step's amax
        (the maximum over its micro-batches; ``precision.state``)."""
        for _, m in self.policy_linears():
            m.quant_state.end_step()

    def optimizer_step(self, schedule, loss: torch.Tensor | float | None = None) -> StepResult:
        """Reduce the gradients the caller's backward produced, clip, set the lr, step (module
        docstring); ``loss`` (global, the same on every rank) joins the norm in the finite check.
        Call :meth:`begin_step` before the step's forward passes."""
        policy = self.nonfinite
        if loss is None:
            loss = torch.zeros((), device=self.device)
        loss, norm, lr = self._reduce_and_step(schedule, loss, check_finite=policy.reads_each_step)
        self.end_quant_step()
        if not policy.reads_each_step:
            return StepResult(loss, norm, lr, "pending")
        loss, norm = float(loss), float(norm)
        if not policy.check or (math.isfinite(loss) and math.isfinite(norm)):
            return StepResult(loss, norm, lr, "ok")
        policy.count += 1
        # the megatron engine steps on a finite loss even if the norm is not: that cannot be undone
        if policy.count > policy.max_skips or self.stepped or self._rollback is None:
            return StepResult(loss, norm, lr, "diverged")
        schedule.num_steps -= 1  # no optimizer step was taken: the next step gets this lr
        for group, group_lr in zip(self.optimizer.param_groups, self._rollback.lrs, strict=True):
            group["lr"] = group_lr
        for (_, m), state in zip(self.policy_linears(), self._rollback.quant, strict=True):
            m.quant_state.load_state_dict(state)
        return StepResult(loss, norm, lr, "skipped")


# ================================================================================================
# torch DDP (CPU and GPU)
# ================================================================================================


class TorchEngine(_StepMixin):
    """torch DDP + ``pretrain.optim`` AdamW; no pipeline parallelism (see module docstring)."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, run: RunConfig, device: torch.device, nonfinite: NonFinitePolicy | None = None):
        self.run = run
        self.model, self.device = model, device
        self.main = MainParams(model) if run.memory.bf16 else None  # --bf16: FP32 mains
        self.optimizer = build_optimizer(model, run.training, self.main)
        self.ddp: torch.nn.Module = model  # wrap() replaces it when DP > 1 (FP32 only)
        self.stepped = False  # whether the last step updated the parameters
        self.nonfinite = nonfinite or NonFinitePolicy.of(run.training)

    def wrap(self) -> None:
        """torch DDP over the data-parallel group (after a checkpoint is loaded into the model); not
        with expert parallelism (its experts differ between data-parallel ranks: summed over the
        expert-data-parallel group in ``_reduce_and_step``, ``pretrain.expert_parallel``)."""
        if parallel_state.get_data_parallel_world_size() > 1 and self.main is None and expert_parallel.ep_size() == 1:
            self.ddp = TorchDDP(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=parallel_state.get_data_parallel_group(),
            )

    def _loss_sum(self, module, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, labels, position_ids, mask = batch_to_device(mb, self.device)
        per_token = module(tokens, position_ids, None, labels=labels)  # [b, s]
        return (per_token.float() * mask).sum(), mask.sum()

    def train_step(self, micro: list[dict], schedule) -> StepResult:
        """One global batch: forward/backward of each micro-batch, then :meth:`optimizer_step`."""
        # counted on the device: a blocking host-to-device copy would wait for the GPU's queue
        masks = [mb["loss_mask"].to(self.device, non_blocking=True) for mb in micro]
        tokens = dp_sum(torch.stack([m.sum() for m in masks]).sum().float())
        # torch DDP averages over data-parallel ranks: scale by dp so the result is sum / global tokens
        dp_size = parallel_state.get_data_parallel_world_size() if self.ddp is not self.model else 1
        self.begin_step()
        # MoE aux / z losses: megatron's per-micro-batch weight, averaged over DP ranks -- by DDP, or here
        # when the gradients are summed (--bf16, expert parallelism)
        summed = parallel_state.get_data_parallel_world_size() // dp_size
        set_aux_loss_scale(1 / (len(micro) * summed), self.device)
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or self.ddp is self.model else self.ddp.no_sync()
            with sync:
                s, _ = self._loss_sum(self.ddp, mb)
                (s * (dp_size / tokens)).backward()
            loss_sum += s.detach()
        return self.optimizer_step(schedule, loss=dp_sum(loss_sum) / tokens)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _reduce_and_step(self, schedule, loss, check_finite: bool):
        """(loss, norm before clipping, lr): gradients summed over DP (unless DDP did) and TP
        partials, clipped; the optimizer steps unless ``check_finite`` finds loss or norm non-finite."""
        params = self.main if self.main is not None else self.model
        if self.ddp is self.model:  # no torch DDP: sum this rank's gradients over (expert-)data-parallel ranks
            expert_parallel.reduce_grads(params.parameters())
        allreduce_tp_partial_grads(params)
        norm = clip_grad_norm(params.parameters(), self.run.training.clip_grad,
                              parallel_state.get_tensor_model_parallel_group(), expert_parallel.expert_norm_group())
        lr = schedule.step()
        self.stepped = not check_finite or bool(torch.isfinite(torch.stack([torch.as_tensor(loss, device=norm.device)
                                                                            .float(), norm])).all())
        if self.stepped:
            self.optimizer.step()
            if self.main is not None:
                self.main.copy_to_model()
        return loss, norm, lr

    @torch.no_grad()
    def eval_loss(self, micro) -> float | None:
        sums = torch.zeros(2, device=self.device)
        for mb in micro:
            s, n = self._loss_sum(self.model, mb)
            sums += torch.stack([s, n])
        dp_sum(sums)
        return (sums[0] / sums[1]).item() if sums[1] > 0 else None

    # checkpoints: the model with its FP32 mains (--bf16), a plain torch optimizer state dict
    def model_state_dict(self) -> dict:
        state = self.model.state_dict()
        return state if self.main is None else self.main.state_dict_into(state)

    def optimizer_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def save_extra(self, rank_dir: str) -> None:
        pass

    def load_optimizer(self, state: dict, rank_dir: str) -> None:
        self.optimizer.load_state_dict(state)

    def weights_loaded(self, state: dict | None = None) -> None:
        """After model weights were copied in: the FP32 mains (``--bf16``) from ``state`` (the
        checkpoint's model entry, FP32) where given, else from the model."""
        if self.main is not None:
            self.main.load(state)

    @contextlib.contextmanager
    def full_precision_weights(self):
        """Within: the model's parameters are FP32 tensors, so weights copied in keep their FP32
        bits; after: the mains take those values and the model their BF16 rounding (``--bf16``;
        nothing changes without it). For ``--pretrained-checkpoint``, whose loaders copy into the model."""
        if self.main is None:
            yield
            return
        params = self.main.model_params
        low = [p.data for p in params]
        for p, (_, main) in zip(params, self.main.named, strict=True):
            p.data = main.detach().clone()
        try:
            yield
        finally:
            loaded = [p.data for p in params]
            for p, data in zip(params, low, strict=True):
                p.data = data
            self.main.load({name: value for (name, _), value in zip(self.main.named, loaded, strict=True)})


# ================================================================================================
# megatron-core DDP, optimizer and schedules (CUDA)
# ================================================================================================


class MegatronEngine(_StepMixin):
    """megatron-core DDP + ``get_megatron_optimizer`` + ``get_forward_backward_func`` (CUDA)."""

    name = "megatron"

    def __init__(self, model: torch.nn.Module, run: RunConfig, device: torch.device, nonfinite: NonFinitePolicy | None = None):
        self.run = run
        self.model, self.device = model, device
        t = run.training
        config = model.config
        # the hooks megatron's schedules call (Megatron-LM's training.setup_model_and_optimizer)
        config.calculate_per_token_loss = True
        config.pipeline_dtype = config.params_dtype
        config.grad_scale_func = None  # FP32 master weights: no loss scaling
        self.distributed_optimizer = bool(run.parallel.use_distributed_optimizer)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer,
        )
        self.ddp = MegatronDDP(config=config, ddp_config=ddp_config, module=model)
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            params_dtype=config.params_dtype,
            bf16=config.params_dtype == torch.bfloat16,  # --bf16: FP32 main params in the optimizer
            fp16=False,
            use_distributed_optimizer=self.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        self.forward_backward = get_forward_backward_func()
        self.stepped = False  # whether the last step updated the parameters
        self.nonfinite = nonfinite or NonFinitePolicy.of(run.training)

    def wrap(self) -> None:
        pass  # wrapped at construction (megatron's optimizer needs the DDP buffers)

    # ---------------------------------------------------------------- megatron's callbacks
    def _forward_step(self, data_iterator, model):
        """Megatron-LM's ``forward_step_func``: every stage reads the micro-batch; the first
        embeds the tokens, the last turns hidden states into per-token losses."""
        tokens, labels, position_ids, mask = batch_to_device(next(data_iterator), self.device)
        output = model(tokens, position_ids, None, labels=labels)
        return output, functools.partial(self._loss_func, mask)

    @staticmethod
    def _loss_func(mask: torch.Tensor, per_token: torch.Tensor):
        """(loss sum, token count, report): megatron divides by the global token count itself."""
        loss_sum = (per_token.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}

    def _run(self, micro: list[dict], forward_only: bool) -> float | None:
        reports = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=iter(micro),
            model=[self.ddp],
            num_microbatches=len(micro),
            seq_length=self.run.model.seq_length,
            micro_batch_size=self.run.training.micro_batch_size,
            forward_only=forward_only,
        )
        sums = torch.zeros(2, device=self.device)
        if parallel_state.is_pipeline_last_stage():
            for report in reports:
                sums += report["lm loss"]
            dp_sum(sums)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(
                sums,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return (sums[0] / sums[1]).item() if sums[1] > 0 else None

    def train_step(self, micro: list[dict], schedule) -> StepResult:
        """One global batch through megatron's schedule, then :meth:`optimizer_step` (loss and norm
        are floats: megatron's optimizer reads its norm to the host)."""
        self.begin_step()
        loss = self._run(micro, forward_only=False)
        return self.optimizer_step(schedule, loss=float("nan") if loss is None else loss)

    def _zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _reduce_and_step(self, schedule, loss, check_finite: bool):
        """megatron's optimizer reduces, clips and steps; a non-finite loss takes no step."""
        lr = schedule.step()
        loss = float(loss)
        if not math.isfinite(loss):  # a non-finite loss: no step (it could be skipped)
            self.stepped = False
            return loss, float("nan"), lr
        ok, norm, _ = self.optimizer.step()
        self.stepped = bool(ok)
        return loss, float(norm if ok and norm is not None else "nan"), lr

    @torch.no_grad()
    def eval_loss(self, micro) -> float | None:
        return self._run(list(micro), forward_only=True)

    # ---------------------------------------------------------------- checkpoints
    def model_state_dict(self) -> dict:
        """The model; with ``--bf16`` its FP32 main parameters are in the optimizer's state
        (megatron's ``fp32_from_fp16_params``, or ``distrib_optim.pt``), as in Megatron-LM."""
        return self.model.state_dict()

    def optimizer_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def save_extra(self, rank_dir: str) -> None:
        """Distributed optimizer: the sharded Adam state, gathered on DP rank 0 into
        ``distrib_optim.pt`` beside ``model_optim_rng.pt`` (Megatron-LM's legacy layout); every
        data-parallel rank must call this."""
        if self.distributed_optimizer:
            os.makedirs(rank_dir, exist_ok=True)
            self.optimizer.save_parameter_state(os.path.join(rank_dir, DISTRIBUTED_OPTIMIZER_FILE))

    def load_optimizer(self, state: dict, rank_dir: str) -> None:
        self.optimizer.load_state_dict(state)
        if self.distributed_optimizer:
            path = os.path.join(rank_dir, DISTRIBUTED_OPTIMIZER_FILE)
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"--load: {path} missing: the checkpoint was saved without --use-distributed-optimizer "
                    "(load it with --finetune, or drop the flag)"
                )
            self.optimizer.load_parameter_state(path)

    def full_precision_weights(self):
        """The torch engine's context (FP32 weights while loading); here the BF16 weights are what
        megatron's optimizer takes its FP32 mains from (``weights_loaded``)."""
        return contextlib.nullcontext()

    def weights_loaded(self, state: dict | None = None) -> None:
        """After model weights were copied in: refresh the optimizer's main parameters (a resume
        then restores the FP32 mains exactly from the optimizer state)."""
        self.optimizer.reload_model_params()


def build_engine(model: torch.nn.Module, run, device: torch.device, nonfinite: NonFinitePolicy | None = None):
    """The engine ``--ddp-impl`` names (``auto``: megatron on CUDA, torch on CPU); ``nonfinite``
    defaults to the run's ``--check-for-nan-in-loss-and-grad`` / ``--skip-nonfinite-steps``."""
    impl = run.parallel.ddp_impl
    if impl == "auto":
        impl = "megatron" if device.type == "cuda" else "torch"
    return (MegatronEngine if impl == "megatron" else TorchEngine)(model, run, device, nonfinite)

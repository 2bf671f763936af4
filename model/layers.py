"""Megatron's tensor-parallel linears with the local GEMM routed through the precision policy.

Megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` do two things: tensor-parallel
(TP) communication around a linear, and the local GEMM itself. We keep the first and replace the
second. The seam is ``_forward_impl(input, weight, bias, gradient_accumulation_fusion,
allreduce_dgrad, sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)``, which
megatron's ``forward`` calls after it has decided what communication the GEMM needs. Megatron's
own implementation (``linear_with_grad_accumulation_and_async_allreduce``) fuses two collectives
*into* its autograd function for overlap; we express the same two collectives with megatron's
public mapping functions, outside our GEMM, so the GEMM is one call to ``policy_linear``:

  column-parallel, TP>1, no SP: ``allreduce_dgrad`` is True and megatron's ``forward`` skipped
      ``copy_to_tensor_model_parallel_region``; we apply it (identity forward, all-reduce of dx).
  column-parallel, SP:          ``sequence_parallel`` is True; we apply
      ``gather_from_sequence_parallel_region`` (all-gather of x forward, reduce-scatter of dx).
  row-parallel:                 megatron passes neither; its ``forward`` reduces (or, with SP,
      reduce-scatters) the output after us, and adds the bias after the reduction.

    y_local = policy_linear(x_local, w_local, self.precision, bias)   # Fprop; Dgrad, Wgrad in backward

Everything else (weight init and sharding, ``gather_output``, bias handling, state dicts) is
megatron's. Megatron's fused Wgrad accumulation into ``main_grad`` (``gradient_accumulation_fusion``)
and deferred embedding Wgrad are not supported: they would bypass the Wgrad recipe.

Each layer holds, as plain attributes:
  ``precision``    its ``LinearPrecision`` (set by ``model.gpt.apply_precision_plan``; ``print(model)``
                   shows it; running without one is an error naming the layer);
  ``layer_name``   its full module name (set by ``set_layer_name``, called by the owning model);
  ``quant_state``  its ``LayerQuantState`` (random streams, amax histories) for the layer's
                   lifetime, seeded from ``(seed, layer_name)``; saved and restored through the
                   module's ``_extra_state`` entry of ``state_dict()`` (megatron's hook for it).
                   Under TP it also knows where this rank's shard sits in the whole layer
                   (``TPLayout``: column/row split, rank, megatron's ``partition_stride``), so that
                   whole-tensor amaxes are reduced over the TP group for sharded operands and
                   stochastic rounding draws, for each element, the number TP=1 draws for it;
  ``gemm_backend`` which ``kernels`` backend runs the GEMMs (``"emulated"`` by default);
  ``backward_operands`` ``"hp"`` (default) or ``"ste"``: Dgrad / Wgrad from the high-precision
                   ``w`` / ``x`` or from Fprop's quantized ``Q(w)`` / ``Q(x)`` (``model.linear``;
                   ``--qat-backward``);
  ``rollout_weight`` None, or while the generation engine runs under a rollout plan the layer's
                   weight quantized once into packed storage (``model.rollout.PackedWeight``):
                   Fprop then reads it instead of quantizing ``weight`` at every call;
  ``fprop_x``      None, or a function of the input whose result Fprop consumes as its ``x``
                   operand while Dgrad/Wgrad see the input itself (``model.linear``; set by
                   rollout-guided QAT, ``pretrain.rl.qat``, to replay the rollout's rounding).

Under activation recomputation a layer's Fprop runs twice per micro-batch; both passes quantize
at the same call index and only the second records anything (``model.recompute``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from model import recompute
from model.linear import policy_linear
from precision.recipe import Gemm
from precision.state import LayerQuantState, TPLayout

if TYPE_CHECKING:
    from precision import LinearPrecision


class _PolicyLinearMixin:
    """Shared state and checks of the two policy-routed linears (put first in the MRO)."""

    tp_split: str  # which weight axis TP shards: "column" (out-features) or "row" (in-features)

    precision: LinearPrecision | None
    layer_name: str | None
    quant_state: LayerQuantState
    gemm_backend: str
    backward_operands: str

    def _init_policy(self, config) -> None:
        self.precision = None
        self.layer_name = None
        self.quant_state = LayerQuantState()
        self.gemm_backend = "emulated"
        self.backward_operands = "hp"  # model.linear: Dgrad / Wgrad from w, x ("hp") or Fprop's Q(w), Q(x) ("ste")
        self._awaiting_recompute = 0  # checkpointed first passes not yet recomputed (model.recompute)
        self.rollout_weight = None
        self.fprop_x = None
        if config.gradient_accumulation_fusion:
            raise ValueError(
                f"{type(self).__name__}: --gradient-accumulation-fusion is not supported; it fuses "
                "Wgrad into main_grad and would bypass the Wgrad recipe (use --no-gradient-accumulation-fusion)"
            )
        if config.defer_embedding_wgrad_compute:
            raise ValueError(
                f"{type(self).__name__}: --defer-embedding-wgrad-compute is not supported by policy linears"
            )

    def _policy_gemm(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.rollout_weight is not None:  # generation under a rollout plan: packed weights, Fprop only
            return self.rollout_weight.fprop(x, bias, self.quant_state, self.gemm_backend)
        self.check_precision()
        with self.fprop_call_index():
            return policy_linear(x, w, self.precision, bias, state=self.quant_state, backend=self.gemm_backend,
                                 fprop_x=self.fprop_x, backward=self.backward_operands)

    def check_precision(self) -> None:
        """Raise (naming the layer) if no precision plan was applied to it."""
        if self.precision is None:
            name = self.layer_name or f"an unnamed {type(self).__name__}"
            raise RuntimeError(
                f"linear layer {name} has no precision recipe: call "
                "model.gpt.apply_precision_plan(model, plan) before running the model"
            )

    @contextlib.contextmanager
    def fprop_call_index(self):
        """Inside, the layer's Fprop quantizes at the call index activation recomputation
        (``model.recompute``) asks for: the first pass is read-only (no autograd) at the index its
        recomputation will use -- the current one plus the first passes of this layer still waiting
        for theirs (pipelining keeps several micro-batches in flight). Grouped experts
        (``model.grouped_experts``) enter it for each expert, as this layer's own GEMM does."""
        ahead, where = 0, recompute.phase()
        if where == "first":
            ahead, self._awaiting_recompute = self._awaiting_recompute, self._awaiting_recompute + 1
        elif where == "recompute":
            self._awaiting_recompute = max(0, self._awaiting_recompute - 1)
        calls = self.quant_state.calls
        calls[Gemm.FPROP.value] += ahead
        try:
            yield
        finally:
            calls[Gemm.FPROP.value] -= ahead

    def set_layer_name(self, name: str, seed: int = 0) -> None:
        """Name the layer (for errors and logs) and start its quantization state from ``(seed, name)``.
        Under tensor parallelism per-tensor scales are taken over the whole tensor (the TP group)."""
        self.layer_name = name
        self.quant_state = LayerQuantState(seed=seed, name=name)
        if self.tp_group is not None and self.tp_group.size() > 1:
            self.quant_state.amax_group = self.tp_group
            self.quant_state.tp = TPLayout(self.tp_group.rank(), self.tp_group.size(), self.tp_split,
                                           getattr(self.weight, "partition_stride", 1))

    # megatron's linears store None as ``_extra_state``; ours store the quantization state.
    def get_extra_state(self) -> dict:
        return self.quant_state.state_dict()

    def set_extra_state(self, state) -> None:
        if state is not None:  # None: a checkpoint from before quantization state was saved
            self.quant_state.load_state_dict(state)

    def extra_repr(self) -> str:
        tp = self.tp_group.size() if self.tp_group is not None else 1
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"bias={self.bias is not None}, TP={tp}, precision={self.precision}"
        )

    # Megatron overrides __repr__ (hiding extra_repr); restore torch's so the recipe prints.
    __repr__ = torch.nn.Module.__repr__


class PolicyColumnParallelLinear(_PolicyLinearMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` (weight split along out-features) whose local GEMM is ``policy_linear``."""

    tp_split = "column"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_policy(self.config)

    def _forward_impl(
        self,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer=None,
        wgrad_deferral_limit=None,
        tp_group=None,
    ):
        if allreduce_dgrad:  # TP>1 without SP: forward skipped the copy; Dgrad must be all-reduced.
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        elif sequence_parallel:  # x arrives sequence-sharded: gather it, reduce-scatter dx.
            input = gather_from_sequence_parallel_region(
                input, tensor_parallel_output_grad=True, group=tp_group
            )
        return self._policy_gemm(input, weight, bias)


class PolicyRowParallelLinear(_PolicyLinearMixin, RowParallelLinear):
    """``RowParallelLinear`` (weight split along in-features) whose local GEMM is ``policy_linear``.

    Megatron's ``forward`` passes ``bias=None`` here and adds the bias after reducing the output.
    """

    tp_split = "row"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_policy(self.config)

    def _forward_impl(self, input, weight, bias, *args, **kwargs):
        return self._policy_gemm(input, weight, bias)

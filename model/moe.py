"""Mixture-of-experts: megatron-core's ``MoELayer`` with every GEMM routed through the precision policy.

A MoE transformer layer replaces the dense MLP by megatron-core 0.16's ``MoELayer``::

    router        PolicyRouter (a TopKRouter)        logits = x . w_routerᵀ   (one policy GEMM)
    dispatcher    PortableAllGatherTokenDispatcher    all-gather tokens over TP x EP, keep the local experts'
    experts       SequentialMLP of megatron MLPs      each expert's linear_fc1 / linear_fc2 are policy linears
                  (--moe-grouped-gemm: the same experts, each group's fc1 / fc2 one grouped GEMM, model.grouped_experts)
    shared        SharedExpertMLP                     its linear_fc1 / linear_fc2 are policy linears
    combine                                           reduce-scatter over TP x EP, weighted sum of the top-k

So every expert's Fprop, Dgrad and Wgrad, the shared experts' and the router's run under the plan,
and each has a name the plan's rules select (``precision.policy``: ``kind:expert``, ``kind:router``,
``kind:shared_expert``, ``experts:A-B``)::

    decoder.layers.L.mlp.router
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc1   (E: the *global* expert index, any EP size)
    decoder.layers.L.mlp.shared_experts.linear_fc1

Plan names number experts globally (``model.gpt.PolicyGPTModel.plan_name``): under expert parallelism
(EP) a rank's ``local_experts.0`` is global expert ``rank x experts-per-rank``, and its quantization
state is seeded from that name, so stochastic rounding draws the same numbers at any EP size.

The router's GEMM runs in ``--moe-router-dtype`` (FP32 by default, as Megatron recommends) and, unless a
rule says otherwise, under the FP32 recipe (every preset's built-in ``kind:router=fp32``, like the output
layer's rule): a quantized router GEMM is an explicit choice (``--precision-rule kind:router=mxfp4``).

What megatron-core 0.16 assumes about CUDA on this path, and what we do (checked on CPU, written for CUDA):
  - ``Router.gating`` moves a CPU weight to ``torch.cuda.current_device()``: ``PolicyRouter.gating``
    computes the logits with ``policy_linear`` on the weight's own device.
  - ``TopKRouter`` allocates the expert-bias and global-aux-loss buffers on CUDA: those options
    (``--moe-router-enable-expert-bias``, ``global_aux_loss``) are not offered.
  - The all-gather dispatcher's gather / reduce-scatter allocate their outputs on CUDA (megatron's
    ``tensor_parallel.mappings``): ``PortableAllGatherTokenDispatcher`` gathers into the tokens' device
    with ``torch.distributed.all_gather`` and reduce-scatters as an all-reduce plus this rank's slice
    (gloo has no reduce-scatter).
  - Tensor parallelism without sequence parallelism (SP is CUDA-only in megatron-core 0.16, ``model.spec``):
    megatron's dispatcher expects each TP rank to hold a different slice of the tokens. Here every TP
    rank holds all of them, so the dispatcher takes its rank's slice first (as SP would have given it)
    and all-gathers the combined output back (backward: the slice of the replicated gradient). The
    router and the shared experts see all tokens on every rank; the router's aux-loss token counts are
    then not summed over TP (they are whole already) and its z-loss not divided by TP, so the router's
    gradient is the TP=1 gradient on every rank without a TP all-reduce. ``MoELayer.forward`` refuses
    this layout outright (a performance warning raised as an error); ``PolicyMoELayer.forward`` runs it.
  - gloo has no all-to-all: ``--moe-token-dispatcher-type alltoall`` (megatron's, for NCCL) runs on CUDA
    only; ``flex`` needs DeepEP (CUDA).

The aux and z losses reach the training loss the way megatron adds them: ``MoEAuxLossAutoScaler``
attaches each to the router's output, and its backward feeds ``main_loss_backward_scale`` (1 unless set)
as the gradient of the aux loss -- ``set_aux_loss_scale(1 / micro-batches)`` matches megatron's schedules.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from model.layers import PolicyColumnParallelLinear, PolicyRowParallelLinear, _PolicyLinearMixin
from precision.state import LayerQuantState

__all__ = ["PolicyMoELayer", "PolicyRouter", "PortableAllGatherTokenDispatcher", "moe_layer_pattern", "validate_moe",
           "moe_module_spec", "set_aux_loss_scale"]

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
MX_BLOCK = 32
_AUX_SCALE: dict[str, float] = {}  # the value set_aux_loss_scale last gave MoEAuxLossAutoScaler


# ============================================================================================
# Collectives that allocate on the tokens' device (gloo on CPU, NCCL on CUDA)
# ============================================================================================


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _slice(x: torch.Tensor, group) -> torch.Tensor:
    n = x.shape[0] // group.size()
    return x[group.rank() * n:(group.rank() + 1) * n].contiguous()


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    total = x.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    return _slice(total, group)


class _Gather(torch.autograd.Function):
    """All-gather along dim 0; backward reduce-scatters (``"sum"``: each rank's copy of the gathered
    tensor had its own gradient) or slices (``"slice"``: the gradient is replicated on every rank)."""

    @staticmethod
    def forward(ctx, x, group, backward):
        ctx.group, ctx.backward = group, backward
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, dy):
        return (_reduce_scatter(dy, ctx.group) if ctx.backward == "sum" else _slice(dy, ctx.group)), None, None


class _Scatter(torch.autograd.Function):
    """This rank's slice of dim 0 -- of the sum over ranks (``"sum"``: a reduce-scatter) or of a
    TP-replicated tensor (``"slice"``); backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group, op):
        ctx.group = group
        return _reduce_scatter(x, group) if op == "sum" else _slice(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.group), None, None


# ============================================================================================
# Router, dispatcher, layer
# ============================================================================================


class PolicyRouter(_PolicyLinearMixin, TopKRouter):
    """megatron's ``TopKRouter`` whose gating GEMM (``logits = x . wᵀ``, ``[T, hidden] -> [T, experts]``)
    is a policy GEMM on the weight's own device. Replicated over TP: its quantization state has no TP
    layout. Without sequence parallelism every TP rank routes all tokens, so the aux-loss token counts
    and the z-loss take no TP reduction (module docstring)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self._init_policy(config)
        if self.tp_group.size() > 1 and not config.sequence_parallel:
            self.tp_cp_group = pg_collection.cp

    @property
    def input_size(self) -> int:
        return self.weight.shape[1]

    @property
    def output_size(self) -> int:
        return self.weight.shape[0]

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return self._policy_gemm(input.to(dtype), self.weight.to(dtype), bias)

    def set_layer_name(self, name: str, seed: int = 0) -> None:
        self.layer_name = name
        self.quant_state = LayerQuantState(seed=seed, name=name)  # replicated weight: no TP layout

    stats: dict | None = None
    """Routing telemetry of the step (``pretrain.trainer.moe_telemetry``): None (off: one check per
    forward), or a dict the training forwards add to on the device: ``tokens`` (assignments per expert,
    after capacity dropping), ``dropped`` (top-k assignments dropped), ``entropy`` (sum over tokens of
    the routing distribution's entropy, nats) and ``count`` (tokens routed)."""

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().routing(logits, padding_mask)
        if self.stats is not None and self.training:
            self._record(logits.detach(), routing_map)
        return probs, routing_map

    @torch.no_grad()
    def _record(self, logits: torch.Tensor, routing_map: torch.Tensor) -> None:
        logits = logits.reshape(-1, logits.shape[-1]).float()
        if self.score_function == "sigmoid":  # the normalised scores: a distribution over the experts
            scores = torch.sigmoid(logits)
            p = scores / scores.sum(-1, keepdim=True)
        else:
            p = torch.softmax(logits, dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        tokens = routing_map.sum(0).float()
        new = {"tokens": tokens, "dropped": logits.shape[0] * self.topk - tokens.sum(),
               "entropy": entropy.sum(), "count": torch.tensor(float(logits.shape[0]), device=logits.device)}
        for key, value in new.items():
            self.stats[key] = self.stats[key] + value if key in self.stats else value

    __repr__ = torch.nn.Module.__repr__


class PortableAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher with collectives on the tokens' device; under TP without SP it
    takes this TP rank's slice of the (replicated) tokens first and gathers the output back."""

    def __init__(self, *args, pg_collection=None, **kwargs):
        super().__init__(*args, pg_collection=pg_collection, **kwargs)
        self.attn_tp_group = pg_collection.tp
        self.slice_tp = self.attn_tp_group.size() > 1 and not self.config.sequence_parallel

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        hidden_states, probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
        if self.slice_tp:
            # tokens not divisible by TP (e.g. a decode step's rows): zero rows routed to no expert pad them
            self.tokens, pad = hidden_states.shape[0], -hidden_states.shape[0] % self.attn_tp_group.size()
            if pad:
                hidden_states, probs = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (hidden_states, probs))
                self.routing_map = torch.nn.functional.pad(self.routing_map, (0, 0, 0, pad))
            hidden_states = _Scatter.apply(hidden_states, self.attn_tp_group, "slice")
            probs = _Scatter.apply(probs, self.attn_tp_group, "slice")
            self.routing_map = _slice(self.routing_map, self.attn_tp_group)
        return hidden_states, probs

    def token_dispatch(self, hidden_states, probs):
        if self.tp_size > 1 or self.ep_size > 1:
            with torch.no_grad():
                self.routing_map = _all_gather(self.routing_map, self.tp_ep_group)
            probs = _Gather.apply(probs, self.tp_ep_group, "sum")
            hidden_states = _Gather.apply(hidden_states, self.tp_ep_group, "sum")
        return hidden_states, probs

    def token_combine(self, hidden_states):
        if self.tp_size > 1 or self.ep_size > 1:
            dtype = hidden_states.dtype
            hidden_states = _Scatter.apply(hidden_states.to(self.local_probs.dtype), self.tp_ep_group, "sum").to(dtype)
        if self.slice_tp:
            hidden_states = _Gather.apply(hidden_states, self.attn_tp_group, "slice")[: self.tokens]
        return hidden_states


class PolicyMoELayer(MoELayer):
    """megatron's ``MoELayer`` with the portable all-gather dispatcher; forward is megatron's route ->
    dispatch -> experts -> combine without CUDA graphs or MoE recomputation, and runs TP without SP."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection)
        if config.moe_token_dispatcher_type == "allgather":
            self.token_dispatcher = PortableAllGatherTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise ValueError("PolicyMoELayer: partial CUDA-graph capture (intermediate_tensors) is not supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(hidden_states, probs)
        output, mlp_bias = self.routed_experts_compute(dispatched, probs)
        output = self.combine(output)
        return self.postprocess(output, shared), mlp_bias


def set_aux_loss_scale(scale: float, device: torch.device | str = "cpu") -> None:
    """The gradient the aux and z losses get in backward (megatron's schedules set 1 / micro-batches).
    A host-to-device copy only when the value or device changes, not every step."""
    current = MoEAuxLossAutoScaler.main_loss_backward_scale
    if current is None or current.device != torch.device(device) or _AUX_SCALE.get("value") != float(scale):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale), device=device))
        _AUX_SCALE["value"] = float(scale)


# ============================================================================================
# Specs
# ============================================================================================


def token_bucket(n: int) -> int:
    """Rows an expert's GEMMs run on for ``n`` routed tokens: the next power of two, at least one MX
    block (32). Zero rows change no result: Fprop and Dgrad are row-wise, and along Wgrad's token
    contraction zeros change neither a block's amax nor a per-tensor amax nor the sum (the linear pads
    partial blocks with zeros itself; stochastic rounding keys on each element's index, which trailing
    rows leave alone)."""
    return max(MX_BLOCK, 1 << max(n - 1, 0).bit_length())


class PaddedSequentialMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` whose experts run on token counts padded by :func:`token_bucket`.

    Why: the routed token count of an expert changes every step, and the compiled quantizers
    (``kernels.fused``) compile once per shape -- bucketed, an expert GEMM sees a handful of shapes
    instead of hundreds. An expert that receives no token still runs on one block of zeros, so every
    expert weight has a (zero) gradient each step, as data-parallel reductions expect. Megatron pads the
    same way for FP8 / FP4 (to multiples of 16 / 32).

    Initialisation (``use_cpu_initialization``): every rank draws every expert's weights in global
    order from the same CPU stream and keeps its own, as TP keeps its shard of a master weight, so an
    expert and every layer after it start from the same values at any EP size (megatron builds only
    the local experts: on CPU, EP rank 1's experts would repeat rank 0's). One discarded expert at a time.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        rng = torch.get_rng_state()
        super().__init__(num_local_experts, config, submodules, pg_collection)
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        if ep_size == 1 or not config.use_cpu_initialization:
            return
        torch.set_rng_state(rng)  # draw again, every expert in global order
        for e in range(num_local_experts * ep_size):
            expert = MLP(self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size, is_expert=True,
                         tp_group=pg_collection.expt_tp)
            owner, i = divmod(e, num_local_experts)
            if owner == ep_rank:
                self.local_experts[i] = expert

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.moe_apply_probs_on_input:
            raise ValueError("PaddedSequentialMLP: moe_apply_probs_on_input is not supported")
        counts = tokens_per_expert.tolist()
        outputs = []
        for expert, tokens, probs in zip(self.local_experts, torch.split(permuted_local_hidden_states, counts),
                                         torch.split(permuted_probs, counts), strict=True):
            n = tokens.shape[0]
            pad = token_bucket(n) - n
            out, _ = expert(torch.nn.functional.pad(tokens, (0, 0, 0, pad)), torch.nn.functional.pad(probs, (0, pad)))
            outputs.append(out[:n])
        return torch.cat(outputs, dim=0), None


def expert_mlp_modules() -> tuple[type, MLPSubmodules]:
    """Experts as a (padded) megatron ``SequentialMLP`` of MLPs whose fc1 / fc2 are policy linears."""
    return PaddedSequentialMLP, MLPSubmodules(linear_fc1=PolicyColumnParallelLinear, linear_fc2=PolicyRowParallelLinear)


def moe_module_spec(experts: type | None = None) -> ModuleSpec:
    """The MoE MLP of a transformer layer: policy router, SequentialMLP experts (or ``experts``, a subclass
    with the same parameters: ``model.grouped_experts.GroupedSequentialMLP`` for ``--moe-grouped-gemm``),
    shared experts."""
    sequential, expert_submodules = expert_mlp_modules()
    experts = experts or sequential
    shared = MLPSubmodules(linear_fc1=PolicyColumnParallelLinear, linear_fc2=PolicyRowParallelLinear)
    return ModuleSpec(
        module=PolicyMoELayer,
        submodules=MoESubmodules(experts=ModuleSpec(module=experts, submodules=expert_submodules),
                                 shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=shared),
                                 router=PolicyRouter),
    )


def moe_layer_pattern(num_layers: int, freq: int | list[int]) -> list[int]:
    """Megatron's ``--moe-layer-freq``: an int N makes every N-th layer (0, N, 2N, ...) MoE; a list gives
    one 0/1 per layer."""
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return list(freq)


# ============================================================================================
# Validation
# ============================================================================================

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")  # global_aux_loss: CUDA buffers
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("allgather", "alltoall")  # flex needs DeepEP
def validate_moe(cfg, tp_size: int, ep_size: int, cuda: bool) -> None:
    """Raise ValueError (one line naming the Megatron-LM flag and what is valid) if ``cfg``'s
    mixture-of-experts settings cannot run at ``tp_size`` x ``ep_size`` (``cuda``: on a GPU)."""
    n = cfg.num_experts
    if n is None:
        given = [flag for flag, v in (("--moe-ffn-hidden-size", cfg.moe_ffn_hidden_size),
                                      ("--moe-shared-expert-intermediate-size", cfg.moe_shared_expert_intermediate_size),
                                      ("--moe-expert-capacity-factor", cfg.moe_expert_capacity_factor),
                                      ("--moe-grouped-gemm", cfg.moe_grouped_gemm or None)) if v is not None]
        if given:
            raise ValueError(f"{given[0]} needs --num-experts (a mixture-of-experts model)")
        if ep_size > 1:
            raise ValueError(f"--expert-model-parallel-size {ep_size} needs --num-experts (a mixture-of-experts model)")
        return
    if n < 1:
        raise ValueError(f"--num-experts {n} must be at least 1")
    if not 1 <= cfg.moe_router_topk <= n:
        raise ValueError(f"--moe-router-topk {cfg.moe_router_topk} must be between 1 and --num-experts {n}")
    if n % ep_size:
        raise ValueError(f"--num-experts {n} is not divisible by --expert-model-parallel-size {ep_size}")
    tp = f"--tensor-model-parallel-size {tp_size}"
    sizes = [("--moe-ffn-hidden-size", cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)]
    if cfg.moe_shared_expert_intermediate_size is not None:
        sizes.append(("--moe-shared-expert-intermediate-size", cfg.moe_shared_expert_intermediate_size))
    for flag, size in sizes:
        if size <= 0 or size % (MX_BLOCK * tp_size):
            raise ValueError(f"{flag} {size} / {tp} must be a positive multiple of {MX_BLOCK} per rank "
                             "(MX block size along the experts' fc2 contraction)")
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq {freq} must be at least 1 (every N-th layer) or a list of 0/1")
    elif len(freq) != cfg.num_layers or set(freq) - {0, 1} or not any(freq):
        raise ValueError(f"--moe-layer-freq {list(freq)}: needs one 0/1 per layer (--num-layers {cfg.num_layers}) "
                         "with at least one 1")
    lb = cfg.moe_router_load_balancing_type
    if lb not in LOAD_BALANCING_TYPES:
        raise ValueError(f"--moe-router-load-balancing-type {lb!r} is not one of {', '.join(LOAD_BALANCING_TYPES)}")
    if lb == "sinkhorn" and (cfg.moe_aux_loss_coeff or cfg.moe_expert_capacity_factor is not None):
        raise ValueError("--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff and no "
                         "--moe-expert-capacity-factor; use aux_loss, seq_aux_loss or none")
    for flag, v in (("--moe-aux-loss-coeff", cfg.moe_aux_loss_coeff), ("--moe-z-loss-coeff", cfg.moe_z_loss_coeff)):
        if v is not None and v < 0:
            raise ValueError(f"{flag} {v} must be non-negative")
    if cfg.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"--moe-router-score-function {cfg.moe_router_score_function!r} is not one of "
                         f"{', '.join(SCORE_FUNCTIONS)}")
    if cfg.moe_expert_capacity_factor is not None and cfg.moe_expert_capacity_factor <= 0:
        raise ValueError(f"--moe-expert-capacity-factor {cfg.moe_expert_capacity_factor} must be positive "
                         "(leave it out for no token dropping)")
    d = cfg.moe_token_dispatcher_type
    if d not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {d!r} is not one of {', '.join(DISPATCHERS)} "
                         "(flex needs DeepEP)")
    if d == "alltoall" and not cuda and (tp_size > 1 or ep_size > 1):
        raise ValueError("--moe-token-dispatcher-type alltoall needs CUDA (NCCL all-to-all; gloo has none); "
                         "use allgather on CPU")
    if cfg.moe_router_dtype not in (*ROUTER_DTYPES, None):
        raise ValueError(f"--moe-router-dtype {cfg.moe_router_dtype!r} is not one of {', '.join(ROUTER_DTYPES)}")

"""Build megatron-core's ``GPTModel`` with every linear layer routed through the precision policy.

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, seq_length=32, vocab_size=256)  # Llama style by default
    model = build_gpt(cfg)                       # needs torch.distributed + parallel_state set up
    apply_precision_plan(model, plan)            # plan: {name: LinearPrecision} for every
                                                 # name in policy_linear_names(model)
    loss = model(tokens, position_ids, None, labels=labels)          # [b, s] per-token loss

Llama style is RMSNorm, SwiGLU, RoPE, untied embeddings, no biases, grouped-query attention
(``num_query_groups < num_attention_heads``); GPT-2 style is ``normalization='LayerNorm',
activation='gelu', position_embedding='learned_absolute', untie_embeddings=False,
add_bias_linear=True``. Qwen2 is Llama style plus ``add_qkv_bias=True``; Llama 3.x adds
``rope_scaling_factor`` (megatron's Llama-3 RoPE scaling: low/high frequency factors 1 and 4 over
an original context of 8192). ``pretrain.hf_convert`` builds these configs from Hugging Face ones.

Policy linears. The layer spec (``model.spec``) makes ``linear_qkv``, ``linear_proj``,
``linear_fc1`` and ``linear_fc2`` ours. ``GPTModel`` builds ``output_layer`` itself as a plain
``ColumnParallelLinear``; ``PolicyGPTModel`` replaces it after construction by a
``PolicyColumnParallelLinear`` built without a weight of its own, then hands it the original
``Parameter`` (same values, same TP attributes, no extra RNG draws). With tied embeddings the
output layer has no weight and megatron passes the embedding table at forward time, as before.

CPU, as measured with megatron-core 0.16.1:
  - RNG. ``model_parallel_cuda_manual_seed`` is CUDA-only (it seeds CUDA generators and
    megatron's CUDA RNG tracker). On CPU call ``torch.manual_seed(seed)`` with the *same* seed on
    every rank before ``build_gpt``. With ``use_cpu_initialization=True`` every rank draws the full
    (master) weight from that CPU stream and keeps its shard, so weights are identical for any TP
    size (as long as the padded vocabulary is: see ``padded_vocab_size``). Hidden dropout acts on
    TP-replicated activations and uses torch's default generator, identical across TP ranks, which
    is what it needs. Attention dropout: see ``model.attention``; dropout defaults to 0. On GPU also
    call ``model_parallel_cuda_manual_seed(seed)`` after ``initialize_model_parallel``.
    Activation recomputation: megatron's ``tensor_parallel.checkpoint`` saves CUDA RNG state (GPU
    only); ``model.recompute`` checkpoints with torch's reentrant checkpoint on CPU (``recompute=``).
  - BF16 (``params_dtype=torch.bfloat16``, ``--bf16``): parameters and activations in BF16 run on
    CPU too; the policy linears quantize from the BF16 values and return BF16 (``model.linear``),
    the loss is FP32. FP32 main weights live in the optimizer (``pretrain.optim``, ``pretrain.engine``).
  - RoPE. megatron's ``RotaryEmbedding.get_emb`` moves its frequencies to
    ``torch.cuda.current_device()``; ``PortableRotaryEmbedding`` does so only when CUDA exists.
  - Attention and norms: ``model.attention`` and ``model.spec``.
  - Fusions (bias-dropout-add, bias-activation, RoPE, softmax, cross-entropy) are off: megatron's
    ``jit_fuser`` is ``torch.compile`` and the others need apex / TransformerEngine.
  - Sequence parallelism and pipeline parallelism are CUDA-only (megatron's SP collectives
    allocate on CUDA; PP schedules and tied-embedding PP sync call ``.cuda()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from model.layers import PolicyColumnParallelLinear, PolicyRowParallelLinear
from model.moe import PolicyRouter, moe_layer_pattern, validate_moe
from model.recompute import RecomputeConfig, RecomputeTransformerBlock
from model.spec import gpt_block_spec

if TYPE_CHECKING:
    from precision import LinearPrecision

MX_BLOCK = 32  # MX formats scale blocks of 32 elements along a GEMM's contraction axis
POLICY_LINEARS = (PolicyColumnParallelLinear, PolicyRowParallelLinear, PolicyRouter)


# ============================================================================================
# Configuration
# ============================================================================================


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model shape and architecture; field names follow Megatron-LM flags (``--hidden-size`` ...)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # = num_attention_heads for plain multi-head attention
    seq_length: int
    vocab_size: int  # tokenizer's; padded per megatron's rule (padded_vocab_size)
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    activation: Literal["swiglu", "gelu"] = "swiglu"
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    untie_embeddings: bool = True  # --untie-embeddings-and-output-weights
    add_bias_linear: bool = False  # --add-bias-linear / --disable-bias-linear
    add_qkv_bias: bool = False  # --add-qkv-bias: bias on linear_qkv only (Qwen2)
    init_method_std: float = 0.02
    rotary_base: int = 10000
    rope_scaling_factor: float | None = None  # --use-rope-scaling --rope-scaling-factor (Llama 3.x)
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128
    kv_quant: str | None = None  # --kv-quant: K and V fake-quantized as the rollout's KV-cache stores them
    qk_layernorm: bool = False  # --qk-layernorm: a norm on each head's query and key before RoPE (Qwen3)
    kv_channels: int | None = None  # --kv-channels: attention head size (None: hidden / heads; Qwen3: 128)
    # Mixture of experts (model.moe; Megatron-LM's flags). None experts: a dense model.
    num_experts: int | None = None  # --num-experts
    moe_router_topk: int = 2  # --moe-router-topk
    moe_ffn_hidden_size: int | None = None  # --moe-ffn-hidden-size (None: ffn_hidden_size)
    moe_shared_expert_intermediate_size: int | None = None  # --moe-shared-expert-intermediate-size
    moe_layer_freq: int | tuple[int, ...] = 1  # --moe-layer-freq: every N-th layer, or one 0/1 per layer
    moe_router_load_balancing_type: str = "aux_loss"  # --moe-router-load-balancing-type
    moe_aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff
    moe_z_loss_coeff: float | None = None  # --moe-z-loss-coeff
    moe_router_score_function: str = "softmax"  # --moe-router-score-function
    moe_router_pre_softmax: bool = False  # --moe-router-pre-softmax: softmax over all experts, then top-k (unnormalized)
    moe_expert_capacity_factor: float | None = None  # --moe-expert-capacity-factor (None: no dropping)
    moe_token_dispatcher_type: str = "allgather"  # --moe-token-dispatcher-type
    moe_grouped_gemm: bool = False  # --moe-grouped-gemm: experts as grouped policy GEMMs (model.grouped_experts)
    moe_router_dtype: str | None = "fp32"  # --moe-router-dtype: the router GEMM's dtype (None: activations')
    expert_model_parallel_size: int = 1  # --expert-model-parallel-size: experts split over this many ranks

    def __post_init__(self):
        choices = {
            "normalization": ("--normalization", ("RMSNorm", "LayerNorm")),
            "activation": ("--activation", ("swiglu", "gelu")),
            "position_embedding": ("--position-embedding-type", ("rope", "learned_absolute")),
        }
        for field, (flag, valid) in choices.items():
            if getattr(self, field) not in valid:
                raise ValueError(f"{flag} {getattr(self, field)!r} is not one of {', '.join(valid)}")


# ModelConfig MoE fields megatron-core's TransformerConfig takes under the same name (num_experts is
# TransformerConfig.num_moe_experts; moe_layer_freq a list there when a tuple here).
MOE_CONFIG_FIELDS = (
    "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_expert_capacity_factor", "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_router_dtype",
)  # fmt: skip

# ModelConfig fields megatron-core's TransformerConfig takes under the same name (the rest of the
# TransformerConfig is derived in transformer_config: activation, parallel layout, dtypes, fusions).
TRANSFORMER_CONFIG_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "normalization",
    "layernorm_epsilon", "add_bias_linear", "add_qkv_bias", "hidden_dropout", "attention_dropout", "init_method_std",
    "qk_layernorm", "kv_channels",
)  # fmt: skip


def validate_config(cfg: ModelConfig, tp_size: int) -> None:
    """Raise ValueError (one line, naming the Megatron-LM flag) if ``cfg`` cannot run at ``tp_size``.

    Mixture-of-experts settings are checked by ``model.moe.validate_moe``. Besides megatron's divisibility rules, the contraction dimensions that every rank quantizes in
    MX blocks must be multiples of 32: hidden and FFN sizes, globally and per TP shard
    (``linear_proj`` contracts over hidden/TP, ``linear_fc2`` over ffn/TP). The vocabulary is padded
    by ``padded_vocab_size`` as Megatron-LM does.
    """
    heads, groups, hidden, ffn = (
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.hidden_size,
        cfg.ffn_hidden_size,
    )
    validate_moe(cfg, tp_size, cfg.expert_model_parallel_size, torch.cuda.is_available())
    tp = f"--tensor-model-parallel-size {tp_size}"
    if heads % tp_size:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by {tp}")
    if heads % groups:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    if groups % tp_size:
        raise ValueError(f"--num-query-groups {groups} is not divisible by {tp}")
    if cfg.kv_channels is None and hidden % heads:
        raise ValueError(f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads} "
                         "(give the head size with --kv-channels)")
    if cfg.kv_channels is not None:
        width = heads * cfg.kv_channels  # linear_proj's in-features: its Fprop contraction
        if cfg.kv_channels < 1 or width % (MX_BLOCK * tp_size):
            raise ValueError(f"--kv-channels {cfg.kv_channels} x --num-attention-heads {heads} / {tp} = "
                             f"{width / tp_size:g} per rank must be a positive multiple of {MX_BLOCK} (MX block "
                             "size along linear_proj's contraction)")
    for flag, size in (("--hidden-size", hidden), ("--ffn-hidden-size", ffn)):
        if size % MX_BLOCK:
            raise ValueError(f"{flag} {size} must be a multiple of {MX_BLOCK} (MX block size)")
        if size % (MX_BLOCK * tp_size):
            raise ValueError(
                f"{flag} {size} / {tp} = {size / tp_size:g} per rank must be a multiple of "
                f"{MX_BLOCK} (MX block size)"
            )


def validate_plan_shapes(cfg: ModelConfig, tp_size: int, plan: Mapping[str, LinearPrecision]) -> None:
    """Raise ValueError (one line, naming the flags) if a TP shard edge would cut a block of a GEMM
    the plan runs in a block format.

    ``linear_qkv`` is column-parallel: its Dgrad contracts over this rank's output features,
    ``(heads + 2 * query groups) / TP x head dim`` of them (Q, K and V of this rank's heads), which
    must be whole blocks (32 for MX, 16 for NVFP4) -- with a head dimension of 8 or 24 they are
    not. Plans whose ``linear_qkv`` Dgrad has no block format (BF16, FP8, HiF8) are not refused.
    Hidden and FFN sizes are checked by :func:`validate_config`.
    """
    from precision.quantize import FORMATS

    if tp_size == 1:
        return
    heads, groups, hidden = cfg.num_attention_heads, cfg.num_query_groups, cfg.hidden_size
    head_dim = head_size(cfg)
    per_rank = (heads + 2 * groups) // tp_size * head_dim
    for name, precision in plan.items():
        if not name.endswith("self_attention.linear_qkv"):
            continue
        recipe = precision.dgrad
        blocks = [(FORMATS[op.fmt].block, op.fmt) for op in (recipe.a, recipe.b) if FORMATS[op.fmt].scaling == "block"]
        if not blocks:
            continue
        block, fmt = max(blocks)
        if per_rank % block:
            raise ValueError(
                (f"--kv-channels {head_dim} (head dim)" if cfg.kv_channels else
                 f"--hidden-size {hidden} / --num-attention-heads {heads} = head dim {head_dim}") + f": {name} has "
                f"({heads} heads + 2 x {groups} --num-query-groups) x {head_dim} / --tensor-model-parallel-size "
                f"{tp_size} = {per_rank} output features per rank, not a multiple of the {block}-element "
                f"{fmt} blocks of its Dgrad; use a head dim whose per-rank Q/K/V width is a multiple of "
                f"{block} (e.g. 16, 32, 64), or a non-block format for that GEMM (--precision-rule)"
            )


def head_size(cfg: ModelConfig) -> int:
    """The attention head size: ``--kv-channels`` (megatron's ``kv_channels``), else hidden / heads."""
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def padded_vocab_size(cfg: ModelConfig, tp_size: int) -> int:
    """Megatron-LM's rule: round the vocabulary up to a multiple of
    ``make_vocab_size_divisible_by * tp_size``. Different TP sizes can pad differently, and then
    the output layer's initial weights differ; the default (128) pads 256 to 256 for TP 1 and 2."""
    multiple = cfg.make_vocab_size_divisible_by * tp_size
    return -(-cfg.vocab_size // multiple) * multiple


def training_flops_per_token(cfg: ModelConfig, seq_length: int, vocab_size: int | None = None) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward), Megatron-LM's way:
    every GEMM of every layer (QKV with grouped K/V, projection, MLP with SwiGLU's two input
    projections), attention scores and context over the full ``seq_length`` (no causal discount),
    and the logits layer over the (padded) vocabulary; norms, softmax and activations not counted.
    A mixture-of-experts layer counts what a token runs: the router, its top-k experts and the shared
    experts (padding rows of ``model.moe.PaddedSequentialMLP`` are not model FLOPs).
    Independent of the precision recipe, so MFU compares recipes fairly."""
    h = cfg.hidden_size
    q = cfg.num_attention_heads * head_size(cfg)  # query (and attention output) width
    kv = cfg.num_query_groups * head_size(cfg)
    gate = 2 if cfg.activation == "swiglu" else 1

    def mlp(width: int) -> int:  # linear_fc1 (SwiGLU: two input projections) + linear_fc2
        return 2 * h * width * gate + 2 * width * h

    attention = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * seq_length * q  # qkv, proj, q.k^T and attention.v
    dense = mlp(cfg.ffn_hidden_size)
    moe = dense
    if cfg.num_experts is not None:
        moe = (2 * h * cfg.num_experts + cfg.moe_router_topk * mlp(cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
               + (mlp(cfg.moe_shared_expert_intermediate_size) if cfg.moe_shared_expert_intermediate_size else 0))
    pattern = moe_layer_pattern(cfg.num_layers, cfg.moe_layer_freq) if cfg.num_experts else [0] * cfg.num_layers
    layers = sum(attention + (moe if is_moe else dense) for is_moe in pattern)
    return 3.0 * (layers + 2 * h * (vocab_size or cfg.vocab_size))


def transformer_config(
    cfg: ModelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute: RecomputeConfig | None = None,
) -> TransformerConfig:
    """The megatron ``TransformerConfig`` for ``cfg`` under the current parallel_state."""
    moe = {}
    if cfg.num_experts is not None:
        freq = cfg.moe_layer_freq
        moe = {name: getattr(cfg, name) for name in MOE_CONFIG_FIELDS}
        moe.update(num_moe_experts=cfg.num_experts, moe_layer_freq=freq if isinstance(freq, int) else list(freq),
                   moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                   moe_permute_fusion=False, moe_router_fusion=False)
    return TransformerConfig(
        **(recompute.transformer_config_fields() if recompute is not None else {}),
        **{name: getattr(cfg, name) for name in TRANSFORMER_CONFIG_FIELDS},
        **moe,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        gated_linear_unit=cfg.activation == "swiglu",
        activation_func=F.silu if cfg.activation == "swiglu" else F.gelu,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,  # activations sent between pipeline stages
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


# ============================================================================================
# The model
# ============================================================================================


class PortableRotaryEmbedding(RotaryEmbedding):
    """megatron's ``RotaryEmbedding`` that moves its frequencies to CUDA only when CUDA exists."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.inv_freq.device.type == "cpu" and torch.cuda.is_available():
            self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]  # [s, 1, 1, dim]


class PolicyGPTModel(GPTModel):
    """``GPTModel`` whose output layer is a ``PolicyColumnParallelLinear`` and whose RoPE runs on CPU.

    Takes ``GPTModel``'s arguments, plus ``quant_seed`` for the linears' quantization random
    streams. After construction every column/row-parallel linear is a policy linear that knows its
    module name (``layer_name``), owns a ``LayerQuantState`` seeded from ``(quant_seed, name)``, and
    has no recipe until ``apply_precision_plan``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec,
        vocab_size: int,
        max_sequence_length: int,
        *,
        quant_seed: int = 0,
        **kwargs,
    ):
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, **kwargs)
        if type(self.decoder) is TransformerBlock:  # recomputation on CPU too; no new state
            self.decoder.__class__ = RecomputeTransformerBlock
        if self.post_process:
            old = self.output_layer
            self.output_layer = PolicyColumnParallelLinear(
                config.hidden_size,
                self.vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=not self.parallel_output,
                skip_weight_param_allocation=True,  # no new weight, no RNG draws: take the old one
                embedding_activation_buffer=self.embedding_activation_buffer,
                grad_output_buffer=self.grad_output_buffer,
                tp_group=self.pg_collection.tp,
            )
            if old.weight is not None:  # untied (or tied on a later pipeline stage)
                self.output_layer.weight = old.weight
        if type(getattr(self, "rotary_pos_emb", None)) is RotaryEmbedding:  # no params: rebuild
            self.rotary_pos_emb = PortableRotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=kwargs.get("seq_len_interpolation_factor"),
                rotary_base=kwargs.get("rotary_base", 10000),
                rope_scaling=kwargs.get("rope_scaling", False),
                rope_scaling_factor=kwargs.get("rope_scaling_factor", 8.0),
                use_cpu_initialization=config.use_cpu_initialization,
                cp_group=self.pg_collection.cp,
            )
        for name, module in self.named_modules():
            if isinstance(module, POLICY_LINEARS):
                module.set_layer_name(self.plan_name(name), seed=quant_seed)
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                raise TypeError(
                    f"{name} is a plain {type(module).__name__}; the layer spec must use policy linears"
                )


    def plan_name(self, module_name: str) -> str:
        """The name precision plans, telemetry and quantization seeds use for ``module_name``: the
        module path with the layer numbered *globally* (megatron numbers a pipeline stage's layers
        from 0 in module paths; ``TransformerLayer.layer_number`` is global and 1-based), and an
        expert numbered globally (``mlp.experts.local_experts.E``: under expert parallelism a rank's
        local expert 0 is global expert ``rank x experts per rank``). Without pipeline and expert
        parallelism the names are the module paths."""
        parts = module_name.split(".")
        if parts[:2] == ["decoder", "layers"] and len(parts) > 2:
            layer = self.decoder.layers[int(parts[2])]
            parts[2] = str(layer.layer_number - 1)
            if parts[3:6] == ["mlp", "experts", "local_experts"] and len(parts) > 6:
                parts[6] = str(layer.mlp.local_expert_indices[int(parts[6])])
        return ".".join(parts)


def build_gpt(
    cfg: ModelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    seed: int = 0,
    recompute: RecomputeConfig | None = None,
) -> PolicyGPTModel:
    """Build this rank's ``PolicyGPTModel`` for ``cfg``.

    Needs ``torch.distributed`` and ``megatron.core.parallel_state.initialize_model_parallel``;
    seed torch identically on all ranks first (see the module docstring). ``seed`` (``--seed``)
    seeds the linears' quantization random streams (stochastic rounding, random Hadamard signs);
    it is the same on every TP rank. ``params_dtype``: ``torch.bfloat16`` for ``--bf16``.
    ``recompute``: activation recomputation (``model.recompute``; None: none).
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    validate_config(cfg, tp_size)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if ep_size != cfg.expert_model_parallel_size:
        raise ValueError(f"--expert-model-parallel-size {cfg.expert_model_parallel_size}: megatron's parallel state "
                         f"has expert parallelism {ep_size}: initialize_model_parallel(expert_model_parallel_size=...) "
                         "must match it")
    if recompute is not None:
        recompute.check(cfg.num_layers // parallel_state.get_pipeline_model_parallel_world_size())
    if sequence_parallel and not torch.cuda.is_available():
        raise ValueError(
            "--sequence-parallel needs CUDA: megatron-core 0.16.1's sequence-parallel all-gather / "
            "reduce-scatter allocate on torch.cuda.current_device()"
        )
    config = transformer_config(cfg, params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute)
    model = PolicyGPTModel(
        config,
        gpt_block_spec(config, qk_layernorm=cfg.qk_layernorm),
        vocab_size=padded_vocab_size(cfg, tp_size),
        max_sequence_length=cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not cfg.untie_embeddings,
        position_embedding_type=cfg.position_embedding,
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        quant_seed=seed,
    )
    if cfg.kv_quant is not None:
        from model.attention import set_kv_quant

        set_kv_quant(model, cfg.kv_quant)
    return model


# ============================================================================================
# Precision plans
# ============================================================================================


def policy_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(plan name, module)`` of every policy linear in ``model``, in module (registration) order.

    Per layer that is ``self_attention.linear_proj``, ``self_attention.linear_qkv`` (megatron's
    ``Attention`` registers the projection first), ``mlp.linear_fc1``, ``mlp.linear_fc2``; then
    ``output_layer``. The plan name is the module path with layers numbered globally
    (``PolicyGPTModel.plan_name``; on a pipeline stage other than the first the two differ). Pass the
    unwrapped model: a DDP wrapper prefixes module paths with ``module.``.
    """
    return [(m.layer_name or name, m) for name, m in model.named_modules() if isinstance(m, POLICY_LINEARS)]


def policy_linear_names(model: torch.nn.Module) -> list[str]:
    """Plan names of every policy linear in ``model`` (see :func:`policy_linears`)."""
    return [name for name, _ in policy_linears(model)]


def apply_precision_plan(model: torch.nn.Module, plan: Mapping[str, LinearPrecision]) -> None:
    """Set each policy linear's ``precision`` from ``plan`` (keyed by ``policy_linear_names``).

    The plan must cover exactly the model's linears: a missing or unknown name is an error, and no
    layer is changed when the plan is rejected.
    """
    linears = policy_linears(model)
    names = [n for n, _ in linears]
    missing = [n for n in names if plan.get(n) is None]
    if missing:
        raise ValueError(f"precision plan has no recipe for linear layer(s): {', '.join(missing)}")
    unknown = sorted(set(plan) - set(names))
    if unknown:
        raise ValueError(f"precision plan names layer(s) this model does not have: {', '.join(unknown)}")
    for name, module in linears:
        module.precision = plan[name]


def allreduce_tp_partial_grads(model: torch.nn.Module) -> None:
    """Sum over TP the gradients that each TP rank holds only partially (megatron's
    ``finalize_model_grads`` does this; torch DDP does not): norm weights under sequence
    parallelism (tagged ``sequence_parallel``) and q/k layernorm weights. Without SP and without
    q/k norms there are none: all other replicated parameters see full activations and full
    gradients on every rank, and this is a no-op. Call after backward, before the optimizer step."""
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return
    for name, p in model.named_parameters():
        partial = getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name
        if partial and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=group)

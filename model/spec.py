"""The layer spec: which modules megatron-core's GPT is built from.

Megatron-core assembles a transformer layer from a ``ModuleSpec`` whose leaves come from a
``BackendSpecProvider``. ``PolicySpecProvider`` is our backend:

  column-parallel linear  ``PolicyColumnParallelLinear``   (linear_qkv, linear_fc1)
  row-parallel linear     ``PolicyRowParallelLinear``      (linear_proj, linear_fc2)
  core attention          ``SDPAttention``                 (CPU and GPU; megatron's local one is CUDA-only)
  self attention          ``RecomputeSelfAttention``       (megatron's, KV-cache buffers on the
                          weights' device instead of CUDA, see ``model.attention``; selective
                          recomputation on CPU too, see ``model.recompute``)
  norm                    ``TorchNorm`` -> ``LayerNorm`` / ``RMSNorm`` (torch's, chosen by
                          ``config.normalization``)

  MLP                     megatron's ``MLP``, or in mixture-of-experts layers ``model.moe.PolicyMoELayer``
                          (policy router, SequentialMLP experts and shared experts of policy linears;
                          ``--moe-grouped-gemm``: the experts as grouped GEMMs, ``model.grouped_experts``)

The output layer is not part of the layer spec; ``model.gpt.PolicyGPTModel`` swaps it in.

Norms and sequence parallelism (SP): megatron's ``WrappedTorchNorm`` refuses SP outright. Our
norms accept it and, like megatron's fused norms, tag their parameters ``sequence_parallel=True``:
under SP each TP rank normalises a different slice of the sequence, so norm-weight gradients are
partial sums that must be all-reduced over TP (megatron's ``finalize_model_grads`` does that for
tagged parameters; ``model.gpt.allreduce_tp_partial_grads`` does it for torch DDP). Note that SP
itself is still CUDA-only in megatron-core 0.16.1: its sequence gather / reduce-scatter allocate on
``torch.cuda.current_device()``.

``gpt_block_spec`` (used by ``build_gpt``) also makes the decoder's final norm ours; a bare layer
spec would leave megatron to pick apex's ``FusedLayerNorm`` or ``WrappedTorchNorm`` for it.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from model.attention import PortableSelfAttention, SDPAttention
from model.grouped_experts import GroupedSequentialMLP
from model.layers import PolicyColumnParallelLinear, PolicyRowParallelLinear
from model.moe import expert_mlp_modules, moe_layer_pattern, moe_module_spec
from model.recompute import checkpoint


class LayerNorm(torch.nn.LayerNorm):
    """torch ``LayerNorm`` whose parameters carry megatron's ``sequence_parallel`` tag."""


class RMSNorm(torch.nn.RMSNorm):
    """torch ``RMSNorm`` whose parameters carry megatron's ``sequence_parallel`` tag."""


class TorchNorm:
    """Norm builder with megatron's norm constructor signature; returns ``LayerNorm`` or ``RMSNorm``."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("--apply-layernorm-1p (zero-centred gamma) is not supported by torch norms")
        if config.memory_efficient_layer_norm:
            raise ValueError("--memory-efficient-layer-norm is not supported by torch norms")
        norm_cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(
                f"--normalization {config.normalization} is not supported; use LayerNorm or RMSNorm"
            )
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class RecomputeSelfAttention(PortableSelfAttention):
    """``PortableSelfAttention`` whose selective recomputation (``--recompute-granularity
    selective``: core attention) checkpoints through ``model.recompute.checkpoint``, which runs on
    CPU too (megatron's ``tensor_parallel.checkpoint`` saves CUDA RNG states). Core attention holds
    no policy linear, so no quantization state is involved."""

    def _checkpointed_attention_forward(self, query, key, value, attention_mask, rotary_pos_emb=None,
                                        attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        def core_attention(query, key, value, attention_mask):
            return self.core_attention(query, key, value, attention_mask, attn_mask_type=mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)

        return checkpoint(core_attention, query, key, value, attention_mask)


class PolicySpecProvider(BackendSpecProvider):
    """Backend of policy-routed linears, SDPA core attention and torch norms (no TE); experts are a
    ``SequentialMLP`` of policy linears (``model.moe``)."""

    def column_parallel_linear(self) -> type:
        return PolicyColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return PolicyRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> type | None:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TorchNorm  # LayerNorm vs RMSNorm follows config.normalization at build time

    def core_attention(self) -> type:
        return SDPAttention

    def grouped_mlp_modules(
        self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool
    ) -> tuple[type, MLPSubmodules | None]:
        if moe_use_legacy_grouped_gemm:
            raise ValueError("--moe-use-legacy-grouped-gemm is not supported: --moe-grouped-gemm runs the experts as "
                             "policy-routed grouped GEMMs (model.grouped_experts)")
        experts, submodules = expert_mlp_modules()
        return (GroupedSequentialMLP if moe_use_grouped_gemm else experts), submodules

    def activation_func(self) -> type:
        return None  # MLP applies config.activation_func itself


def gpt_layer_spec(
    backend: BackendSpecProvider | None = None,
    qk_layernorm: bool = False,
    ffn_hidden_size: int | None = None,
    moe: bool = False,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """A GPT transformer layer (megatron's local spec, non-MLA branch) built from ``backend``: a dense MLP,
    or with ``moe`` the mixture-of-experts layer of ``model.moe`` (``moe_grouped_gemm``: grouped experts)."""
    backend = backend or PolicySpecProvider()
    norm = backend.layer_norm()
    qk_norm = backend.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    if moe:
        mlp = moe_module_spec(GroupedSequentialMLP if moe_grouped_gemm else None)
    else:
        mlp = get_mlp_module_spec_for_backend(backend=backend)
        if ffn_hidden_size is not None:  # megatron warns when the MLP has to fall back to the config's
            mlp = dataclasses.replace(mlp, params={**mlp.params, "ffn_hidden_size": ffn_hidden_size})
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=RecomputeSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def gpt_block_spec(
    config: TransformerConfig, backend: BackendSpecProvider | None = None, qk_layernorm: bool = False
) -> TransformerBlockSubmodules:
    """The decoder block: this pipeline stage's layers plus the final norm, all from ``backend``. With
    ``config.num_moe_experts`` the layers ``--moe-layer-freq`` picks are mixture-of-experts layers."""
    backend = backend or PolicySpecProvider()
    dense = gpt_layer_spec(backend, qk_layernorm=qk_layernorm, ffn_hidden_size=config.ffn_hidden_size)
    pattern = [0] * config.num_layers
    if config.num_moe_experts:
        pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
        moe = gpt_layer_spec(backend, qk_layernorm=qk_layernorm, moe=True, moe_grouped_gemm=config.moe_grouped_gemm)
    offset = get_transformer_layer_offset(config)
    return TransformerBlockSubmodules(
        layer_specs=[moe if pattern[offset + i] else dense for i in range(get_num_layers_to_build(config))],
        layer_norm=backend.layer_norm(),
    )

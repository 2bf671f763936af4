"""The model group of flags (``ModelArgs``) and its one mapping to and from ``model.gpt.ModelConfig``.

``ModelArgs`` holds the flags as Megatron-LM spells them (``--swiglu``, ``--position-embedding-type``,
``--norm-epsilon`` ...); ``ModelConfig`` is what the model is built from. One table, :data:`MODEL_FLAGS`,
maps each flag to its field and back; ``model_config`` and ``shape_of`` are its two directions: parsing a ``--pretrained-checkpoint`` reads the
shape flags off its config, a checkpoint's ``args`` rebuild its config, and a resume compares the
:data:`SHAPE_FLAGS` (those fixing parameter shapes) with the checkpoint's.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from pretrain.config.fields import arg

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_SIZES_DIR = os.path.join(REPO, "configs", "models")


def model_sizes() -> list[str]:
    """Names of the model-size files in ``configs/models``."""
    if not os.path.isdir(MODEL_SIZES_DIR):
        return []
    return sorted(f[: -len(".yaml")] for f in os.listdir(MODEL_SIZES_DIR) if f.endswith(".yaml"))


def moe_layer_freq_type(value: str) -> int | list:
    """``--moe-layer-freq``: an integer N, or a list of 0/1 such as ``[1,0,1,0]`` (read as a literal)."""
    try:
        got = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        got = None
    if isinstance(got, int) and not isinstance(got, bool):
        return got
    if isinstance(got, (list, tuple)) and all(v in (0, 1) for v in got):
        return list(got)
    raise argparse.ArgumentTypeError(f"{value!r}: expected an integer N or a list of 0/1 per layer, e.g. [1,0,1,0]")


@dataclass(frozen=True)
class ModelArgs:
    """Model shape and architecture flags (group "model"); ``to_model_config`` builds the model's config."""

    model_size: str | None = arg("--model-size", metavar="NAME|FILE", help=lambda: (
        f"model shape and recommended hyper-parameters from configs/models/NAME.yaml "
        f"({', '.join(model_sizes())}) or a .yaml file; explicit flags override it"))
    """A ``configs/models/NAME.yaml`` or a ``.yaml`` path: parser defaults < the file < flags given."""
    num_layers: int | None = arg("--num-layers", type=int)
    """Transformer layers (required, or from ``--model-size`` / ``--pretrained-checkpoint``)."""
    hidden_size: int | None = arg("--hidden-size", type=int)
    """Model width (required, or from a model-size file)."""
    ffn_hidden_size: int | None = arg("--ffn-hidden-size", type=int, help="default: 4 * hidden size")
    """MLP width; filled with 4 x ``hidden_size`` when not given."""
    num_attention_heads: int | None = arg("--num-attention-heads", type=int)
    """Attention heads (required, or from a model-size file)."""
    kv_channels: int | None = arg("--kv-channels", type=int,
                                  help="attention head size (default: hidden size / heads; Qwen3 models: 128)")
    """Megatron's ``--kv-channels``: each head's query/key/value size; None: ``hidden_size / heads``."""
    num_query_groups: int | None = arg("--num-query-groups", type=int,
                                       help="grouped-query attention groups (default: = heads)")
    """Key/value heads of grouped-query attention; filled with ``num_attention_heads`` when not given."""
    seq_length: int | None = arg("--seq-length", type=int)
    """Training sequence length in tokens (required)."""
    normalization: str = arg("--normalization", choices=["RMSNorm", "LayerNorm"], default="RMSNorm")
    """RMSNorm or LayerNorm."""
    swiglu: bool = arg("--swiglu", action=argparse.BooleanOptionalAction, default=True,
                       help="SwiGLU MLP (--no-swiglu: GeLU)")
    """SwiGLU MLP; ``False``: GeLU."""
    position_embedding_type: str = arg("--position-embedding-type", choices=["rope", "learned_absolute"],
                                       default="rope")
    """rope or learned_absolute."""
    rotary_base: int = arg("--rotary-base", type=int, default=10000)
    """RoPE base."""
    use_rope_scaling: bool = arg("--use-rope-scaling", action="store_true",
                                 help="Llama 3.x RoPE frequency scaling (--rope-scaling-factor)")
    """Llama 3.x RoPE frequency scaling by ``rope_scaling_factor``."""
    rope_scaling_factor: float = arg("--rope-scaling-factor", type=float, default=8.0)
    """The scaling factor with ``use_rope_scaling``."""
    untie_embeddings_and_output_weights: bool = arg("--untie-embeddings-and-output-weights",
                                                    action=argparse.BooleanOptionalAction, default=True)
    """Separate output layer (``False``: tied to the input embedding)."""
    add_bias_linear: bool = arg("--add-bias-linear", action="store_true", default=False,
                                also=((("--disable-bias-linear",), {"action": "store_false"}),))
    """Biases on every linear (``--disable-bias-linear``: none, the default)."""
    add_qkv_bias: bool = arg("--add-qkv-bias", action="store_true", help="bias on linear_qkv only (Qwen2)")
    """A bias on ``linear_qkv`` only (Qwen2)."""
    init_method_std: float = arg("--init-method-std", type=float, default=0.02)
    """Standard deviation of the normal initialisation."""
    norm_epsilon: float = arg("--norm-epsilon", type=float, default=1e-5)
    """Epsilon of the normalization layers."""
    hidden_dropout: float = arg("--hidden-dropout", type=float, default=0.0)
    """Dropout after attention and MLP."""
    attention_dropout: float = arg("--attention-dropout", type=float, default=0.0)
    """Dropout of the attention probabilities."""
    make_vocab_size_divisible_by: int = arg("--make-vocab-size-divisible-by", type=int, default=128)
    """The embedding table is padded to a multiple of this (times the TP size; megatron's rule)."""
    qk_layernorm: bool = arg("--qk-layernorm", action="store_true",
                             help="a norm (--normalization) on each head's query and key before RoPE (Qwen3)")
    """Per-head query and key norms (megatron's ``q_layernorm`` / ``k_layernorm``)."""
    # ---- mixture of experts (model.moe; Megatron-LM's flags) ----
    num_experts: int | None = arg("--num-experts", type=int,
                                  help="routed experts per MoE layer (default: none, a dense model)")
    """Routed experts per mixture-of-experts layer; None: a dense model."""
    moe_router_topk: int = arg("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = arg("--moe-ffn-hidden-size", type=int,
                                          help="each routed expert's MLP width (default: --ffn-hidden-size)")
    """Each routed expert's MLP width; None: ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: int | None = arg(
        "--moe-shared-expert-intermediate-size", type=int,
        help="total MLP width of the shared experts every token passes through (default: none)")
    """Shared experts' total MLP width (number of shared experts x their width); None: no shared expert."""
    moe_layer_freq: int | list = arg("--moe-layer-freq", type=moe_layer_freq_type, default=1, metavar="N|[0/1,...]",
                                     help="every N-th layer is MoE (0, N, 2N, ...), or one 0/1 per layer, e.g. [1,0,1,0]")
    """Which layers are MoE: every N-th (from layer 0), or a list with one 0/1 per layer."""
    moe_router_load_balancing_type: str = arg("--moe-router-load-balancing-type", default="aux_loss",
                                              choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"])
    """Load balancing: the switch-transformer aux loss per micro-batch or per sequence, sinkhorn, or none."""
    moe_aux_loss_coeff: float = arg("--moe-aux-loss-coeff", type=float, default=0.0,
                                    help="weight of the load-balancing loss (e.g. 1e-2)")
    """Weight of the load-balancing (aux) loss in the training loss."""
    moe_z_loss_coeff: float | None = arg("--moe-z-loss-coeff", type=float,
                                         help="weight of the router z-loss (ST-MoE; e.g. 1e-3; default: none)")
    """Weight of the router z-loss; None: none."""
    moe_router_score_function: str = arg("--moe-router-score-function", default="softmax",
                                         choices=["softmax", "sigmoid"])
    """softmax or sigmoid scores over the experts."""
    moe_router_pre_softmax: bool = arg("--moe-router-pre-softmax", action="store_true",
                                       help="softmax over all experts before top-k (weights not renormalized)")
    """Softmax over all experts, then top-k (Qwen3-MoE without norm_topk_prob); default: top-k, then softmax."""
    moe_expert_capacity_factor: float | None = arg(
        "--moe-expert-capacity-factor", type=float,
        help="tokens an expert takes, as a multiple of its even share; the rest are dropped (default: no dropping)")
    """Expert capacity as a multiple of the even share of tokens; None: no dropping."""
    moe_token_dispatcher_type: str = arg("--moe-token-dispatcher-type", default="allgather",
                                         choices=["allgather", "alltoall"],
                                         help="allgather (CPU and GPU) or alltoall (NCCL, CUDA only)")
    """allgather (gloo and NCCL) or alltoall (NCCL)."""
    moe_grouped_gemm: bool = arg("--moe-grouped-gemm", action="store_true",
                                 help="each group of identically-planned experts' fc1 / fc2 as one grouped GEMM "
                                      "(torch._grouped_mm / _scaled_grouped_mm where the format has one, else per expert)")
    """Megatron's grouped expert GEMM: the same experts (parameters, plan names, checkpoints), each group's
    fc1 / fc2 one grouped policy GEMM (``model.grouped_experts``)."""
    moe_router_dtype: str = arg("--moe-router-dtype", choices=["fp32", "fp64"], default="fp32",
                                help="dtype of the router's GEMM and softmax")
    """Dtype the router computes its logits in."""
    expert_model_parallel_size: int = arg("--expert-model-parallel-size", type=int, default=1,
                                          help="EP: the routed experts split over this many ranks")
    """EP: each rank holds ``num_experts / EP`` routed experts (taken from the data-parallel ranks)."""

    def to_model_config(self, vocab_size: int, kv_quant: str | None = None):
        """The ``model.gpt.ModelConfig`` for a tokenizer of ``vocab_size`` tokens (``--kv-quant``: K and V
        fake-quantized as a rollout KV-cache stores them)."""
        return model_config(self, vocab_size, kv_quant)


# Flags that fix parameter shapes: a checkpoint must agree with the run on all of them.
SHAPE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "swiglu",
    "normalization", "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "kv_channels", "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
)  # fmt: skip



@dataclass(frozen=True)
class _Maps:
    """How one model flag becomes a ``ModelConfig`` field and back."""

    field: str
    """The ``model.gpt.ModelConfig`` field."""
    to_config: Callable | None = None
    """flag value -> field value (``None``: the same value)."""
    from_config: Callable | None = None
    """field value -> flag value (``None``: the same value)."""
    read_back: bool = True
    """Whether ``shape_of`` reads it off a checkpoint's config (the shape a ``--pretrained-checkpoint``
    or an RL ``--load`` fixes; not the sequence length, initialisation or dropout)."""


# The one table between the model flags (ModelArgs) and model.gpt.ModelConfig, both directions: a new
# model flag is a ModelArgs field, a ModelConfig field and a row here. (--use-rope-scaling with
# --rope-scaling-factor is the one pair of flags behind one field: model_config / shape_of.)
MODEL_FLAGS: dict[str, _Maps] = {
    "num_layers": _Maps("num_layers"),
    "hidden_size": _Maps("hidden_size"),
    "ffn_hidden_size": _Maps("ffn_hidden_size"),
    "num_attention_heads": _Maps("num_attention_heads"),
    "num_query_groups": _Maps("num_query_groups"),
    "seq_length": _Maps("seq_length", read_back=False),
    "normalization": _Maps("normalization"),
    "swiglu": _Maps("activation", lambda v: "swiglu" if v else "gelu", lambda c: c == "swiglu"),
    "position_embedding_type": _Maps("position_embedding"),
    "untie_embeddings_and_output_weights": _Maps("untie_embeddings"),
    "add_bias_linear": _Maps("add_bias_linear"),
    "add_qkv_bias": _Maps("add_qkv_bias"),
    "init_method_std": _Maps("init_method_std", read_back=False),
    "rotary_base": _Maps("rotary_base"),
    "norm_epsilon": _Maps("layernorm_epsilon"),
    "hidden_dropout": _Maps("hidden_dropout", read_back=False),
    "attention_dropout": _Maps("attention_dropout", read_back=False),
    "make_vocab_size_divisible_by": _Maps("make_vocab_size_divisible_by"),
    "qk_layernorm": _Maps("qk_layernorm"),
    "kv_channels": _Maps("kv_channels"),
    "num_experts": _Maps("num_experts"),
    "moe_router_topk": _Maps("moe_router_topk"),
    "moe_ffn_hidden_size": _Maps("moe_ffn_hidden_size"),
    "moe_shared_expert_intermediate_size": _Maps("moe_shared_expert_intermediate_size"),
    "moe_layer_freq": _Maps("moe_layer_freq", lambda v: v if isinstance(v, int) else tuple(v),
                            lambda c: c if isinstance(c, int) else list(c)),
    "moe_router_load_balancing_type": _Maps("moe_router_load_balancing_type"),
    "moe_aux_loss_coeff": _Maps("moe_aux_loss_coeff"),
    "moe_z_loss_coeff": _Maps("moe_z_loss_coeff"),
    "moe_router_score_function": _Maps("moe_router_score_function"),
    "moe_router_pre_softmax": _Maps("moe_router_pre_softmax"),
    "moe_expert_capacity_factor": _Maps("moe_expert_capacity_factor"),
    "moe_token_dispatcher_type": _Maps("moe_token_dispatcher_type", read_back=False),
    "moe_grouped_gemm": _Maps("moe_grouped_gemm", read_back=False),
    "moe_router_dtype": _Maps("moe_router_dtype"),
    "expert_model_parallel_size": _Maps("expert_model_parallel_size", read_back=False),
}


# A flag's default, for saved arguments from before the flag existed (the MoE flags: a dense model).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelArgs)}


def model_config(a, vocab_size: int, kv_quant: str | None = None):
    """The ``model.gpt.ModelConfig`` of the model flags in ``a`` (``ModelArgs``, or any object with
    their names, e.g. a checkpoint's saved arguments); ``kv_quant`` defaults to ``a.kv_quant`` where
    ``a`` has it."""
    from model.gpt import ModelConfig  # megatron-core: only once a model config is built, not for --help

    if kv_quant is None:
        kv_quant = getattr(a, "kv_quant", None)
    fields = {m.field: (m.to_config or (lambda v: v))(getattr(a, flag, _DEFAULTS.get(flag)))
              for flag, m in MODEL_FLAGS.items()}
    return ModelConfig(**fields, vocab_size=vocab_size, kv_quant=kv_quant,
                       rope_scaling_factor=a.rope_scaling_factor if a.use_rope_scaling else None)


# Flag name -> how to read it off a ModelConfig (the inverse of model_config), from MODEL_FLAGS.
SHAPE_FROM_CONFIG = {
    **{flag: (lambda c, m=m: (m.from_config or (lambda v: v))(getattr(c, m.field)))
       for flag, m in MODEL_FLAGS.items() if m.read_back},
    "use_rope_scaling": lambda c: c.rope_scaling_factor is not None,
}


def shape_of(cfg) -> dict:
    """The model flags' values that reproduce ``cfg``'s shape (``model.gpt.ModelConfig``)."""
    values = {name: get(cfg) for name, get in SHAPE_FROM_CONFIG.items()}
    if cfg.rope_scaling_factor is not None:
        values["rope_scaling_factor"] = cfg.rope_scaling_factor
    return values

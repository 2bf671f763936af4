"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``, for CPU and GPU.

Megatron-core's local ``DotProductAttention`` allocates its score buffer on
``torch.cuda.current_device()`` and so cannot run on CPU; ``TEDotProductAttention`` needs
TransformerEngine. ``SDPAttention`` takes their place in the layer spec (``core_attention``) and
uses whatever SDPA kernel torch picks for the device (flash / memory-efficient on GPU, the fused
CPU kernel or the math reference on CPU). Attention is not a linear layer: it is outside the
precision policy and runs in the activations' dtype.

Interface (what megatron 0.16.1's ``SelfAttention`` calls):
    __init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
             softmax_scale=None, cp_comm_type=None, pg_collection=None)
    forward(query [sq, b, np, hn], key/value [sk, b, ng, hn], attention_mask,
            attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> [sq, b, np * hn]
``np`` / ``ng`` are the heads / query groups local to this tensor-parallel rank (heads / TP);
grouped-query attention maps each group to ``np / ng`` consecutive query heads, as megatron does.

Masks follow megatron: ``attention_mask`` is boolean with True = *masked out*, broadcastable to
[b, np, sq, sk]. For causal mask types the causal mask is always applied, combined with
``attention_mask`` when one is given (e.g. end-of-document masks).

Our generation engine (``model.generate``) keeps its own KV-cache (``kv_cache`` below). megatron's
own KV-cache inference (``StaticInferenceContext``) works too: megatron's ``Attention`` stores new
keys/values in the context's buffers and hands this module the whole cache, so ``sk`` = cached + new positions. The
prefill step is an ordinary causal call (``sq == sk``). Decode steps feed one token and megatron
passes ``attn_mask_type=no_mask``: the single query is the newest position and may see every
cached key. Whenever ``sq != sk`` under a causal mask type, the queries are taken to be the *last*
``sq`` positions (bottom-right aligned ``tril(diagonal=sk - sq)``), never SDPA's top-left
``is_causal``. ``PortableSelfAttention`` lets megatron allocate those buffers on CPU.

Quantized keys and values (``model.kv_cache``). Plain attributes, ``None`` by default:
  ``kv_format``  a ``KVFormat``: keys and values are fake-quantized as the rollout's KV-cache stores
                 them (quantize -> dequantize along the head dimension, straight-through gradient;
                 ``--kv-quant``, set by :func:`set_kv_quant`), after RoPE, before attention;
  ``kv_amax``    ``[2, ng]`` per-head amax of K and V for formats with a tensor-level scale (FP8,
                 NVFP4): calibrated by ``model.generate.calibrate_kv``; without it (training) each
                 call scales every head by its own current amax;
  ``kv_cache``   a ``LayerKV`` while the generation engine runs: new keys and values are written to
                 it (quantized in ``kv_format``) and attention reads every cached one back.
A KV-cache call passes an explicit ``attention_mask`` ``[b, 1, sq, sk]`` (padding and causality);
the queries are the last ``sq`` of the ``sk`` slots.

Dropout on the attention probabilities is drawn from megatron's model-parallel RNG tracker when it
has been seeded (``model_parallel_cuda_manual_seed``, GPU only), so each TP rank's heads get
independent masks; on CPU it falls back to torch's default generator, which is seeded identically
on all TP ranks, so ranks' heads get correlated masks. Use ``attention_dropout=0`` (our default)
for TP>1 runs on CPU.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from model.kv_cache import KVFormat, LayerKV, per_head_amax

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class SDPAttention(MegatronModule):
    """Causal / grouped-query core attention built on ``scaled_dot_product_attention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support --context-parallel-size > 1")
        if config.window_size is not None:
            raise ValueError("SDPAttention does not support sliding-window attention (--window-size)")
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type 'vanilla' only, got {config.softmax_type!r}"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies it back
        # inside an FP32 softmax: a no-op mathematically, so it is ignored here.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.kv_format: KVFormat | None = None  # see the module docstring
        self.kv_amax: torch.Tensor | None = None
        self.kv_cache: LayerKV | None = None
        self.kv_observed: torch.Tensor | None = None  # [2, ng] running amax while calibrating

    def extra_repr(self) -> str:
        kv = f", kv={self.kv_format.fmt}" if self.kv_format is not None else ""
        return f"mask={self.attn_mask_type.name}, scale={self.softmax_scale:.4g}, dropout={self.dropout_p}{kv}"

    def _keys_values(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads: through the KV-cache when one is attached, else
        fake-quantized in ``kv_format`` (or as they are). ``[s, b, ng, hn]``."""
        if self.kv_observed is not None:  # calibration: per-head amax of what the cache would store
            seen = torch.stack([per_head_amax(key), per_head_amax(value)])
            self.kv_observed = torch.maximum(self.kv_observed, seen)
        if self.kv_cache is not None:
            return self.kv_cache.update(key, value)
        if self.kv_format is not None:
            amax = self.kv_amax if self.kv_amax is not None else (None, None)
            return self.kv_format.fake_quantize(key, amax[0]), self.kv_format.fake_quantize(value, amax[1])
        return key, value

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        key, value = self._keys_values(key, value)
        sq, b, np_, hn = query.shape
        sk, ng = key.shape[0], key.shape[2]
        if np_ % ng:
            raise ValueError(f"local query heads ({np_}) are not a multiple of local query groups ({ng})")

        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

        causal = mask_type in _CAUSAL
        allowed = None  # SDPA's boolean mask: True = attend
        if attention_mask is not None:
            allowed = ~attention_mask.to(torch.bool)
        if causal and (allowed is not None or sq != sk):
            # queries are the last sq positions of the sk keys (bottom-right aligned)
            tri = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
            allowed = tri if allowed is None else allowed & tri
            causal = False

        dropout_p = self.dropout_p if self.training else 0.0
        rng = contextlib.nullcontext()
        if dropout_p > 0 and get_cuda_rng_tracker().is_initialized():
            rng = get_cuda_rng_tracker().fork()
        with rng:
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=np_ != ng,
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def core_attentions(model: torch.nn.Module) -> list[SDPAttention]:
    """Every ``SDPAttention`` of ``model`` in layer order."""
    return [m for m in model.modules() if isinstance(m, SDPAttention)]


def set_kv_quant(model: torch.nn.Module, fmt: KVFormat | str | None) -> None:
    """Fake-quantize keys and values in every core attention of ``model`` as a KV-cache in ``fmt``
    stores them (``--kv-quant``; None: off). Refuses a block format that does not divide the head
    dimension, naming the flag."""
    fmt = KVFormat.parse(fmt) if isinstance(fmt, str) else fmt
    for attn in core_attentions(model):
        if fmt is not None:
            fmt.check_head_dim(attn.config.kv_channels, "--kv-quant")
        attn.kv_format = fmt


class PortableSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` whose KV-cache buffers live on the layer's own device.

    megatron-core 0.16.1's ``Attention._allocate_memory`` (called only under a static inference
    context, to make each layer's ``[max_seq, max_batch, ng, hn]`` key and value buffers) allocates
    on ``torch.cuda.current_device()``, so KV-cache inference cannot run on CPU. This is the only
    change: training never calls it, and on GPU the weights' device is that CUDA device.
    """

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        return torch.empty(
            inference_max_sequence_length,
            batch_size,
            self.num_query_groups_per_partition,
            dim,
            dtype=dtype,
            device=self.linear_qkv.weight.device,
        )

"""Our megatron-core GPT -> a Hugging Face Llama / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE checkpoint, BF16 or FP4-packed.

    state, cfg, tok_dir = load_tp1_weights("ckpt/")           # any TP size; hf_converted.pt; plain file
    files = export_hf(state, cfg, "out/")                      # BF16 safetensors + config.json
    files = export_hf(state, cfg, "out/", weight_format="nvfp4")  # compressed-tensors nvfp4-pack-quantized
    formats, acts, note = weight_formats_from_rollout("nvfp4", ["first:1=bf16"], cfg)  # a rollout plan
    files = export_hf(state, cfg, "out/", weight_format=formats, activations=acts)    # layer 0 in BF16

The reverse of ``pretrain.hf_convert`` (its module docstring has the name mapping and the layout
facts): ``linear_qkv``'s per-group ``[q heads; k; v]`` rows split into ``q_proj`` / ``k_proj`` /
``v_proj``, ``linear_fc1 = [gate; up]`` into ``gate_proj`` / ``up_proj``, the vocabulary cut back
to the tokenizer's ``vocab_size`` rows (megatron pads it). The architecture (:func:`hf_architecture`):

    dense, --add-qkv-bias                      Qwen2ForCausalLM
    dense, --qk-layernorm                      Qwen3ForCausalLM
    dense                                      LlamaForCausalLM
    --num-experts, --qk-layernorm              Qwen3MoeForCausalLM (norm_topk_prob = not --moe-router-pre-softmax;
                                               dense layers of --moe-layer-freq -> mlp_only_layers)
    --num-experts                              MixtralForCausalLM (every layer MoE, top-k renormalized)

Each expert's ``linear_fc1 = [gate; up]`` splits into ``gate_proj`` / ``up_proj`` (Mixtral: ``w1`` /
``w3``), ``linear_fc2`` is ``down_proj`` (``w2``), the router is the MoE block's ``gate``. Refused in
one line: what those architectures cannot say (LayerNorm, GELU, learned positions, biases on every
linear, shared experts -- Qwen2-MoE's is gated, ours is not --, sigmoid scores, token dropping by
capacity factor, pre-softmax routing without q/k norms). Training-only router settings: the aux-loss
coefficient is written as ``router_aux_loss_coef``; the z-loss has no HF field.

FP4 export: compressed-tensors' ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` formats
(what vLLM and SGLang load). Every decoder linear's weight is quantized **by our own quantizer**
(``precision.quantize`` with the rollout's Fprop weight format, blocks along in-features) and
stored as the format asks; embeddings, norms and ``lm_head`` stay BF16 (``ignore: [lm_head]``).
Per linear ``L`` of the HF model:

==========================  ==================================  ==========================================
tensor                      compressed-tensors                   ours
==========================  ==================================  ==========================================
``L.weight_packed``         uint8 [out, in/2], two E2M1 codes   ``QuantizedTensor.packed()``: same code
                            per byte, low nibble = even index   table (sign bit 3), same nibble order
``L.weight_scale`` nvfp4    float8_e4m3fn [out, in/16]          our E4M3 block-scale bytes, viewed
``L.weight_scale`` mxfp4    uint8 [out, in/32], E8M0 2^(b-127)  our E8M0 scale bytes as they are
``L.weight_global_scale``   float32 [1] (nvfp4 only)            ``g_enc = 448*6 / amax`` (an *encode*
                                                                scale, like theirs; not our ``g_dec``)
==========================  ==================================  ==========================================

Conventions that differ, and how the export maps them (tested against the real package):
  - NVFP4 global scale: compressed-tensors dequantizes ``w = e2m1 * (s_block / global_scale)``
    (a division), we compute ``e2m1 * (s_block * g_dec)`` with ``g_dec = 1/g_enc`` and on hardware
    apply ``g_dec`` at the GEMM output (vLLM's FP4 kernels do the same with
    ``alpha = 1/(g_w g_x)``). Storing ``global_scale = g_enc`` makes codes, block scales and the
    tensor scale identical. Its CPU decompressor then rounds the weight to BF16 (an FP4 value x an
    E4M3 scale x the FP32 tensor scale is not a BF16 value), which ours does not: its decompressed
    weight equals ours rounded to BF16, bit for bit (tested; in FP32 ``fl(s/g_enc)`` and
    ``fl(s * g_dec)`` may differ by one ulp, which the BF16 rounding absorbs in the tested model).
  - Fused projections: vLLM fuses q/k/v and gate/up and needs one global scale per fused weight
    (llm-compressor makes them equal on export). Ours *is* one tensor (``linear_qkv``,
    ``linear_fc1``), so its ``g_enc`` is written for each part: the parts' codes are exactly the
    fused tensor's rows (blocks run along in-features, inside a row).
  - MXFP4 scale bytes: the E8M0 byte is stored as is; compressed-tensors decodes
    ``2^(byte-127)``, ours too, so MXFP4 weights are bit-identical in any dtype.
  - Packing is compressed-tensors' own: ``pack_fp4_to_uint8`` packs the E2M1 values our codes decode
    to (its code table, sign bit and nibble order are ours, so the bytes are ``packed()``'s, tested
    bit for bit); MXFP4's E8M0 bytes go through its ``compress_mx_scale`` (from ``2^(b-127)``: exact
    for every finite byte). NVFP4's E4M3 block scales are our bytes viewed as ``float8_e4m3fn``: the
    library's own step for them (``NVFP4PackedCompressor``) is that dtype cast, which from our FP32
    decoded scale would round-trip to the same byte -- no packer to call.
  - Mixture of experts: every expert's fc1 / fc2 is packed like a dense linear (fc1 ``[gate; up]``
    one tensor, so gate and up share its ``g_enc``, as vLLM's fused MoE ``w13`` wants); the router
    follows the rollout plan (FP32 by default: BF16 in the file, listed in ``ignore``).
  - Activations: ``mxfp4`` rollouts (dynamic MXFP4 activations, block 32) map to
    compressed-tensors' ``MXFP4`` scheme; an NVFP4 activation's FP32 tensor scale is per call (its
    own amax), which compressed-tensors' ``NVFP4`` scheme cannot say (it wants a calibrated static
    ``input_global_scale``), so NVFP4 exports are weight-only (``NVFP4A16``) and say so in
    ``export_info.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
from sentencepiece import sentencepiece_model_pb2

from model.gpt import ModelConfig, head_size
from model.moe import moe_layer_pattern
from model.rollout_plan import resolve_rollout_plan
from precision.elements import E2M1
from precision.formats import decode_element
from precision.quantize import quantize
from pretrain import hf_convert
from pretrain.checkpointing import TRACKER, checkpoint_tokenizer, load_checkpoint
from pretrain.hf_convert import TOKENIZER_FILES

__all__ = [
    "EXPORT_FORMATS",
    "HFExportError",
    "decoder_linear_names",
    "export_hf",
    "hf_architecture",
    "hf_config",
    "hf_state_dict",
    "load_tp1_weights",
    "quantization_config",
    "quantize_weight",
    "weight_formats_from_rollout",
]

EXPORT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}


class HFExportError(ValueError):
    """A model or checkpoint we cannot export; one line naming the flag or field."""


# ================================================================================================
# Reading our weights (TP=1, whatever TP they were saved at)
# ================================================================================================


def load_tp1_weights(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig, str | None]:
    """(TP=1 state dict without ``_extra_state``, ModelConfig, tokenizer or None) of a
    training checkpoint directory (any TP size: shards merged by ``pretrain.reshard``), a
    ``launch/convert_hf.py`` output, or a plain ``{"model", "model_config"}`` file. Training
    checkpoints need torch.distributed set up (``pretrain.evaluation.loading.init_single_process``).
    The tokenizer is the one that came with the weights: a Hugging Face tokenizer folder, or the
    sentencepiece model a training run used (the copy its checkpoint carries), for :func:`export_hf`."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, TRACKER)):
        ckpt = load_checkpoint(path, tp_size=1, reshard_model=True)
        if ckpt is None or not ckpt.get("model_config"):
            raise HFExportError(f"--load {path}: no checkpoint with a model_config (saved by an older version)")
        tok, tok_type = checkpoint_tokenizer(ckpt["path"], ckpt)
        hf = tok_type == "HuggingFaceTokenizer"
        tok = tok if tok and (os.path.isdir(tok) if hf else os.path.isfile(tok)) else None
        state = {k: v for k, v in ckpt["model"].items() if not k.endswith("._extra_state")}
        return state, ModelConfig(**ckpt["model_config"]), tok
    file = os.path.join(path, hf_convert.FILE_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise HFExportError(f"--load {path}: neither a training checkpoint ({TRACKER}) nor a "
                            f"{hf_convert.FILE_NAME} / plain weights file")
    payload = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "model" not in payload or "model_config" not in payload:
        raise HFExportError(f"--load {file}: expected a dict with 'model' and 'model_config'")
    state = {k: v for k, v in payload["model"].items() if not k.endswith("._extra_state")}
    tok = hf_convert.converted_tokenizer_dir(payload, file) if payload.get("format") == hf_convert.FORMAT else None
    return state, ModelConfig(**payload["model_config"]), tok


# ================================================================================================
# Names, layouts, config
# ================================================================================================


def _check_exportable(cfg: ModelConfig) -> None:
    problems = [(cfg.normalization != "RMSNorm", f"--normalization {cfg.normalization}"),
                (cfg.activation != "swiglu", f"--activation {cfg.activation}"),
                (cfg.position_embedding != "rope", f"--position-embedding-type {cfg.position_embedding}"),
                (cfg.add_bias_linear, "--add-bias-linear"),
                (cfg.add_qkv_bias and cfg.qk_layernorm, "--add-qkv-bias with --qk-layernorm")]
    bad = [what for cond, what in problems if cond]
    if bad:
        raise HFExportError(f"model: {', '.join(bad)} has no Hugging Face Llama/Qwen2/Qwen3 equivalent (needs "
                            f"RMSNorm, swiglu, rope, no linear biases except --add-qkv-bias)")
    if cfg.num_experts is None:
        return
    moe = [(cfg.moe_shared_expert_intermediate_size is not None,
            f"--moe-shared-expert-intermediate-size {cfg.moe_shared_expert_intermediate_size} (Qwen3-MoE and Mixtral "
            "have no shared expert; Qwen2-MoE's is gated)"),
           (cfg.moe_router_score_function != "softmax",
            f"--moe-router-score-function {cfg.moe_router_score_function} (softmax only)"),
           (cfg.moe_expert_capacity_factor is not None,
            f"--moe-expert-capacity-factor {cfg.moe_expert_capacity_factor} (transformers drops no tokens)"),
           (cfg.add_qkv_bias, "--add-qkv-bias"),
           (not cfg.qk_layernorm and cfg.moe_router_pre_softmax,
            "--moe-router-pre-softmax without --qk-layernorm (Mixtral always renormalizes the top-k weights)"),
           (not cfg.qk_layernorm and not all(moe_layer_pattern(cfg.num_layers, cfg.moe_layer_freq)),
            f"--moe-layer-freq {cfg.moe_layer_freq} without --qk-layernorm (Mixtral: every layer MoE)")]
    bad = [what for cond, what in moe if cond]
    if bad:
        raise HFExportError(f"mixture-of-experts model: {bad[0]} has no Hugging Face Qwen3-MoE / Mixtral equivalent")


def hf_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture ``cfg`` exports as (module docstring); refuses in one line."""
    _check_exportable(cfg)
    if cfg.num_experts is not None:
        return "Qwen3MoeForCausalLM" if cfg.qk_layernorm else "MixtralForCausalLM"
    if cfg.qk_layernorm:
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if cfg.add_qkv_bias else "LlamaForCausalLM"


def _moe_layers(cfg: ModelConfig) -> list[int]:
    return moe_layer_pattern(cfg.num_layers, cfg.moe_layer_freq) if cfg.num_experts else [0] * cfg.num_layers


def _hf_linears(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """``{our decoder linear: its HF linears}`` (fused ones -- linear_qkv, linear_fc1 -- have several)."""
    mixtral = hf_architecture(cfg) == "MixtralForCausalLM"
    out = {}
    for i, is_moe in enumerate(_moe_layers(cfg)):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[ours + "self_attention.linear_qkv"] = tuple(f"{hf}self_attn.{p}_proj" for p in "qkv")
        out[ours + "self_attention.linear_proj"] = (f"{hf}self_attn.o_proj",)
        if not is_moe:
            out[ours + "mlp.linear_fc1"] = (f"{hf}mlp.gate_proj", f"{hf}mlp.up_proj")
            out[ours + "mlp.linear_fc2"] = (f"{hf}mlp.down_proj",)
            continue
        block = hf + ("block_sparse_moe." if mixtral else "mlp.")
        out[ours + "mlp.router"] = (block + "gate",)
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(cfg.num_experts):
            expert = f"{ours}mlp.experts.local_experts.{e}."
            out[expert + "linear_fc1"] = (f"{block}experts.{e}.{gate}", f"{block}experts.{e}.{up}")
            out[expert + "linear_fc2"] = (f"{block}experts.{e}.{down}",)
    return out


def _split_qkv(t: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's per-group ``[q heads of g; k_g; v_g]`` rows -> HF's q, k, v (inverse of
    ``hf_convert._grouped_qkv``)."""
    groups, head_dim = cfg.num_query_groups, head_size(cfg)
    per_group = cfg.num_attention_heads // groups
    rest = t.shape[1:]
    g = t.reshape(groups, (per_group + 2) * head_dim, *rest)
    q, k, v = g.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our TP=1 names -> HF names (dtype kept). Every tensor of ``state`` must be used."""
    _check_exportable(cfg)
    st = dict(state)

    def take(name: str) -> torch.Tensor:
        try:
            return st.pop(name)
        except KeyError:
            raise HFExportError(f"checkpoint has no tensor {name!r}") from None

    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")[: cfg.vocab_size]}
    for ours, parts in _hf_linears(cfg).items():
        w = take(ours + ".weight")
        if ours.endswith("linear_qkv"):
            out.update({f"{p}.weight": t for p, t in zip(parts, _split_qkv(w, cfg))})
            if cfg.add_qkv_bias:
                out.update({f"{p}.bias": t for p, t in zip(parts, _split_qkv(take(ours + ".bias"), cfg))})
        elif len(parts) == 2:  # linear_fc1 = [gate; up]
            out[f"{parts[0]}.weight"], out[f"{parts[1]}.weight"] = w.chunk(2, dim=0)
        else:
            out[f"{parts[0]}.weight"] = w
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "pre_mlp_layernorm.weight")
        if cfg.qk_layernorm:
            for p in "qk":
                out[f"{dst}self_attn.{p}_norm.weight"] = take(f"{src}self_attention.{p}_layernorm.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if cfg.untie_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")[: cfg.vocab_size]
    else:
        st.pop("output_layer.weight", None)  # a last pipeline stage's copy of the tied table
    if st:
        raise HFExportError(f"checkpoint has {len(st)} tensor(s) the export does not map, e.g. {min(st)!r}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """``config.json`` for ``cfg`` (the inverse of ``hf_convert.model_config_from_hf``)."""
    arch = hf_architecture(cfg)
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}[arch]
    d = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": head_size(cfg),
        "max_position_embeddings": cfg.seq_length,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": float(cfg.rotary_base),
        "tie_word_embeddings": not cfg.untie_embeddings,
        "initializer_range": cfg.init_method_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        d.update(attention_bias=False)
    if model_type == "llama":
        d.update(mlp_bias=False)
    if model_type in ("qwen3", "qwen3_moe"):
        d.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3_moe":
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                 norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
                 mlp_only_layers=[i for i, m in enumerate(_moe_layers(cfg)) if not m],
                 router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False)
    if model_type == "mixtral":
        d.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, sliding_window=None,
                 router_jitter_noise=0.0, router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False)
    if cfg.rope_scaling_factor is not None:
        d["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                             **hf_convert._MEGATRON_ROPE_SCALING}
    return d


# ================================================================================================
# FP4 weights in compressed-tensors' layout
# ================================================================================================


def quantize_weight(w: torch.Tensor, fmt, amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``{"weight_packed", "weight_scale"[, "weight_global_scale"]}`` of one ``[out, in]`` weight,
    quantized by ``precision.quantize`` along in-features (the Fprop contraction axis) in ``fmt``
    (an ``OperandFormat`` or format name: nvfp4 / mxfp4). ``amax``: NVFP4's tensor amax (the fused
    projection's, see the module docstring); default the weight's own."""
    name = getattr(fmt, "fmt", fmt)
    if name not in EXPORT_FORMATS:
        raise HFExportError(f"--rollout-precision: weight format {name!r} has no compressed-tensors export; "
                            f"valid: {', '.join(EXPORT_FORMATS)}")
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    q = quantize(w.float(), fmt, axis=1, amax=amax)
    # our codes decide the values; the library packs them (its table is ours: module docstring)
    out = {"weight_packed": pack_fp4_to_uint8(decode_element(q.codes, E2M1))}
    if name == "nvfp4":
        out["weight_scale"] = q.scales.view(torch.float8_e4m3fn)
        out["weight_global_scale"] = q.tensor_scale.reshape(1).float()
    else:
        if bool((q.scales == 255).any()):  # E8M0 NaN: a non-finite weight
            raise HFExportError(f"weight {tuple(w.shape)}: a non-finite value gives an E8M0 NaN block scale")
        out["weight_scale"] = compress_mx_scale(torch.exp2(q.scales.float() - 127), torch.uint8)
    return out


def quantization_config(weight_format: str, activations: bool) -> dict:
    """compressed-tensors' ``quantization_config`` for decoder linears in ``weight_format``;
    ``activations``: dynamic MXFP4 activations too (mxfp4 only, see the module docstring)."""
    group = 16 if weight_format == "nvfp4" else 32
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "group_size": group,
               "strategy": "tensor_group" if weight_format == "nvfp4" else "group",
               "scale_dtype": "torch.float8_e4m3fn" if weight_format == "nvfp4" else "torch.uint8",
               "zp_dtype": "torch.float8_e4m3fn" if weight_format == "nvfp4" else "torch.uint8",
               "observer": "memoryless_minmax"}
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
              "format": EXPORT_FORMATS[weight_format]}
    if activations:
        scheme["input_activations"] = {**weights, "dynamic": True, "observer": None}
    return {"quant_method": "compressed-tensors", "format": EXPORT_FORMATS[weight_format],
            "quantization_status": "compressed", "config_groups": {"group_0": scheme}, "ignore": ["lm_head"],
            "kv_cache_scheme": None}


def _fused_amax(hf: dict[str, torch.Tensor], parts: tuple[str, ...]) -> torch.Tensor:
    return torch.stack([hf[f"{p}.weight"].float().abs().amax() for p in parts]).amax()


def decoder_linear_names(cfg: ModelConfig) -> list[str]:
    """Our decoder linears' names (``model.gpt.policy_linear_names`` without the output layer)."""
    return list(_hf_linears(cfg))


def _per_linear(weight_format, cfg: ModelConfig) -> dict[str, object]:
    """``{our decoder linear: weight format or None (BF16)}`` from one format or a mapping. One format
    leaves the MoE routers dense, as the rollout presets do (``kind:router=fp32``)."""
    if isinstance(weight_format, dict):
        return {n: weight_format.get(n) for n in decoder_linear_names(cfg)}
    return {n: None if n.endswith(".mlp.router") else weight_format for n in decoder_linear_names(cfg)}


def _quantize_linears(hf: dict[str, torch.Tensor], cfg: ModelConfig, formats: dict) -> tuple[dict, list[str]]:
    """Replace the decoder linears' ``weight`` with their packed form where ``formats`` gives an FP4
    format (biases stay BF16); returns the new state and the HF linears left in BF16."""
    out, dense, linears = dict(hf), [], _hf_linears(cfg)
    for name, fmt in formats.items():
        parts = linears[name]
        if fmt is None:
            dense += list(parts)
            continue
        nv = getattr(fmt, "fmt", fmt) == "nvfp4"
        amax = _fused_amax(hf, parts) if nv else None  # the fused tensor's amax: its g_enc
        for lin in parts:
            for k, v in quantize_weight(out.pop(f"{lin}.weight"), fmt, amax).items():
                out[f"{lin}.{k}"] = v
    return out, dense


def weight_formats_from_rollout(value: str, rules, cfg: ModelConfig) -> tuple[dict, bool, str]:
    """``--rollout-precision`` (+ ``--rollout-precision-rule``) -> (``{our linear: weight
    OperandFormat or None}``, whether MXFP4 activations are declared, a note for export_info).
    Refused in one line: weight formats compressed-tensors' FP4 packing cannot hold, two FP4
    formats in one model, a rotation (the exported weight would be the rotated one)."""
    names = decoder_linear_names(cfg) + ["output_layer"]
    plan = resolve_rollout_plan(value, list(rules), names, cfg.num_layers, head_size(cfg))
    formats, xs = {}, set()
    for n in decoder_linear_names(cfg):
        recipe = plan.fprop(n)
        w = recipe.b
        if recipe.rotation != "none":
            raise HFExportError(f"--rollout-precision {value}: {n} rotates its operands ({recipe.rotation}); "
                                "the exported weights would be rotated ones, which no HF loader undoes")
        if w.fmt in ("bf16", "fp32"):  # fp32: the router's built-in rule; stored BF16 like every dense weight
            formats[n] = None
            continue
        if w.fmt not in EXPORT_FORMATS:
            raise HFExportError(f"--rollout-precision {value}: {n} weight format {w.fmt} has no compressed-tensors "
                                f"export; valid: bf16, {', '.join(EXPORT_FORMATS)}")
        formats[n] = w
        xs.add(recipe.a.fmt)
    used = {f.fmt for f in formats.values() if f is not None}
    if len(used) > 1:
        raise HFExportError(f"--rollout-precision {value}: mixes weight formats {', '.join(sorted(used))}; "
                            "an export holds one FP4 format")
    acts = used == {"mxfp4"} and xs == {"mxfp4"}
    note = ("activations: dynamic MXFP4 (block 32), as the rollout" if acts else
            f"activations: not declared (rollout x formats {', '.join(sorted(xs)) or '-'}; only dynamic MXFP4 "
            "activations can be)")
    return formats, acts, note + f"; KV-cache {plan.kv.fmt}: not part of the export"


# ================================================================================================
# Files
# ================================================================================================


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str, *, weight_format=None,
              activations: bool = False, tokenizer: str | None = None, info: dict | None = None) -> list[str]:
    """Write ``out_dir/{config.json, model.safetensors, export_info.json}`` and the tokenizer in
    Hugging Face's format: ``tokenizer`` a Hugging Face tokenizer folder (its files copied) or a
    sentencepiece model (:func:`write_sentencepiece_tokenizer`). ``weight_format``: None (BF16); ``"nvfp4"`` / ``"mxfp4"`` or an
    ``OperandFormat`` of them for every decoder linear; or ``{our linear name: format or None}``
    (:func:`weight_formats_from_rollout`), BF16 ones listed in the scheme's ``ignore``.
    ``activations``: declare dynamic MXFP4 input activations (mxfp4 only). Returns the files written."""
    from safetensors.torch import save_file

    formats = _per_linear(weight_format, cfg)
    routers = [n for n, f in formats.items() if f is not None and n.endswith(".mlp.router")]
    if routers:
        raise HFExportError(f"--rollout-precision: {routers[0]} would be FP4-packed; the MoE router gate is an "
                            "unquantized layer in transformers and vLLM (keep the router in BF16/FP32: the preset's "
                            "kind:router=fp32)")
    used = {getattr(f, "fmt", f) for f in formats.values() if f is not None}
    bad = sorted(used - set(EXPORT_FORMATS))
    if bad:
        raise HFExportError(f"--rollout-precision: weight format {bad[0]!r} has no compressed-tensors export; "
                            f"valid: {', '.join(EXPORT_FORMATS)}")
    if len(used) > 1:
        raise HFExportError(f"--rollout-precision: mixes weight formats {', '.join(sorted(used))}")
    name = next(iter(used), None)
    if activations and name != "mxfp4":
        raise HFExportError(f"--rollout-precision: {name} activations cannot be declared in compressed-tensors' "
                            f"format (only dynamic MXFP4 activations can); export the weights alone")
    hf = hf_state_dict(state, cfg)
    dense: list[str] = []
    if name is not None:
        hf, dense = _quantize_linears({k: v.float() for k, v in hf.items()}, cfg, formats)
    packed_keys = ("weight_packed", "weight_scale", "weight_global_scale")
    hf = {k: (v if k.rsplit(".", 1)[-1] in packed_keys else v.to(torch.bfloat16)) for k, v in hf.items()}
    os.makedirs(out_dir, exist_ok=True)
    config = hf_config(cfg)
    if name is not None:
        config["quantization_config"] = quantization_config(name, activations)
        config["quantization_config"]["ignore"] += dense
    files = [os.path.join(out_dir, "config.json"), os.path.join(out_dir, "model.safetensors"),
             os.path.join(out_dir, "export_info.json")]
    with open(files[0], "w") as f:
        json.dump(config, f, indent=2)
    save_file(hf, files[1], metadata={"format": "pt"})
    meta = {"weights": name or "bf16", "bf16_linears": dense,
            "activations": ("mxfp4 (dynamic, block 32)" if activations else "not quantized by the export (weight-only)"),
            "model_config": dataclasses.asdict(cfg), **(info or {})}
    with open(files[2], "w") as f:
        json.dump(meta, f, indent=2)
    if tokenizer and os.path.isdir(tokenizer):
        for fn in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, fn)):
                shutil.copy2(os.path.join(tokenizer, fn), out_dir)
                files.append(os.path.join(out_dir, fn))
    elif tokenizer:
        files += write_sentencepiece_tokenizer(tokenizer, out_dir, model_max_length=cfg.seq_length)
    return files


# The sentencepiece settings Hugging Face's Llama tokenizer reproduces (pretrain.data.train_tokenizer's):
# BPE pieces, text as given (no normalization, whitespace kept), no dummy prefix unless the model adds one.
_SP_BPE = 2  # sentencepiece's TrainerSpec.model_type BPE


def write_sentencepiece_tokenizer(model_file: str, out_dir: str, model_max_length: int | None = None) -> list[str]:
    """A sentencepiece BPE model in Hugging Face's format: ``tokenizer.model`` (the model itself),
    ``tokenizer.json`` and ``tokenizer_config.json``, converted by transformers' ``LlamaTokenizer``
    (byte fallback, user-defined pieces such as ``"\\n"`` as non-special added tokens, no BOS / EOS
    added: ``AutoTokenizer`` encodes a text to the ids ``pretrain.data.Tokenizer.tokenize`` gives).
    A model whose segmentation it would not reproduce (unigram, a normalization rule, collapsed
    whitespace) is refused in one line. Returns the files written."""
    # transformers: an optional dependency (the [hf] extra), and seconds to import
    try:
        from transformers import LlamaTokenizer
    except ImportError:
        raise HFExportError(f"{model_file}: writing the tokenizer in Hugging Face's format needs transformers "
                            "(pip install '.[hf]')") from None
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        with open(model_file, "rb") as f:
            proto.ParseFromString(f.read())
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and OSError alike: not a model file
        raise HFExportError(f"tokenizer {model_file}: not a sentencepiece model ({e})") from None
    norm = proto.normalizer_spec
    unlike = [why for bad, why in (
        (proto.trainer_spec.model_type != _SP_BPE, "not a BPE model"),
        (norm.name not in ("identity", "") or bool(norm.precompiled_charsmap), f"normalization rule {norm.name!r}"),
        (norm.remove_extra_whitespaces, "it collapses whitespace"),
        (not proto.trainer_spec.byte_fallback, "no byte fallback")) if bad]
    if unlike:
        raise HFExportError(f"tokenizer {model_file}: {unlike[0]}; Hugging Face's Llama tokenizer would not "
                            "segment text as it does (a model from launch/preprocess_data.py --train-tokenizer does)")
    shutil.copy2(model_file, os.path.join(out_dir, "tokenizer.model"))
    tok = LlamaTokenizer.from_pretrained(out_dir, legacy=False, add_prefix_space=norm.add_dummy_prefix,
                                         add_bos_token=False, add_eos_token=False,
                                         **({"model_max_length": model_max_length} if model_max_length else {}))
    written = [os.path.join(out_dir, "tokenizer.model"), *tok.save_pretrained(out_dir)]
    # The conversion lists user-defined pieces among the special tokens, which tokenizer.json does not
    # mark special (so decoding keeps them); the config says the same. Drop the loading-time keys.
    config_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    special = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    config["extra_special_tokens"] = [t for t in config.get("extra_special_tokens", []) if t in special]
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    return sorted(set(written))

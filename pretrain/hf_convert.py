"""Hugging Face Llama / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE checkpoints -> our megatron-core GPT (``model.gpt``).

    payload = convert_hf_checkpoint("Llama-3.2-1B/")        # config.json + *.safetensors
    path = save_converted(payload, "out/")                  # out/hf_converted.pt
    state, cfg, source = load_converted(path)
    model = build_gpt(cfg)                                  # any tensor-parallel size
    load_converted_state_dict(model, state, cfg)            # shards for this TP rank

Converted file format (``OUT/hf_converted.pt``, a plain ``torch.save`` of a dict):

    format          "hf_converted"
    format_version  1
    model           {name: tensor}: our module names at TP=1, the checkpoint's own dtype, the
                    vocabulary *unpadded* (``model_config['vocab_size']`` rows); no ``_extra_state``
    model_config    ``dataclasses.asdict(ModelConfig)`` (``ModelConfig(**d)`` rebuilds it)
    source          {"hf_dir", "architecture", "model_type", "transformers_version", "dtype",
                     "files": [safetensors names], "tokenizer_dir": OUT/hf_tokenizer or None}

Name mapping (TP=1; ``i`` = layer, ``e`` = expert):

    model.embed_tokens.weight                       embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight           decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{w,b}     decoder.layers.i.self_attention.linear_qkv.{w,b}
    model.layers.i.self_attn.{q,k}_norm.weight      decoder.layers.i.self_attention.{q,k}_layernorm.weight (Qwen3)
    model.layers.i.self_attn.o_proj.weight          decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight  decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight        decoder.layers.i.mlp.linear_fc1.weight = [gate; up]
    model.layers.i.mlp.down_proj.weight             decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                               decoder.final_layernorm.weight
    lm_head.weight (absent when tied)               output_layer.weight (absent when tied)

  Mixture-of-experts layers (Qwen3-MoE ``mlp.``; Mixtral ``block_sparse_moe.`` with w1 = gate,
  w3 = up, w2 = down):

    model.layers.i.mlp.gate.weight                  decoder.layers.i.mlp.router.weight
    model.layers.i.mlp.experts.e.{gate,up}_proj     decoder.layers.i.mlp.experts.local_experts.e.linear_fc1 = [gate; up]
    model.layers.i.mlp.experts.e.down_proj          decoder.layers.i.mlp.experts.local_experts.e.linear_fc2

Routing (megatron-core 0.16's ``TopKRouter``, softmax scores, ``topk_routing_with_score_function``):
  - Mixtral and Qwen3-MoE with ``norm_topk_prob: true`` take the softmax over all experts, keep the
    top k and renormalize them to sum to one: that is ``softmax(top-k logits)``, megatron's default
    (``moe_router_pre_softmax`` false). Qwen3-MoE with ``norm_topk_prob: false`` keeps the top-k
    softmax probabilities as they are: ``--moe-router-pre-softmax``. Same experts either way (softmax
    is monotonic); the weights agree to rounding.
  - Which layers are sparse: Qwen3-MoE's ``decoder_sparse_step`` / ``mlp_only_layers`` become the
    per-layer ``--moe-layer-freq`` list (every layer for Mixtral); dense layers keep
    ``intermediate_size``, experts ``moe_intermediate_size``.
  - Training-only settings: ``router_aux_loss_coef`` -> ``--moe-aux-loss-coeff`` (the switch
    load-balancing loss in both; transformers adds it only with ``output_router_logits``); Mixtral's
    ``router_jitter_noise`` other than 0 is refused. Shared experts with a sigmoid gate (Qwen2-MoE)
    are refused: our MoE layer's shared expert has no gate.

Layout facts (megatron-core 0.16.1), each checked against transformers by the tests:
  - ``linear_qkv`` rows are grouped per query group g: [q heads of g; k_g; v_g]
    (``SelfAttention.get_query_key_value_tensors`` views the output as [ng, (np/ng + 2) * hn]).
    Contiguous TP shards of that layout are whole groups, so ``linear_qkv`` shards plainly on dim 0.
  - ``linear_fc1`` is [gate; up]: megatron's GLU computes ``silu(chunk 0) * chunk 1`` on each
    rank's output, so rank r holds [gate_r; up_r] (``partition_stride`` 2).
  - RoPE: megatron's ``rotary_interleaved=False`` rotates halves ([-x2, x1]) with frequencies
    ``cat(f, f)``, exactly HF's ``rotate_half``; no q/k permutation is needed. Llama-3 RoPE scaling
    maps to megatron's ``rope_scaling`` (factor only: megatron fixes the low/high frequency factors
    at 1 and 4 and the original context at 8192, so other values are refused).
  - RMSNorm: both compute ``w * x / sqrt(mean(x^2) + eps)``; ``rms_norm_eps`` -> ``layernorm_epsilon``.
    Qwen3's per-head ``q_norm`` / ``k_norm`` (before RoPE) are megatron's ``q_layernorm`` /
    ``k_layernorm`` (``--qk-layernorm``), the same RMSNorm over each head's channels.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

import torch
from megatron.core import parallel_state

from model.gpt import ModelConfig, head_size
from model.moe import moe_layer_pattern
from pretrain.reshard import ReshardError, model_layout, shard_tensor

FORMAT = "hf_converted"
FORMAT_VERSION = 1
FILE_NAME = "hf_converted.pt"
SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
MOE_ARCHS = ("mixtral", "qwen3_moe")
# architectures we name a reason for refusing
_REFUSED = {"Qwen2MoeForCausalLM": "its shared expert has a sigmoid gate our MoE layer does not have",
            "DeepseekV3ForCausalLM": "multi-latent attention is not supported"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")
_TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a tokenizer
_MEGATRON_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFConvertError(ValueError):
    """A Hugging Face checkpoint we cannot convert; the message is one line naming the file or field."""


# ================================================================================================
# Reading a Hugging Face directory
# ================================================================================================


def read_hf_config(hf_dir: str) -> dict:
    """``hf_dir/config.json`` as a dict (errors name ``--hf-dir`` and the missing file)."""
    if not os.path.isdir(hf_dir):
        raise HFConvertError(f"--hf-dir {hf_dir}: no such directory")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFConvertError(f"--hf-dir {hf_dir}: no config.json (expected a Hugging Face model directory)")
    with open(path) as f:
        return json.load(f)


def safetensors_files(hf_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        bins = [os.path.basename(p) for p in glob.glob(os.path.join(hf_dir, "*.bin"))]
        hint = f" (found {', '.join(bins)}: re-save with safe_serialization=True)" if bins else ""
        raise HFConvertError(f"--hf-dir {hf_dir}: no *.safetensors weight files{hint}")
    return files


def read_hf_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of ``hf_dir/*.safetensors`` (sharded checkpoints included), on CPU."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(hf_dir):
        state.update(load_file(path, device="cpu"))
    return state


# ================================================================================================
# Config
# ================================================================================================


def _rope(hf: dict) -> tuple[float, float | None]:
    """(rope theta, Llama-3 scaling factor or None) from old- or new-style (``rope_parameters``) configs."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise HFConvertError(f"config.json: rope type {rope_type!r} is not supported (supported: default, llama3)")
    for key, want in _MEGATRON_ROPE_SCALING.items():
        if float(params.get(key, want)) != want:
            raise HFConvertError(f"config.json: llama3 rope scaling with {key}={params[key]} is not supported "
                                 f"(megatron-core fixes it at {want:g})")
    return theta, float(params["factor"])


def model_config_from_hf(hf_config: dict, *, seq_length: int | None = None) -> ModelConfig:
    """Our ``ModelConfig`` for a Llama- or Qwen2-style ``config.json`` dict.

    ``seq_length`` defaults to ``max_position_embeddings`` (it only bounds evaluation contexts: RoPE
    models have no position table); training sets its own ``--seq-length``.
    """
    arch = (hf_config.get("architectures") or [None])[0]
    if arch in _REFUSED:
        raise HFConvertError(f"config.json: architectures [{arch!r}] is not supported: {_REFUSED[arch]} "
                             f"(supported: {', '.join(SUPPORTED)})")
    if arch not in SUPPORTED:
        raise HFConvertError(f"config.json: architectures {hf_config.get('architectures')} is not supported "
                             f"(supported: {', '.join(SUPPORTED)})")
    kind = SUPPORTED[arch]
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads  # Qwen3: its own (128), whatever hidden / heads is
    if hf_config.get("hidden_act", "silu") != "silu":
        raise HFConvertError(f"config.json: hidden_act {hf_config['hidden_act']!r} is not supported (silu only)")
    if hf_config.get("mlp_bias") or hf_config.get("attention_bias"):
        raise HFConvertError("config.json: attention_bias / mlp_bias are not supported")
    if hf_config.get("use_sliding_window"):
        raise HFConvertError("config.json: use_sliding_window is not supported")
    if kind == "mixtral" and hf_config.get("sliding_window") is not None:
        raise HFConvertError(f"config.json: sliding_window {hf_config['sliding_window']} is not supported "
                             "(full causal attention only: null)")
    theta, scaling = _rope(hf_config)
    return ModelConfig(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        seq_length=seq_length or hf_config.get("max_position_embeddings", 2048),
        vocab_size=hf_config["vocab_size"],
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding="rope",
        untie_embeddings=not hf_config.get("tie_word_embeddings", False),
        add_bias_linear=False,
        add_qkv_bias=kind == "qwen2",
        qk_layernorm=kind in ("qwen3", "qwen3_moe"),
        kv_channels=None if head_dim * heads == hidden else head_dim,
        init_method_std=hf_config.get("initializer_range", 0.02),
        rotary_base=int(theta) if float(theta).is_integer() else float(theta),
        rope_scaling_factor=scaling,
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        **(_moe_fields(hf_config, kind) if kind in MOE_ARCHS else {}),
    )


def hf_moe_layers(hf_config: dict) -> list[int]:
    """One 0/1 per layer: which layers of a Qwen3-MoE config are sparse (transformers' rule: layer
    ``i`` unless ``i in mlp_only_layers``, and only if ``(i + 1) % decoder_sparse_step == 0``)."""
    step = hf_config.get("decoder_sparse_step", 1) or 1
    only_mlp = set(hf_config.get("mlp_only_layers") or [])
    return [int(i not in only_mlp and (i + 1) % step == 0) for i in range(hf_config["num_hidden_layers"])]


def _moe_fields(hf: dict, kind: str) -> dict:
    """Our MoE ModelConfig fields for a Mixtral / Qwen3-MoE config (module docstring: Routing)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise HFConvertError(f"config.json: {kind} config without num_local_experts / num_experts")
    fields = {"num_experts": experts, "moe_router_topk": hf["num_experts_per_tok"],
              "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0),
              "moe_router_score_function": "softmax", "moe_shared_expert_intermediate_size": None}
    if kind == "mixtral":
        if hf.get("router_jitter_noise"):
            raise HFConvertError(f"config.json: router_jitter_noise {hf['router_jitter_noise']} is not supported "
                                 "(megatron-core's router has no multiplicative jitter; 0 is)")
        return {**fields, "moe_ffn_hidden_size": hf["intermediate_size"], "moe_router_pre_softmax": False}
    pattern = hf_moe_layers(hf)
    if not any(pattern):
        raise HFConvertError("config.json: decoder_sparse_step / mlp_only_layers leave no sparse layer "
                             "(a dense model: convert it as Qwen3ForCausalLM)")
    return {**fields, "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
            "moe_layer_freq": 1 if all(pattern) else tuple(pattern)}


# ================================================================================================
# Weights
# ================================================================================================


def _grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF's separate q/k/v (weights [out, in] or biases [out]) -> megatron's per-group [q..; k; v] rows."""
    groups, head_dim = cfg.num_query_groups, head_size(cfg)
    per_group = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * head_dim, *rest)
    k = k.reshape(groups, head_dim, *rest)
    v = v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def convert_state_dict(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                       architecture: str | None = None) -> dict[str, torch.Tensor]:
    """HF tensor names -> our TP=1 names (see the module docstring). Every HF tensor must be used.
    ``architecture``: the config's (``MixtralForCausalLM`` names its experts w1/w2/w3)."""
    hf = dict(hf_state)
    for name in [n for n in hf if n.endswith("rotary_emb.inv_freq")]:  # old checkpoints: a buffer
        del hf[name]

    def take(name: str) -> torch.Tensor:
        try:
            return hf.pop(name)
        except KeyError:
            raise HFConvertError(f"HF checkpoint has no tensor {name!r}") from None

    moe = moe_layer_pattern(cfg.num_layers, cfg.moe_layer_freq) if cfg.num_experts else [0] * cfg.num_layers
    mixtral = architecture == "MixtralForCausalLM"
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "self_attention.linear_qkv.weight"] = _grouped_qkv(
            *(take(f"{attn}{p}_proj.weight") for p in "qkv"), cfg)
        if cfg.add_qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _grouped_qkv(*(take(f"{attn}{p}_proj.bias") for p in "qkv"), cfg)
        out[dst + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        if cfg.qk_layernorm:
            for p in "qk":
                out[f"{dst}self_attention.{p}_layernorm.weight"] = take(f"{attn}{p}_norm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        if moe[i]:
            block = src + ("block_sparse_moe." if mixtral else "mlp.")
            out[dst + "mlp.router.weight"] = take(block + "gate.weight")
            for e in range(cfg.num_experts):
                ex, ours = f"{block}experts.{e}.", f"{dst}mlp.experts.local_experts.{e}."
                names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                gate, up, down = (take(f"{ex}{n}.weight") for n in names)
                out[ours + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
                out[ours + "linear_fc2.weight"] = down
            continue
        gate, up = take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if cfg.untie_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    else:
        hf.pop("lm_head.weight", None)  # some tied checkpoints store the shared table twice
    if hf:
        extra = sorted(hf)
        raise HFConvertError(f"HF checkpoint has {len(extra)} tensor(s) this converter does not map, "
                             f"e.g. {extra[0]!r} (num_hidden_layers {cfg.num_layers})")
    return out


@torch.no_grad()
def load_converted_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Copy a converted TP=1 ``state`` into ``model`` (built from ``cfg`` at any TP size and any
    pipeline stage, unwrapped).

    Every parameter must be present with the right shape and no tensor may be left over (with
    pipeline parallelism: none of this stage's); the policy linears' ``_extra_state``
    (quantization state) keeps the model's own. Casts to each parameter's dtype. This rank's slices
    come from ``pretrain.reshard.shard_tensor`` with the model's own megatron attributes
    (vocabulary zero-padded to ``padded_vocab_size(cfg, tp)`` rows: the padded logits are not
    tokens; evaluation drops them). A pipeline stage's layers are numbered from 0 in its module
    names; their weights are the converted ones of the same *global* layer
    (``PolicyGPTModel.plan_name``). With tied embeddings, a last stage that does not also hold the
    embedding gets the embedding table as its ``output_layer.weight`` (megatron keeps the two
    copies equal from then on).
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    params = dict(model.named_parameters())
    global_name = getattr(model, "plan_name", lambda n: n)

    def source(name: str) -> str:
        if name == "output_layer.weight" and not cfg.untie_embeddings:
            return "embedding.word_embeddings.weight"  # tied: the last stage's copy of the table
        return global_name(name)

    missing = sorted(source(n) for n in params if source(n) not in state)
    used = {source(n) for n in params}
    unknown = [] if pipelined else sorted(set(state) - used)  # other stages' weights are not ours
    if missing or unknown:
        raise HFConvertError(f"converted weights do not fit this model: missing {missing[:3]}, "
                             f"unexpected {unknown[:3]}")
    layout = model_layout(model)
    for name, param in params.items():
        try:
            shard = shard_tensor(name, state[source(name)], layout[name], cfg, tp_rank, tp_size)
        except ReshardError as e:
            raise HFConvertError(str(e)) from None
        if shard.shape != param.shape:
            raise HFConvertError(f"{name}: converted shard {tuple(shard.shape)} != model {tuple(param.shape)} "
                                 f"at TP rank {tp_rank}/{tp_size}")
        param.copy_(shard)


# ================================================================================================
# Files
# ================================================================================================


def convert_hf_checkpoint(hf_dir: str, *, seq_length: int | None = None) -> dict:
    """Read and convert ``hf_dir``; returns the payload ``save_converted`` writes (see module docstring)."""
    hf_config = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf_config, seq_length=seq_length)
    files = safetensors_files(hf_dir)
    hf_state = read_hf_state_dict(hf_dir)
    state = convert_state_dict(hf_state, cfg, hf_config["architectures"][0])
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": state,
        "model_config": dataclasses.asdict(cfg),
        "source": {
            "hf_dir": os.path.abspath(hf_dir),
            "architecture": hf_config["architectures"][0],
            "model_type": hf_config.get("model_type"),
            "transformers_version": hf_config.get("transformers_version"),
            "dtype": ",".join(dtypes),
            "files": [os.path.basename(f) for f in files],
            "tokenizer_dir": None,
        },
    }


def save_converted(payload: dict, out_dir: str) -> str:
    """Write ``out_dir/hf_converted.pt`` (atomically) and copy the HF tokenizer files, if any, to
    ``out_dir/hf_tokenizer/``; returns the file's path."""
    os.makedirs(out_dir, exist_ok=True)
    hf_dir = payload["source"]["hf_dir"]
    tok_files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    if set(tok_files) & set(_TOKENIZER_MODELS):
        tok_dir = os.path.join(os.path.abspath(out_dir), "hf_tokenizer")
        os.makedirs(tok_dir, exist_ok=True)
        for f in tok_files:
            shutil.copy2(os.path.join(hf_dir, f), tok_dir)
        payload = {**payload, "source": {**payload["source"], "tokenizer_dir": tok_dir}}
    path = os.path.join(out_dir, FILE_NAME)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def read_converted(path: str, *, mmap: bool = False) -> dict:
    """The checked payload of a converted file (or its directory); ``mmap=True`` reads no tensor
    data until it is used (for the config alone)."""
    if os.path.isdir(path):
        path = os.path.join(path, FILE_NAME)
    if not os.path.isfile(path):
        raise HFConvertError(f"no converted checkpoint at {path}")
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise HFConvertError(f"{path} is not a {FORMAT} file (format {found!r})")
    if payload.get("format_version") != FORMAT_VERSION:
        raise HFConvertError(f"{path}: format_version {payload.get('format_version')} is not "
                             f"{FORMAT_VERSION}; re-run launch/convert_hf.py")
    return payload


def converted_tokenizer_dir(payload: dict, path: str) -> str | None:
    """The HF tokenizer folder that came with the converted file at ``path``: the one the
    conversion recorded, or, if the output was moved, the ``hf_tokenizer`` folder beside the file."""
    tok_dir = (payload.get("source") or {}).get("tokenizer_dir")
    if tok_dir and not os.path.isdir(tok_dir):  # moved with its file: look beside it
        tok_dir = os.path.join(os.path.dirname(os.path.abspath(path)), "hf_tokenizer")
        tok_dir = tok_dir if os.path.isdir(tok_dir) else None
    return tok_dir


def load_converted(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """(TP=1 state dict, ModelConfig, source metadata) of a converted file (or its directory)."""
    payload = read_converted(path)
    return payload["model"], ModelConfig(**payload["model_config"]), payload["source"]

"""Hugging Face Qwen3-MoE / Mixtral / Qwen3 -> our GPT: logits agree with transformers' own models.

Tiny random models built locally with transformers (no downloads): hidden 64, 2 layers, 4 heads / 2
KV groups, 4 experts of width 32, top-2, a vocabulary of 200. ``qwen3_moe`` and ``qwen3`` have a head
size of their own (``head_dim`` 32, not hidden / heads = 16, as real Qwen3 models: 30B-A3B has hidden
2048, 32 heads of 128): ``--kv-channels``. Norm weights (q/k norms included) are
randomised so a mis-mapped norm shows up. Four MoE variants cover the routing settings:

  - ``qwen3_moe``: ``norm_topk_prob: false`` (softmax over all experts, top-2 kept as they are:
    ``--moe-router-pre-softmax``), every layer sparse;
  - ``qwen3_moe_norm``: ``norm_topk_prob: true`` (megatron's default top-k-then-softmax) and
    ``mlp_only_layers: [1]`` (layer 1 a dense MLP of ``intermediate_size``: ``--moe-layer-freq [1,0]``);
  - ``mixtral``: w1/w3/w2 experts under ``block_sparse_moe``, renormalized top-2;
  - ``qwen3``: the dense Qwen3 (q/k norms only).

Exact path (``policy_linear`` replaced by ``F.linear``, fp32 throughout, TP=1): our logits equal
transformers' to 1e-5 x max |logit| (the routing weights are the same numbers computed in another
order: softmax of the top-k logits vs top-k of the softmax renormalized). A control shows the
tolerance is not vacuous: the wrong ``--moe-router-pre-softmax`` setting moves the logits by far more.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from precision import PrecisionPolicy
from pretrain import hf_convert
from tests.model._fakes import ReferenceLinear

COMMON = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "initializer_range": 0.1, "vocab_size": 200}
MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.01}
SEQ = 24
KINDS = ("qwen3_moe", "qwen3_moe_norm", "mixtral", "qwen3")


def hf_model(kind: str):
    """A tiny random transformers model of ``kind`` (this file's docstring), in eval mode."""
    import transformers as tf

    torch.manual_seed(KINDS.index(kind) + 10)
    if kind.startswith("qwen3_moe"):
        extra = {"norm_topk_prob": True, "mlp_only_layers": [1]} if kind == "qwen3_moe_norm" else {}
        head_dim = 16 if kind == "qwen3_moe_norm" else 32  # 32: head_dim x heads (128) != hidden (64)
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, head_dim=head_dim,
                                                         **MOE, **COMMON, **extra))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, **MOE, **COMMON))
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=32, **COMMON))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{kind: (hf_dir, tokens, float32 reference logits)}."""
    pytest.importorskip("transformers")
    out = {}
    for kind in KINDS:
        model = hf_model(kind)
        path = str(tmp_path_factory.mktemp(kind))
        model.save_pretrained(path, safe_serialization=True)
        tokens = torch.randint(0, 200, (2, SEQ), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            out[kind] = (path, tokens, model(tokens).logits)
    return out


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def ours(payload: dict, **overrides):
    cfg = ModelConfig(**{**payload["model_config"], **overrides})
    torch.manual_seed(0)
    model = build_gpt(cfg)
    hf_convert.load_converted_state_dict(model, payload["model"], cfg)
    apply_precision_plan(model, PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), cfg.num_layers))
    return model.eval(), cfg


@torch.no_grad()
def logits_of(model, cfg, tokens):
    return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., : cfg.vocab_size]


def test_moe_config_mapping(hf):
    q = hf_convert.model_config_from_hf(_config(hf["qwen3_moe"][0]))
    assert (q.num_experts, q.moe_router_topk, q.moe_ffn_hidden_size, q.ffn_hidden_size) == (4, 2, 32, 64)
    assert q.qk_layernorm and q.moe_router_pre_softmax and q.moe_layer_freq == 1
    assert q.moe_aux_loss_coeff == 0.01 and q.moe_shared_expert_intermediate_size is None
    assert q.kv_channels == 32  # head_dim 32 != hidden 64 / 4 heads
    qn = hf_convert.model_config_from_hf(_config(hf["qwen3_moe_norm"][0]))
    assert not qn.moe_router_pre_softmax and qn.moe_layer_freq == (1, 0)
    assert qn.kv_channels is None  # head_dim 16 = hidden / heads: megatron's default
    m = hf_convert.model_config_from_hf(_config(hf["mixtral"][0]))
    assert (m.num_experts, m.moe_ffn_hidden_size, m.qk_layernorm, m.moe_router_pre_softmax) == (4, 64, False, False)
    d = hf_convert.model_config_from_hf(_config(hf["qwen3"][0]))
    assert d.qk_layernorm and d.num_experts is None and d.kv_channels == 32
    step2 = {**_config(hf["qwen3_moe"][0]), "decoder_sparse_step": 2}
    assert hf_convert.model_config_from_hf(step2).moe_layer_freq == (0, 1)  # transformers: (i + 1) % 2 == 0


def test_moe_configs_we_cannot_represent_are_refused(hf):
    qwen, mixtral = _config(hf["qwen3_moe"][0]), _config(hf["mixtral"][0])
    cases = [({**qwen, "architectures": ["Qwen2MoeForCausalLM"]}, "sigmoid gate"),
             ({**qwen, "mlp_only_layers": [0, 1]}, "no sparse layer"),
             ({**mixtral, "router_jitter_noise": 0.01}, "router_jitter_noise"),
             ({**mixtral, "sliding_window": 4096}, "sliding_window")]
    for bad, needle in cases:
        with pytest.raises(hf_convert.HFConvertError, match=needle) as e:
            hf_convert.model_config_from_hf(bad)
        assert "\n" not in str(e.value)


def test_cli_converts_a_moe_checkpoint(hf, tmp_path, capsys):
    from launch.convert_hf import main

    assert main(["--hf-dir", hf["qwen3_moe_norm"][0], "--save", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out and "q/k norms" in out
    assert "mixture of experts (layers [0]): 4 experts of width 32, top-2 (top-k renormalized)" in out
    state, cfg, source = hf_convert.load_converted(str(tmp_path))
    assert source["architecture"] == "Qwen3MoeForCausalLM" and cfg.num_experts == 4
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in state


def test_moe_names(hf):
    payload = hf_convert.convert_hf_checkpoint(hf["mixtral"][0])
    state = payload["model"]
    assert state["decoder.layers.1.mlp.router.weight"].shape == (4, 64)
    assert state["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (128, 64)  # [w1; w3]
    assert state["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"].shape == (64, 64)
    mixed = hf_convert.convert_hf_checkpoint(hf["qwen3_moe_norm"][0])["model"]
    assert mixed["decoder.layers.1.mlp.linear_fc1.weight"].shape == (128, 64)  # the dense layer
    assert mixed["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (16,)
    wide = hf_convert.convert_hf_checkpoint(hf["qwen3_moe"][0])["model"]  # head_dim 32: q 4 x 32, k and v 2 x 32
    assert wide["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (4 * 32 + 2 * 2 * 32, 64)
    assert wide["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 4 * 32)
    assert wide["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (32,)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("world_of_one")
def test_logits_match_transformers_exact_gemms(hf, kind, monkeypatch):
    import model.layers

    monkeypatch.setattr(model.layers, "policy_linear", ReferenceLinear())
    path, tokens, ref = hf[kind]
    model, cfg = ours(hf_convert.convert_hf_checkpoint(path))
    diff = (logits_of(model, cfg, tokens) - ref).abs().max().item()
    assert diff <= 1e-5 * ref.abs().max().item(), diff


@pytest.mark.usefixtures("world_of_one")
def test_router_normalization_matters(hf, monkeypatch):
    """Control: the other ``--moe-router-pre-softmax`` setting is far outside the tolerance above."""
    import model.layers

    monkeypatch.setattr(model.layers, "policy_linear", ReferenceLinear())
    path, tokens, ref = hf["qwen3_moe"]
    model, cfg = ours(hf_convert.convert_hf_checkpoint(path), moe_router_pre_softmax=False)
    assert (logits_of(model, cfg, tokens) - ref).abs().max().item() > 1e-3 * ref.abs().max().item()


def test_pretraining_takes_the_moe_shape_from_a_converted_checkpoint(hf, tmp_path):
    """``launch/pretrain.py --pretrained-checkpoint``: the run's model config is the converted one
    (router normalization, q/k norms and the sparse-layer pattern included), not the default shape."""
    import dataclasses

    from pretrain.arguments import parse_args
    from pretrain.config.model import model_config

    for kind in ("qwen3_moe", "qwen3_moe_norm"):
        payload = hf_convert.convert_hf_checkpoint(hf[kind][0])
        hf_convert.save_converted(payload, str(tmp_path / kind))
        args = parse_args(["--pretrained-checkpoint", str(tmp_path / kind), "--seq-length", "32", "--train-iters", "1"])
        cfg = model_config(args, args.pretrained_vocab_size)
        want = ModelConfig(**payload["model_config"])
        assert cfg == dataclasses.replace(want, seq_length=32, init_method_std=cfg.init_method_std)
        assert cfg.qk_layernorm and cfg.moe_router_pre_softmax == (kind == "qwen3_moe")
        assert cfg.moe_layer_freq == (1 if kind == "qwen3_moe" else (1, 0))

"""Export of mixture-of-experts models: our MoE GPT -> Hugging Face Qwen3-MoE / Mixtral, BF16 and FP4.

Tiny models, every parameter random (BF16 values, as a GPU run's): hidden 64, 2 layers, 4 heads / 2
KV groups, 4 experts of width 32, top-2, vocabulary 200 (padded to 256). ``QWEN``: q/k norms,
softmax-then-top-k unnormalized (``--moe-router-pre-softmax``: ``norm_topk_prob false``), layer 1 a
dense MLP (``--moe-layer-freq [1,0]``: ``mlp_only_layers [1]``). ``MIXTRAL``: every layer MoE,
renormalized top-2.

  - BF16: the importer (``pretrain.hf_convert``, the other direction) reads the export back to our
    exact tensors and config; ``AutoModelForCausalLM`` loads it and gives our logits (FP32 GEMMs on
    both sides, 1e-5 x max |logit|; measured ~1e-6).
  - FP4: each expert's fc1 / fc2 is packed by compressed-tensors (``pack_fp4_to_uint8``) from our
    quantizer's codes: the codes, scale bytes and NVFP4 global scale in the file are ours bit for
    bit (gate and up rows of the fused fc1 share its global scale), and compressed-tensors' own
    decompressor gives our weights back (MXFP4 exactly, NVFP4 rounded to BF16 -- its output dtype).
    The router stays BF16 and is listed in ``ignore``.
  - MXFP4 through transformers: the expert weights it decompresses are ours exactly, and its logits
    equal ours (same weight-only plan) once the model is in FP32 -- transformers 5.24 leaves the
    decompressed fused experts in BF16 (measured: 0.0074 of max |logit| 3.4 from that alone).
    NVFP4 experts are not checked through transformers: its fused-experts loading path (5.24) leaves
    them off by the factor of their ``weight_global_scale`` (measured: ratio ~7e3 = g_enc), while its
    dense linears and compressed-tensors' own decompressor apply it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from precision import PrecisionPolicy
from precision.formats import unpack_codes
from precision.quantize import quantize
from pretrain import hf_convert
from pretrain.hf_export import HFExportError, export_hf, hf_state_dict
from tests.launch.test_export_hf import _random_state as random_state  # weights ~N(0, 0.1), BF16 values

QWEN = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   seq_length=32, vocab_size=200, qk_layernorm=True, num_experts=4, moe_ffn_hidden_size=32,
                   moe_layer_freq=(1, 0), moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01)
QWEN_HEAD = dataclasses.replace(QWEN, kv_channels=48)  # head_dim 48 != 64 / 4 heads, as real Qwen3 models
MIXTRAL = dataclasses.replace(QWEN, qk_layernorm=False, moe_layer_freq=1, moe_router_pre_softmax=False,
                              ffn_hidden_size=32)  # all layers MoE: Mixtral has one intermediate_size
EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc{}.weight"


def our_logits(state, cfg, tokens, spec="fp32"):
    torch.manual_seed(0)
    model = build_gpt(cfg)
    model.load_state_dict(state, strict=False)
    plan = PrecisionPolicy.from_args(spec, ["kind:output=fp32", "kind:router=fp32"]).resolve(
        policy_linear_names(model), cfg.num_layers)
    apply_precision_plan(model, plan)
    with torch.no_grad():
        return model.eval()(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., : cfg.vocab_size]


def _safetensors(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model.safetensors"))


TOKENS = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("cfg", [QWEN, QWEN_HEAD, MIXTRAL], ids=["qwen3_moe", "qwen3_moe_head_dim", "mixtral"])
def test_bf16_moe_export_round_trips_and_loads_in_transformers(world_of_one, tmp_path, cfg):
    tf = pytest.importorskip("transformers")
    state = random_state(cfg)
    export_hf(state, cfg, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    arch = "Qwen3MoeForCausalLM" if cfg.qk_layernorm else "MixtralForCausalLM"
    assert config["architectures"] == [arch]
    assert config["head_dim"] == (cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads)
    assert hf_convert.model_config_from_hf(config, seq_length=cfg.seq_length) == cfg
    back = hf_convert.convert_state_dict(_safetensors(tmp_path), cfg, arch)
    assert back.keys() == state.keys()
    for k, v in state.items():
        want = v[: cfg.vocab_size] if v.shape[0] == 256 else v
        assert torch.equal(back[k], want.to(torch.bfloat16)), k

    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    with torch.no_grad():
        ref = hf(TOKENS).logits
    diff = (our_logits(state, cfg, TOKENS) - ref).abs().max().item()
    assert diff <= 1e-5 * ref.abs().max().item(), diff


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp4_w4a16"])
def test_fp4_experts_are_packed_by_compressed_tensors_from_our_codes(world_of_one, tmp_path, preset):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from launch.export_hf import main

    fmt = preset.removesuffix("_w4a16")
    state = random_state(QWEN)
    torch.save({"model": state, "model_config": dataclasses.asdict(QWEN)}, tmp_path / "w.pt")
    assert main(["--load", str(tmp_path / "w.pt"), "--out", str(tmp_path / "out"), "--rollout-precision", preset]) == 0
    st = _safetensors(tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.gate"]  # the router: FP32 in the rollout, BF16 here
    assert st["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    scheme = QuantizationScheme(**{k: v for k, v in qc["config_groups"]["group_0"].items() if k != "format"})
    for e in range(QWEN.num_experts):
        for fc, parts in ((1, ("gate_proj", "up_proj")), (2, ("down_proj",))):
            q = quantize(state[EXPERT.format(0, e, fc)].float(), fmt, axis=1)
            rows = [t.chunk(len(parts), dim=0) for t in (q.codes, q.scales, q.dequantize())]
            for j, part in enumerate(parts):
                pre = f"model.layers.0.mlp.experts.{e}.{part}."
                tensors = {k.removeprefix(pre): v for k, v in st.items() if k.startswith(pre)}
                assert torch.equal(unpack_codes(tensors["weight_packed"], 4), rows[0][j]), pre
                assert torch.equal(tensors["weight_scale"].view(torch.uint8), rows[1][j]), pre
                if fmt == "nvfp4":  # fc1's gate and up rows share the fused tensor's g_enc
                    assert torch.equal(tensors["weight_global_scale"], q.tensor_scale.reshape(1)), pre
                weight = compressor.decompress(tensors, scheme)["weight"]
                assert torch.equal(weight.float(), rows[2][j].to(weight.dtype).float()), pre
                if fmt == "mxfp4":
                    assert torch.equal(weight.float(), rows[2][j]), pre  # powers of two: exact in BF16
    assert "model.layers.1.mlp.gate_proj.weight_packed" in st  # the dense layer's MLP, packed as before


def test_mxfp4_moe_export_loads_in_transformers(world_of_one, tmp_path):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    state = random_state(QWEN)
    export_hf(state, QWEN, str(tmp_path), weight_format="mxfp4")
    hf = tf.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, quantization_config=tf.CompressedTensorsConfig(dequantize=True)).eval()
    experts = dict(hf.named_parameters())
    for e in range(QWEN.num_experts):
        for fc, name in ((1, "gate_up_proj"), (2, "down_proj")):
            ours = quantize(state[EXPERT.format(0, e, fc)].float(), "mxfp4", axis=1).dequantize()
            assert torch.equal(experts[f"model.layers.0.mlp.experts.{name}"][e].float(), ours), (e, name)
    hf = hf.float()  # transformers keeps decompressed fused experts in BF16 (module docstring)
    with torch.no_grad():
        ref = hf(TOKENS).logits
    diff = (our_logits(state, QWEN, TOKENS, "base=fp32,fprop=fp32@mxfp4") - ref).abs().max().item()
    assert diff <= 1e-5 * ref.abs().max().item(), diff


def test_moe_models_without_hf_equivalent_are_refused():
    cases = [(dataclasses.replace(QWEN, moe_shared_expert_intermediate_size=64), "no shared expert"),
             (dataclasses.replace(QWEN, moe_router_score_function="sigmoid"), "sigmoid (softmax only)"),
             (dataclasses.replace(QWEN, moe_expert_capacity_factor=1.0), "drops no tokens"),
             (dataclasses.replace(MIXTRAL, moe_router_pre_softmax=True), "Mixtral always renormalizes"),
             (dataclasses.replace(MIXTRAL, moe_layer_freq=(1, 0)), "Mixtral: every layer MoE"),
             (dataclasses.replace(QWEN, add_qkv_bias=True), "--add-qkv-bias with --qk-layernorm")]
    for cfg, needle in cases:
        with pytest.raises(HFExportError, match=re.escape(needle)) as e:
            hf_state_dict({}, cfg)
        assert "\n" not in str(e.value)


def test_an_fp4_router_is_refused(world_of_one, tmp_path, capsys):
    from launch.export_hf import main

    torch.save({"model": random_state(QWEN), "model_config": dataclasses.asdict(QWEN)}, tmp_path / "w.pt")
    argv = ["--load", str(tmp_path / "w.pt"), "--out", str(tmp_path / "out"), "--rollout-precision", "nvfp4",
            "--rollout-precision-rule", "kind:router=nvfp4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "decoder.layers.0.mlp.router would be FP4-packed" in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_moe_training_run_exports_and_loads_in_transformers(data_cache, tmp_path):
    """The whole path: ``launch/pretrain.py`` trains a Qwen3-MoE-shaped model for 2 iterations
    (q/k norms, pre-softmax routing, layer 1 dense), ``launch/export_hf.py`` exports its checkpoint,
    and ``AutoModelForCausalLM`` gives the logits of our model with the exported (BF16) weights."""
    tf = pytest.importorskip("transformers")
    from launch.export_hf import main
    from pretrain.evaluation.loading import init_single_process
    from pretrain.hf_export import load_tp1_weights
    from tests.pretrain._launch import TINY, run_pretrain

    moe = ["--qk-layernorm", "--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-router-pre-softmax",
           "--moe-layer-freq", "[1,0]", "--moe-aux-loss-coeff", "0.01"]
    run_pretrain([*TINY, *moe, "--train-iters", "2", "--eval-interval", "100", "--precision", "bf16",
                  "--data-cache-dir", str(data_cache), "--save", str(tmp_path / "ckpt")], nproc=0)
    assert main(["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.mlp_only_layers == [1]
    assert hf.config.norm_topk_prob is False
    init_single_process()
    state, cfg, _ = load_tp1_weights(str(tmp_path / "ckpt"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits
    mine = our_logits({k: v.bfloat16() for k, v in state.items()}, cfg, tokens)
    assert (mine - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()

"""launch/export_hf.py: our GPT -> Hugging Face Llama / Qwen2, BF16 and compressed-tensors FP4.

A tiny GQA model (2 layers, hidden 64, vocabulary 300 padded to 384) with every parameter random.
Checked against independent references:
  - BF16 (Llama; Qwen2 with qkv biases and tied embeddings): ``pretrain.hf_convert`` (the importer,
    written separately) reads the export back to our exact TP=1 tensors (BF16-rounded, vocabulary
    unpadded); a TP=2 checkpoint exports the same files as its TP=1 model.
  - FP4, without the client: the packed codes, block-scale bytes and NVFP4 global scale in the
    safetensors equal our quantizer's on the *fused* ``linear_qkv`` / ``linear_fc1`` (what the
    rollout quantizes), bit for bit.
  - FP4 with the client (``transformers`` + ``compressed-tensors``, skipped if absent): the weights
    it decompresses equal ours bit for bit -- MXFP4 exactly; NVFP4 equal to our value rounded to
    BF16 (its decompressor's dtype) and to an independent decoder of its convention,
    ``bf16(e2m1 * (s / global_scale))``. Logits of the transformers model equal our model's under
    the same weight-only plan (``fprop=fp32@FMT``, FP32 activations) within FP32 noise for MXFP4
    (measured: identical); for NVFP4 within what its BF16 weight rounding explains (measured 0.019 of max |logit| 3.3), and
    within FP32 noise once our FP32 weights are put into the transformers model.
  - the rollout plan decides (``--rollout-precision nvfp4 --rollout-precision-rule first:1=bf16``):
    layer 0 exported dense and listed in ``ignore``, layer 1's packed tensors equal the generation
    engine's own (``model.rollout.RolloutModel``), and transformers loads the mixed export.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from precision import PrecisionPolicy
from precision.formats import unpack_codes
from precision.quantize import quantize
from pretrain import hf_convert
from pretrain.hf_export import HFExportError, export_hf, hf_state_dict, load_tp1_weights

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  seq_length=32, vocab_size=300)
QKV, FC1 = "decoder.layers.{}.self_attention.linear_qkv.weight", "decoder.layers.{}.mlp.linear_fc1.weight"


def _random_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A TP=1 state dict (vocabulary padded), weights ~N(0, 0.1), norms ~N(1, 0.1), every value a BF16
    value (as a GPU run's parameters are): the export's BF16 tensors are then exact."""
    torch.manual_seed(0)
    model = build_gpt(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0)).bfloat16())
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


@pytest.fixture
def state(world_of_one):
    return _random_state(CFG)


def _safetensors(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model.safetensors"))


# ================================================================================================
# BF16 export: the importer reads it back
# ================================================================================================


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied"])
def test_bf16_export_is_the_inverse_of_the_importer(tmp_path, world_of_one, kind):
    cfg = CFG if kind == "llama" else dataclasses.replace(CFG, add_qkv_bias=True, untie_embeddings=False)
    state = _random_state(cfg)
    export_hf(state, cfg, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == (["LlamaForCausalLM"] if kind == "llama" else ["Qwen2ForCausalLM"])
    assert hf_convert.model_config_from_hf(config, seq_length=cfg.seq_length) == cfg
    back = hf_convert.convert_state_dict(_safetensors(str(tmp_path)), cfg)
    assert back.keys() == state.keys()
    for k, v in state.items():
        want = v[: cfg.vocab_size] if v.shape[0] == 384 else v  # padded vocabulary rows are dropped
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], want.to(torch.bfloat16)), k


def test_tp2_checkpoint_exports_its_tp1_weights(state, tmp_path):
    from tests.pretrain.test_reshard import _write_tp2_checkpoint

    model = build_gpt(CFG)
    plan = PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), CFG.num_layers)
    full = {**model.state_dict(), **state}  # _extra_state entries of a real model, our weights
    _write_tp2_checkpoint(tmp_path / "ckpt", CFG, full, plan)
    merged, cfg, _ = load_tp1_weights(str(tmp_path / "ckpt"))
    assert cfg == CFG and merged.keys() == state.keys()
    assert all(torch.equal(merged[k], state[k]) for k in state)


def test_unexportable_models_are_refused(state):
    with pytest.raises(HFExportError, match="--normalization LayerNorm, --activation gelu"):
        hf_state_dict(state, dataclasses.replace(CFG, normalization="LayerNorm", activation="gelu"))
    with pytest.raises(HFExportError, match="weight format 'mxfp8_e4m3' has no compressed-tensors export"):
        export_hf(state, CFG, "/nonexistent", weight_format="mxfp8_e4m3")
    with pytest.raises(HFExportError, match="nvfp4 activations cannot be declared"):
        export_hf(state, CFG, "/nonexistent", weight_format="nvfp4", activations=True)


# ================================================================================================
# FP4: the packed tensors are our quantizer's
# ================================================================================================


def _split_rows(t: torch.Tensor, which: str, layer: int):
    """Our fused tensor's rows for each HF projection (q/k/v per query group; gate/up halves)."""
    from pretrain.hf_export import _split_qkv

    if which == "qkv":
        return dict(zip(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _split_qkv(t, CFG)))
    return dict(zip(("mlp.gate_proj", "mlp.up_proj"), t.chunk(2, dim=0)))


def _ours(state: dict, fmt: str):
    """{HF linear name: our QuantizedTensor's (codes, scale bytes, g_enc, dequantized) rows}."""
    out = {}
    for i in range(CFG.num_layers):
        fused = {"qkv": QKV.format(i), "fc1": FC1.format(i)}
        for which, name in fused.items():
            q = quantize(state[name].float(), fmt, axis=1)
            parts = [_split_rows(t, which, i) for t in (q.codes, q.scales, q.dequantize())]
            for lin in parts[0]:
                out[f"model.layers.{i}.{lin}"] = (parts[0][lin], parts[1][lin], q.tensor_scale, parts[2][lin])
        for lin, name in (("self_attn.o_proj", "self_attention.linear_proj"), ("mlp.down_proj", "mlp.linear_fc2")):
            q = quantize(state[f"decoder.layers.{i}.{name}.weight"].float(), fmt, axis=1)
            out[f"model.layers.{i}.{lin}"] = (q.codes, q.scales, q.tensor_scale, q.dequantize())
    return out


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_codes_and_scales_are_ours_bit_for_bit(state, tmp_path, fmt):
    export_hf(state, CFG, str(tmp_path), weight_format=fmt)
    st = _safetensors(str(tmp_path))
    ours = _ours(state, fmt)
    assert len(ours) == 7 * CFG.num_layers
    for lin, (codes, scales, g_enc, _) in ours.items():
        packed = st[f"{lin}.weight_packed"]
        assert packed.dtype == torch.uint8 and packed.shape == (codes.shape[0], codes.shape[1] // 2)
        assert torch.equal(unpack_codes(packed, 4), codes), lin
        if fmt == "nvfp4":  # E4M3 scale bytes; global scale = our encode scale g_enc (448*6/amax)
            assert st[f"{lin}.weight_scale"].dtype == torch.float8_e4m3fn
            assert torch.equal(st[f"{lin}.weight_scale"].view(torch.uint8), scales), lin
            assert st[f"{lin}.weight_global_scale"].dtype == torch.float32
            assert torch.equal(st[f"{lin}.weight_global_scale"], g_enc.reshape(1)), lin
        else:  # E8M0 bytes as they are, no global scale
            assert torch.equal(st[f"{lin}.weight_scale"], scales) and f"{lin}.weight_global_scale" not in st
    # q, k, v (and gate, up) share the fused tensor's global scale, as vLLM's fused layers need
    if fmt == "nvfp4":
        g = [st[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"] for p in "qkv"]
        assert torch.equal(g[0], g[1]) and torch.equal(g[1], g[2])
    assert st["lm_head.weight"].dtype == torch.bfloat16  # ignored by the scheme
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == f"{fmt}-pack-quantized" and qc["ignore"] == ["lm_head"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == (16 if fmt == "nvfp4" else 32)


# ================================================================================================
# FP4 through the real client: transformers + compressed-tensors
# ================================================================================================


def _load_hf(out: str):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    return tf.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=tf.CompressedTensorsConfig(dequantize=True)).eval()


def _our_model(state: dict, fmt: str):
    torch.manual_seed(0)
    model = build_gpt(CFG)
    model.load_state_dict(state, strict=False)
    plan = PrecisionPolicy.from_args(f"base=fp32,fprop=fp32@{fmt}", ["kind:output=fp32"]).resolve(
        policy_linear_names(model), CFG.num_layers)
    apply_precision_plan(model, plan)
    return model.eval()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_transformers_decompresses_our_rollout_weights(state, tmp_path, fmt):
    export_hf(state, CFG, str(tmp_path), weight_format=fmt)
    hf = _load_hf(str(tmp_path))
    weights = dict(hf.named_parameters())
    for lin, (codes, scales, g_enc, ours) in _ours(state, fmt).items():
        theirs = weights[f"{lin}.weight"]
        if fmt == "mxfp4":
            assert torch.equal(theirs, ours), lin  # power-of-two scales: exact in every dtype
            continue
        # compressed-tensors: bf16(e2m1 * (s / global_scale)); ours: e2m1 * (s * (1 / g_enc)) in FP32
        from precision.elements import e2m1_decode

        s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        convention = (e2m1_decode(codes) * (s / g_enc)).to(torch.bfloat16).float()
        assert torch.equal(theirs, convention), lin
        assert torch.equal(theirs, ours.to(torch.bfloat16).float()), lin
        assert (theirs - ours).abs().max() <= 2**-8 * ours.abs().max()  # one BF16 rounding

    tokens = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits
        mine = _our_model(state, fmt)(tokens, torch.arange(24).expand_as(tokens), None)[..., : CFG.vocab_size]
    diff, scale = (mine - ref).abs().max().item(), ref.abs().max().item()
    if fmt == "mxfp4":
        assert diff <= 1e-5 * scale, diff  # same weights, FP32 GEMMs: FP32 noise
        return
    # NVFP4: measured 0.019 of max |logit| 3.3, the size of a BF16 weight rounding (a BF16 plan moves
    # these logits by ~0.03, tests/pretrain/test_convert_hf.py) ...
    assert diff <= 0.02 * scale, diff
    # ... and it is only that: with our FP32 rollout weights put in, transformers gives our logits
    with torch.no_grad():
        for lin, (*_, ours) in _ours(state, fmt).items():
            weights[f"{lin}.weight"].copy_(ours)
        assert (hf(tokens).logits - mine).abs().max().item() <= 1e-5 * scale


def test_cli_exports_and_refuses_in_one_line(state, tmp_path, capsys):
    from launch.export_hf import main

    torch.save({"model": state, "model_config": dataclasses.asdict(CFG)}, tmp_path / "w.pt")
    # W4A4 MXFP4 (this model's head dimension 16 takes no MXFP4 KV-cache; the KV is not exported anyway)
    assert main(["--load", str(tmp_path / "w.pt"), "--out", str(tmp_path / "out"), "--rollout-precision",
                 "base=mxfp4,kv=bf16"]) == 0
    assert "mxfp4 weights" in capsys.readouterr().out
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is True  # W4A4: dynamic MXFP4
    info = json.loads((tmp_path / "out" / "export_info.json").read_text())
    assert info["weights"] == "mxfp4" and info["rollout_precision"] == "base=mxfp4,kv=bf16"
    assert info["note"].startswith("activations: dynamic MXFP4")
    cases = [(["--load", str(tmp_path / "missing")], "neither a training checkpoint"),
             (["--rollout-precision", "fp6"], "--rollout-precision 'fp6': unknown rollout preset"),
             (["--rollout-precision", "fp8"], "weight format fp8_e4m3 has no compressed-tensors export"),
             (["--rollout-precision", "mxfp4"], "do not divide the head dimension 16"),
             (["--rollout-precision", "mxfp4_w4a16+had16"], "rotates its operands (had16)"),
             (["--rollout-precision", "mxfp4_w4a16", "--rollout-precision-rule", "first:1=nvfp4"],
              "mixes weight formats")]
    for extra, needle in cases:
        argv = ["--load", str(tmp_path / "w.pt"), "--out", str(tmp_path / "o2"), *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_export_follows_the_rollout_plan(state, tmp_path):
    """``--rollout-precision nvfp4 --rollout-precision-rule first:1=bf16``: layer 0 stays BF16 (the
    scheme's ignore list), layer 1 holds the generation engine's own packed weights."""
    from model.rollout import RolloutModel
    from model.rollout_plan import resolve_rollout_plan
    from pretrain.hf_export import weight_formats_from_rollout

    formats, acts, note = weight_formats_from_rollout("nvfp4", ["first:1=bf16"], CFG)
    assert not acts and "not declared" in note
    export_hf(state, CFG, str(tmp_path), weight_format=formats)
    st = _safetensors(str(tmp_path))
    ignore = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore[0] == "lm_head" and "model.layers.0.self_attn.q_proj" in ignore and len(ignore) == 1 + 7
    assert torch.equal(st["model.layers.0.mlp.down_proj.weight"], state["decoder.layers.0.mlp.linear_fc2.weight"].bfloat16())
    model = build_gpt(CFG)
    model.load_state_dict(state, strict=False)
    names = policy_linear_names(model)
    plan = resolve_rollout_plan("nvfp4", ["first:1=bf16"], names, CFG.num_layers, 16)
    engine = RolloutModel(model, plan)
    engine.update()
    packed = engine.packed[QKV.format(1).removesuffix(".weight")]
    for lin, codes in _split_rows(packed.unpacked_codes(), "qkv", 1).items():
        assert torch.equal(unpack_codes(st[f"model.layers.1.{lin}.weight_packed"], 4), codes), lin
        assert torch.equal(st[f"model.layers.1.{lin}.weight_global_scale"], packed.tensor_scale.reshape(1))
    weights = dict(_load_hf(str(tmp_path)).named_parameters())  # a mixed dense / packed export loads
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], state["decoder.layers.0.mlp.linear_fc2.weight"])
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"],
                       engine.packed["decoder.layers.1.mlp.linear_fc2"].values().bfloat16().float())


# ================================================================================================
# The tokenizer a training run used, in Hugging Face's format
# ================================================================================================

# A page of text: Python source (runs of spaces, tabs, newlines, digits) and prose beyond the
# tokenizer's pieces (accents, CJK, an emoji: byte fallback).
PAGE = (json.decoder.__doc__ or "") + "".join(
    f"\ndef f_{i}(x, y={i * 37}):\n\tif x  >  {i}:\n        return x ** 2 - y  # {i} times\n    return None\n"
    for i in range(40)) + "\nNaïve café — 日本語のテキスト 🙂, 12345.678 and   three   spaces.\n"


SP_CFG = dataclasses.replace(CFG, vocab_size=600)  # the stdlib text's characters alone take 334 pieces


def _sentencepiece(path) -> str:
    """A BPE model as ``launch/preprocess_data.py --train-tokenizer`` (and the built-in data) trains it."""
    from pretrain.data.corpus import stdlib_corpus
    from pretrain.data.tokenizer import train_tokenizer

    train_tokenizer([d.text for d in stdlib_corpus(max_mb=0.2)[0][:6]], str(path), vocab_size=SP_CFG.vocab_size)
    return str(path)


def test_a_training_checkpoints_tokenizer_loads_with_auto_tokenizer(world_of_one, tmp_path, capsys):
    """launch/export_hf.py on a training checkpoint made with a sentencepiece tokenizer (its copy in the
    checkpoint; the original deleted): AutoTokenizer encodes a page of text to sentencepiece's ids and
    decodes it back, and AutoModelForCausalLM loads the same folder and gives our model's logits."""
    import sentencepiece as spm

    from launch.export_hf import main
    from pretrain.checkpointing import checkpoint_tokenizer, save_checkpoint

    tf = pytest.importorskip("transformers")
    sp_model = _sentencepiece(tmp_path / "tok.model")
    cfg = SP_CFG
    state = _random_state(cfg)
    model = build_gpt(cfg)
    args = {"tensor_model_parallel_size": 1, "tokenizer_model": None, "tokenizer_type": "SentencePieceTokenizer"}
    ckpt_dir = save_checkpoint(str(tmp_path / "ckpt"), 1, {"model": {**model.state_dict(), **state}, "args": args,
                                                          "model_config": dataclasses.asdict(cfg),
                                                          "tokenizer_model": sp_model})
    os.remove(sp_model)
    copy, _ = checkpoint_tokenizer(ckpt_dir)
    out = tmp_path / "out"
    assert main(["--load", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert "no tokenizer" not in capsys.readouterr().out
    assert {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} <= set(os.listdir(out))

    tok = tf.AutoTokenizer.from_pretrained(str(out))
    want = spm.SentencePieceProcessor(model_file=copy).encode(PAGE)
    ids = tok(PAGE)["input_ids"]
    assert len(ids) > 1000 and ids == want  # no BOS added: the ids the model was trained on
    assert tok.decode(ids) == PAGE and tok.eos_token_id == 2 and tok.model_max_length == cfg.seq_length
    assert tok.decode(ids, skip_special_tokens=True) == PAGE  # "\n" is a piece, not a special token

    hf = tf.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.tensor([ids[:cfg.seq_length], ids[cfg.seq_length : 2 * cfg.seq_length]])
    ours = build_gpt(cfg)
    ours.load_state_dict(state, strict=False)
    apply_precision_plan(ours, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(ours), cfg.num_layers))
    with torch.no_grad():
        ref = hf(tokens).logits
        mine = ours.eval()(tokens, torch.arange(cfg.seq_length).expand_as(tokens), None)[..., : cfg.vocab_size]
    assert (mine - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()  # BF16 weights, FP32 GEMMs


def test_a_tokenizer_hugging_face_would_segment_differently_is_refused(state, tmp_path):
    import io

    import sentencepiece as spm

    pytest.importorskip("transformers")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(PAGE.splitlines() * 20), model_writer=buf,
                                   model_type="unigram", vocab_size=SP_CFG.vocab_size, byte_fallback=True, hard_vocab_limit=False,
                                   minloglevel=2)
    (tmp_path / "unigram.model").write_bytes(buf.getvalue())
    with pytest.raises(HFExportError, match=r"unigram.model: not a BPE model; Hugging Face's Llama tokenizer"):
        export_hf(state, CFG, str(tmp_path / "out"), tokenizer=str(tmp_path / "unigram.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(HFExportError, match="junk.model: not a sentencepiece model"):
        export_hf(state, CFG, str(tmp_path / "out"), tokenizer=str(tmp_path / "junk.model"))

"""Rollout weights and plans (``model.rollout``, ``model.rollout_plan``).

Same bits as the trainer: for every rollout preset (with and without the Hadamard) the packed
weight's codes and scales equal the trainer's Fprop weight codes and scales
(``kernels.operand.gemm_operands(Gemm.FPROP, ..., codes=True)``), its dequantized values equal the
trainer's emulated Fprop operand computed by the *fused* quantizer's expression (an independent
implementation, ``impl="eager"``), and the packed Fprop equals ``policy_linear``'s, all bit for bit.
Weight shape 48 x 80: in-features not a multiple of 32, so block padding is exercised.
"""

from __future__ import annotations

import pytest
import torch

from kernels.operand import gemm_operands
from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names, policy_linears
from model.linear import policy_linear
from model.rollout import RolloutModel, pack_weight
from model.rollout_plan import ROLLOUT_PRESETS, parse_rollout, resolve_rollout_plan
from precision import LinearPrecision, PrecisionPolicy, SpecError
from precision.recipe import Gemm
from precision.state import LayerQuantState

SPECS = [p for name in ROLLOUT_PRESETS for p in (name, f"{name}+had16")]
BITS = {"bf16": 16, "fp8": 8, "mxfp4": 4.25, "nvfp4": 4.5, "mxfp4_w4a16": 4.25, "nvfp4_4over6": 4.5}


def _w_x():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 80, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier: per-tensor and block scales matter
    return w, torch.randn(6, 80, generator=g)


@pytest.mark.parametrize("spec", SPECS)
def test_rollout_weight_codes_are_the_trainers_bit_for_bit(spec):
    w, x = _w_x()
    recipe = parse_rollout(spec).linear
    state = LayerQuantState(seed=1, name="decoder.layers.0.mlp.linear_fc1")
    packed = pack_weight(w, recipe, state)
    trainer = gemm_operands(Gemm.FPROP, x, w, recipe, state, impl="reference", codes=True).b
    assert torch.equal(packed.unpacked_codes(), trainer.codes)
    for got, want in ((packed.scales, trainer.scales), (packed.tensor_scale, trainer.tensor_scale)):
        assert (got is None and want is None) or torch.equal(got, want)
    fused = gemm_operands(Gemm.FPROP, x, w, recipe, state, impl="eager").b.values
    assert torch.equal(packed.values(), fused)
    with torch.no_grad():
        y_trainer = policy_linear(x, w, LinearPrecision(fprop=recipe), state=state, backend="reference")
        y_rollout = packed.fprop(x, None, state, "reference")
    assert torch.equal(y_rollout, y_trainer)


def test_error_controls_in_a_rollout_plan():
    """The forward controls are rollout recipes (4/6 on NVFP4 weights and activations, QuEST's
    MXFP4 scale under had32: deterministic, so a token's numbers never depend on when it was
    generated); MS-EDEN, a stochastic backward control, is refused in one line naming it."""
    w, x = _w_x()
    for spec in ("nvfp4_4over6", "linear=nvfp4/4over6(mae)@nvfp4/2d/4over6,kv=bf16",
                 "linear=mxfp4/quest@mxfp4/quest+had32,kv=mxfp4"):
        recipe = parse_rollout(spec).linear
        state = LayerQuantState(seed=1, name="decoder.layers.0.mlp.linear_fc1")
        packed = pack_weight(w, recipe, state)
        with torch.no_grad():
            y_trainer = policy_linear(x, w, LinearPrecision(fprop=recipe), state=state, backend="reference")
            y_rollout = packed.fprop(x, None, state, "reference")
        assert torch.equal(y_rollout, y_trainer), spec
    plan = parse_rollout("nvfp4_4over6").linear
    assert plan.a.four_over_six == "mse" and plan.b.four_over_six == "mse"
    for spec, flag in (("linear=nvfp4/eden@nvfp4+rht16,kv=bf16", "--rollout-precision linear="),
                       ("linear=nvfp4+eden128+rht128,kv=bf16", "--rollout-precision linear=")):
        with pytest.raises(SpecError) as e:
            parse_rollout(spec)
        msg = str(e.value)
        assert msg.startswith(flag) and "MS-EDEN (eden" in msg and "\n" not in msg, msg
    with pytest.raises(SpecError, match="MS-EDEN \\(eden\\) is a backward control"):
        resolve_rollout_plan("nvfp4", ["kind:mlp=nvfp4/eden@nvfp4/eden+rht16"], ["decoder.layers.0.mlp.linear_fc1"], 1, 32)


@pytest.mark.parametrize("preset", sorted(ROLLOUT_PRESETS))
def test_packed_storage_bits_per_weight(preset):
    w, _ = _w_x()
    w = w[:, :64]  # whole blocks: the storage is exactly the format's bits per element
    packed = pack_weight(w, parse_rollout(preset).linear, LayerQuantState())
    tensor_scale_bytes = {"fp8": 4, "nvfp4": 4, "nvfp4_4over6": 4}.get(preset, 0)
    assert (packed.nbytes - tensor_scale_bytes) * 8 / w.numel() == BITS[preset]
    if packed.fmt in ("mxfp4", "nvfp4"):  # two codes per byte, low nibble = the even index
        c = packed.unpacked_codes()
        assert torch.equal(packed.codes, c[:, 0::2] | (c[:, 1::2] << 4))


def test_weights_are_quantized_once_per_update(world_of_one):
    cfg = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1,
                      seq_length=16, vocab_size=64)
    torch.manual_seed(0)
    model = build_gpt(cfg).eval()
    names = policy_linear_names(model)
    apply_precision_plan(model, PrecisionPolicy.from_args("bf16").resolve(names, cfg.num_layers))
    rollout = RolloutModel(model, resolve_rollout_plan("mxfp4", [], names, cfg.num_layers, 32))
    rollout.update()
    tokens, pos = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    with torch.no_grad(), rollout.active():
        before = model(tokens, pos, None)
        for _, m in policy_linears(model):
            if m.weight is not None:
                m.weight.mul_(1.5)  # the policy changes ...
        stale = model(tokens, pos, None)  # ... the rollout still runs the packed weights of its update
        rollout.update()
        fresh = model(tokens, pos, None)
    assert torch.equal(before, stale) and not torch.equal(before, fresh)
    assert all(m.rollout_weight is None for _, m in policy_linears(model))  # training sees its own weights
    sizes = rollout.weight_bytes()
    assert sizes["packed_linears"] > 0 and sizes["other"] > 0


def test_plan_rules_and_table():
    names = [f"decoder.layers.{i}.{k}" for i in range(2)
             for k in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
    names.append("output_layer")
    plan = resolve_rollout_plan("nvfp4+had16", ["first:1=bf16", "kind:fc2=bf16@mxfp4"], names, 2, 32)
    assert plan.fprop("decoder.layers.0.mlp.linear_fc2").spec() == "bf16"  # first match wins
    assert plan.fprop("decoder.layers.1.mlp.linear_fc2").spec() == "bf16@mxfp4"
    assert plan.fprop("decoder.layers.1.mlp.linear_fc1").spec() == "nvfp4+had16"
    assert plan.fprop("output_layer").spec() == "bf16" and plan.kv.fmt == "nvfp4"
    assert "kv-cache" in plan.table() and plan.to_dict()["kv_cache"] == "nvfp4"
    assert parse_rollout("base=mxfp4,kv=fp8").kv.fmt == "fp8_e4m3"
    assert parse_rollout("linear=bf16@nvfp4+had32,kv=bf16").linear.rotation == "had32"


@pytest.mark.parametrize("value,rules,match", [
    ("mxfp3", [], r"--rollout-precision 'mxfp3': unknown rollout preset; valid: .*bf16, fp8, mxfp4, nvfp4, mxfp4_w4a16"),
    ("base=mxfp4,kv=int4", [], r"unknown KV-cache format 'int4'; valid: .*nvfp4"),
    ("base=mxfp4,kvv=bf16", [], r"unknown key 'kvv'; valid keys: base, linear, kv"),
    ("linear=mxfp4+rht16,kv=bf16", [], r"rotation rht16 is not deterministic; valid: none, had16, had32"),
    ("linear=mxfp4/sr,kv=bf16", [], r"a rollout rounds to nearest"),
    ("mxfp4", ["last:5=bf16"], r"--rollout-precision-rule 'last:5=bf16': the model has 2 layers"),
    ("mxfp4", ["kind:fc3=bf16"], r"unknown kind 'fc3'"),
    ("mxfp4", ["first:1=mxfp5"], r"--rollout-precision-rule 'first:1=mxfp5': 'mxfp5': unknown rollout preset"),
])
def test_bad_rollout_precision_is_refused_in_one_line(value, rules, match):
    names = ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1", "output_layer"]
    with pytest.raises(SpecError, match=match) as e:
        resolve_rollout_plan(value, rules, names, 2, 32)
    assert "\n" not in str(e.value)


def test_kv_block_must_divide_the_head_dim():
    with pytest.raises(ValueError, match=r"--rollout-precision kv mxfp4: its 32-element blocks do not divide the "
                                         r"head dimension 16 .*valid for this model: .*nvfp4"):
        resolve_rollout_plan("mxfp4", [], ["output_layer"], 1, 16)

"""Per-layer KV-cache formats of a rollout plan (``--rollout-precision-rule SELECTOR=kv=FORMAT``).

Oracles: the trainer's own forward with each core attention fake-quantizing K/V in *its* layer's
format (``SDPAttention.kv_format`` set by hand, layer by layer, no cache) must re-score the
engine's tokens with the engine's log-probs; and a plan whose KV rules give every layer the same
format must generate exactly what the plan-wide format generates (tokens and log-probs equal).
"""

from __future__ import annotations

import pytest
import torch

from model.attention import core_attentions
from model.generate import Engine, SamplingParams
from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names, policy_linears
from model.kv_cache import KVCache, KVFormat
from model.rollout import RolloutModel
from model.rollout_plan import resolve_rollout_plan
from precision import PrecisionPolicy, SpecError

VOCAB = 100
CFG = {"num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 2,
       "num_query_groups": 1, "seq_length": 48, "vocab_size": VOCAB, "init_method_std": 0.3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [11, 12, 13, 14], [42]]
GREEDY = SamplingParams(max_new_tokens=5)
FLOAT_TOL = 1e-4
NAMES = [f"decoder.layers.{i}.{k}" for i in range(3)
         for k in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
NAMES.append("output_layer")


@pytest.fixture(scope="module")
def llama(world_of_one):
    cfg = ModelConfig(**CFG)
    torch.manual_seed(0)
    model = build_gpt(cfg).eval()
    for _, m in policy_linears(model):
        m.gemm_backend = "reference"
    apply_precision_plan(model, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(model), cfg.num_layers))
    return model, cfg


def _rollout(model, cfg, spec, rules=()):
    return RolloutModel(model, resolve_rollout_plan(spec, rules, policy_linear_names(model), cfg.num_layers, 32))


# ================================================================================================
# The plan
# ================================================================================================


def test_kv_rules_resolve_per_layer_first_match_wins():
    plan = resolve_rollout_plan("mxfp4", ["last:1=kv=fp8", "layers:1-2=kv=bf16", "first:1=linear=bf16,kv=nvfp4"],
                                NAMES, 3, 32)
    assert [plan.kv_for(i).fmt for i in range(3)] == ["nvfp4", "bf16", "fp8_e4m3"]
    assert plan.kv.fmt == "mxfp4"  # the plan-wide default is kept
    assert plan.fprop("decoder.layers.0.mlp.linear_fc1").spec() == "bf16"  # the rule's linear part
    assert plan.fprop("decoder.layers.2.mlp.linear_fc1").spec() == "mxfp4"  # a kv-only rule moves no linear
    assert plan.per_head_scale  # FP8 and NVFP4 layers need calibrated per-head scales
    assert plan.to_dict()["kv_cache_layers"] == ["nvfp4", "bf16", "fp8_e4m3"]
    table = plan.table()
    assert "kv-cache layer 2" in table and "--rollout-precision-rule last:1=kv=fp8" in table
    glob = resolve_rollout_plan("mxfp4", ["decoder.layers.1.*=kv=bf16"], NAMES, 3, 32)
    assert [glob.kv_for(i).fmt for i in range(3)] == ["mxfp4", "bf16", "mxfp4"]
    plain = resolve_rollout_plan("mxfp4", ["first:1=bf16"], NAMES, 3, 32)
    assert plain.kv_layers == () and plain.kv_for(2).fmt == "mxfp4" and "kv_cache_layers" not in plain.to_dict()


@pytest.mark.parametrize("rules,match", [
    (["kind:mlp=kv=fp8"], r"kv= needs a selector of transformer layers .*kind:mlp names linears"),
    (["layers:3-3=kv=fp8"], r"'layers:3-3=kv=fp8': layer 3 is beyond the model \(3 layers: 0-2\)"),
    (["last:1=kv=int4"], r"'last:1=kv=int4': kv= 'int4': unknown KV-cache format; valid: .*mxfp4"),
    (["last:1=kv=fp8,kv=bf16"], r"'last:1=kv=fp8,kv=bf16': kv given twice"),
    (["last:1=kvv=fp8"], r"unknown key 'kvv'; valid: a preset or X@W spec, linear=SPEC, kv=FORMAT"),
    (["decoder.layers.7.*=kv=fp8"], r"matches no layer's KV-cache"),
    (["last:2=kv=fp8", "last:1=kv=bf16"], r"'last:1=kv=bf16': selects no layer's KV-cache: every layer .*earlier"),
    (["last:1=kv=mxfp6_e2m3"], None),  # valid (block 32 divides 32)
])
def test_bad_kv_rules_are_refused_in_one_line(rules, match):
    if match is None:
        resolve_rollout_plan("mxfp4", rules, NAMES, 3, 32)
        return
    with pytest.raises(SpecError, match=match) as e:
        resolve_rollout_plan("mxfp4", rules, NAMES, 3, 32)
    assert "\n" not in str(e.value) and "--rollout-precision-rule" in str(e.value)


def test_kv_rule_block_must_divide_the_head_dim():
    with pytest.raises(ValueError, match=r"--rollout-precision-rule 'last:1=kv=mxfp4' kv mxfp4|its 32-element "
                                         r"blocks do not divide the head dimension 16"):
        resolve_rollout_plan("base=nvfp4,kv=bf16", ["last:1=kv=mxfp4"], NAMES, 3, 16)


# ================================================================================================
# The cache and the engine
# ================================================================================================


def test_cache_stores_each_layer_in_its_format():
    fmts = [KVFormat("mxfp4"), None, KVFormat("fp8")]
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 2, 1, 32, generator=g), torch.randn(5, 2, 1, 32, generator=g)
    amax = torch.stack([k.abs().amax(dim=(0, 1, 3)), v.abs().amax(dim=(0, 1, 3))])
    cache = KVCache(3, 1, 32, fmts, [None, None, amax])
    for layer, fmt in zip(cache.layers, fmts):
        got_k, got_v = layer.update(k, v)
        want_k = k if fmt is None else fmt.fake_quantize(k, amax[0] if fmt.per_head_scale else None)
        want_v = v if fmt is None else fmt.fake_quantize(v, amax[1] if fmt.per_head_scale else None)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # bytes: K and V of one token, each layer in its own format (MXFP4 4.25 bits, FP32 32, FP8 8)
    assert cache.bytes_per_token == 2 * 1 * 32 * (4.25 + 32 + 8) / 8
    with pytest.raises(AttributeError, match="read KVCache.formats"):
        _ = cache.fmt
    assert KVCache(2, 1, 32, KVFormat("mxfp4")).fmt == KVFormat("mxfp4")
    with pytest.raises(ValueError, match="2 per-layer KV formats for 3 layers"):
        KVCache(3, 1, 32, fmts[:2])


@torch.no_grad()
def test_engine_caches_each_layer_in_its_format(llama):
    """The trainer's forward with K/V fake-quantized layer by layer in the plan's per-layer formats
    (no cache) re-scores the engine's tokens with the engine's log-probs; one layer cached in BF16
    changes them (so the per-layer format is really in use)."""
    model, cfg = llama
    rules = ["last:1=kv=bf16"]
    rollout = _rollout(model, cfg, "mxfp4", rules)
    out = Engine(model, vocab_size=VOCAB, rollout=rollout).generate(PROMPTS, GREEDY)
    uniform = Engine(model, vocab_size=VOCAB, rollout=_rollout(model, cfg, "mxfp4")).score(PROMPTS, out.tokens)
    attns = core_attentions(model)
    apply_precision_plan(model, rollout.plan.linears)
    try:
        for attn, fmt in zip(attns, ["mxfp4", "mxfp4", "bf16"]):
            attn.kv_format = KVFormat(fmt)
        for prompt, resp, lp in zip(PROMPTS, out.tokens, out.logprobs):
            ids = torch.tensor([prompt + resp])
            logp = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :VOCAB].float().log_softmax(-1)
            want = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(resp)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(lp), want, rtol=0, atol=FLOAT_TOL)
    finally:
        for attn in attns:
            attn.kv_format = None
        apply_precision_plan(model, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(model),
                                                                              cfg.num_layers))
    diff = max(abs(a - b) for ra, rb in zip(out.logprobs, uniform) for a, b in zip(ra, rb))
    assert diff > 10 * FLOAT_TOL
    mx = 2 * 1 * 32 * 4.25 / 8
    assert Engine(model, vocab_size=VOCAB, rollout=rollout).kv_bytes_per_token() == 2 * mx + 2 * 1 * 32 * 2  # BF16: 2 bytes


@torch.no_grad()
def test_rules_giving_every_layer_one_format_equal_the_plan_wide_format(llama):
    model, cfg = llama
    want = Engine(model, vocab_size=VOCAB, rollout=_rollout(model, cfg, "mxfp4")).generate(PROMPTS, GREEDY)
    got = Engine(model, vocab_size=VOCAB,
                 rollout=_rollout(model, cfg, "base=mxfp4,kv=bf16", ["layers:0-2=kv=mxfp4"])).generate(PROMPTS, GREEDY)
    assert got.tokens == want.tokens and got.logprobs == want.logprobs


@torch.no_grad()
def test_calibration_only_where_a_layer_needs_it(llama):
    model, cfg = llama
    rollout = _rollout(model, cfg, "mxfp4", ["last:1=kv=fp8"])
    assert rollout.needs_kv_calibration
    Engine(model, vocab_size=VOCAB, rollout=rollout).generate(PROMPTS, GREEDY)
    assert not rollout.needs_kv_calibration
    assert not _rollout(model, cfg, "base=mxfp4,kv=fp8", ["layers:0-2=kv=mxfp4"]).needs_kv_calibration


def test_qat_forward_fake_quantizes_each_layers_kv_in_its_format(llama):
    from pretrain.rl.qat import RolloutQAT

    model, cfg = llama
    plan = resolve_rollout_plan("mxfp4", ["first:1=kv=bf16", "last:1=kv=nvfp4"], policy_linear_names(model),
                                cfg.num_layers, 32)
    qat = RolloutQAT(model, plan, "rtn")
    with qat.trainer_forward():
        assert [a.kv_format.fmt for a in core_attentions(model)] == ["bf16", "mxfp4", "nvfp4"]
    assert all(a.kv_format is None for a in core_attentions(model))


def test_attribution_puts_every_layers_cache_back_in_bf16():
    """The attribution's "KV-cache back in BF16" variant must move the per-layer formats too."""
    from pretrain.rl.attribution import _variant

    plan = resolve_rollout_plan("mxfp4", ["last:1=kv=fp8"], NAMES, 3, 32)
    back, overrides = _variant(plan, ["kv_cache"], None)
    assert [f.fmt for f in back.kv_formats(3)] == ["bf16"] * 3 and overrides == {}
    some, overrides = _variant(plan, ["kv_cache"], {0})
    assert [f.fmt for f in some.kv_formats(3)] == ["mxfp4", "mxfp4", "fp8_e4m3"] and overrides == {0: KVFormat("bf16")}

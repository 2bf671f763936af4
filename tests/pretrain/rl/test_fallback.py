"""Automatic rollout precision fallback (pretrain.rl.fallback) on a tiny 3-layer GPT.

Checks that can fail: the flag's parse errors (one line each, naming the flag); the threshold;
on an MXFP4 rollout of a model whose layer 1 has an outlier in every 32-block of its linears' weights
(the other elements of such a block lose their low bits: measured share of k3_kl 65 %, layer 0
11 %, layer 2 1 %), the attribution moves layer 1 first and its rule resolves through
model.rollout_plan.resolve_rollout_plan to BF16 (or FP8) for layer 1's linears only; a layer a
user rule sets is no candidate; a moved layer is never chosen again; state_dict round trip.
"""

from __future__ import annotations

import json

import pytest
import torch

from model.generate import Engine, SamplingParams
from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names, policy_linears
from model.rollout import RolloutModel
from model.rollout_plan import resolve_rollout_plan
from precision import PrecisionPolicy
from pretrain.rl.fallback import RolloutFallback

CFG = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1,
                  seq_length=32, vocab_size=64)
V = CFG.vocab_size
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15], [3, 4]]
ROLLOUT, RULES = "base=mxfp4,kv=bf16", ["layers:2-2=mxfp4"]


@pytest.fixture(scope="module")
def setup(world_of_one):
    torch.manual_seed(0)
    gpt = build_gpt(CFG).eval()
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
        for n, m in policy_linears(gpt):
            if n.startswith("decoder.layers.1."):
                m.weight[:, ::32] *= 30.0  # one outlier per 32-block along the in-features
    names = policy_linear_names(gpt)
    apply_precision_plan(gpt, PrecisionPolicy.from_args("bf16", []).resolve(names, 3))
    plan = resolve_rollout_plan(ROLLOUT, RULES, names, 3, 32)
    gen = Engine(gpt, vocab_size=V, rollout=RolloutModel(gpt, plan)).generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    return gpt, gen.rollout_batch()


@pytest.mark.parametrize("value,msg", [
    ("k3_kl", "expected METRIC=THRESHOLD"),
    ("ppl_ratio=0.1", "unknown metric 'ppl_ratio'; valid (verl mismatch keys that grow with the mismatch): k3_kl, kl,"),
    ("k3_kl=abc", "threshold 'abc' is not a number"),
    ("k3_kl=0", "threshold must be a finite number > 0, got 0"),
    ("k3_kl=-0.1", "threshold must be a finite number > 0"),
    ("k3_kl=nan", "threshold must be a finite number > 0"),
    ("k3_kl=0.1,to=int8", "to='int8' is not a fallback precision; valid: bf16, fp8"),
    ("k3_kl=0.1,layers=0", "layers='0' must be an integer >= 1"),
    ("k3_kl=0.1,every=2", "unknown option 'every=2'; valid: to=bf16|fp8, layers=K"),
    ("k3_kl=0.1,to=fp8,to=bf16", "to given twice"),
])
def test_parse_errors(value, msg):
    with pytest.raises(ValueError) as e:
        RolloutFallback.parse(value)
    assert str(e.value).startswith(f"--rollout-fallback {value!r}: ") and msg in str(e.value)
    assert "\n" not in str(e.value)


def test_parse_and_threshold():
    fb = RolloutFallback.parse("k3_kl=0.02")
    assert (fb.metric, fb.key, fb.threshold, fb.to, fb.layers_per_trigger) == ("k3_kl", "rollout_corr/k3_kl", 0.02,
                                                                               "bf16", 1)
    fb2 = RolloutFallback.parse(" training/rollout_probs_diff_max = 0.5 , to=fp8, layers=2")
    assert (fb2.metric, fb2.to, fb2.layers_per_trigger) == ("rollout_probs_diff_max", "fp8", 2)
    assert not fb.triggered({"rollout_corr/k3_kl": 0.02}) and fb.triggered({"rollout_corr/k3_kl": 0.0201})
    assert fb.triggered({"mismatch/rollout_corr/k3_kl": 1.0}) and not fb.triggered({"k3_kl": float("nan")})
    with pytest.raises(KeyError, match="have no rollout_corr/k3_kl"):
        fb.triggered({"rollout_corr/kl": 1.0})


def test_choose_moves_the_worst_layer_first(setup):
    model, batch = setup
    names = policy_linear_names(model)
    fb = RolloutFallback.parse("k3_kl=1e-6")
    assert fb.choose(model, batch, vocab_size=V, rollout=ROLLOUT, rules=RULES, iteration=3) == ["layers:1-1"]
    event = fb.events[-1]
    assert event["iteration"] == 3 and event["moved"] == ["layers:1-1"]
    shares = event["shares"]
    assert set(shares) == {"layers:0-0", "layers:1-1"}  # layer 2: the user's rule comes first
    assert max(shares, key=shares.get) == "layers:1-1" and shares["layers:1-1"] > 0.5, shares
    assert event["after"] < event["rescored"]
    assert fb.rollout_rules() == ["layers:1-1=bf16"]
    plan = resolve_rollout_plan(ROLLOUT, RULES + fb.rollout_rules(), names, 3, 32)
    base = resolve_rollout_plan(ROLLOUT, RULES, names, 3, 32)
    for n in names:
        want = "bf16" if n.startswith("decoder.layers.1.") else base.fprop(n).spec()
        assert plan.fprop(n).spec() == want, n
    # the next trigger (the loop passes its user rules; the fallback's own are added once)
    again = fb.choose(model, batch, vocab_size=V, rollout=ROLLOUT, rules=RULES + fb.rollout_rules(), iteration=5)
    assert "layers:1-1" not in again and "layers:1-1" not in fb.events[-1]["shares"]
    assert fb.moved == ["layers:1-1", *again]
    # round trip (JSON, as a checkpoint stores it)
    fresh = RolloutFallback.parse("k3_kl=1e-6")
    fresh.load_state_dict(json.loads(json.dumps(fb.state_dict())))
    assert fresh.state_dict() == fb.state_dict() and fresh.rollout_rules() == fb.rollout_rules()
    with pytest.raises(ValueError, match="^--rollout-fallback to=fp8: the checkpoint moved layers:1-1"):
        RolloutFallback.parse("k3_kl=1e-6,to=fp8").load_state_dict(fb.state_dict())


def test_fp8_target_and_layers_per_trigger(setup):
    model, batch = setup
    fb = RolloutFallback.parse("k3_kl=1e-6,to=fp8,layers=2")
    ref = torch.zeros_like(batch.rollout_logprobs)  # any trainer log-probs may be given as the reference
    chosen = fb.choose(model, batch, vocab_size=V, rollout=ROLLOUT, rules=[], iteration=0,
                       reference=ref + _bf16_ref(model, batch))
    assert len(chosen) == 2 and chosen[0] == "layers:1-1", fb.events[-1]
    names = policy_linear_names(model)
    plan = resolve_rollout_plan(ROLLOUT, fb.rollout_rules(), names, 3, 32)
    assert plan.fprop("decoder.layers.1.mlp.linear_fc1").spec() == "fp8_e4m3"
    assert [plan.fprop(f"decoder.layers.{i}.mlp.linear_fc2").spec() for i in range(3)].count("mxfp4") == 1
    fb.moved.append(next(s for s in ("layers:0-0", "layers:1-1", "layers:2-2") if s not in fb.moved))
    assert fb.exhausted and not fb.triggered({"rollout_corr/k3_kl": 1.0})


def _bf16_ref(model, batch):
    from pretrain.rl.attribution import score_logprobs

    return score_logprobs(model, batch, vocab_size=V)

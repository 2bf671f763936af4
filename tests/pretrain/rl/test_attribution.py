"""Mismatch attribution (pretrain.rl.attribution) on a tiny GPT (2 layers, head dim 32).

Checks that can fail:
  - the re-score of a batch equals the generation engine's own log-probs (a blocked-format rollout:
    every token's numbers are the same in a recomputation, model.generate's docstring);
  - a rollout that quantizes one component only: that component's effect and share are the whole
    total, the others exactly 0 (bit-identical re-scores), no interaction; its per-group effects
    plus the group interaction row are the total (the layers' effects are not additive: measured
    interaction 15 % of k3_kl and 48 % of the log-prob gap for MXFP4 weights on this 32-token batch);
  - a full MXFP4 rollout: Shapley shares add up to 100 % within 1e-9; effects + interaction = total;
    the table and plot are written.
"""

from __future__ import annotations

import pytest

from model.generate import Engine, SamplingParams
from model.gpt import ModelConfig
from model.rollout import RolloutModel
from pretrain.rl.attribution import (
    COMPONENTS,
    _plan,
    attribute_mismatch,
    layer_groups,
    score_logprobs,
    shapley,
)
from tests.pretrain.rl._models import sharp_gpt

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1,
                  seq_length=32, vocab_size=64)
V = CFG.vocab_size
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15], [3, 4]]


@pytest.fixture
def model(world_of_one):
    return sharp_gpt(CFG)


def _batch(model, rollout: str):
    engine = Engine(model, vocab_size=V, rollout=RolloutModel(model, _plan(model, rollout, ())))
    return engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)).rollout_batch()


def test_rescore_equals_the_engines_logprobs(model):
    batch = _batch(model, "mxfp4_w4a16")
    lp = score_logprobs(model, batch, vocab_size=V, rollout=RolloutModel(model, _plan(model, "mxfp4_w4a16", ())))
    assert batch.response_mask.sum() == 32
    assert (lp - batch.rollout_logprobs).abs().max() < 1e-4


@pytest.mark.parametrize("rollout,only", [("mxfp4_w4a16", "weights"), ("base=bf16,kv=mxfp4", "kv_cache")])
def test_a_single_quantized_component_takes_the_whole_total(model, rollout, only):
    groups = None if only == "weights" else {}  # per-group effects: once is enough (6 more forwards)
    a = attribute_mismatch(model, _batch(model, rollout), vocab_size=V, rollout=rollout, groups=groups)
    for metric in ("k3_kl", "logprob_gap"):
        assert a.total[metric] > 0
        for c in COMPONENTS:
            want = a.total[metric] if c == only else 0.0
            assert a.overall[c][metric] == want and a.shapley[c][metric] == pytest.approx(want, abs=1e-12)
        assert a.interaction(metric) == 0.0
        if a.groups:
            effects = [a.groups[g][only][metric] for g in a.groups]
            assert max(effects) > 0, effects  # a layer's effect may be negative (errors that cancel), not all
            assert sum(effects) + a.group_interaction(metric) == pytest.approx(a.total[metric], rel=1e-12)
    assert list(a.groups) == (["layer 0", "layer 1"] if only == "weights" else [])


def test_full_rollout_shares_add_up(model, tmp_path):
    a = attribute_mismatch(model, _batch(model, "mxfp4"), vocab_size=V, rollout="mxfp4", groups={})
    for metric in ("k3_kl", "logprob_gap"):
        assert a.total[metric] > 0
        assert abs(sum(a.share(a.shapley[c][metric], metric) for c in COMPONENTS) - 1.0) < 1e-9
        effects = sum(a.overall[c][metric] for c in COMPONENTS) + a.interaction(metric)
        assert effects == pytest.approx(a.total[metric], rel=1e-12)
    text = a.table()
    assert "| weights |" in text and "| interaction |" in text and "| **total** | 100% | 100% |" in text
    assert (tmp_path / "a.png").exists() is False and a.plot(str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_shapley_and_groups_by_hand():
    # v(S) = |S| + 2 [a and b in S]: a and b split the interaction 2, c gets 1
    v = {frozenset(s): len(s) + (2.0 if {"a", "b"} <= set(s) else 0.0)
         for s in ([], ["a"], ["b"], ["c"], ["a", "b"], ["a", "c"], ["b", "c"], ["a", "b", "c"])}
    assert shapley(v, ["a", "b", "c"]) == pytest.approx({"a": 2.0, "b": 2.0, "c": 1.0})
    assert layer_groups(2) == {"layer 0": [0], "layer 1": [1]}
    assert layer_groups(10, 4) == {"layers 0-1": [0, 1], "layers 2-4": [2, 3, 4], "layers 5-7": [5, 6, 7],
                                   "layers 8-9": [8, 9]}


# ================================================================================================
# A mixture-of-experts policy: the router as a fourth component
# ================================================================================================

MOE_CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1,
                      seq_length=32, vocab_size=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                      moe_shared_expert_intermediate_size=64)


def test_moe_router_component(world_of_one, tmp_path):
    """A weights-only rollout (MXFP4 W4A16) of a MoE policy: activations and KV take exactly 0; weights and
    router share the total (100 % within 1e-9); the router's effect is the total minus the metric of the
    rollout's arithmetic with the reference's routing replayed -- computed here from two re-scores."""
    from model.moe_replay import RoutingTap
    from pretrain.rl.attribution import MOE_COMPONENTS, _metric

    model = sharp_gpt(MOE_CFG)
    batch = _batch(model, "mxfp4_w4a16")
    a = attribute_mismatch(model, batch, vocab_size=V, rollout="mxfp4_w4a16", groups={})
    assert a.components == MOE_COMPONENTS
    tap = RoutingTap(model)
    lp_ref = score_logprobs(model, batch, vocab_size=V, rollout=RolloutModel(model, _plan(model, "bf16", ())),
                            routing=tap)
    ref_routing = [(e, None) for e, _ in tap.last]
    lp_w = score_logprobs(model, batch, vocab_size=V, rollout=RolloutModel(model, _plan(model, "mxfp4_w4a16", ())),
                          routing=tap, replay=ref_routing)
    without_router = _metric(lp_w, lp_ref, batch.response_mask)
    for metric in ("k3_kl", "logprob_gap"):
        assert a.total[metric] > 0
        for c in ("activations", "kv_cache"):
            assert a.overall[c][metric] == 0.0 and a.shapley[c][metric] == pytest.approx(0.0, abs=1e-12)
        assert a.overall["router"][metric] == pytest.approx(a.total[metric] - without_router[metric], rel=1e-9)
        assert a.overall["router"][metric] != 0.0  # FP4 weights move some tokens' expert choices on this batch
        assert abs(sum(a.share(a.shapley[c][metric], metric) for c in MOE_COMPONENTS) - 1.0) < 1e-9
    assert "| router |" in a.table() and a.plot(str(tmp_path / "moe.png"))

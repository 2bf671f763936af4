"""The generation engine serving a mixture-of-experts policy (model.generate, model.rollout, model.moe_replay).

Checks that can fail:
  - a rollout plan over a MoE model: the router's GEMM FP32 by default (the trainer's router), every
    routed and shared expert in the preset's format, packed; ``kind:`` / ``experts:`` rules select them
    and a user rule on the router wins;
  - cached decoding equals uncached for a MoE policy under BF16 and MXFP4 (W4A4 + KV, blocked per token):
    the same tokens, log-probs and the same recorded experts at every position;
  - the recorded routing (prompt + every fed-back token) equals what the routers choose in one
    teacher-forced forward of the whole sequences under the same rollout (an independent bookkeeping);
  - routing replay: the trainer's forward (its own BF16 plan) picks different top-k sets than an
    NVFP4 rollout on some tokens, and with the rollout's choices replayed its top-k sets equal the
    rollout's on every recorded position.
"""

from __future__ import annotations

import pytest
import torch

from model.generate import Engine, SamplingParams, attention_mask, forward_logits
from model.gpt import ModelConfig, apply_precision_plan, policy_linear_names
from model.moe_replay import RoutingTap, routing_targets
from model.rollout import packed_rollout
from precision import PrecisionPolicy
from precision.recipe import SpecError
from pretrain.rl.attribution import sequences
from tests.pretrain.rl._models import sharp_gpt

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1,
                  seq_length=64, vocab_size=100, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                  moe_shared_expert_intermediate_size=64)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
NEW = 8


@pytest.fixture(scope="module")
def model(world_of_one):
    m = sharp_gpt(CFG)
    apply_precision_plan(m, PrecisionPolicy.from_args("bf16", []).resolve(policy_linear_names(m), CFG.num_layers))
    return m


def _sets(experts: torch.Tensor) -> torch.Tensor:
    return experts.long().sort(-1).values


def test_rollout_plan_covers_experts_and_keeps_the_router_fp32(model):
    r = packed_rollout(model, CFG, "nvfp4")
    fmts = {n: p.fmt for n, p in r.packed.items()}
    assert fmts["decoder.layers.0.mlp.router"] == "fp32"
    assert fmts["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2"] == "nvfp4"
    assert fmts["decoder.layers.0.mlp.shared_experts.linear_fc1"] == "nvfp4"
    assert r.plan.linears.rule_for("decoder.layers.0.mlp.router") == "rollout preset: kind:router=fp32"
    r = packed_rollout(model, CFG, "nvfp4", ["kind:router=nvfp4", "kind:shared_expert=bf16", "experts:0-1,layers:1-1=mxfp4"])
    fmts = {n: p.fmt for n, p in r.packed.items()}
    assert fmts["decoder.layers.0.mlp.router"] == "nvfp4"
    assert fmts["decoder.layers.1.mlp.shared_experts.linear_fc2"] == "bf16"
    assert fmts["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1"] == "mxfp4"
    assert fmts["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1"] == "nvfp4"
    assert fmts["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1"] == "nvfp4"
    with pytest.raises(SpecError, match="--rollout-precision-rule"):
        packed_rollout(model, CFG, "nvfp4", ["experts:7-9=bf16"])


@pytest.mark.parametrize("spec", ["bf16", "mxfp4"])
def test_cached_decoding_equals_uncached(model, spec):
    r = packed_rollout(model, CFG, spec)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=3)
    cached = Engine(model, vocab_size=CFG.vocab_size, rollout=r).generate(PROMPTS, params)
    full = Engine(model, vocab_size=CFG.vocab_size, rollout=r, use_cache=False).generate(PROMPTS, params)
    assert cached.tokens == full.tokens
    for a, b in zip(cached.logprobs, full.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    for p, toks, a, b in zip(PROMPTS, cached.tokens, cached.routes, full.routes):
        assert a.experts.shape == (CFG.num_layers, len(p) + len(toks) - 1, CFG.moe_router_topk)
        assert torch.equal(_sets(a.experts), _sets(b.experts))
        assert torch.allclose(a.probs, b.probs, atol=1e-5)
        assert torch.allclose(a.probs.sum(-1), torch.ones(()), atol=1e-5)


def _teacher_forced(model, batch, replay=None):
    tokens, valid, _ = sequences(batch)
    tap = RoutingTap(model)
    with torch.no_grad(), tap.attached(replay=replay):
        forward_logits(model, tokens, (valid.long().cumsum(1) - 1).clamp(min=0), attention_mask(valid, tokens.shape[1]))
    return [e for e, _ in tap.last], tokens.shape[1]


def _differ(choices, targets) -> tuple[int, int]:
    differ = total = 0
    for own, (want, mask) in zip(choices, targets):
        differ += int(((_sets(own) != _sets(want)).any(-1) & mask).sum())
        total += int(mask.sum())
    return differ, total


def test_recorded_routing_equals_a_teacher_forced_forward(model):
    r = packed_rollout(model, CFG, "mxfp4")
    batch = Engine(model, vocab_size=CFG.vocab_size, rollout=r).generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) \
        .rollout_batch()
    assert batch.routes is not None
    with r.active():
        choices, width = _teacher_forced(model, batch)
    differ, total = _differ(choices, routing_targets(batch.routes, width))
    assert total == CFG.num_layers * sum(len(p) + NEW - 1 for p in PROMPTS)
    assert differ == 0


def test_routing_replay_makes_the_trainers_topk_sets_the_rollouts(model):
    r = packed_rollout(model, CFG, "nvfp4")
    batch = Engine(model, vocab_size=CFG.vocab_size, rollout=r).generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) \
        .rollout_batch()
    own, width = _teacher_forced(model, batch)  # the trainer's own (BF16) plan, routing afresh
    targets = routing_targets(batch.routes, width)
    differ, total = _differ(own, targets)
    assert 0 < differ < total  # NVFP4 moves some tokens' expert choices (measured: 5 of 62)
    replayed, _ = _teacher_forced(model, batch, replay=targets)
    assert _differ(replayed, targets) == (0, total)
    # unrecorded slots (each row's last token, padding) route afresh: in the first MoE layer (its input
    # precedes any replayed choice) they choose as without replay
    mask = targets[0][1]
    assert bool((~mask).any()) and torch.equal(_sets(own[0])[~mask], _sets(replayed[0])[~mask])

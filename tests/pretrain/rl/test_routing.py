"""Routing metrics and routing replay in the RL loop (pretrain.rl.routing, score, update) on a tiny MoE policy.

Checks that can fail:
  - a step of an NVFP4-rollout MoE run logs routing/* beside mismatch/*: fractions in [0, 1], one per
    MoE layer, their mean (equal position counts per layer) the overall fraction;
  - the metrics computed here from the step's own batch (the rollout's recorded choices against a
    teacher-forced trainer forward routing afresh) equal the logged top-k mismatch fraction;
  - with --routing-replay the trainer's recompute reuses the rollout's choices: its log-prob mismatch
    is the "replay" one, and routing/k3_kl_replay is what mismatch/k3_kl reports;
  - --routing-replay on a dense model is refused in one line naming the flag.
"""

from __future__ import annotations

import pytest
import torch

from pretrain.arguments import ConfigError
from tests.pretrain.rl.test_rl_loop import _trainer, base, tokenizer  # noqa: F401 (fixture)

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--moe-shared-expert-intermediate-size", "64", "--rollout-precision", "nvfp4", "--precision", "bf16",
       "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6"]


def _sharpen(model, scale=3.0):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(scale)


@pytest.mark.parametrize("replay", [False, True])
def test_moe_step_logs_routing_metrics(world_of_one, tokenizer, replay):  # noqa: F811
    from model.generate import attention_mask
    from model.moe_replay import RoutingTap
    from pretrain.rl.attribution import sequences
    from pretrain.rl.routing import routing_counts

    t = _trainer(base(tokenizer, *MOE, *(["--routing-replay"] if replay else [])))
    _sharpen(t.model)
    t.rollout.update()
    assert t.routing is not None and len(t.routing) == 2
    _, gen, _ = t.generate(0)
    batch = gen.rollout_batch()
    tokens, valid, _ = sequences(batch)
    tap = RoutingTap(t.model)
    t.model.train()
    with torch.no_grad(), tap.attached():
        t.model(tokens, (valid.long().cumsum(1) - 1).clamp(min=0), attention_mask(valid, tokens.shape[1]))
    counts = routing_counts(batch.routes, list(tap.last), tokens.shape[1])
    want = float(counts[:, 1].sum() / counts[:, 0].sum())

    s = t.step()
    assert s["routing/topk_mismatch_fraction"] == pytest.approx(want, abs=1e-12)
    layers = [s[f"routing/layer_{i}/topk_mismatch_fraction"] for i in range(2)]
    assert all(0 <= f <= 1 for f in layers)
    assert s["routing/topk_mismatch_fraction"] == pytest.approx(sum(layers) / 2, abs=1e-12)
    assert s["routing/router_prob_gap"] > 0  # NVFP4 experts and KV move the router's input
    used = "replay" if replay else "no_replay"
    assert s["mismatch/k3_kl"] == pytest.approx(s[f"routing/k3_kl_{used}"], rel=1e-6, abs=1e-9)
    if want > 0:  # a routing difference somewhere: the two recomputes differ
        assert s["routing/logprob_gap_replay"] != s["routing/logprob_gap_no_replay"]


def test_routing_replay_on_a_dense_model_is_refused(tokenizer):  # noqa: F811
    from pretrain.rl.arguments import parse_rl_args

    with pytest.raises(ConfigError, match="--routing-replay"):
        parse_rl_args(base(tokenizer, "--routing-replay"), 1, False)


def test_moe_rollout_guided_qat(world_of_one, tokenizer):  # noqa: F811
    """--rollout-qat replay on a MoE policy (MXFP4 rollouts, routing replayed): the routed experts take
    rtn (no per-position record), every other linear replays; the QAT recompute reproduces the rollout's
    log-probs to float rounding. Selecting routed experts for replay is refused in one line."""
    t = _trainer(base(tokenizer, *MOE, "--rollout-precision", "mxfp4", "--routing-replay", "--rollout-qat", "replay"))
    assert t.qat.record_layers and not any(".mlp.experts." in n for n in t.qat.record_layers)
    assert any(".mlp.shared_experts." in n for n in t.qat.record_layers)
    s = t.step()
    assert s["qat/k3_kl"] < 1e-6 < s["mismatch/k3_kl"]
    with pytest.raises(ConfigError, match="routed expert"):
        _trainer(base(tokenizer, *MOE, "--rollout-precision", "mxfp4", "--rollout-qat", "replay",
                      "--rollout-qat-layers", "kind:expert_fc1"))

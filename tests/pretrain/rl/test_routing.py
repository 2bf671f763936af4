"""Routing metrics and routing replay in the RL loop (pretrain.rl.routing, score, update) on a tiny MoE policy.

Checks that can fail:
  - a step of an NVFP4-rollout MoE run logs routing/* beside mismatch/*: fractions in [0, 1], one per
    MoE layer, their mean (equal position counts per layer) the overall fraction;
  - the metrics computed here from the step's own batch (the rollout's recorded choices against a
    teacher-forced trainer forward routing afresh) equal the logged top-k mismatch fraction;
  - with --routing-replay the trainer's recompute reuses the rollout's choices: its log-prob mismatch
    is the "replay" one, and routing/k3_kl_replay is what mismatch/k3_kl reports;
  - --routing-replay on a dense model is refused in one line naming the flag;
  - under data parallelism (torchrun, DP=2, gloo) the routing/* metrics are those of the global batch:
    each rank's rows scored on that rank, the sums all-reduced, equal the DP=1 metrics of the same
    rows scored in one process (the same weights, the rollout's own records). Tolerance: the top-k
    fractions exactly (a routing flip would be one position of a few hundred), the probability gap and
    the log-prob mismatches to 1e-5 relative (each rank's forward runs another batch shape).

This file is also the DP=2 worker: ``torchrun --nproc-per-node 2 -m tests.pretrain.rl.test_routing
--tokenizer TOK --out F``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


# ================================================================================================
# Data parallelism: DP=2 under torchrun equals DP=1 on the same batch
# ================================================================================================

DP_ARGS = [*MOE, "--routing-replay", "--seed", "7"]  # 2 prompts x G 4: one prompt per DP rank
ROUTING_RTOL = 1e-5


def _dp_worker(argv: list[str]) -> None:
    """Rank r of DP=2: the sharpened policy's rollout of iteration 0 (this rank's prompt), scored here;
    rank 0 saves the step's scalars, every rank's problems and generation, and the weights."""
    import argparse

    from pretrain.rl.arguments import parse_rl_args
    from pretrain.rl.score import score
    from pretrain.rl.trainer import setup
    from pretrain.rl.update import update

    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    run, cfg = parse_rl_args(base(a.tokenizer, *DP_ARGS), int(os.environ["WORLD_SIZE"]), False)
    t = setup(run, cfg)
    _sharpen(t.model)
    t.rollout.update()
    state = {k: v.clone() for k, v in t.model.state_dict().items() if isinstance(v, torch.Tensor)}
    problems, gen, _ = t.generate(0)
    scored = score(t, problems, gen)
    gen.last_logits = []
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, (problems, gen))
    update_scalars = update(t, scored)  # the MoE update with replay runs under DP
    if torch.distributed.get_rank() == 0:
        torch.save({"scalars": scored.scalars, "parts": parts, "state": state, "update": update_scalars}, a.out)


@pytest.mark.slow
def test_routing_metrics_under_data_parallelism(world_of_one, tokenizer, tmp_path):  # noqa: F811
    from model.generate import Generation
    from pretrain.rl.score import score
    from tests._dist import free_port, run_scaled
    from tests.pretrain._launch import REPO, env

    out = tmp_path / "dp2.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "tests.pretrain.rl.test_routing", "--tokenizer", tokenizer,
           "--out", str(out)]
    proc = run_scaled(cmd, 240, cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    dp2 = torch.load(out, weights_only=False)
    assert all(torch.isfinite(torch.tensor(v)) for v in dp2["update"].values())
    (p0, g0), (p1, g1) = dp2["parts"]
    assert [p.prompt for p in p0] != [p.prompt for p in p1]  # each rank its own prompt

    # DP=1: the same weights score both ranks' rows at once
    t = _trainer(base(tokenizer, *DP_ARGS))
    t.model.load_state_dict(dp2["state"], strict=False)
    t.rollout.update()
    fields = ("prompts", "tokens", "logprobs", "finish_reasons")
    gen = Generation(*(getattr(g0, f) + getattr(g1, f) for f in fields), routes=g0.routes + g1.routes)
    one = score(t, p0 + p1, gen).scalars
    two = dp2["scalars"]
    keys = sorted(k for k in one if k.startswith("routing/"))
    assert "routing/layer_1/topk_mismatch_fraction" in keys and set(keys) == {k for k in two if k.startswith("routing/")}
    assert one["routing/topk_mismatch_fraction"] > 0  # NVFP4 rollouts moved some expert choices: counted
    for k in keys:
        if k.endswith("topk_mismatch_fraction"):
            assert two[k] == one[k], (k, two[k], one[k])
        else:
            assert two[k] == pytest.approx(one[k], rel=ROUTING_RTOL, abs=1e-12), (k, two[k], one[k])
    assert two["mismatch/k3_kl"] == pytest.approx(one["mismatch/k3_kl"], rel=ROUTING_RTOL)
    # rank 0's rows alone give other metrics: a reduction that kept rank 0's shard would fail above
    alone = score(t, p0, Generation(*(getattr(g0, f) for f in fields), routes=g0.routes)).scalars
    assert any(alone[k] != pytest.approx(one[k], rel=1e-3) for k in keys)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    _dp_worker(sys.argv[1:])

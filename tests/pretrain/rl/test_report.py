"""mismatch.md for a generation run (pretrain.rl.report): trainer recompute vs rollout log-probs."""

from __future__ import annotations

import pytest

from model.generate import Engine, SamplingParams
from model.rollout import RolloutModel
from pretrain.rl.attribution import _plan
from pretrain.rl.report import trainer_logprobs, write_generation_mismatch
from tests.pretrain.rl.test_attribution import PROMPTS, V, model  # noqa: F401  (the fixture)


def _batch(gpt, rollout):
    engine = Engine(gpt, vocab_size=V, rollout=RolloutModel(gpt, _plan(gpt, rollout, ())))
    return engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)).rollout_batch()


def test_trainer_under_the_rollouts_plan_reproduces_the_rollout(model):  # noqa: F811
    batch = _batch(model, "mxfp4_w4a16")
    # the rollout's plan as a training plan, and the rollout's BF16 KV-cache emulated (--kv-quant bf16)
    same = trainer_logprobs(model, batch, vocab_size=V, precision="base=bf16,fprop=bf16@mxfp4", kv_quant="bf16")
    no_kv = trainer_logprobs(model, batch, vocab_size=V, precision="base=bf16,fprop=bf16@mxfp4")
    bf16 = trainer_logprobs(model, batch, vocab_size=V, precision="bf16")
    m = batch.response_mask
    assert (same - batch.rollout_logprobs)[m].abs().max() < 1e-4  # same quantizer, same bits
    assert (no_kv - batch.rollout_logprobs)[m].abs().max() > 1e-3  # FP32 K/V are not the cache's BF16
    assert (bf16 - batch.rollout_logprobs)[m].abs().max() > 1e-2  # a BF16 trainer does differ


def test_mismatch_md_with_attribution(model, tmp_path):  # noqa: F811
    from model.gpt import policy_linears

    before = [m.precision for _, m in policy_linears(model)]
    batch = _batch(model, "mxfp4_w4a16")
    out = write_generation_mismatch(str(tmp_path), model, batch, vocab_size=V, rollout="mxfp4_w4a16",
                                    trainer_precision="bf16", groups={})
    assert [m.precision for _, m in policy_linears(model)] == before  # the model's own plan is back
    text = (tmp_path / "mismatch.md").read_text()
    assert "rollout mxfp4_w4a16 vs trainer bf16" in text and "## Where the rollout's mismatch comes from" in text
    assert "| weights | 100.0% | 100.0% |" in text  # weight-only rollout: all of it is the weights
    for png in ("mismatch_by_position.png", "attribution.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert out["overall"]["rollout_corr/k3_kl"] > 0 and out["attribution"].total["k3_kl"] > 0
    with pytest.raises(ValueError, match="unknown"):
        trainer_logprobs(model, batch, vocab_size=V, precision="nope")


def test_generate_cli_writes_mismatch_md(model, tmp_path):  # noqa: F811
    import dataclasses
    import json

    import torch

    from launch.generate import main
    from tests.pretrain.rl.test_attribution import CFG

    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"model": state, "model_config": dataclasses.asdict(CFG)}, tmp_path / "w.pt")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:2]))
    assert main(["--load", str(tmp_path / "w.pt"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "out"), "--rollout-precision", "mxfp4_w4a16", "--precision", "bf16",
                 "--max-new-tokens", "4", "--temperature", "1.0"]) == 0
    text = (tmp_path / "out" / "mismatch.md").read_text()
    assert "rollout mxfp4_w4a16 vs trainer --precision bf16" in text and "2 sequences, 8 response tokens" in text
    assert "Where the rollout's mismatch comes from" not in text  # --attribution not given


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8)])
def test_truncated_sampling_is_scored_as_sampled(model, top_k, top_p, tmp_path):  # noqa: F811
    """Top-k / top-p samples: the trainer under the rollout's own plan gives the engine's log-probs of
    the truncated distribution (the full distribution's would differ by the truncation)."""
    engine = Engine(model, vocab_size=V, rollout=RolloutModel(model, _plan(model, "mxfp4_w4a16", ())))
    batch = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_new_tokens=8,
                                                    seed=2)).rollout_batch()
    kw = {"vocab_size": V, "precision": "base=bf16,fprop=bf16@mxfp4", "kv_quant": "bf16"}
    m = batch.response_mask
    same = trainer_logprobs(model, batch, top_k=top_k, top_p=top_p, **kw)
    assert (same - batch.rollout_logprobs)[m].abs().max() < 1e-4
    assert (trainer_logprobs(model, batch, **kw) - batch.rollout_logprobs)[m].abs().max() > 1e-2
    write_generation_mismatch(str(tmp_path), model, batch, vocab_size=V, rollout="mxfp4_w4a16",
                              trainer_precision="base=bf16,fprop=bf16@mxfp4", kv_quant="bf16", top_k=top_k,
                              top_p=top_p, attribution=False)
    assert "the trainer scored the same truncated distribution" in (tmp_path / "mismatch.md").read_text()

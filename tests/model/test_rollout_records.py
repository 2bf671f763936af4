"""Rounding records taken by the engine while it generates (``model.rollout_records``).

Oracles: a teacher-forced forward of each sequence alone under the rollout (no padding, no cache),
whose captured Fprop inputs ``precision.rounding_record.record_rounding`` records directly; and
the trainer's own forward (megatron's) on the same tokens, which replays the engine's records.
Under ``mxfp4`` a token's activations do not depend on the call that ran it (MX blocks lie within
one token's row, the cache stores what a recomputation fake-quantizes), so the records agree bit
for bit whether taken in prefill, in a cached decode step or in the teacher-forced pass.
"""

from __future__ import annotations

import pytest
import torch

from model.attention import set_kv_quant
from model.generate import Engine, attention_mask, forward_logits
from model.gpt import apply_precision_plan, policy_linear_names
from precision import PrecisionPolicy
from precision.quantize import quantize
from precision.recipe import SpecError
from precision.rounding_record import code_agreement, record_rounding, replay_fake_quantize, replay_quantize
from pretrain.rl.alignment import capture_inputs, engine_alignment
from tests.model.test_generate import GREEDY, PROMPTS, VOCAB, _rollout, build

FC1_0, QKV_1 = "decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.self_attention.linear_qkv"
QKV_0 = "decoder.layers.0.self_attention.linear_qkv"
SELECT = ["kind:fc1", QKV_1]  # a --precision-rule selector and a plain name


@pytest.fixture(scope="module")
def llama(world_of_one):
    return build("llama")


@torch.no_grad()
def _teacher_forced(model, rollout, names, seq: list[int]) -> dict[str, torch.Tensor]:
    """Fprop inputs ``[len(seq), in]`` of ``names`` in one uncached forward of ``seq`` under the rollout."""
    ids = torch.tensor([seq])
    with rollout.active(), capture_inputs(model, names) as x:
        forward_logits(model, ids, torch.arange(len(seq))[None], attention_mask(torch.ones_like(ids, dtype=torch.bool), len(seq)))
    return dict(x)


@pytest.mark.parametrize(("padding", "use_cache"), [("left", True), ("right", True), ("left", False)])
def test_engine_records_equal_teacher_forced_records(llama, padding, use_cache):
    model, cfg = llama
    rollout = _rollout(model, cfg, "mxfp4")
    engine = Engine(model, vocab_size=VOCAB, rollout=rollout, padding=padding, use_cache=use_cache,
                    record_layers=SELECT)
    out = engine.generate(PROMPTS, GREEDY)
    names = sorted(engine.recorded)
    assert names == sorted([FC1_0, "decoder.layers.1.mlp.linear_fc1", QKV_1])
    batch = out.rollout_batch()
    assert batch.records is out.records and len(out.records) == len(PROMPTS)
    for prompt, resp, recs in zip(PROMPTS, out.tokens, out.records):
        seq = prompt + resp
        x = _teacher_forced(model, rollout, names, seq)
        for n in names:
            rec = recs[n]
            assert rec.shape == (len(seq) - 1, 64) and rec.fmt == "mxfp4" and rec.axis == 1
            _, want = record_rounding(x[n][: len(seq) - 1], rollout.plan.fprop(n).a, axis=1)
            assert torch.equal(rec.scales, want.scales), n
            assert torch.equal(rec.direction, want.direction), n
            assert rec.bits_per_element == 1.25  # 1 direction bit + an 8-bit E8M0 scale per 32


def test_trainer_replays_the_engines_records(llama):
    model, cfg = llama
    rollout = _rollout(model, cfg, "mxfp4")
    out = Engine(model, vocab_size=VOCAB, rollout=rollout, record_layers=[FC1_0, QKV_1]).generate(PROMPTS, GREEDY)
    fmt = rollout.plan.fprop(FC1_0).a

    def trainer_inputs(seq):
        with torch.no_grad(), capture_inputs(model, [FC1_0, QKV_1]) as x:
            model(torch.tensor([seq]), torch.arange(len(seq))[None], None)  # megatron's training forward
        return {n: v[: len(seq) - 1] for n, v in x.items()}

    # the trainer under the rollout's Fprop recipes and KV format: the rollout's own numbers
    apply_precision_plan(model, rollout.plan.linears)
    set_kv_quant(model, "mxfp4")
    try:
        for prompt, resp, recs in zip(PROMPTS, out.tokens, out.records):
            seq = prompt + resp
            x_roll = _teacher_forced(model, rollout, [FC1_0, QKV_1], seq)
            for n, x_train in trainer_inputs(seq).items():
                q_roll, _ = record_rounding(x_roll[n][: len(seq) - 1], fmt, axis=1)
                assert code_agreement(replay_quantize(x_train, recs[n]), q_roll) == 1.0
                torch.testing.assert_close(replay_fake_quantize(x_train, recs[n]), q_roll.dequantize(torch.float32),
                                           rtol=0, atol=0)
    finally:
        set_kv_quant(model, None)
        apply_precision_plan(model, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(model),
                                                                              cfg.num_layers))
    # an FP32 trainer with a BF16 cache (its own plan): layer 1 sees other inputs; replay recovers codes
    seq = PROMPTS[0] + out.tokens[0]
    q_roll, _ = record_rounding(_teacher_forced(model, rollout, [QKV_1], seq)[QKV_1][: len(seq) - 1], fmt, axis=1)
    x_train = trainer_inputs(seq)[QKV_1]
    own = code_agreement(quantize(x_train, fmt, axis=1), q_roll)
    assert own < 1.0 and code_agreement(replay_quantize(x_train, out.records[0][QKV_1]), q_roll) > own


def test_unrecordable_layers_are_refused(llama):
    model, cfg = llama
    with pytest.raises(SpecError, match="runs x as bf16@mxfp4 under the rollout plan mxfp4_w4a16"):
        Engine(model, vocab_size=VOCAB, rollout=_rollout(model, cfg, "mxfp4_w4a16"), record_layers=["kind:fc1"])
    with pytest.raises(SpecError, match="linear_fc1 runs x as nvfp4 under"):
        Engine(model, vocab_size=VOCAB, rollout=_rollout(model, cfg, "nvfp4"), record_layers=["kind:fc1"])
    with pytest.raises(SpecError, match="output_layer runs x as bf16 under"):
        Engine(model, vocab_size=VOCAB, rollout=_rollout(model, cfg, "mxfp4"), record_layers=["output_layer"])
    with pytest.raises(SpecError, match="'decoder.layers.7.\\*': selects no linear"):
        Engine(model, vocab_size=VOCAB, rollout=_rollout(model, cfg, "mxfp4"), record_layers=["decoder.layers.7.*"])
    with pytest.raises(ValueError, match="pass rollout="):
        Engine(model, vocab_size=VOCAB, record_layers=["kind:fc1"])


def test_engine_alignment_against_the_rollouts_own_codes(llama):
    """``pretrain.rl.alignment.engine_alignment``: the trainer's forward against the codes the engine
    kept while generating (``record_codes=True``), with and without replaying its records."""
    model, cfg = llama
    rollout = _rollout(model, cfg, "mxfp4")
    engine = Engine(model, vocab_size=VOCAB, rollout=rollout, record_layers=[QKV_0, FC1_0, QKV_1], record_codes=True)
    out = engine.generate(PROMPTS, GREEDY)
    for prompt, resp, codes in zip(PROMPTS, out.tokens, out.record_codes):  # the codes the rollout ran
        seq = prompt + resp
        x = _teacher_forced(model, rollout, [FC1_0], seq)[FC1_0][: len(seq) - 1]
        assert torch.equal(codes[FC1_0].codes, record_rounding(x, rollout.plan.fprop(FC1_0).a, axis=1)[0].codes)
    batch = out.rollout_batch()
    same = engine_alignment(model, batch, out.record_codes, engine.recorded, vocab_size=VOCAB,
                            trainer="base=bf16,fprop=mxfp4@mxfp4", kv_quant="mxfp4")
    assert all(r["own"] == r["replay"] == 1.0 and r["bits_per_element"] == 1.25 for r in same), same
    rows = {r["layer"]: r for r in engine_alignment(model, batch, out.record_codes, engine.recorded,
                                                    vocab_size=VOCAB, trainer="bf16")}
    assert rows[QKV_0]["own"] == rows[QKV_0]["replay"] == 1.0  # embeddings + norm: the same x
    for n in (FC1_0, QKV_1):  # after a BF16 attention and KV-cache: other inputs; replay recovers codes
        assert rows[n]["own"] < 1.0 and rows[n]["replay"] > rows[n]["own"], rows[n]
    assert rows[QKV_1]["elements"] == sum(len(p) + len(t) - 1 for p, t in zip(PROMPTS, out.tokens)) * 64

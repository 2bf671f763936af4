"""Rounding alignment on a generated batch (pretrain.rl.alignment): record in the rollout, replay
in the trainer, count agreeing codes."""

from __future__ import annotations

import pytest

from pretrain.rl.alignment import alignment_table, rounding_alignment
from tests.pretrain.rl.test_attribution import V, _batch, model  # noqa: F401  (the fixture)

QKV0, FC1 = "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc1"


def test_record_and_replay_on_a_batch(model):  # noqa: F811
    batch = _batch(model, "mxfp4")
    # a BF16 trainer: every layer after the first sees other inputs than the MXFP4 rollout did
    rows = {r["layer"]: r for r in rounding_alignment(model, batch, vocab_size=V, rollout="mxfp4",
                                                      layers=[QKV0, "decoder.layers.1.mlp.*"], trainer="bf16")}
    assert set(rows) == {QKV0, FC1, "decoder.layers.1.mlp.linear_fc2"}
    assert rows[QKV0]["own"] == rows[QKV0]["replay"] == 1.0  # embeddings + norm: the same x
    assert rows[FC1]["own"] < 0.99 and rows[FC1]["replay"] > rows[FC1]["own"], rows[FC1]
    assert all(r["replay"] >= r["own"] for r in rows.values())
    assert rows[FC1]["bits_per_element"] == 1.25 and rows[FC1]["elements"] == batch.response_ids.shape[0] * 14 * 64
    # the trainer under the rollout's own plan and KV-cache: identical inputs, 100 % without replay
    same = rounding_alignment(model, batch, vocab_size=V, rollout="mxfp4", layers=[FC1],
                              trainer="base=bf16,fprop=mxfp4@mxfp4", kv_quant="mxfp4")
    assert same[0]["own"] == same[0]["replay"] == 1.0
    assert "| `decoder.layers.1.mlp.linear_fc1` | mxfp4 |" in alignment_table(list(rows.values()))


def test_unrecordable_layers_are_refused(model):  # noqa: F811
    batch = _batch(model, "mxfp4_w4a16")
    with pytest.raises(ValueError, match="runs x as bf16@mxfp4 under --rollout-precision mxfp4_w4a16"):
        rounding_alignment(model, batch, vocab_size=V, rollout="mxfp4_w4a16", layers=[FC1])
    with pytest.raises(ValueError, match="match no linear"):
        rounding_alignment(model, batch, vocab_size=V, rollout="mxfp4", layers=["decoder.layers.7.*"])

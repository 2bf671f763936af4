"""verl's mismatch metrics on a hand-computed example (pretrain.rl.mismatch).

Two sequences, probabilities powers of two so every metric has a closed form in ln 2:

    row 0 (mask 1 1 0):  p_train .5 .25 (pad)   p_rollout .25 .25 (pad)   r = ln2, 0
    row 1 (mask 1 1 1):  p_train .5 .5  1       p_rollout 1   .5  .5      r = -ln2, 0, ln2

Float64 inputs (the metrics compute in float64). The padded entry holds NaN / -inf on purpose: masked entries must not leak into any metric.
"""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.rl.mismatch import (
    METRIC_KEYS,
    mismatch_by_position,
    mismatch_metrics,
    response_positions,
    write_mismatch_report,
)

LN2 = math.log(2.0)


def _example():
    train = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.5, 0.5, 1.0]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.25, 0.25, 1.0], [1.0, 0.5, 0.5]], dtype=torch.float64))
    train[0, 2], rollout[0, 2] = float("nan"), float("-inf")
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return train, rollout, mask


def test_every_metric_against_hand_computed_values():
    m = mismatch_metrics(*_example())
    expected = {
        "rollout_corr/kl": -LN2 / 5,  # mean(-r) over 5 tokens, sum r = ln2
        "rollout_corr/k3_kl": (1.5 - LN2) / 5,  # 2 (1 - ln2) + (ln2 - 1/2)
        "rollout_corr/training_ppl": (2**1.5 + 2 ** (2 / 3)) / 2,  # per-seq mean log-probs -1.5 ln2, -2/3 ln2
        "rollout_corr/training_log_ppl": (1.5 + 2 / 3) * LN2 / 2,
        "rollout_corr/rollout_ppl": (4 + 2 ** (2 / 3)) / 2,  # -2 ln2, -2/3 ln2
        "rollout_corr/rollout_log_ppl": (2 + 2 / 3) * LN2 / 2,
        "rollout_corr/log_ppl_diff": -0.25 * LN2,  # d = (-0.5 ln2, 0)
        "rollout_corr/log_ppl_abs_diff": 0.25 * LN2,
        "rollout_corr/log_ppl_diff_max": 0.0,
        "rollout_corr/log_ppl_diff_min": -0.5 * LN2,
        "rollout_corr/ppl_ratio": (2**-0.5 + 1) / 2,
        "rollout_corr/chi2_token": (4 + 1 + 0.25 + 1 + 4) / 5 - 1,  # rho^2
        "rollout_corr/chi2_seq": (4 + 1) / 2 - 1,  # (prod rho)^2 = 4, 1
        "training/rollout_probs_diff_mean": 0.25,  # |dp| = .25 0 .5 0 .5
        "training/rollout_probs_diff_max": 0.5,
        "training/rollout_probs_diff_std": 0.25,  # unbiased, as torch.std
        "training/rollout_actor_probs_pearson_corr": 0.0625 / math.sqrt(0.3 * 0.375),
    }
    assert set(m) == set(METRIC_KEYS) == set(expected)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_identical_logprobs_have_no_mismatch():
    train, _, mask = _example()
    m = mismatch_metrics(train, train.clone(), mask)
    for k in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert m["rollout_corr/" + k] == 0.0, k
    assert m["rollout_corr/ppl_ratio"] == 1.0 and m["training/rollout_probs_diff_max"] == 0.0
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)


def test_chi2_uses_verls_safety_clamp():
    lt, lr, mask = torch.tensor([[0.0]]), torch.tensor([[-30.0]]), torch.ones(1, 1)
    m = mismatch_metrics(lt, lr, mask)
    assert m["rollout_corr/chi2_token"] == pytest.approx(math.exp(40.0) - 1)  # log rho clamped at 20
    assert m["rollout_corr/k3_kl"] == pytest.approx(math.exp(30.0) - 31)  # k3 is not clamped (as verl)


def test_response_positions_skip_the_prompt():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    pos = response_positions(mask)
    assert pos[mask.bool()].tolist() == [0, 1, 2, 0, 1]


def test_by_position_buckets():
    rows = mismatch_by_position(*_example(), edges=(0, 1, 2))
    assert [(r["lo"], r["hi"], r["tokens"], r["sequences"]) for r in rows] == [(0, 1, 2, 2), (1, 2, 2, 2),
                                                                              (2, None, 1, 1)]
    first, second, last = rows
    assert first["rollout_corr/k3_kl"] == pytest.approx(0.25)  # r = ln2, -ln2: (1 - ln2 + ln2 - 1/2) / 2
    assert first["rollout_corr/chi2_seq"] == pytest.approx((4 + 0.25) / 2 - 1)
    assert second["rollout_corr/kl"] == 0.0 and second["rollout_corr/k3_kl"] == 0.0
    assert last["rollout_corr/kl"] == pytest.approx(-LN2)
    assert mismatch_by_position(*_example(), edges=(5,)) == []  # no token that far


def test_bad_input_is_refused():
    train, rollout, mask = _example()
    with pytest.raises(ValueError, match="one shape"):
        mismatch_metrics(train, rollout[:, :2], mask)
    with pytest.raises(ValueError, match="no response token"):
        mismatch_metrics(train, rollout, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="increasing"):
        mismatch_by_position(train, rollout, mask, edges=(4, 2))


def test_report_writes_markdown_and_plot(tmp_path):
    out = write_mismatch_report(str(tmp_path), *_example(), rollout="nvfp4", trainer="bf16", edges=(0, 2))
    assert out["md"] == str(tmp_path / "mismatch.md")
    text = (tmp_path / "mismatch.md").read_text()
    assert "rollout nvfp4 vs trainer bf16" in text and "2 sequences, 5 response tokens" in text
    assert f"| `rollout_corr/chi2_seq` | {1.5:.4g} |" in text
    assert "| 0-1 | 4 |" in text and "| 2+ | 1 |" in text
    assert (tmp_path / "mismatch_by_position.png").stat().st_size > 1000

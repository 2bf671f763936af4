"""pretrain.rl.objective against hand-computed examples (the numbers are written here, or derived with
plain Python arithmetic in the test, never with the functions under test)."""

import math

import pytest
import torch

from pretrain.rl.objective import (
    CORRECTIONS,
    Correction,
    agg_loss,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    policy_loss,
    rollout_correction,
)


def close(a, b, tol=1e-5):
    a, b = (x.detach() if isinstance(x, torch.Tensor) else x for x in (a, b))
    return abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))


# ================================================================================================
# Advantages
# ================================================================================================


def test_grpo_and_dr_grpo_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 2: all equal -> 0
    grpo = group_advantages(rewards, 4, "grpo")
    assert torch.allclose(grpo, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]), atol=1e-5)
    dr = group_advantages(rewards, 4, "dr_grpo")
    assert torch.equal(dr, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    # two responses: mean 1, std sqrt(2) -> +-1/sqrt(2); eps 1e-6 in the denominator
    two = group_advantages(torch.tensor([2.0, 0.0]), 2)
    assert close(two[0], 1 / (math.sqrt(2) + 1e-6)) and close(two[1], -1 / (math.sqrt(2) + 1e-6))
    # groups are consecutive: the same rewards in another grouping give other advantages
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, "dr_grpo"),
                       torch.tensor([0.5, -0.5, 0.5, -0.5]))


def test_group_errors_name_the_flag():
    for g in (1, 0):
        with pytest.raises(ValueError, match=r"^--group-size .*at least 2") as e:
            group_advantages(torch.zeros(4), g)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not whole groups"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="--advantage-estimator 'rloo'.*grpo, dr_grpo"):
        group_advantages(torch.zeros(4), 2, "rloo")


# ================================================================================================
# Loss aggregation
# ================================================================================================

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_agg_modes_by_hand():
    assert close(agg_loss(LOSS, MASK, "token-mean"), (1 + 2 + 4) / 3)
    assert close(agg_loss(LOSS, MASK, "seq-mean-token-mean"), ((1 + 2) / 2 + 4 / 1) / 2)
    assert close(agg_loss(LOSS, MASK, "seq-mean-token-sum"), (3 + 4) / 2)
    # verl's agg_loss (core_algos.py): the token sums over loss_scale_factor only, no sequence count
    assert close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm"), (3 + 4) / 3)  # width 3
    assert close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=8), (3 + 4) / 8)
    assert close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=8, global_seqs=5), (3 + 4) / 8)
    # a float mask weighs the same way; a sequence with no token does not count as a sequence
    assert close(agg_loss(LOSS, MASK.float(), "token-mean"), 7 / 3)
    empty = torch.tensor([[True, True, False], [False, False, False]])
    assert close(agg_loss(LOSS, empty, "seq-mean-token-mean"), 1.5)
    assert close(agg_loss(LOSS, empty, "seq-mean-token-sum"), 3.0)
    assert float(agg_loss(LOSS, torch.zeros_like(MASK), "token-mean")) == 0.0  # never NaN
    with pytest.raises(ValueError, match="--loss-agg-mode 'mean'.*token-mean"):
        agg_loss(LOSS, MASK, "mean")


def test_global_normalizers_make_micro_batches_sum_to_the_batch_loss():
    parts = sum(agg_loss(LOSS[i : i + 1], MASK[i : i + 1], "seq-mean-token-sum-norm", norm_length=3) for i in range(2))
    assert close(parts, agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=3))  # needs no count
    for mode, kw in (("token-mean", {"global_tokens": 3}), ("seq-mean-token-mean", {"global_seqs": 2}),
                     ("seq-mean-token-sum", {"global_seqs": 2})):
        whole = agg_loss(LOSS, MASK, mode)
        parts = sum(agg_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, **kw) for i in range(2))
        assert close(parts, whole), mode
        # without them each micro-batch normalizes by itself: not the batch loss here
        local = sum(agg_loss(LOSS[i : i + 1], MASK[i : i + 1], mode) for i in range(2))
        assert not close(local, whole), mode


def test_a_global_batch_with_every_token_rejected_gives_zero_loss():
    """geo_mis under a large mismatch can mask every token of the global batch: no update, no error."""
    none = torch.zeros_like(MASK)
    leaf = LOSS.clone().requires_grad_()
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss = agg_loss(leaf, none, mode, global_tokens=0, global_seqs=0, norm_length=3)
        assert float(loss) == 0.0, mode
        loss.backward()
        assert float(leaf.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="global_tokens must be >= 0"):
        agg_loss(LOSS, MASK, "token-mean", global_tokens=-1)


# ================================================================================================
# Rollout corrections: rho = [[3, 0.25, 1.5], [1.2, 0.9, pad]]
# ================================================================================================

RHO = [[3.0, 0.25, 1.5], [1.2, 0.9, 1.0]]
VALID = torch.tensor([[True, True, True], [True, True, False]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
OLD = ROLLOUT + torch.tensor([[math.log(r) for r in row] for row in RHO])
OLD[1, 2] = -3.0  # a padding slot's value never matters


def _ess(ws):
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


def run(kind, **kw):
    return rollout_correction(OLD, ROLLOUT, VALID, Correction.from_args(kind, **kw))


def test_none_and_tis():
    res = run("none")
    assert torch.equal(res.weights, torch.ones(2, 3)) and torch.equal(res.mask, VALID)
    assert res.metrics["ess"] == 1.0 and res.metrics["masked_fraction"] == 0.0
    assert close(res.metrics["ess_raw"], _ess([3.0, 0.25, 1.5, 1.2, 0.9]))

    res = run("tis")  # cap C = 2.0
    assert torch.allclose(res.weights, torch.tensor([[2.0, 0.25, 1.5], [1.2, 0.9, 1.0]]), atol=1e-6)
    assert torch.equal(res.mask, VALID) and not res.weights.requires_grad
    m = res.metrics
    # verl's compute_is_metrics: ESS of the weights clamped to [1/C, C]; mean, max, min and the
    # fractions of the ratio before truncation; fraction_low: rho < 1/C
    assert close(m["ess"], _ess([2.0, 0.5, 1.5, 1.2, 0.9])) and m["masked_fraction"] == 0.0
    assert close(m["is_weight_max"], 3.0) and close(m["is_weight_min"], 0.25)
    assert close(m["is_weight_mean"], (3.0 + 0.25 + 1.5 + 1.2 + 0.9) / 5)
    assert close(m["ratio_fraction_high"], 1 / 5) and close(m["ratio_fraction_low"], 1 / 5)
    res = run("tis", is_threshold=1.25)
    assert torch.allclose(res.weights, torch.tensor([[1.25, 0.25, 1.25], [1.2, 0.9, 1.0]]), atol=1e-6)


def test_mis_icepop_bounds():
    res = run("mis")  # [0.5, 2.0]: 3.0 too high, 0.25 too low
    assert torch.equal(res.mask, torch.tensor([[False, False, True], [True, True, False]]))
    assert torch.allclose(res.weights, torch.tensor([[1.0, 1.0, 1.5], [1.2, 0.9, 1.0]]), atol=1e-6)
    m = res.metrics
    assert close(m["masked_fraction"], 2 / 5) and close(m["seq_masked_fraction"], 1 / 2)
    assert close(m["ess"], _ess([2.0, 0.5, 1.5, 1.2, 0.9]))  # clamped to [L, U], before rejection (verl)
    assert close(m["is_weight_mean"], (3.0 + 0.25 + 1.5 + 1.2 + 0.9) / 5) and close(m["is_weight_min"], 0.25)
    assert close(m["ratio_fraction_high"], 1 / 5) and close(m["ratio_fraction_low"], 1 / 5)
    wide = run("mis", rs_threshold=4.0, rs_threshold_lower=0.2)
    assert torch.equal(wide.mask, VALID) and close(wide.weights[0, 0], 3.0)
    upper_only = run("mis", rs_threshold=4.0)  # lower = 1/4: 0.25 stays (not below)
    assert torch.equal(upper_only.mask, VALID)
    float_mask = rollout_correction(OLD, ROLLOUT, VALID.float(), Correction("mis"))
    assert float_mask.mask.dtype == torch.float32 and float_mask.mask.tolist() == [[0, 0, 1], [1, 1, 0]]


def test_sequence_level_kinds():
    # rho_seq: 3 * 0.25 * 1.5 = 1.125 and 1.2 * 0.9 = 1.08
    res = run("seq_tis")
    assert torch.allclose(res.weights, torch.tensor([[1.125] * 3, [1.08, 1.08, 1.0]]), atol=1e-5)
    res = run("seq_tis", is_threshold=1.1)
    assert torch.allclose(res.weights, torch.tensor([[1.1] * 3, [1.08, 1.08, 1.0]]), atol=1e-5)
    assert close(res.metrics["ratio_fraction_high"], 1 / 2)  # one sequence of two
    assert close(res.metrics["ess"], _ess([1.1] * 3 + [1.08] * 2))  # token-weighted, clamped to [1/C, C]
    assert close(res.metrics["is_weight_mean"], (3 * 1.125 + 2 * 1.08) / 5)  # before truncation
    assert close(res.metrics["is_weight_max"], 1.125) and close(res.metrics["is_weight_min"], 1.08)
    low = run("seq_tis", is_threshold=1.0 / 0.95)  # 1/C = 0.95 > neither ratio
    assert low.metrics["ratio_fraction_low"] == 0.0

    res = run("seq_mis")  # both within [0.5, 2]
    assert torch.equal(res.mask, VALID) and close(res.weights[0, 1], 1.125)
    res = run("seq_mis", rs_threshold=1.1)  # lower 1/1.1: the first sequence goes
    assert torch.equal(res.mask, torch.tensor([[False] * 3, [True, True, False]]))
    assert close(res.metrics["masked_fraction"], 3 / 5) and close(res.metrics["seq_masked_fraction"], 1 / 2)
    assert close(res.metrics["ess"], _ess([1.1] * 3 + [1.08] * 2))

    # rho_geo: 1.125 ** (1/3) = 1.04004 and 1.08 ** (1/2) = 1.03923
    assert close(1.125 ** (1 / 3), 1.040042, 1e-6) and close(1.08**0.5, 1.039230, 1e-6)
    res = run("geo_mis")  # verl's 1.001: both rejected
    assert not res.mask.any() and res.metrics["ess"] == 1.0 and res.metrics["masked_fraction"] == 1.0
    res = run("geo_mis", rs_threshold=1.0396)
    assert torch.equal(res.mask, torch.tensor([[False] * 3, [True, True, False]]))
    assert torch.equal(res.weights, torch.ones(2, 3))  # rejection only, no weights
    res = run("geo_mis", rs_threshold=1.05, rs_threshold_lower=1 / 1.0396)
    assert torch.equal(res.mask, VALID)


def test_defaults_follow_verl():
    assert Correction.from_args("tis").is_threshold == 2.0
    mis = Correction.from_args("mis")
    assert (mis.rs_threshold, mis.rs_threshold_lower) == (2.0, 0.5)
    geo = Correction.from_args("geo_mis")
    assert geo.rs_threshold == 1.001 and close(geo.rs_threshold_lower, 1 / 1.001)
    assert Correction.from_args("none") == Correction()
    assert set(CORRECTIONS) == {"none", "tis", "mis", "seq_tis", "seq_mis", "geo_mis"}


def test_verl_lower_upper_rejection_bounds():
    """Current verl (rollout_corr_helper.compute_rollout_rejection_mask, token_k1) keeps tokens whose
    -log rho lies in [log LOWER, log UPPER]: "0.8_2.0" keeps rho in [1/2.0, 1/0.8] = [0.5, 1.25]."""
    c = Correction.from_args("mis", rs_threshold="0.8_2.0")
    assert close(c.rs_threshold, 1.25) and close(c.rs_threshold_lower, 0.5)
    res = rollout_correction(OLD, ROLLOUT, VALID, c)  # rho 3, 0.25, 1.5 out; 1.2, 0.9 in
    assert res.mask.tolist() == [[False, False, False], [True, True, False]]
    same = Correction.from_args("mis", rs_threshold="2.0")  # one number: [1/U, U] in both conventions
    assert (same.rs_threshold, same.rs_threshold_lower) == (2.0, 0.5)
    for bad in ("2.0_0.8", "0_2", "x_2", "abc"):
        with pytest.raises(ValueError, match=r"^--rollout-rs-threshold "):
            Correction.from_args("seq_mis", rs_threshold=bad)
    with pytest.raises(ValueError, match=r"^--rollout-rs-threshold 0.8_2.0: .*drop --rollout-rs-threshold-lower"):
        Correction.from_args("mis", rs_threshold="0.8_2.0", rs_threshold_lower=0.5)


@pytest.mark.parametrize("kind,kw,flag", [
    ("tis", {"is_threshold": 1.0}, "--rollout-is-threshold"),
    ("seq_tis", {"is_threshold": -2.0}, "--rollout-is-threshold"),
    ("tis", {"is_threshold": float("nan")}, "--rollout-is-threshold"),
    ("mis", {"rs_threshold": 0.9}, "--rollout-rs-threshold"),
    ("seq_mis", {"rs_threshold": float("inf")}, "--rollout-rs-threshold"),
    ("geo_mis", {"rs_threshold_lower": 1.5}, "--rollout-rs-threshold-lower"),
    ("mis", {"rs_threshold_lower": -0.1}, "--rollout-rs-threshold-lower"),
    ("mis", {"is_threshold": 3.0}, "--rollout-is-threshold"),  # mis takes no cap
    ("tis", {"rs_threshold": 3.0}, "--rollout-rs-threshold"),
    ("none", {"rs_threshold_lower": 0.5}, "--rollout-rs-threshold-lower"),
    ("icepop", {}, "--rollout-correction"),
])
def test_bad_corrections_refused_in_one_line(kind, kw, flag):
    with pytest.raises(ValueError) as e:
        Correction.from_args(kind, **kw)
    msg = str(e.value)
    assert msg.startswith(flag + " ") and "\n" not in msg


# ================================================================================================
# Policy loss
# ================================================================================================

RATIO = [[1.5, 0.5, 1.1], [1.5, 0.5, 4.0]]
ADV = torch.tensor([1.0, -1.0])


def _logprobs():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0]])
    lp = (old + torch.tensor([[math.log(r) for r in row] for row in RATIO])).requires_grad_(True)
    return lp, old


def test_policy_loss_clipping_by_hand():
    lp, old = _logprobs()
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, m = policy_loss(lp, old, ADV, mask)
    # A = +1: max(-r, -clip(r, 0.8, 1.2)) = [-1.2 (clipped), -0.5, -1.1]
    # A = -1: max(r, clip(r)) = [1.5, 0.8 (clipped), 4.0] -> dual clip min(., 3) = [1.5, 0.8, 3.0]
    tokens = [-1.2, -0.5, -1.1, 1.5, 0.8, 3.0]
    assert close(loss, sum(tokens) / 6)
    assert close(m["clipfrac"], 2 / 6) and close(m["clipfrac_lower"], 1 / 6)
    assert close(m["ppo_kl"], -sum(math.log(r) for row in RATIO for r in row) / 6)
    loss.backward()
    # d/dlogp of -A r is -A r where the unclipped branch is taken, 0 where clipped
    want = torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 0.0]]) / 6
    assert torch.allclose(lp.grad, want, atol=1e-6)

    lp, old = _logprobs()
    loss, m = policy_loss(lp, old, ADV, mask, clip_ratio_c=None)
    assert close(loss, (-1.2 - 0.5 - 1.1 + 1.5 + 0.8 + 4.0) / 6) and m["clipfrac_lower"] == 0.0
    loss, _ = policy_loss(lp, old, ADV, mask, clip_ratio_low=0.6, clip_ratio_high=0.6)  # clip [0.4, 1.6]
    assert close(loss, (-1.5 - 0.5 - 1.1 + 1.5 + 0.5 + 3.0) / 6)


def test_policy_loss_is_weights_mask_and_agg():
    lp, old = _logprobs()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 0.5]])
    loss, _ = policy_loss(lp, old, ADV, mask, is_weights=w)
    assert close(loss, (-2.4 - 0.5 - 1.1 + 1.5 + 0.8) / 5)  # weights after clipping; masked slot out
    loss, _ = policy_loss(lp, old, ADV, mask, loss_agg_mode="seq-mean-token-sum", global_seqs=4)
    assert close(loss, ((-1.2 - 0.5 - 1.1) + (1.5 + 0.8)) / 4)
    adv_tokens = ADV[:, None].expand(2, 3)  # [B, T] advantages are taken as they are
    assert close(policy_loss(lp, old, adv_tokens, mask)[0], policy_loss(lp, old, ADV, mask)[0])
    for kw, flag in (({"clip_ratio_low": 1.0}, "--clip-ratio-low"), ({"clip_ratio_high": -0.1}, "--clip-ratio-high"),
                     ({"clip_ratio_c": 1.0}, "--clip-ratio-c")):
        with pytest.raises(ValueError, match=f"^{flag} "):
            policy_loss(lp, old, ADV, mask, **kw)


# ================================================================================================
# KL and entropy
# ================================================================================================


def test_kl_kinds_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    assert close(kl_penalty(lp, ref, "k1"), ln2) and close(kl_penalty(lp, ref, "kl"), ln2)
    assert close(kl_penalty(ref, lp, "abs"), ln2)
    assert close(kl_penalty(lp, ref, "mse"), 0.5 * ln2**2) and close(kl_penalty(lp, ref, "k2"), 0.5 * ln2**2)
    # k3: d = log p_ref - log p = -ln 2: exp(d) - d - 1 = 0.5 + ln 2 - 1
    assert close(kl_penalty(lp, ref, "low_var_kl"), 0.5 + ln2 - 1) and close(kl_penalty(lp, ref, "k3"), 0.5 + ln2 - 1)
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]))) == 10.0  # clamped as verl
    assert float(kl_penalty(lp, lp)) == 0.0
    with pytest.raises(ValueError, match="--kl-type 'full'"):
        kl_penalty(lp, ref, "full")


def test_entropy_by_hand():
    h = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -math.inf, -math.inf]]))
    assert close(h[0], math.log(4)) and close(h[1], -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_dapo_overlong_reward_by_hand():
    """DAPO (arXiv 2503.14476, eq. 13) with L_max 8, L_cache 4: 0 up to 4 tokens, then -(n - 4) / 4."""
    from pretrain.rl.objective import overlong_reward

    got = overlong_reward(torch.tensor([1, 4, 5, 6, 8]), max_len=8, buffer_len=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_reward(torch.tensor([8]), 8, 4, factor=0.5).tolist() == [-0.5]
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"^--overlong-buffer-len "):
            overlong_reward(torch.tensor([1]), 8, bad)

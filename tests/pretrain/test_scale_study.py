"""Slopes over model sizes (pretrain.scale_study) on synthetic data whose slope is known."""

import math
import random

import numpy as np
import pytest
import yaml

from pretrain.scale_study import (
    Record,
    non_embedding_params,
    paired_effects,
    predictor_fit,
    slope_over_sizes,
)

PARAMS = {"s1": 1e5, "s2": 4e5, "s3": 1.6e6, "s4": 6.4e6}


def _records(slope: float, noise: float, seeds: int = 6, seed: int = 0, curve: float = 0.0) -> list[Record]:
    """Treatment b at +2 % everywhere; a at log(1 + x_a) = log(1.02) + 0.05 + slope * (log10 N - 5)
    (+ curve * (log10 N - 5.9)^2), plus per-(size, seed) noise on log(1 + x_a) and on log(1 + x_b)."""
    rng = random.Random(seed)
    out = []
    for size, n in PARAMS.items():
        u = math.log10(n) - 5
        for k in range(seeds):
            yb = math.log1p(0.02) + rng.gauss(0, noise)
            ya = math.log1p(0.02) + 0.05 + slope * u + curve * (u - 0.9) ** 2 + rng.gauss(0, noise)
            out += [Record(size, "a", k, 100 * math.expm1(ya)), Record(size, "b", k, 100 * math.expm1(yb))]
    return out


def test_noiseless_slope_is_exact_and_matches_numpy():
    eff = paired_effects(_records(0.03, 0.0), "a", "b")
    res = slope_over_sizes(eff, PARAMS, boot=200)
    assert math.isclose(res.slope, 0.03, abs_tol=1e-12)
    x = [math.log10(PARAMS[s]) for s in res.sizes]
    assert np.allclose(np.polyfit(x, res.means, 1), [res.slope, res.intercept], atol=1e-12)
    assert res.boot[1] - res.boot[0] < 1e-12 and res.verdict == "grows with size"
    pct, lo, hi = res.predict(1e8)  # three decades above log10 N = 5
    assert math.isclose(pct, 100 * math.expm1(0.05 + 0.09), rel_tol=1e-9) and lo <= pct <= hi


def test_known_slope_is_covered_and_a_flat_effect_is_no_trend():
    covered = 0
    for s in range(20):
        res = slope_over_sizes(paired_effects(_records(0.04, 0.02, seed=s), "a", "b"), PARAMS, boot=300)
        covered += res.interval[0] <= 0.04 <= res.interval[1]
        assert res.slope == pytest.approx(0.04, abs=0.03)
    assert covered >= 18  # nominal 95 %, each interval the union of two
    flat = slope_over_sizes(paired_effects(_records(0.0, 0.02, seed=3), "a", "b"), PARAMS, boot=300)
    assert flat.verdict == "no trend shown" and flat.interval[0] < 0 < flat.interval[1]


def test_curvature_across_sizes_widens_the_regression_interval_not_the_bootstrap():
    res = slope_over_sizes(paired_effects(_records(0.04, 0.001, curve=0.1), "a", "b"), PARAMS, boot=300)
    assert res.regression[1] - res.regression[0] > 10 * (res.boot[1] - res.boot[0])


def test_unfinished_seed_is_reported_not_dropped():
    recs = _records(0.04, 0.01)
    recs[0] = Record("s1", "a", 0, float("nan"))
    res = slope_over_sizes(paired_effects(recs, "a", "b"), PARAMS)
    assert res.not_finite == 1 and res.verdict.startswith("not estimable")
    with pytest.raises(ValueError, match="at least 3 sizes"):
        slope_over_sizes({"s1": {0: 0.1, 1: 0.2}, "s2": {0: 0.1, 1: 0.2}}, PARAMS)


def test_predictor_fit_and_parameter_count():
    slope, r, n = predictor_fit({"s1": 0.1, "s2": 0.2, "s3": 0.3, "s4": 0.5}, {"s1": 1.0, "s2": 2.0, "s3": 3.0, "s4": 5.0})
    assert n == 4 and math.isclose(slope, 10.0) and math.isclose(r, 1.0)
    tiny = yaml.safe_load(open("configs/models/tiny.yaml"))  # the file says 5.2 M parameters with a 4096 vocab
    emb = 2 * 4096 * tiny["hidden_size"]
    norms = tiny["num_layers"] * 2 * tiny["hidden_size"] + tiny["hidden_size"]
    assert round((non_embedding_params(tiny) + emb + norms) / 1e5) == 52


def test_paired_effects_of_the_validation_gap():
    recs = [Record("s1", "a", 0, 5.0, 0.04), Record("s1", "b", 0, 5.0, 0.01), Record("s1", "a", 1, 5.0),
            Record("s1", "b", 1, 5.0, 0.02)]
    eff = paired_effects(recs, "a", "b", "val_gap")
    assert math.isclose(eff["s1"][0], 0.03) and math.isnan(eff["s1"][1])  # a gap not recorded: NaN, kept
    assert paired_effects(recs, "a", "b")["s1"] == {0: 0.0, 1: 0.0}
    with pytest.raises(ValueError, match="metric 'loss': expected one of extra_tokens, val_gap"):
        paired_effects(recs, "a", "b", "loss")

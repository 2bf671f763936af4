"""The plan search's guarantee, by simulation: an additive problem with known truth.

The issue's Monte Carlo: the all-cheapest plan's true gap is 2%, the budget 1%, a probe's per-seed
paired gap has sd 0.48%, 3 seeds. 200 searches at 96 and at 384 units; the delivered plan's *true*
gap may exceed the budget in at most 5% of them (the confirmation's one-sided level is 1.25%, on 8
fresh seeds and their own spread). The
old scheme -- greedy first-fit on one 95% bound per probe, no fresh seeds -- fails the same check."""

from __future__ import annotations

import random

import pytest

from pretrain.evaluation.stats import paired_interval
from pretrain.plan_search import Sample, greedy_search, guarded_search

BUDGET, TOTAL, SD, SEEDS, SEARCHES = 0.01, 0.02, 0.0048, 3, 200


def problem(n_units: int, rng: random.Random):
    """Per unit a true penalty at its cheapest rung (summing to 2%) and a saving; rung 0 = baseline."""
    w = [rng.expovariate(1.0) for _ in range(n_units)]
    penalty = {f"u{i}": TOTAL * x / sum(w) for i, x in enumerate(w)}
    saving = {u: rng.uniform(0.5, 1.5) / n_units for u in penalty}
    return penalty, saving


def _true_gap(penalty, levels):
    return sum(penalty[u] for u, lv in levels.items() if lv)


def _search(n_units: int, seed: int, guarded: bool):
    rng = random.Random(seed)
    penalty, saving = problem(n_units, rng)
    units = list(penalty)
    n_levels = dict.fromkeys(units, 2)

    def cost(levels):
        return 1.0 - sum(saving[u] for u, lv in levels.items() if lv)

    def draw(levels):
        m = _true_gap(penalty, levels)
        return tuple(m + rng.gauss(0.0, SD) for _ in range(SEEDS))

    # telemetry's ranking is informative but noisy: the true penalty per saving, times lognormal noise
    score = {u: penalty[u] / saving[u] * rng.lognormvariate(0.0, 0.5) for u in units}
    priority = sorted(units, key=lambda u: -score[u])
    if not guarded:  # the previous scheme
        r = greedy_search(units, n_levels, cost, lambda lv: paired_interval(list(draw(lv))), BUDGET, priority)
        return _true_gap(penalty, r.levels), r
    per = max(1, n_units // 12)  # 12 coarse groups: contiguous runs of the priority-free unit order
    groups = {f"g{k}": units[k * per:(k + 1) * per] for k in range((n_units + per - 1) // per)}
    # the confirmation on 8 fresh seeds: its bound is its own spread (7 degrees of freedom)
    r = guarded_search(groups, n_levels, cost, lambda lv: Sample(draw(lv)), lambda lv: Sample(draw(lv) + draw(lv)[:5]),
                       BUDGET, priority)
    return _true_gap(penalty, r.levels), r


@pytest.mark.parametrize("n_units", [96, 384])
def test_delivered_plan_is_over_budget_in_at_most_5_percent_of_searches(n_units):
    results = [_search(n_units, s, guarded=True) for s in range(SEARCHES)]
    over = sum(g > BUDGET for g, _ in results)
    assert over <= 0.05 * SEARCHES, f"{over} of {SEARCHES} searches delivered a plan over budget"
    # not by never answering: a share of the searches deliver a confirmed, cheaper plan
    confirmed = [r for _, r in results if r.confirmed]
    assert len(confirmed) >= 0.2 * SEARCHES and all(r.cost < 1.0 for r in confirmed)
    # and every probe's bound was held to its share of the error budget
    r = results[0][1]
    assert r.probe_alpha * len(r.probes) <= 0.0125 + 1e-12 and r.confirm_alpha == 0.0125


def test_the_previous_scheme_fails_the_same_check():
    n = 40  # the issue measured 35% at 384 units: 40 searches show it well past 5%
    over = sum(_search(384, s, guarded=False)[0] > BUDGET for s in range(n))
    assert over > 0.05 * n


def _search_longer(seed: int, gap_x: float, sd_x: float, confirm_seeds: int):
    """A search whose confirmation (the full --train-iters) sees a gap ``gap_x`` times the probes'
    and a per-seed spread ``sd_x`` times theirs: the probes' pooled spread must not vouch for it."""
    rng = random.Random(seed)
    penalty, saving = problem(384, rng)
    units = list(penalty)

    def cost(levels):
        return 1.0 - sum(saving[u] for u, lv in levels.items() if lv)

    def probe(levels):
        m = _true_gap(penalty, levels)
        return Sample(tuple(m + rng.gauss(0.0, SD) for _ in range(SEEDS)))

    def confirm(levels):
        m = gap_x * _true_gap(penalty, levels)
        return Sample(tuple(m + rng.gauss(0.0, sd_x * SD) for _ in range(confirm_seeds)))

    score = {u: penalty[u] / saving[u] * rng.lognormvariate(0.0, 0.5) for u in units}
    groups = {f"g{k}": units[k * 32:(k + 1) * 32] for k in range(12)}
    r = guarded_search(groups, dict.fromkeys(units, 2), cost, probe, confirm, BUDGET,
                       sorted(units, key=lambda u: -score[u]))
    return gap_x * _true_gap(penalty, r.levels), r


@pytest.mark.parametrize("gap_x, sd_x", [(2.0, 2.0), (3.0, 3.0), (2.0, 3.0)])
def test_confirmation_holds_when_full_length_runs_have_a_larger_gap_and_spread(gap_x, sd_x):
    # issue #37: with the confirmation's spread pooled with the probes', a full-length s.d. twice the
    # pooled one made the confirmation's own size ~13 % at the boundary. From its own 8 seeds the
    # bound holds whatever the ratio. 100 searches at 384 units: the binomial s.e. of a 5 % rate is
    # 2.2 points, so up to 5 over budget are allowed (the one-sided level is 1.25 %).
    results = [_search_longer(s, gap_x, sd_x, confirm_seeds=8) for s in range(100)]
    over = sum(g > BUDGET for g, _ in results)
    assert over <= 5, f"{over} of 100 searches delivered a plan over budget at --train-iters"
    # not by never answering: measured 14, 6 and 9 of 100 confirmed (the probes' choices at 2-3x
    # their gap are mostly over budget at full length, and the confirmation rejects them)
    assert sum(r.confirmed for _, r in results) >= 3


def test_confirmation_size_at_the_boundary_own_spread_against_pooled():
    # a plan whose full-length gap is exactly the budget, confirmed on 3 seeds whose s.d. is twice the
    # probes' (pooled over 30 probes of 3 seeds): how often is it accepted? The previous pooled bound
    # ~13 % (issue #37); the confirmation's own spread holds its one-sided 1.25 %. 4,000 draws: the
    # binomial s.e. at 1.25 % is 0.18 points.
    from pretrain.plan_search import SpentBounds

    rng = random.Random(7)
    bounds = SpentBounds()
    for _ in range(30):
        bounds.add(Sample(tuple(rng.gauss(0.005, SD) for _ in range(SEEDS))))
    own = pooled = 0
    for _ in range(4000):
        s = Sample(tuple(rng.gauss(BUDGET, 2 * SD) for _ in range(SEEDS)))
        own += bounds.upper(s, 0.0125, own=True).hi <= BUDGET
        pooled += bounds.upper(s, 0.0125).hi <= BUDGET
    assert own / 4000 <= 0.0125 + 3 * 0.0018
    assert pooled / 4000 > 0.08  # the old rule's size, measured here near the 13 %

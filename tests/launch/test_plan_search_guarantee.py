"""The plan search's guarantee, by simulation: an additive problem with known truth.

The issue's Monte Carlo: the all-cheapest plan's true gap is 2%, the budget 1%, a probe's per-seed
paired gap has sd 0.48%, 3 seeds. 200 searches at 96 and at 384 units; the delivered plan's *true*
gap may exceed the budget in at most 5% of them (the confirmation's one-sided level is 1.25%). The
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
    r = guarded_search(groups, n_levels, cost, lambda lv: Sample(draw(lv)), lambda lv: Sample(draw(lv)),
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

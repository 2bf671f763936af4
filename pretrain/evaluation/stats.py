"""How far to trust a difference between two training runs: seed spreads and paired intervals.

A precision ablation asks whether one GEMM in one format costs quality, and the answer is a small
difference between runs. Two sources of noise decide whether it is real:

* **seed noise** -- initialization and data order. Runs of two precisions with the *same* seed see
  the same initial weights and the same batches, so their per-seed difference (a **paired** gap)
  removes most of it; the interval of the mean paired gap over seeds uses Student's t with
  ``n - 1`` degrees of freedom (n seeds). One seed gives a gap but no interval.
* **validation sampling noise** -- the held-out loss is a mean over a finite number of batches.
  Every run is evaluated on the same batches, so the paired per-batch differences give the
  standard error of the gap that comes from the choice of batches (``paired_batch_se``).

Verdicts (``gap_verdict``, the one function every results table uses):

* ``worse`` / ``better``: the gap differs from 0 at the 5% level **after Holm's adjustment** over
  the table's comparisons (``holm_adjust``), so the chance of any false ``worse``/``better`` in the
  whole table stays below 5% however many rows it has. The unadjusted interval is printed beside it.
* ``equivalent (±m)``: two one-sided t-tests (TOST) show the gap inside ``±m``, the margin the
  sweep file names (``equivalence_margin``), Holm-adjusted too. This is the only verdict that may
  be read as "no cost" -- and only as "no cost larger than m".
* ``not shown to differ``: neither. The interval contains 0 (or Holm's adjustment removed the
  difference): the data do not tell the precisions apart. It never means "free".
* ``diverged in k of n seeds``: a seed whose gap is not finite (NaN/Inf loss) is a result, never
  averaged away; the interval beside it is the survivors' and says so. A divergence is the worst
  outcome, so it counts in the test: with a ``RankTest`` (an exact two-sample rank test of the
  per-seed outcomes, a diverged seed ranked +inf; ``rank_test``) the verdict reads e.g.
  ``worse (diverged in 3 of 4 seeds; rank test)``.
* With an equivalence margin both verdicts are printed, the difference first:
  ``worse; equivalent (±m)`` (shown to differ, and by less than m), ``not shown to differ; not shown
  equivalent (±m)`` (the data say neither).
* ``1 seed: no interval``, ``n/a`` (no pair), ``baseline``.

An interval says how many seeds it used (``Interval.n``) and how many it left out
(``Interval.excluded``). These are the numbers the sweep tables print beside every gap
(``pretrain.sweep.results`` behind ``launch/sweep.py``, and ``pretrain.rl.sweep_results``); MLCommons' FP4
discussion asks for exactly this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ALPHA",
    "Interval",
    "RankTest",
    "gap_verdict",
    "holm_adjust",
    "paired_batch_se",
    "paired_interval",
    "rank_test",
    "spread",
    "t_quantile",
    "table_verdicts",
    "tost_p_value",
]

ALPHA = 0.05  # family-wise error rate of a table's verdicts


def t_quantile(confidence: float, df: int) -> float:
    """Two-sided Student-t critical value: P(|T| <= q) = confidence for ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2.0, df))


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with a two-sided confidence interval (``lo``/``hi`` NaN when n < 2)."""

    mean: float
    lo: float
    hi: float
    n: int
    sd: float  # sample standard deviation (NaN when n < 2)
    confidence: float = 0.95
    excluded: int = 0  # values left out because they were not finite (a diverged seed's NaN gap)

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0

    @property
    def within_noise(self) -> bool | None:
        """True when the interval contains 0 (on its own, the gap is *not shown to differ*); None when
        there is no interval (one value)."""
        if self.n < 2 or math.isnan(self.lo):
            return None
        return self.lo <= 0.0 <= self.hi

    @property
    def se(self) -> float:
        """Standard error of the mean (NaN when n < 2)."""
        return self.sd / math.sqrt(self.n) if self.n >= 2 else math.nan

    def p_value(self) -> float:
        """Two-sided one-sample t-test of mean 0 (NaN without an interval)."""
        if self.n < 2 or not math.isfinite(self.sd):
            return math.nan
        if self.sd == 0.0:
            return 1.0 if self.mean == 0.0 else 0.0
        from scipy.stats import t

        return float(2.0 * t.sf(abs(self.mean) / self.se, self.n - 1))

    def text(self, digits: int = 4, unit: str = "", seeds: bool = False) -> str:
        """``+0.0123 ± 0.0045`` (or ``+0.0123 (1 seed)``); ``seeds``: append ``(n seeds)``, and
        ``of N`` when values were left out."""
        if math.isnan(self.mean):
            return "n/a"
        total = self.n + self.excluded
        of = f" of {total}" if self.excluded else ""
        who = "survivors' mean, " if self.excluded else ""
        if self.n < 2:
            return f"{self.mean:+.{digits}f}{unit} ({who}1{of} seed)"
        tail = f" ({who}{self.n}{of} seeds)" if seeds or self.excluded else ""
        return f"{self.mean:+.{digits}f}{unit} ± {self.half_width:.{digits}f}{tail}"


def paired_interval(diffs: list[float], confidence: float = 0.95) -> Interval:
    """Mean of paired differences (one per seed) and its t interval."""
    given = [d for d in diffs if d is not None]
    vals = [float(d) for d in given if math.isfinite(d)]
    n, excluded = len(vals), len(given) - len(vals)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, confidence, excluded)
    mean = sum(vals) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, math.nan, confidence, excluded)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    h = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - h, mean + h, n, sd, confidence, excluded)


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of the finite values; sd NaN for fewer than two."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def paired_batch_se(a: list[float], b: list[float]) -> float:
    """Standard error of mean(a) - mean(b) for per-batch losses of two runs on the same batches."""
    if len(a) != len(b) or len(a) < 2:
        return math.nan
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    return math.sqrt(sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d))


def tost_p_value(gap: Interval, margin: float) -> float:
    """Two one-sided t-tests of ``|true gap| < margin``: the larger of the two one-sided p-values
    (Schuirmann 1987). Small means the gap is shown to lie inside ``±margin``; NaN without an interval."""
    if gap.n < 2 or not math.isfinite(gap.sd) or not margin > 0:
        return math.nan
    if gap.sd == 0.0:
        return 0.0 if abs(gap.mean) < margin else 1.0
    from scipy.stats import t

    lower = t.sf((gap.mean + margin) / gap.se, gap.n - 1)  # H0: gap <= -margin
    upper = t.cdf((gap.mean - margin) / gap.se, gap.n - 1)  # H0: gap >= +margin
    return float(max(lower, upper))


def holm_adjust(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN entries are not comparisons and stay NaN):
    ``p_(i) * (m - i + 1)``, made monotone, capped at 1. Rejecting where the adjusted value is
    below alpha controls the family-wise error rate at alpha for any dependence between tests."""
    idx = sorted((i for i, p in enumerate(p_values) if math.isfinite(p)), key=lambda i: p_values[i])
    m = len(idx)
    out = [math.nan] * len(p_values)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class RankTest:
    """An exact two-sample rank test of per-seed outcomes (``rank_test``): ``p`` two-sided, and
    whether the treatment's outcomes rank ``higher`` than the baseline's."""

    p: float
    higher: bool


def rank_test(treatment: list[float], baseline: list[float]) -> RankTest:
    """Wilcoxon-Mann-Whitney by exact permutation of the pooled ranks (midranks for ties), a
    diverged seed's outcome (NaN or +inf) ranked above every finite one: the test that counts a
    divergence as the worst outcome instead of leaving it out. With 4 seeds a side the smallest
    two-sided p is 2/70 = 0.029 (every treatment seed above every baseline seed)."""
    import numpy as np
    from scipy.stats import permutation_test, rankdata

    def worst(v: float) -> float:
        return math.inf if v is None or math.isnan(v) else float(v)

    a, b = [worst(v) for v in treatment], [worst(v) for v in baseline]
    if len(a) < 2 or len(b) < 2:  # one seed a side: no test
        return RankTest(math.nan, False)
    ranks = rankdata(a + b)
    ra, rb = ranks[:len(a)], ranks[len(a):]
    if np.all(ranks == ranks[0]):
        return RankTest(1.0, False)
    res = permutation_test((ra, rb), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
                           permutation_type="independent", n_resamples=20000, vectorized=True,
                           rng=np.random.default_rng(0))
    return RankTest(float(res.pvalue), bool(ra.mean() > rb.mean()))


def gap_verdict(gap: Interval, is_baseline: bool, higher_is_better: bool = False, *,
                p_adjusted: float | None = None, tost_adjusted: float | None = None,
                margin: float | None = None, alpha: float = ALPHA, rank: RankTest | None = None) -> str:
    """The words a results table prints beside a paired gap (see the module docstring):
    ``baseline``, ``n/a`` (no pair), ``diverged in k of n seeds`` (non-finite gaps; never averaged
    away; with ``rank``, the rank test's verdict before it), ``1 seed: no interval``, then the
    difference verdict -- ``worse``/``better`` (a loss gap: higher is worse; an accuracy or reward
    gap: ``higher_is_better``) or ``not shown to differ`` -- and, with a ``margin``, the
    equivalence verdict after it: ``; equivalent (±m)`` or ``; not shown equivalent (±m)``.

    ``p_adjusted`` / ``tost_adjusted``: the gap's Holm-adjusted two-sided and equivalence p-values
    over its table (``table_verdicts``); without them the unadjusted interval decides (one
    comparison). ``worse``/``better`` that only the unadjusted interval shows reads
    ``not shown to differ (unadjusted: worse)``."""
    if is_baseline:
        return "baseline"
    if gap.excluded:
        div = f"diverged in {gap.excluded} of {gap.n + gap.excluded} seeds"
        if rank is None or not math.isfinite(rank.p):
            return div
        p = rank.p if p_adjusted is None else p_adjusted
        if p < alpha:
            return f"{'better' if rank.higher == higher_is_better else 'worse'} ({div}; rank test)"
        return f"not shown to differ ({div}; rank test)"
    if gap.n == 0:
        return "n/a"
    if gap.within_noise is None:
        return "1 seed: no interval"
    direction = "better" if (gap.mean > 0) == higher_is_better else "worse"
    p = gap.p_value() if p_adjusted is None else p_adjusted
    if not gap.within_noise and p < alpha:
        verdict = direction
    elif not gap.within_noise:
        verdict = f"not shown to differ (unadjusted: {direction})"
    else:
        verdict = "not shown to differ"
    if margin is None:
        return verdict
    q = tost_p_value(gap, margin) if tost_adjusted is None else tost_adjusted
    return f"{verdict}; {'equivalent' if q < alpha else 'not shown equivalent'} (±{margin:g})"


def table_verdicts(gaps: list[Interval], is_baseline: list[bool], higher_is_better: bool = False,
                   margin: float | None = None, alpha: float = ALPHA,
                   ranks: list[RankTest | None] | None = None) -> list[str]:
    """``gap_verdict`` for every row of one table, Holm-adjusted over the table's comparisons (the
    rows that are not the baseline and have an interval, and the rows with diverged seeds that
    carry a ``RankTest`` in ``ranks``), for the difference tests and, with a ``margin``, separately
    for the equivalence tests (rows without diverged seeds)."""
    ranks = ranks or [None] * len(gaps)
    live = [not b and g.n >= 2 and not g.excluded for g, b in zip(gaps, is_baseline)]
    ranked = [not b and g.excluded > 0 and r is not None and math.isfinite(r.p)
              for g, b, r in zip(gaps, is_baseline, ranks)]
    p = holm_adjust([g.p_value() if ok else (r.p if rk else math.nan)
                     for g, ok, rk, r in zip(gaps, live, ranked, ranks)])
    q = (holm_adjust([tost_p_value(g, margin) if ok else math.nan for g, ok in zip(gaps, live)])
         if margin is not None else [None] * len(gaps))
    return [gap_verdict(g, b, higher_is_better, p_adjusted=pi if (ok or rk) else None,
                        tost_adjusted=qi if ok else None, margin=margin, alpha=alpha, rank=r)
            for g, b, ok, rk, pi, qi, r in zip(gaps, is_baseline, live, ranked, p, q, ranks)]

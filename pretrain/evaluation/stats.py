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

A gap is **within noise** when its interval contains 0. These are the numbers the sweep tables
print beside every gap (``launch/sweep.py``); MLCommons' FP4 discussion asks for exactly this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Interval", "gap_verdict", "paired_batch_se", "paired_interval", "spread", "t_quantile"]


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

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0

    @property
    def within_noise(self) -> bool | None:
        """True when the interval contains 0; None when there is no interval (one value)."""
        if self.n < 2 or math.isnan(self.lo):
            return None
        return self.lo <= 0.0 <= self.hi

    def text(self, digits: int = 4, unit: str = "") -> str:
        """``+0.0123 ± 0.0045`` (or ``+0.0123 (1 seed)``)."""
        if math.isnan(self.mean):
            return "n/a"
        if self.n < 2:
            return f"{self.mean:+.{digits}f}{unit} (1 seed)"
        return f"{self.mean:+.{digits}f}{unit} ± {self.half_width:.{digits}f}"


def paired_interval(diffs: list[float], confidence: float = 0.95) -> Interval:
    """Mean of paired differences (one per seed) and its t interval."""
    vals = [float(d) for d in diffs if d is not None and math.isfinite(d)]
    n = len(vals)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, confidence)
    mean = sum(vals) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, math.nan, confidence)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    h = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - h, mean + h, n, sd, confidence)


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


def gap_verdict(gap: Interval, is_baseline: bool, higher_is_better: bool = False) -> str:
    """The word a results table prints beside a paired gap: ``baseline``, ``n/a`` (no pair),
    ``1 seed: no interval``, ``within noise`` (the interval contains 0), ``better`` or ``worse``
    (a loss gap: higher is worse; an accuracy or reward gap: ``higher_is_better``)."""
    if is_baseline:
        return "baseline"
    if gap.n == 0:
        return "n/a"
    if gap.within_noise is None:
        return "1 seed: no interval"
    if gap.within_noise:
        return "within noise"
    return "better" if (gap.mean > 0) == higher_is_better else "worse"

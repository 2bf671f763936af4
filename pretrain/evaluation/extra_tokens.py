"""Extra tokens: how many more training tokens a precision needs than the baseline for the same loss.

This is the study's metric (arXiv 2605.09825 reports e.g. +8-9% for MXFP4 Fprop against FP8). Runs of
a sweep share the batch size and sequence length, so a ratio of iterations is a ratio of tokens.
With the same ``--train-iters`` for every run, "the step at which the treatment reaches the
baseline's final loss" can never exceed the run's length, so it cannot measure a cost. Measured
both ways on the smoothed training-loss curves instead (``crossing_extra_pct``):

* a **worse** treatment (final loss ``L_t`` above the baseline's ``L_b``): the baseline reached
  ``L_t`` at step ``s_b`` (interpolated between logged points); the treatment needed its whole
  run ``S_t`` for it, so it costs ``S_t / s_b - 1`` (> 0);
* a **better** one: the treatment reached ``L_b`` at step ``s_t``, so ``s_t / S_b - 1`` (< 0).

Swapping the two runs turns ``1 + x`` into ``1 / (1 + x)``, so it is ``log(1 + x)`` whose
distribution is symmetric about 0 when the two treatments are the same (exchangeable runs); ``x``
itself is not centred (a ratio and its inverse: +25 % one way is -20 % the other, so the mean of
``x`` over seeds of identical treatments drifts above 0, the more the noisier the curves' ends).
``summarize_extra`` therefore averages and tests ``log(1 + x)`` and reports the back-transformed
mean and interval, ``100 * (exp(.) - 1)`` (the geometric mean ratio; the interval is asymmetric).
Both crossings always exist (the curve that must cross ends at or below the target), also for runs
of different lengths, so no seed is left out as "not reached".

Measured with identical treatments (``tests/launch/test_sweep_stats.py``'s Monte Carlo, curves
``4 + 3 exp(-s/80)`` with noise s.d. 0.03, smoothed over 10): the 95 % interval excludes 0 in 5.3 %,
4.8 % and 5.4 % of studies of 3, 4 and 8 seeds (Monte Carlo s.e. 0.4-0.7 points). Where a curve's
end is flat against its noise (``4 + 3 exp(-s/40)``) the per-seed values pile up away from 0 -- the
crossing of a nearly flat curve jumps -- and the t interval excludes 0 in ~17 % at 3 seeds, 11 % at
4 and 5-8 % at 8 even on the log scale: compare such runs during the descent (``descent_gap``) or on
the validation gap, not by this crossing.

Beside it, a fitted loss curve ``L(D) = E + A * D**-alpha`` per run (``fit_power_law``) gives the
token ratio at the baseline's final loss, ``D_t(L_b) / D_b(L_b)`` (``fitted_extra_pct``), marked
``extrapolated`` when the treatment's fit must go beyond its run to reach ``L_b``, and censored
(unreachable) when ``L_b`` lies below the treatment's fitted floor ``E``.

During a descent (``descent_gap``): without sampling noise (full-batch training on a fixed set,
``--fixed-train-set``) two runs of one seed differ only by their numerics, and they are best compared
*while the loss falls*, before the set is memorized and every run ends near zero. At every logged
step ``s`` of a window ``[first, last]`` the baseline's loss ``L_b(s)`` is a target; the run reaches
it at step ``t(s)`` (interpolated), and ``100 * (t(s) / s - 1)`` is the extra steps (= tokens) the run
needs at ``s``. The window's mean of these is the run's cost, beside its mean excess loss
``L_t(s) - L_b(s)``; a target the run never reaches makes the value a lower bound (censored).

Both need curves whose intermediate points are comparable: under a cosine decay the loss at step
``s`` of a longer run is not the loss of a shorter run at ``s``; with a constant (or WSD stable
phase) learning rate it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DescentGap", "ExtraSummary", "ExtraTokens", "PowerLaw", "crossing_extra_pct", "crossing_step",
           "descent_gap", "fit_power_law", "fitted_extra_pct", "from_log_ratio", "interpolate", "log_ratio",
           "summarize_extra"]


@dataclass(frozen=True)
class ExtraTokens:
    """``pct`` extra tokens (negative: fewer); ``censored``: a lower bound (the true value is larger);
    ``extrapolated``: a fitted value beyond the run's own tokens."""

    pct: float
    censored: bool = False
    extrapolated: bool = False

    def text(self, digits: int = 1) -> str:
        if math.isnan(self.pct):
            return "n/a"
        return ("> " if self.censored else "") + f"{self.pct:+.{digits}f}" + (" (extrapolated)" * self.extrapolated)


def crossing_step(steps: list[float], values: list[float], target: float) -> float | None:
    """The first step at which the curve reaches ``target`` or below, linearly interpolated between
    the two logged points around the crossing; None if it never does."""
    prev = None
    for s, v in zip(steps, values):
        if v <= target:
            if prev is None or prev[1] == v:
                return float(s)
            s0, v0 = prev
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
        prev = (s, v)
    return None


def crossing_extra_pct(run_curve, base_curve) -> ExtraTokens:
    """Extra tokens of ``run_curve`` against ``base_curve`` (each ``(steps, smoothed losses)``), both
    ways as the module docstring says; NaN when a curve is empty."""
    rs, rl = run_curve
    bs, bl = base_curve
    if not rl or not bl:
        return ExtraTokens(math.nan)
    run_final, base_final = rl[-1], bl[-1]
    if run_final == base_final and list(rs) == list(bs):
        return ExtraTokens(0.0)
    if run_final >= base_final:  # worse: where did the baseline reach the treatment's final loss?
        s_b = crossing_step(bs, bl, run_final)  # found: the baseline's last point is at or below it
        return ExtraTokens(100.0 * (rs[-1] / s_b - 1.0) if s_b > 0 else math.nan)
    s_t = crossing_step(rs, rl, base_final)  # better: found, the run's last point is below it
    return ExtraTokens(100.0 * (s_t / bs[-1] - 1.0) if bs[-1] > 0 else math.nan)


def interpolate(steps: list[float], values: list[float], at: float) -> float:
    """The curve's value at step ``at``, linear between logged points; NaN outside the logged steps."""
    for (s0, v0), (s1, v1) in zip(zip(steps, values), zip(steps[1:], values[1:])):
        if s0 <= at <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (at - s0) / (s1 - s0)
    if steps and at == steps[-1]:
        return float(values[-1])
    return math.nan


@dataclass(frozen=True)
class DescentGap:
    """One run against the baseline during the descent (module docstring): ``extra`` (% extra steps,
    mean over the window; ``censored``: a lower bound) and ``excess_loss`` (mean ``L_t(s) - L_b(s)``)."""

    extra: ExtraTokens
    excess_loss: float
    steps: int  # the baseline's logged steps inside the window


def descent_gap(run_curve, base_curve, first: float, last: float) -> DescentGap:
    """``run_curve`` against ``base_curve`` (each ``(steps, losses)``, unsmoothed) at the baseline's
    logged steps in ``[first, last]``; NaN when a curve is empty or the window holds no step both
    runs logged."""
    rs, rl = list(run_curve[0]), list(run_curve[1])
    window = [(s, v) for s, v in zip(*base_curve) if first <= s <= last and s > 0 and math.isfinite(v)]
    window = [(s, v) for s, v in window if math.isfinite(interpolate(rs, rl, s))]
    if not rs or not window:
        return DescentGap(ExtraTokens(math.nan), math.nan, 0)
    if not all(math.isfinite(v) for v in rl):
        return DescentGap(ExtraTokens(math.nan), math.nan, len(window))  # diverged: no finite comparison
    extras, excess, censored = [], [], False
    for s, target in window:
        t = crossing_step(rs, rl, target)
        if t is None:  # never reached within the run: at least its length
            t, censored = float(rs[-1]), True
        extras.append(100.0 * (t / s - 1.0))
        excess.append(interpolate(rs, rl, s) - target)
    return DescentGap(ExtraTokens(sum(extras) / len(extras), censored=censored), sum(excess) / len(excess),
                      len(window))


@dataclass(frozen=True)
class PowerLaw:
    """``L(D) = E + A * D**-alpha`` fitted to a run's curve over ``[d_min, d_max]`` (D in steps)."""

    E: float
    A: float
    alpha: float
    d_min: float
    d_max: float
    rmse: float

    def loss(self, d: float) -> float:
        return self.E + self.A * d ** -self.alpha

    def steps_to(self, loss: float) -> float:
        """D at which the fit reaches ``loss``; inf when ``loss`` is at or below the floor E."""
        if loss <= self.E:
            return math.inf
        return (self.A / (loss - self.E)) ** (1.0 / self.alpha)


def _lstsq_e_a(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Least squares of ``y = E + A x``: (E, A, sum of squared residuals)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx) ** 2 for v in x)
    if sxx == 0:
        return my, 0.0, sum((v - my) ** 2 for v in y)
    a = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx
    e = my - a * mx
    return e, a, sum((v - e - a * u) ** 2 for u, v in zip(x, y))


def fit_power_law(steps: list[float], losses: list[float], skip_fraction: float = 0.1) -> PowerLaw | None:
    """A robust fit of ``E + A * D**-alpha``: for each exponent on a grid (0.02..3) ``E`` and ``A``
    are a linear least-squares problem; the best exponent is refined by a bounded scalar search.
    The first ``skip_fraction`` of the points (warm-up) is left out. None with fewer than 5 points
    or no decreasing fit (A <= 0)."""
    from scipy.optimize import minimize_scalar

    pts = [(float(s), float(v)) for s, v in zip(steps, losses) if s > 0 and math.isfinite(v)]
    pts = pts[int(len(pts) * skip_fraction):]
    if len(pts) < 5:
        return None
    d = [p[0] for p in pts]
    y = [p[1] for p in pts]
    # scale D to [~0, 1] so the powers stay well conditioned
    scale = d[-1]

    def sse(alpha: float) -> float:
        _, a, r = _lstsq_e_a([(v / scale) ** -alpha for v in d], y)
        return r if a > 0 else math.inf

    grid = [0.02 * 1.04 ** k for k in range(130)]  # 0.02 .. ~3.3
    costs = [sse(a) for a in grid]
    k = min(range(len(grid)), key=costs.__getitem__)
    if not math.isfinite(costs[k]):
        return None
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    res = minimize_scalar(sse, bounds=(lo, hi), method="bounded")
    alpha = float(res.x) if res.fun < costs[k] else grid[k]
    e, a, r = _lstsq_e_a([(v / scale) ** -alpha for v in d], y)
    return PowerLaw(E=e, A=a * scale ** alpha, alpha=alpha, d_min=d[0], d_max=d[-1], rmse=math.sqrt(r / len(d)))


def fitted_extra_pct(run_fit: PowerLaw | None, base_fit: PowerLaw | None, base_final_loss: float) -> ExtraTokens:
    """The fits' token ratio at the baseline's final loss, ``D_t(L_b) / D_b(L_b) - 1`` in %.
    ``extrapolated`` when the treatment's fit reaches ``L_b`` beyond its run; ``censored`` with
    the run's own length as the bound when ``L_b`` is below the treatment's floor E (never reached)."""
    if run_fit is None or base_fit is None or not math.isfinite(base_final_loss):
        return ExtraTokens(math.nan)
    d_b = base_fit.steps_to(base_final_loss)
    if not math.isfinite(d_b) or d_b <= 0:
        return ExtraTokens(math.nan)
    d_t = run_fit.steps_to(base_final_loss)
    if math.isinf(d_t):
        return ExtraTokens(100.0 * (run_fit.d_max / d_b - 1.0), censored=True, extrapolated=True)
    return ExtraTokens(100.0 * (d_t / d_b - 1.0), extrapolated=d_t > run_fit.d_max * 1.0001)


def log_ratio(pct: float) -> float:
    """``log(1 + pct / 100)``: the scale on which extra tokens are averaged and tested (NaN at or
    below -100 %)."""
    return math.log1p(pct / 100.0) if pct > -100.0 else math.nan


def from_log_ratio(y: float) -> float:
    """The inverse of ``log_ratio``: % extra tokens."""
    return 100.0 * math.expm1(y) if math.isfinite(y) else y


@dataclass(frozen=True)
class ExtraSummary:
    """Extra tokens of one grid point over its seeds. ``log_interval``: the t interval of
    ``log(1 + x)`` over the surviving seeds (what tests and verdicts use); ``interval``: its mean and
    bounds back-transformed to % (``mean`` is the geometric-mean ratio minus 1). With a censored seed
    the mean is a lower bound and there is no interval; diverged seeds are not in the mean (the
    survivors') and are counted in the table's rank test (``pretrain.evaluation.stats.rank_test``)."""

    interval: object  # pretrain.evaluation.stats.Interval, back-transformed (%), sd NaN
    log_interval: object  # pretrain.evaluation.stats.Interval over log(1 + x)
    censored: int  # seeds whose value is a lower bound
    extrapolated: int  # seeds whose (fitted) value lies beyond their run
    diverged: int  # seeds without a value because the run diverged

    def text(self, digits: int = 1) -> str:
        iv = self.interval
        if iv.n == 0:
            return f"n/a ({self.diverged} diverged)" if self.diverged else "n/a"
        notes = []
        if self.censored:
            notes.append(f"lower bound: {self.censored} of {iv.n} seeds censored, no interval")
        if self.extrapolated:
            notes.append(f"{self.extrapolated} of {iv.n} extrapolated")
        if self.diverged:
            notes.append(f"survivors' mean: {self.diverged} of {iv.n + self.diverged} seeds diverged, "
                         "counted as the worst outcome in the rank test")
        if self.censored:
            head = f"> {iv.mean:+.{digits}f}"
        elif iv.n < 2:
            head = f"{iv.mean:+.{digits}f} (1 seed)"
        else:
            head = f"{iv.mean:+.{digits}f} [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}] ({iv.n} seeds)"
        return head + (f" ({'; '.join(notes)})" if notes else "")


def summarize_extra(values: list[ExtraTokens], diverged: int = 0, confidence: float = 0.95) -> ExtraSummary:
    """``ExtraSummary`` of one grid point's per-seed values (NaN values are left out): the mean and t
    interval of ``log(1 + x)``, back-transformed (module docstring)."""
    from pretrain.evaluation.stats import Interval, paired_interval

    vals = [v for v in values if math.isfinite(v.pct)]
    censored = sum(v.censored for v in vals)
    extrapolated = sum(v.extrapolated for v in vals)
    logs = [log_ratio(v.pct) for v in vals]
    if censored:
        mean = sum(logs) / len(logs)
        log_iv = Interval(mean, math.nan, math.nan, len(vals), math.nan, confidence)
    else:
        log_iv = paired_interval(logs, confidence)
    iv = Interval(from_log_ratio(log_iv.mean), from_log_ratio(log_iv.lo), from_log_ratio(log_iv.hi), log_iv.n,
                  math.nan, confidence, log_iv.excluded)
    return ExtraSummary(iv, log_iv, censored, extrapolated, diverged)

"""The plan search: the cheapest per-layer, per-GEMM precision plan within a loss budget.

A **unit** is one GEMM (Fprop, Dgrad or Wgrad) of a group of linears -- by default all linears of
one transformer layer (``layer-gemm``): 3 units per layer. Each GEMM has a **ladder** of recipes,
most precise first, starting at the baseline's recipe (``bf16 > fp8 > mxfp4`` for Fprop, Wgrad's
cheapest rung ``mxfp4+had16``). A plan gives every unit a rung (0 = the baseline's recipe).

The search (:func:`greedy_search`) is a pure function of three callables-worth of information:

* ``cost(levels) -> float``: the modelled step time of a plan (``precision.cost_model``);
* ``evaluate(levels) -> Interval``: the plan's loss gap to the baseline, relative
  (``val / val_baseline - 1``, paired by seed), with its confidence interval;
* ``priority``: the units, most sensitive first (per unit of cost saving), from telemetry.

It accepts a plan only when the gap's **upper** bound is within ``budget``:

1. probe the all-cheapest plan; if it fits, it is the answer (nothing is cheaper);
2. *top-down*, most sensitive first: raise the next unit to its baseline rung and probe, until the
   plan fits (the baseline itself always fits: its gap is 0 by definition);
3. *bottom-up refinement*, least sensitive raised unit first: lower it one rung at a time (to rungs
   the cost model says are cheaper) and keep each move only if the probe still fits.

"Cheapest" is the cost model's word, not the ladder's: on a memory-bound shape a lower rung can cost
more than a higher one (its quantization passes outweigh the narrower GEMM), and the search then
never moves a unit there. The cost is additive over units.

Every probe is recorded (:class:`Probe`) so the report can say which units stayed in higher
precision and which numbers decided. ``max_probes`` bounds the number of evaluated plans; the
answer is then the cheapest plan found that fits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from precision.policy import layer_index
from precision.recipe import Gemm, GemmRecipe, LinearPrecision, SpecError, parse_gemm
from pretrain.evaluation.stats import Interval

__all__ = [
    "DEFAULT_LADDER",
    "GRANULARITIES",
    "GuardedResult",
    "Ladder",
    "Probe",
    "Sample",
    "SearchResult",
    "SpentBounds",
    "Unit",
    "apply_levels",
    "cheapest_levels",
    "fits",
    "greedy_search",
    "guarded_search",
    "layer_groups",
    "make_units",
    "probe_budget",
    "unit_sensitivity",
]

GRANULARITIES = ("layer-gemm", "linear-gemm", "gemm")
DEFAULT_LADDER = "fprop=bf16>fp8>mxfp4;dgrad=bf16>fp8>mxfp4;wgrad=bf16>fp8>mxfp4+had16"
Levels = Mapping[str, int]


# ====================================================================== units and ladders
@dataclass(frozen=True)
class Unit:
    """One GEMM of a group of linears, searched as one: ``key`` is ``SCOPE/GEMM`` (``layer3/wgrad``)."""

    scope: str
    gemm: Gemm
    linears: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.scope}/{self.gemm.value}"


def make_units(names: Iterable[str], granularity: str, exclude: Iterable[str] = ("output_layer",)) -> list[Unit]:
    """The search units over layer ``names`` (plan names); linears in ``exclude`` keep the baseline."""
    if granularity not in GRANULARITIES:
        raise SpecError(f"--granularity {granularity!r}: valid: {', '.join(GRANULARITIES)}")
    names = [n for n in names if n not in set(exclude)]
    groups: dict[str, list[str]] = {}
    for n in names:
        if granularity == "gemm":
            scope = "all"
        elif granularity == "layer-gemm":
            i = layer_index(n)
            scope = n if i is None else f"layer{i}"
        else:
            scope = n
        groups.setdefault(scope, []).append(n)
    return [Unit(scope, g, tuple(members)) for scope, members in groups.items() for g in Gemm]


@dataclass(frozen=True)
class Ladder:
    """Per GEMM, the recipes a unit may take, most precise first (rung 0 = the baseline's)."""

    rungs: Mapping[Gemm, tuple[str, ...]]

    @classmethod
    def parse(cls, text: str, flag: str = "--ladder") -> Ladder:
        """``fprop=bf16>fp8>mxfp4;dgrad=...;wgrad=...`` (a GEMM left out keeps only the baseline)."""
        rungs: dict[Gemm, tuple[str, ...]] = {}
        for part in (p.strip() for p in text.split(";") if p.strip()):
            if "=" not in part:
                raise SpecError(f"{flag} {part!r}: expected GEMM=RECIPE>RECIPE>..., e.g. wgrad=fp8>mxfp4+had16")
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in [g.value for g in Gemm]:
                raise SpecError(f"{flag} {part!r}: unknown GEMM {key!r}; valid: fprop, dgrad, wgrad")
            g = Gemm(key)
            if g in rungs:
                raise SpecError(f"{flag}: {key} given twice")
            steps = tuple(s.strip() for s in value.split(">"))
            for s in steps:
                try:
                    parse_gemm(s, g)
                except SpecError as e:
                    raise SpecError(f"{flag} {part!r}: {e}") from None
            if len(set(steps)) != len(steps):
                raise SpecError(f"{flag} {part!r}: a recipe is listed twice")
            rungs[g] = steps
        return cls(rungs)

    def from_baseline(self, baseline: Mapping[Gemm, GemmRecipe], flag: str = "--ladder") -> Ladder:
        """The rungs at and below each GEMM's baseline recipe (the search only lowers precision)."""
        out = {}
        for g in Gemm:
            steps = self.rungs.get(g, ())
            recipes = [parse_gemm(s, g) for s in steps]
            base = baseline[g]
            if base in recipes:
                out[g] = steps[recipes.index(base):]
            elif not steps:
                out[g] = (base.spec(),)
            else:
                raise SpecError(f"{flag}: {g.value}: the baseline's recipe {base.spec()} is not a rung of "
                                f"{'>'.join(steps)}; start the ladder at it")
        return Ladder(out)

    def count(self, gemm: Gemm) -> int:
        return len(self.rungs[gemm])

    def recipe(self, gemm: Gemm, level: int) -> GemmRecipe:
        return parse_gemm(self.rungs[gemm][level], gemm)

    def text(self) -> str:
        return ";".join(f"{g.value}={'>'.join(self.rungs[g])}" for g in Gemm if g in self.rungs)


def apply_levels(baseline: Mapping[str, LinearPrecision], units: Sequence[Unit], ladder: Ladder,
                 levels: Levels) -> dict[str, LinearPrecision]:
    """The per-linear plan: the baseline with each unit's GEMM set to its rung."""
    plan = dict(baseline)
    for u in units:
        lvl = levels.get(u.key, 0)
        if lvl:
            r = ladder.recipe(u.gemm, lvl)
            for n in u.linears:
                plan[n] = dataclasses.replace(plan[n], **{u.gemm.value: r})
    return plan


# ====================================================================== telemetry -> sensitivity
_TAG = re.compile(r"^numerics/(?P<layer>.+)/(?P<gemm>fprop|dgrad|wgrad)/(?P<operand>x|w|dy)/(?P<metric>\w+)$")


def unit_sensitivity(scalars: Mapping[str, list[tuple[int, float]]], units: Sequence[Unit]) -> dict[str, dict]:
    """Per unit, from TensorBoard ``numerics/<layer>/<gemm>/<operand>/<metric>`` series: the mean
    noise-to-signal power ``nsr = 10^(-sqnr_db/10)`` summed over the GEMM's two operands (the output
    error of a product grows with both), and the mean clipped and flushed fractions, averaged over
    the unit's linears and the telemetry steps. Higher ``nsr``: more sensitive."""
    per: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for tag, series in scalars.items():
        m = _TAG.match(tag)
        if m and m["metric"] in ("sqnr_db", "clipped", "flushed"):
            per.setdefault((m["layer"], m["gemm"], m["operand"]), {}).setdefault(m["metric"], []).extend(
                v for _, v in series if math.isfinite(v))
    out = {}
    for u in units:
        nsr, clipped, flushed, seen = [], [], [], 0
        for n in u.linears:
            ops = [per.get((n, u.gemm.value, o), {}) for o in u.gemm.operands]
            if not all(o.get("sqnr_db") for o in ops):
                continue
            seen += 1
            nsr.append(sum(sum(10 ** (-s / 10) for s in o["sqnr_db"]) / len(o["sqnr_db"]) for o in ops))
            clipped.append(sum(_mean(o.get("clipped", [])) for o in ops))
            flushed.append(sum(_mean(o.get("flushed", [])) for o in ops))
        out[u.key] = {"nsr": _mean(nsr), "sqnr_db": -10 * math.log10(_mean(nsr)) if nsr and _mean(nsr) > 0
                      else math.nan, "clipped": _mean(clipped), "flushed": _mean(flushed), "linears_seen": seen}
    return out


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else math.nan


# ====================================================================== the search
@dataclass(frozen=True)
class Probe:
    """One evaluated plan: its rungs, modelled cost, measured gap and whether it fits the budget."""

    levels: tuple[tuple[str, int], ...]
    cost: float
    gap: Interval
    fits: bool
    why: str  # the move it tested, e.g. "raise layer0/wgrad to rung 0"


@dataclass(frozen=True)
class SearchResult:
    levels: dict[str, int]
    cost: float
    probes: tuple[Probe, ...]
    reason: str  # how the search ended


def fits(gap: Interval, budget: float) -> bool:
    """A gap fits when its interval's upper bound is within the budget (a NaN bound never fits)."""
    return math.isfinite(gap.hi) and gap.hi <= budget


def greedy_search(units: Sequence[str], n_levels: Mapping[str, int], cost: Callable[[Levels], float],
                  evaluate: Callable[[Levels], Interval], budget: float, priority: Sequence[str],
                  max_probes: int | None = None) -> SearchResult:
    """Most-sensitive-first greedy search (see the module docstring). ``units``: unit keys;
    ``n_levels[u]``: its number of rungs; ``priority``: the keys, most sensitive first."""
    if sorted(priority) != sorted(units):
        raise ValueError("priority must order exactly the units")
    probes: list[Probe] = []
    cache: dict[tuple, Probe] = {}
    exact_zero = Interval(0.0, 0.0, 0.0, 0, 0.0)

    def probe(levels: dict[str, int], why: str) -> Probe | None:
        key = tuple(sorted((u, lv) for u, lv in levels.items() if lv))
        if key in cache:
            return cache[key]
        if not key:  # the baseline: gap 0 by definition
            p = Probe(key, cost(levels), exact_zero, True, why)
            cache[key] = p
            return p
        if max_probes is not None and len(probes) >= max_probes:
            return None
        gap = evaluate(dict(levels))
        p = Probe(key, cost(levels), gap, fits(gap, budget), why)
        cache[key] = p
        probes.append(p)
        return p

    rung_cost = _rung_costs(units, n_levels, cost)
    cheapest = cheapest_levels(units, n_levels, cost)
    first = probe(cheapest, "all units at their cheapest rung")
    if first is not None and first.fits:
        return SearchResult(cheapest, first.cost, tuple(probes), "the all-cheapest plan fits the budget")
    current, raised, reason = dict(cheapest), [], ""
    for u in priority:  # phase A: protect the most sensitive units until the plan fits
        if current[u] == 0:
            continue
        current[u] = 0
        raised.append(u)
        p = probe(current, f"raise {u} to rung 0 (baseline)")
        if p is None:
            reason = f"stopped at --max-probes {max_probes} while raising units"
            break
        if p.fits:
            break
    best = _best_fitting(cache.values(), current, cost)
    if reason:
        return SearchResult(best[0], best[1], tuple(probes), reason)
    current = best[0]
    for u in reversed(raised):  # phase B: lower what was raised, least sensitive first
        for lvl in range(1, n_levels[u]):
            if rung_cost[u][lvl] >= rung_cost[u][current[u]]:
                continue  # not cheaper than what the unit has
            trial = {**current, u: lvl}
            p = probe(trial, f"lower {u} to rung {lvl}")
            if p is None:
                best = _best_fitting(cache.values(), current, cost)
                return SearchResult(best[0], best[1], tuple(probes),
                                    f"stopped at --max-probes {max_probes} while refining")
            if not p.fits:
                break
            current = trial
    return SearchResult(current, cost(current), tuple(probes),
                        f"greedy: {len(raised)} unit(s) raised most-sensitive-first, then refined")


def _rung_costs(units: Sequence[str], n_levels: Mapping[str, int],
                cost: Callable[[Levels], float]) -> dict[str, list[float]]:
    """Per unit, each rung's cost change from the baseline (the cost is additive over units)."""
    base = cost({})
    return {u: [cost({u: lv}) - base for lv in range(n_levels[u])] for u in units}


def cheapest_levels(units: Sequence[str], n_levels: Mapping[str, int], cost: Callable[[Levels], float]) -> dict:
    """Each unit at its cheapest rung by the cost model (ties: the lower precision)."""
    rc = _rung_costs(units, n_levels, cost)
    return {u: min(range(n_levels[u]), key=lambda lv: (rc[u][lv], -lv)) for u in units}


def _best_fitting(probes: Iterable[Probe], like: dict[str, int],
                  cost: Callable[[Levels], float]) -> tuple[dict[str, int], float]:
    """The cheapest fitting probe's levels (the baseline's, all rungs 0, if none fits)."""
    ok = [p for p in probes if p.fits]
    if not ok:
        base = {u: 0 for u in like}
        return base, cost(base)
    p = min(ok, key=lambda q: q.cost)
    levels = {u: 0 for u in like}
    levels.update(dict(p.levels))
    return levels, p.cost


# ====================================================================== the guarded search
# greedy_search accepts a plan on one 95% bound per probe: over many probes, and on the same seeds the
# answer is then judged by, noise passes for a fitting plan (issue's Monte Carlo: 10% of searches at
# 96 units, 35% at 384 chose a plan whose true gap is over budget). guarded_search spends one error
# budget over all its tests, searches coarse units first, and confirms on seeds no probe used.
@dataclass(frozen=True)
class Sample:
    """The measured gaps of one plan: per-seed paired relative gaps (``inf``: a failed or diverged
    run) and, for a single seed, its gap's standard error from the validation batches."""

    gaps: tuple[float, ...]
    se: float = math.nan


class SpentBounds:
    """One-sided upper bounds of gaps at levels that add up to one error budget ``alpha``.

    With two or more seeds per plan the standard deviation of a paired gap is pooled over every
    plan measured so far (the paired noise is that of seeds and data order, alike for plans near
    the baseline), so a 3-seed probe's bound has the pooled degrees of freedom, not 2. With one seed
    the bound is normal on the validation batches' standard error."""

    def __init__(self) -> None:
        self.ss, self.df = 0.0, 0

    def add(self, s: Sample) -> None:
        g = [x for x in s.gaps if math.isfinite(x)]
        if len(g) == len(s.gaps) and len(g) >= 2:
            m = sum(g) / len(g)
            self.ss += sum((x - m) ** 2 for x in g)
            self.df += len(g) - 1

    def upper(self, s: Sample, alpha: float, own: bool = False) -> Interval:
        """The gap's mean with ``[lo, hi]`` its two-sided ``1 - 2 alpha`` interval (``hi`` the one-sided
        ``1 - alpha`` bound); ``inf`` for a failed run, NaN bounds where none is defined. ``own``: the
        standard deviation of the sample's own seeds (``n - 1`` degrees of freedom), nothing pooled --
        the confirmation's: its runs are longer than the probes and their spread may be larger, so no
        probe may vouch for it (one seed: no bound)."""
        n, conf = len(s.gaps), 1 - 2 * alpha
        if not n or not all(math.isfinite(x) for x in s.gaps):
            return Interval(math.inf, math.inf, math.inf, n, math.nan, conf)
        mean = sum(s.gaps) / n
        if own:
            if n < 2:
                return Interval(mean, math.nan, math.nan, n, math.nan, conf)
            sd = math.sqrt(sum((x - mean) ** 2 for x in s.gaps) / (n - 1))
            h = _quantile(alpha, n - 1) * sd / math.sqrt(n)
            return Interval(mean, mean - h, mean + h, n, sd, conf)
        if n >= 2 and self.df >= 1:
            sd = math.sqrt(self.ss / self.df)
            h = _quantile(alpha, self.df) * sd / math.sqrt(n)
        elif n == 1 and math.isfinite(s.se):
            sd, h = math.nan, _quantile(alpha, None) * s.se
        else:
            return Interval(mean, math.nan, math.nan, n, math.nan, conf)
        return Interval(mean, mean - h, mean + h, n, sd, conf)


@functools.lru_cache(maxsize=4096)
def _quantile(alpha: float, df: int | None) -> float:
    """The one-sided ``1 - alpha`` quantile of Student's t with ``df`` degrees of freedom (None: normal)."""
    from scipy.stats import norm, t

    return float(norm.ppf(1 - alpha) if df is None else t.ppf(1 - alpha, df))


@dataclass(frozen=True)
class GuardedResult:
    levels: dict[str, int]  # the delivered plan: the candidate if confirmed, else the baseline (all 0)
    candidate: dict[str, int]  # what the probes chose
    cost: float  # of the delivered plan
    probes: tuple[Probe, ...]
    confirmation: Interval | None  # the candidate's gap on fresh seeds (None: nothing to confirm)
    confirmed: bool
    probe_alpha: float  # one-sided error rate of each probe's bound
    confirm_alpha: float
    reason: str


def probe_budget(n_groups: int, group_size: int, n_rungs: int) -> int:
    """The default number of probes a search may run (its error budget is split over them): the
    coarse stage's worst case (the all-cheapest plan, each group raised, then lowered rung by rung)
    plus the fine stage's bisections (``ceil(log2(group_size)) + 1`` probes per group and rung)."""
    return 1 + n_groups * n_rungs + n_groups * (n_rungs - 1) * (math.ceil(math.log2(max(group_size, 1))) + 1)


def guarded_search(groups: Mapping[str, Sequence[str]], n_levels: Mapping[str, int],
                   cost: Callable[[Levels], float], evaluate: Callable[[Levels], Sample],
                   confirm: Callable[[Levels], Sample] | None, budget: float, priority: Sequence[str],
                   alpha: float = 0.025, max_probes: int | None = None) -> GuardedResult:
    """Coarse-to-fine search with one error budget, confirmed on fresh seeds.

    ``groups``: coarse unit -> its fine units (e.g. ``layers0-7/wgrad`` -> ``layer0/wgrad`` ...;
    every fine unit of a group has the same ladder); ``priority``: the fine units, most sensitive
    first. ``alpha`` (one-sided) is spent half on the probes -- ``alpha / 2 / max_probes`` each, a
    union bound over every test the search may run -- and half on the confirmation, which measures
    the candidate on seeds no probe used, its bound from the confirmation runs' own spread (Student's
    t, ``n - 1`` degrees of freedom; nothing pooled with the shorter probes, whose gap and spread may
    both be smaller): the delivered plan's true gap exceeds ``budget`` with probability at most
    ``alpha / 2`` from the confirmation alone, whatever the probes selected and however the
    full-length runs' spread differs from the probes'. With few confirmation seeds the t quantile is
    large (3 seeds at 1.25 %: 6.2 standard errors), so a confirmation wants 6-8 seeds.

    The guarantee is about the confirmation's length (``--train-iters``) and its validation set: the
    true gap of a run of that length on that data. It says nothing about a production run that is
    longer, larger or on other data -- a quantization bias can grow with the run's length.

    1. coarse: :func:`greedy_search` over the groups (a group's rung applies to all its members);
    2. fine: in each group left above its cheapest rung, per rung, a bisection finds the longest run
       of its members (least sensitive first) that can be lowered to it with the probe still fitting;
    3. confirmation of the candidate (none when it is the baseline); unconfirmed, the baseline is
       delivered and the candidate reported."""
    fine = [u for g in groups.values() for u in g]
    if sorted(priority) != sorted(fine):
        raise ValueError("priority must order exactly the fine units")
    rank = {u: i for i, u in enumerate(priority)}
    rungs = {g: n_levels[m[0]] for g, m in groups.items()}
    if max_probes is None:
        max_probes = probe_budget(len(groups), max(len(m) for m in groups.values()), max(rungs.values()))
    a_probe, a_confirm = alpha / 2 / max_probes, alpha / 2
    bounds = SpentBounds()
    probes: list[Probe] = []
    zero = Interval(0.0, 0.0, 0.0, 0, 0.0)
    cache: dict[tuple, Probe] = {}

    def measure(levels: Mapping[str, int], why: str) -> Probe | None:
        key = tuple(sorted((u, lv) for u, lv in levels.items() if lv))
        if key in cache:
            return cache[key]
        if not key:
            cache[key] = Probe(key, cost(levels), zero, True, why)
            return cache[key]
        if len(probes) >= max_probes:
            return None
        s = evaluate(dict(levels))
        bounds.add(s)
        gap = bounds.upper(s, a_probe)
        p = Probe(key, cost(levels), gap, fits(gap, budget), why)
        cache[key] = p
        probes.append(p)
        return p

    def expand(glevels: Mapping[str, int]) -> dict[str, int]:
        return {u: glevels.get(g, 0) for g, members in groups.items() for u in members}

    g_priority = sorted(groups, key=lambda g: min(rank[u] for u in groups[g]))

    def g_evaluate(glevels):  # greedy_search's evaluate: the expanded plan, measured once
        p = measure(expand(glevels), "coarse: " + ", ".join(f"{g}={lv}" for g, lv in sorted(glevels.items()) if lv))
        return p.gap if p is not None else Interval(math.inf, math.inf, math.inf, 0, math.nan)

    coarse = greedy_search(list(groups), rungs, lambda gl: cost(expand(gl)), g_evaluate, budget, g_priority,
                           max_probes)
    current = expand(coarse.levels)
    reason = f"coarse ({len(groups)} groups): {coarse.reason}"
    rc = _rung_costs(fine, n_levels, cost)
    stopped = False
    for g in reversed(g_priority):  # fine: inside the groups the coarse stage kept above their cheapest
        members = sorted(groups[g], key=lambda m: -rank[m])  # least sensitive first
        for lvl in range(1, rungs[g]):
            movable = [u for u in members if rc[u][lvl] < rc[u][current[u]]]
            # bisect for the longest least-sensitive prefix that can take this rung (the gap is additive,
            # so a longer prefix costs at least as much loss): ~log2(group size) probes per group and rung
            lo, hi = 0, len(movable)
            while lo < hi and not stopped:
                k = (lo + hi + 1) // 2
                p = measure({**current, **dict.fromkeys(movable[:k], lvl)},
                            f"lower the {k} least sensitive of {g} to rung {lvl}")
                if p is None:
                    stopped = True
                elif p.fits:
                    lo = k
                else:
                    hi = k - 1
            current = {**current, **dict.fromkeys(movable[:lo], lvl)}
            if stopped:
                break
        if stopped:
            reason += f"; fine stage stopped at {max_probes} probes"
            break
    else:
        reason += "; fine stage done"
    candidate = {u: v for u, v in current.items()}
    conf_iv, confirmed = None, False
    if any(candidate.values()) and confirm is not None:
        conf_iv = bounds.upper(confirm(dict(candidate)), a_confirm, own=True)
        confirmed = fits(conf_iv, budget)
    delivered = candidate if confirmed else {u: 0 for u in fine}
    if not any(candidate.values()):
        reason += "; the candidate is the baseline"
    elif confirm is None:
        reason += "; not confirmed (no confirmation): the baseline is delivered"
    else:
        reason += "; confirmed on fresh seeds" if confirmed else "; NOT confirmed on fresh seeds: the baseline is delivered"
    return GuardedResult(delivered, candidate, cost(delivered), tuple(probes), conf_iv, confirmed, a_probe,
                         a_confirm, reason)


def layer_groups(units: Sequence[Unit], layers_per_group: int) -> dict[str, list[str]]:
    """Coarse units: per GEMM, runs of ``layers_per_group`` consecutive layers (``layers0-7/wgrad``);
    a unit outside the transformer layers is a group of its own. 0 or 1: every unit its own group."""
    out: dict[str, list[str]] = {}
    for u in units:
        i = layer_index(u.linears[0])
        if layers_per_group <= 1 or i is None:
            out.setdefault(u.key, []).append(u.key)
            continue
        a = i // layers_per_group * layers_per_group
        out.setdefault(f"layers{a}-{a + layers_per_group - 1}/{u.gemm.value}", []).append(u.key)
    return out

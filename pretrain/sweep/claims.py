"""A study's declared claims: the contrasts it tests, written before its runs, adjusted together.

A sweep file may carry a ``claims:`` section (checked by ``pretrain.sweep.spec``)::

    claims:
      study: mxfp4_fullbatch_cpu      # the study the claims belong to (one family)
      declared: 2026-12-06            # when they were written (ISO date)
      study_claims: 6                 # how many claims the whole study declared, over all its files
      note: ...                       # e.g. "declared after the runs" for an old study
      tests:
        - {id: fprop_costs, contrast: [mxfp4_fprop, fp8], metric: excess_loss, direction: worse}
        - {id: had_free, contrast: [had16, fp8], metric: val_loss, direction: equivalent, margin: 0.01}

An RL sweep (``script: rl``) declares its claims on held-out accuracy::

        - {id: bf16_learns, contrast: [bf16, start], metric: gain, direction: better, margin: 0.10}
        - {id: fp4_matches, contrast: [nvfp4_tis, bf16], metric: final_accuracy, direction: equivalent, margin: 0.03}

``final_accuracy`` is the final held-out accuracy gap of ``contrast[0]`` against ``contrast[1]``;
``gain`` is ``contrast[0]``'s final held-out accuracy minus its own starting policy's (``start``, the
evaluation at iteration 0), so ``better`` beyond 0.10 reads "learns more than +0.10".

Each test pairs the runs of ``contrast[0]`` with those of ``contrast[1]`` by seed (and
hyper-parameters) and tests its ``metric`` one-sided in the declared ``direction``: ``worse`` /
``better`` beyond ``margin`` (default 0) by a t-test, ``equivalent`` inside ``±margin`` by two
one-sided tests. A seed whose run diverged is the worst outcome of its side (+inf for the treatment):
the test is then the exact one-sided Wilcoxon signed-rank test, and equivalence is not shown. Extra tokens/steps are tested on ``log(1 + x)`` (``margin`` in %). The p-values are
Holm-adjusted over **all** the study's claims (``study_claims``; a claim of the study whose p-value
this report does not hold counts as p = 1, which only makes the adjustment stricter). Every other
comparison of the report is exploratory.

The first time a report holds a claim's table, ``claims_first.json`` records when and on which
seeds. A later report tests the claim on those seeds only, and seeds added since as a **new
confirmatory run** with its own test, one more claim in the family -- never a silent extension.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pretrain.evaluation.extra_tokens import log_ratio
from pretrain.evaluation.stats import ALPHA, holm_adjust, paired_interval, tost_p_value

__all__ = ["CLAIM_METRICS", "DIRECTIONS", "RL_CLAIM_METRICS", "START", "ClaimResult", "claims_table",
           "evaluate_claims", "reported_mean", "study_table"]

# metric -> (what a seed's value is, whether it is a % tested on log(1 + x))
CLAIM_METRICS = {"val_loss": ("final validation loss gap", False),
                 "excess_loss": ("excess training loss during the descent", False),
                 "extra_steps": ("% extra steps during the descent", True),
                 "extra_tokens": ("% extra tokens at the end (crossing)", True),
                 "final_accuracy": ("final held-out accuracy gap (RL)", False),
                 "gain": ("held-out accuracy gain over the starting policy (RL)", False)}
RL_CLAIM_METRICS = ("final_accuracy", "gain")
START = "start"  # the second label of a ``gain`` claim: the run's own starting policy
DIRECTIONS = ("worse", "better", "equivalent")
FIRST_LOOK = "claims_first.json"


@dataclass(frozen=True)
class ClaimResult:
    """One declared test on one set of seeds: the mean effect, its p-value (one-sided in the declared
    direction, or TOST), the Holm-adjusted p over the study's claims and the verdict."""

    id: str
    contrast: tuple[str, str]
    metric: str
    direction: str
    margin: float
    seeds: tuple[int, ...]
    mean: float
    p: float
    p_holm: float = math.nan
    new_run: bool = False

    @property
    def verdict(self) -> str:
        if not math.isfinite(self.p):
            return "no test (fewer than 2 paired seeds)"
        return "supported" if self.p_holm < ALPHA else "not supported"


def _p_value(values: list[float], direction: str, margin: float) -> tuple[float, float]:
    """(mean, p) of the declared test on per-seed values."""
    from scipy.stats import t

    if any(math.isinf(v) for v in values):  # a divergence: the worst outcome (+inf; -inf: the other side's)
        if direction == "equivalent" or len(values) < 2:
            return math.nan if len(values) < 2 else math.inf, 1.0
        from scipy.stats import wilcoxon

        big = 1e6 * max([abs(v) for v in values if math.isfinite(v)] + [1.0])
        finite = [max(-big, min(big, v)) for v in values]
        alt = "greater" if direction == "worse" else "less"
        return math.inf, float(wilcoxon([v - margin for v in finite], alternative=alt, method="exact").pvalue)
    gap = paired_interval(values)
    if gap.n < 2 or gap.excluded:
        return gap.mean, math.nan
    if direction == "equivalent":
        return gap.mean, tost_p_value(gap, margin)
    if gap.sd == 0.0:
        shown = gap.mean > margin if direction == "worse" else gap.mean < -margin
        return gap.mean, 0.0 if shown else 1.0
    z = (gap.mean - margin) / gap.se if direction == "worse" else (-margin - gap.mean) / gap.se
    return gap.mean, float(t.sf(z, gap.n - 1))


def _per_seed(rows: list[dict], test: dict, window: list[int] | None) -> dict[int, float]:
    """The metric's paired value per seed (a higher value is worse for the first label)."""
    from pretrain.sweep.results import _diverged, descent_numbers, pair_numbers, partner

    a, b = test["contrast"]
    if test["metric"] in RL_CLAIM_METRICS:
        return _per_seed_rl(rows, test)
    out = {}
    for m in rows:
        if m["_run"].label != a or m.get("status", "done") not in ("done", "diverged"):
            continue
        base = partner(rows, b, m)
        if base is None or base.get("status", "done") not in ("done", "diverged"):
            continue
        metric = test["metric"]
        if metric in ("excess_loss", "extra_steps"):
            if not window:
                continue
            d = descent_numbers(m, base, window)
            v = d.excess_loss if metric == "excess_loss" else d.extra.pct
        else:
            p = pair_numbers(m, base)
            v = p["gap_val_loss"] if metric == "val_loss" else p["extra_tokens_pct"]
        if _diverged(m) or _diverged(base):  # counted as the worst outcome of the side that diverged
            v = math.inf if _diverged(m) else -math.inf
        out[m["_run"].seed] = log_ratio(v) if CLAIM_METRICS[metric][1] and math.isfinite(v) else v
    return out


def _per_seed_rl(rows: list[dict], test: dict) -> dict[int, float]:
    """An RL claim's value per seed, signed so that a higher value is worse for ``contrast[0]``: the
    accuracy gap ``against - label`` (``final_accuracy``) or minus the gain over the start (``gain``).
    A diverged run is its side's worst outcome."""
    from pretrain.sweep.results import partner

    a, b = test["contrast"]
    finished = ("done", "diverged")
    out = {}
    for m in rows:
        if m["_run"].label != a or m.get("status", "done") not in finished:
            continue
        if test["metric"] == "gain":
            v = -m["gain"]
            if m.get("status") == "diverged":
                v = math.inf
        else:
            base = partner(rows, b, m)
            if base is None or base.get("status", "done") not in finished:
                continue
            v = base["final_accuracy"] - m["final_accuracy"]
            if m.get("status") == "diverged" or base.get("status") == "diverged":
                v = math.inf if m.get("status") == "diverged" else -math.inf
        if math.isnan(v):
            continue
        out[m["_run"].seed] = v
    return out


def reported_mean(metric: str, mean: float) -> float:
    """A claim's mean in its reader's sign: ``label - against`` for RL accuracy (and the gain itself),
    where the tests work on "higher is worse for the first label"; every other metric is already so."""
    return -mean if metric in RL_CLAIM_METRICS and math.isfinite(mean) else mean


def _shown_mean(metric: str, mean: float) -> str:
    """A claim's mean as its reader expects it: a % for extra tokens/steps, ``label - against`` (or the
    gain) for RL accuracy, the raw gap otherwise."""
    if math.isinf(mean):
        return "diverged seeds: signed-rank test"
    if CLAIM_METRICS[metric][1] and math.isfinite(mean):
        return f"{100 * math.expm1(mean):+.2f} %"
    if metric in RL_CLAIM_METRICS:
        return f"{reported_mean(metric, mean):+.4f}" + (" gain" if metric == "gain" else " acc")
    return f"{mean:+.4f}"


def _first_look(out: Path, claims: dict, seeds_by_test: dict[str, list[int]]) -> dict:
    """The record of the first report that held these claims (written now if there is none)."""
    f = out / FIRST_LOOK
    if f.is_file():
        return json.loads(f.read_text())
    record = {"produced": datetime.now(timezone.utc).isoformat(timespec="seconds"), "declared": claims["declared"],
              "seeds": {k: sorted(v) for k, v in seeds_by_test.items()}}
    if any(seeds_by_test.values()):
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(f)
    return record


def evaluate_claims(out: Path, rows: list[dict], claims: dict, window: list[int] | None = None) -> list[ClaimResult]:
    """Every declared test of ``claims`` on this sweep's rows, on the first look's seeds, then one
    new confirmatory run per test whose seeds were added after it; Holm over the study's claims."""
    values = {t["id"]: _per_seed(rows, t, window) for t in claims["tests"]}
    first = _first_look(out, claims, {k: list(vals) for k, vals in values.items()})
    results = []
    for t in claims["tests"]:
        vals = values[t["id"]]
        earlier = first["seeds"].get(t["id"]) or sorted(vals)
        margin = float(t.get("margin", 0.0))
        if CLAIM_METRICS[t["metric"]][1]:
            margin = log_ratio(margin)
        for new_run, seeds in ((False, [s for s in earlier if s in vals]),
                               (True, [s for s in sorted(vals) if s not in earlier])):
            if new_run and not seeds:
                continue
            mean, p = _p_value([vals[s] for s in seeds], t["direction"], margin)
            results.append(ClaimResult(t["id"], tuple(t["contrast"]), t["metric"], t["direction"],
                                       float(t.get("margin", 0.0)), tuple(seeds), mean, p, new_run=new_run))
    m = max(int(claims.get("study_claims", len(claims["tests"]))), len(claims["tests"]))
    m += sum(r.new_run for r in results)  # each new confirmatory run is one more test of the family
    p = [r.p for r in results] + [1.0] * max(0, m - len(results))
    adj = holm_adjust(p)
    return [ClaimResult(**{**r.__dict__, "p_holm": a}) for r, a in zip(results, adj)]


def claims_table(results: list[ClaimResult], claims: dict, first: dict | None = None) -> list[str]:
    """Markdown: the study's declared claims, one row per test (and per new confirmatory run)."""
    m = max(int(claims.get("study_claims", len(claims["tests"]))), len(claims["tests"])) + sum(
        r.new_run for r in results)
    lines = [(f"## Declared claims of study {claims['study']} (declared {claims['declared']}; Holm over the "
             f"study's {m} claims)"), ""]
    if claims.get("note"):
        lines += [str(claims["note"]), ""]
    if first:
        lines += [(f"First produced {first['produced']}: seeds added after that are a new confirmatory run, "
                  "tested on their own and counted in the family."), ""]
    lines += ["| claim | contrast | metric | declared | seeds | mean | p (one-sided / TOST) | Holm p | verdict |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mean = _shown_mean(r.metric, r.mean)
        declared = r.direction + (f" (margin {r.margin:g})" if r.margin or r.direction == "equivalent" else "")
        name = r.id + (" (new confirmatory run)" if r.new_run else "")
        lines.append(f"| {name} | {r.contrast[0]} vs {r.contrast[1]} | {r.metric} | {declared} | "
                     f"{','.join(map(str, r.seeds))} | {mean} | {r.p:.3g} | {r.p_holm:.3g} | {r.verdict} |")
    lines += ["", ("Every other verdict in this report is exploratory: it is not one of the study's declared "
              "claims, and its Holm adjustment covers only its own table."), ""]
    return lines


def study_table(dirs: list[Path]) -> list[str]:
    """The claims of several sweeps' reports (their ``claims.csv``) of one study, Holm-adjusted
    together: what ``launch/report.py SWEEP_OUT SWEEP_OUT ...`` prints after each sweep's tables."""
    import csv

    rows, sizes, studies = [], [], set()
    for d in dirs:
        f = d / "claims.csv"
        if not f.is_file():
            raise FileNotFoundError(f"{d}: no claims.csv (its sweep file declares no claims:)")
        info = json.loads((d / "sweep.json").read_text())["sweep"]["claims"]
        sizes.append(max(int(info.get("study_claims", len(info["tests"]))), len(info["tests"])))
        studies.add(info["study"])
        rows += [dict(r, sweep=str(d)) for r in csv.DictReader(f.open())]
    if len(studies) != 1:
        raise ValueError(f"claims of different studies ({', '.join(sorted(studies))}) are separate families; "
                         "give the sweep directories of one study")
    m = max(max(sizes), sum(r["new_confirmatory_run"] == "False" for r in rows)) + sum(
        r["new_confirmatory_run"] == "True" for r in rows)
    p = [float(r["p"]) for r in rows]
    adj = holm_adjust(p + [1.0] * max(0, m - len(p)))
    lines = [f"## Study {studies.pop()}: {len(rows)} claim tests from {len(dirs)} sweeps, Holm over {m}", "",
             "| sweep | claim | contrast | metric | declared | seeds | p | Holm p | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, a in zip(rows, adj):
        v = ("no test" if not math.isfinite(float(r["p"])) else "supported" if a < ALPHA else "not supported")
        name = r["claim"] + (" (new confirmatory run)" if r["new_confirmatory_run"] == "True" else "")
        lines.append(f"| {r['sweep']} | {name} | {r['label']} vs {r['against']} | {r['metric']} | {r['direction']} | "
                     f"{r['seeds']} | {float(r['p']):.3g} | {a:.3g} | {v} |")
    return lines

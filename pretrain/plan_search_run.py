"""The precision-plan search's runs: its context (the pretrain flags, the model's linears and their
modelled costs, the runs of a plan), the search itself (calibration, ranking, probes, confirmation;
``launch/search_plan.py``'s docstring tells the steps) and its report.

    ctx = Context(args, pretrain_flags)     # args: launch/search_plan.py's parsed flags
    summary = search(ctx)                   # writes OUT/plan.yaml, report.md, probes.json, plans/
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from precision import PrecisionPolicy, SpecError
from precision.cost_model import ASSUMPTIONS, get_target, linear_shapes, plan_cost
from precision.policy import layer_index, write_plan_file
from precision.recipe import Gemm, LinearPrecision
from pretrain.arguments import ConfigError, model_config, parse_args_or_raise
from pretrain.evaluation.stats import Interval, paired_batch_se, paired_interval
from pretrain.plan_search import (
    Ladder,
    Sample,
    apply_levels,
    cheapest_levels,
    guarded_search,
    layer_groups,
    make_units,
    probe_budget,
    unit_sensitivity,
)
from pretrain.sweep.results import read_scalars, read_val_batches
from pretrain.sweep.runner import read_status, run_dir, run_local
from pretrain.sweep.spec import Run
from pretrain.trainer.tags import VAL_LOSS, series

RESERVED = ("--precision", "--precision-rule", "--seed", "--save", "--load", "--tensorboard-dir",
            "--numerics-interval", "--eval-interval", "--precision-schedule")
REFERENCE = ("wgrad_hadamard", ("first:1=bf16", "last:1=bf16"))  # the study's plan with BF16 edge layers


class SearchError(ValueError):
    """A bad flag; one line naming it and what is valid."""


# ---------------------------------------------------------------- flags
def parse_budget(text: str) -> float:
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise SearchError(f"--budget {text!r}: expected a relative loss budget such as 1% or 0.01") from None
    if not 0 <= value < 1:
        raise SearchError(f"--budget {text!r}: must be in [0%, 100%)")
    return value


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SearchError(f"--seeds {text!r}: expected distinct integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SearchError(f"--seeds {text!r}: expected distinct integers, e.g. 0,1,2")
    return seeds


class Context:
    """Everything fixed for one search: model shapes, baseline plan, units, ladder, runs."""

    def __init__(self, args, extra: list[str]):
        for flag in extra:
            if flag.split("=", 1)[0] in RESERVED:
                raise SearchError(f"{flag.split('=', 1)[0]} after '--': set by the search itself "
                                  f"(use --baseline for the baseline plan, --seeds for seeds)")
        try:
            pargs = parse_args_or_raise(extra + ["--precision", args.baseline])
        except (ConfigError, SystemExit) as e:
            raise SearchError(f"pretrain flags after '--': {e}") from None
        if args.probe_iters < 1 or args.probe_iters > pargs.train_iters:
            raise SearchError(f"--probe-iters {args.probe_iters}: must be in 1..--train-iters ({pargs.train_iters})")
        if args.numerics_interval < 1 or args.numerics_interval > args.probe_iters:
            raise SearchError(f"--numerics-interval {args.numerics_interval}: must be in 1..--probe-iters")
        if not 0 < args.confidence < 1:
            raise SearchError(f"--confidence {args.confidence}: must be in (0, 1)")
        if args.max_probes is not None and args.max_probes < 1:
            raise SearchError(f"--max-probes {args.max_probes}: must be >= 1")
        if args.parallel < 1 or args.nproc_per_node < 1:
            raise SearchError("--parallel and --nproc-per-node must be >= 1")
        vocab = args.vocab_size
        if vocab is None:
            if pargs.tokenizer_model:
                raise SearchError("--vocab-size: required with --tokenizer-model (the output layer's shape)")
            from pretrain.data.tokenizer import DEFAULT_VOCAB_SIZE  # pretrain.data loads megatron-core

            vocab = DEFAULT_VOCAB_SIZE
        self.args, self.extra, self.pargs = args, extra, pargs
        self.budget = parse_budget(args.budget)
        self.seeds = parse_seeds(args.seeds)
        if args.confirm_seeds is None:  # at least 2: the confirmation's bound is its own runs' spread
            self.confirm_seeds = [max(self.seeds) + 1 + i for i in range(max(2, len(self.seeds)))]
        else:
            self.confirm_seeds = parse_seeds(args.confirm_seeds).copy()
            if len(self.confirm_seeds) < 2 and not getattr(args, "no_confirm", False):
                raise SearchError(f"--confirm-seeds {args.confirm_seeds}: at least 2 seeds (the confirmation's bound "
                                  "uses the spread of its own runs), e.g. 3,4,5,6,7,8")
            if set(self.confirm_seeds) & set(self.seeds):
                raise SearchError(f"--confirm-seeds {args.confirm_seeds}: {sorted(set(self.confirm_seeds) & set(self.seeds))} "
                                  f"also in --seeds {args.seeds}; the confirmation needs seeds no probe used")
        if args.group_layers is not None and not 1 <= args.group_layers <= pargs.num_layers:
            raise SearchError(f"--group-layers {args.group_layers}: must be in 1..--num-layers ({pargs.num_layers})")
        self.group_layers = args.group_layers or max(1, math.ceil(pargs.num_layers / 4))
        self.target = get_target(args.target)
        cfg = model_config(pargs, vocab_size=vocab)
        self.shapes = linear_shapes(cfg, pargs.micro_batch_size, pargs.tensor_model_parallel_size)
        self.names = [s.name for s in self.shapes]
        self.num_layers = pargs.num_layers
        try:
            self.baseline = dict(PrecisionPolicy.from_args(args.baseline).resolve(self.names, self.num_layers))
        except SpecError as e:
            raise SearchError(f"--baseline: {e}") from None
        try:
            self.units = make_units(self.names, args.granularity)
            searched = [n for n in self.names if n != "output_layer"]
            base_recipes = {}
            for g in Gemm:
                recipes = {self.baseline[n].recipe(g) for n in searched}
                if len(recipes) != 1:
                    raise SearchError(f"--baseline {args.baseline}: its {g.value} differs between layers; the "
                                      "ladder needs one baseline recipe per GEMM")
                base_recipes[g] = recipes.pop()
            self.ladder = Ladder.parse(args.ladder).from_baseline(base_recipes)
        except SpecError as e:
            raise SearchError(str(e)) from None
        self.unit_keys = [u.key for u in self.units]
        self.n_levels = {u.key: self.ladder.count(u.gemm) for u in self.units}
        self.out = Path(args.out)
        self.fused = args.fused_quantization
        self.base_cost = plan_cost(self.shapes, self.baseline, self.target, self.fused)

    # ------------------------------------------------------------ plans
    def plan(self, levels) -> dict[str, LinearPrecision]:
        return apply_levels(self.baseline, self.units, self.ladder, levels)

    def cost(self, levels) -> float:
        return plan_cost(self.shapes, self.plan(levels), self.target, self.fused).ratio(self.base_cost)

    def plan_id(self, plan: dict[str, LinearPrecision]) -> str:
        text = json.dumps({n: str(p) for n, p in plan.items()}, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:10]

    def write_plan(self, path: Path, plan: dict[str, LinearPrecision], metadata: dict | None = None,
                   header: str = "") -> None:
        """A plan file resolving to ``plan`` (one rule per transformer layer whose linears share a
        precision, exact entries otherwise); the output layer is pinned. Checked by reading it back."""
        rules, linears = [], {"output_layer": str(plan["output_layer"])}
        by_layer: dict[int, list[str]] = {}
        for n in self.names:
            if (i := layer_index(n)) is not None:
                by_layer.setdefault(i, []).append(n)
        default = self.args.baseline if not Path(self.args.baseline).is_file() else str(self.baseline[self.names[0]])
        default_lp = PrecisionPolicy.from_args(default).default
        for i, members in by_layer.items():
            lps = {str(plan[n]) for n in members}
            if len(lps) == 1:
                if str(plan[members[0]]) != str(default_lp):
                    rules.append(f"layers:{i}-{i}={lps.pop()}")
            else:
                linears.update({n: str(plan[n]) for n in members if str(plan[n]) != str(default_lp)})
        path.parent.mkdir(parents=True, exist_ok=True)
        write_plan_file(str(path), default, rules, linears, metadata, header)
        back = PrecisionPolicy.from_args(str(path)).resolve(self.names, self.num_layers)
        if {n: str(back[n]) for n in self.names} != {n: str(p) for n, p in plan.items()}:
            raise RuntimeError(f"{path}: the written plan file does not resolve to the intended plan")

    def describe(self, levels) -> str:
        """``layer0/wgrad=mxfp4+had16, ...`` (the units below rung 0), or ``baseline``."""
        moved = [f"{k}={self.ladder.rungs[Gemm(k.split('/')[1])][v]}" for k, v in levels.items() if v]
        return ", ".join(moved) or "baseline"

    # ------------------------------------------------------------ runs
    def runs_for(self, label: str, precision: str, iters: int, numerics: bool = False,
                 seeds: list[int] | None = None) -> list[Run]:
        flags = list(self.extra) + ["--train-iters", str(iters), "--eval-interval", str(iters)]
        if numerics:
            flags += ["--numerics-interval", str(self.args.numerics_interval)]
        return [Run(f"{label}__seed-{s}", precision, flags + ["--seed", str(s)], label, {}, s)
                for s in (self.seeds if seeds is None else seeds)]

    def execute(self, runs: list[Run]) -> None:
        run_local(self.out, runs, self.args.nproc_per_node, self.args.parallel, [])

    def final_val(self, run: Run, iters: int) -> tuple[float, list[float] | None]:
        """(validation loss at ``iters``, its per-batch losses) -- NaN if the run did not get there."""
        if read_status(self.out, run) != "done":
            return math.nan, None
        tb = run_dir(self.out, run) / "tensorboard"
        val = dict(series(read_scalars(tb), VAL_LOSS))
        return val.get(iters, math.nan), read_val_batches(tb).get(iters)

    def sample(self, runs: list[Run], base_runs: list[Run], iters: int) -> tuple[Sample, list[dict]]:
        """The per-seed relative gaps (and, for one seed, its validation-batch s.e.) of ``runs``."""
        _, per_seed = self.gap(runs, base_runs, iters)
        gaps = tuple(p["rel_gap"] for p in per_seed)
        return Sample(gaps, per_seed[0]["batch_se"] if len(per_seed) == 1 else math.nan), per_seed

    def gap(self, runs: list[Run], base_runs: list[Run], iters: int) -> tuple[Interval, list[dict]]:
        """The relative gap ``val / val_baseline - 1`` paired by seed, with its interval."""
        per_seed, rels, ses = [], [], []
        for r, b in zip(runs, base_runs):
            v, vb = self.final_val(r, iters)
            bv, bb = self.final_val(b, iters)
            rel = v / bv - 1 if math.isfinite(v) and math.isfinite(bv) else math.inf
            se = paired_batch_se(vb, bb) / bv if vb and bb and math.isfinite(bv) else math.nan
            per_seed.append({"seed": r.seed, "val": v, "baseline_val": bv, "rel_gap": rel, "batch_se": se,
                             "status": read_status(self.out, r)})
            rels.append(rel)
            ses.append(se)
        if any(math.isinf(x) for x in rels):  # a failed or diverged run: never fits
            return Interval(math.inf, math.inf, math.inf, len(rels), math.nan, self.args.confidence), per_seed
        if len(rels) >= 2:
            return paired_interval(rels, self.args.confidence), per_seed
        from scipy.stats import norm  # one seed: the validation batches' noise only

        z = float(norm.ppf(0.5 + self.args.confidence / 2))
        h = z * ses[0] if math.isfinite(ses[0]) else math.nan
        return Interval(rels[0], rels[0] - h, rels[0] + h, 1, math.nan, self.args.confidence), per_seed


# ---------------------------------------------------------------- the search
def search(ctx: Context) -> dict:
    args, out = ctx.args, ctx.out
    out.mkdir(parents=True, exist_ok=True)
    iters = args.probe_iters
    base_runs = ctx.runs_for("baseline-probe", args.baseline, iters)
    cheapest = cheapest_levels(ctx.unit_keys, ctx.n_levels, ctx.cost)
    if not any(cheapest.values()):
        print("the cost model finds no unit cheaper below its baseline rung on this target and shape: the "
              "baseline is the cheapest plan (see --fused-quantization)", flush=True)
    records: dict[str, dict] = {}

    def plan_runs(levels, numerics=False):
        plan = ctx.plan(levels)
        pid = ctx.plan_id(plan)
        path = out / "plans" / f"{pid}.yaml"
        if not path.exists():
            ctx.write_plan(path, plan, {"levels": {k: v for k, v in levels.items() if v}})
        return pid, ctx.runs_for(f"probe-{pid}", str(path), iters, numerics)

    # 1. calibration: the all-cheapest plan with telemetry (also its probe) and the baseline's probes
    cal_id, cal_runs = plan_runs(cheapest, numerics=True)
    print(f"calibration: the all-cheapest plan ({cal_id}) with --numerics-interval {args.numerics_interval}, "
          f"and the baseline's probes: {len(cal_runs) + len(base_runs)} runs of {iters} iterations", flush=True)
    ctx.execute(base_runs + cal_runs)
    if read_status(out, cal_runs[0]) != "done":
        raise SearchError(f"the calibration run failed; see {run_dir(out, cal_runs[0]) / 'train.log'}")
    scalars = read_scalars(run_dir(out, cal_runs[0]) / "tensorboard")
    sens = unit_sensitivity(scalars, ctx.units)
    if not any(s["linears_seen"] for s in sens.values()):
        raise SearchError("the calibration run logged no numerics/ telemetry; is --numerics-interval reaching "
                          "a logged iteration?")
    # 2. rank: sensitivity per unit of modelled saving, most sensitive first
    saving = {k: 1.0 - ctx.cost({k: cheapest[k]}) for k in ctx.unit_keys}  # the unit alone at its cheapest
    score = {k: (sens[k]["nsr"] if math.isfinite(sens[k]["nsr"]) else math.inf) / max(saving[k], 1e-12)
             for k in ctx.unit_keys}
    priority = sorted(ctx.unit_keys, key=lambda k: -score[k])

    # 3. probes
    done = []

    def evaluate(levels):
        pid, runs = plan_runs(levels, numerics=levels == cheapest)
        done.append(pid)
        print(f"probe {len(done)} of at most {max_probes} ({pid}): {ctx.describe(levels)}", flush=True)
        ctx.execute(runs)
        sample, per_seed = ctx.sample(runs, base_runs, iters)
        records[pid] = {"plan_id": pid, "levels": {k: v for k, v in levels.items() if v}, "per_seed": per_seed,
                        "cost_ratio": ctx.cost(levels)}
        (out / "probes.json").write_text(json.dumps(list(records.values()), indent=1))
        print(f"  per-seed gaps {', '.join(pct(g) for g in sample.gaps)}, modelled cost {ctx.cost(levels):.3f} x "
              "baseline", flush=True)
        return sample

    full = ctx.pargs.train_iters
    confirm_record = {}

    def confirm(levels):
        plan = ctx.plan(levels)
        cid = ctx.plan_id(plan)
        path = out / "plans" / f"confirm-{cid}.yaml"
        ctx.write_plan(path, plan)
        c_runs = ctx.runs_for(f"confirm-{cid}", str(path), full, seeds=ctx.confirm_seeds)
        cb_runs = ctx.runs_for("baseline-confirm", args.baseline, full, seeds=ctx.confirm_seeds)
        print(f"confirmation: the candidate and the baseline at {full} iterations (--train-iters) on fresh seeds "
              f"{ctx.confirm_seeds}; its bound uses these runs' own spread", flush=True)
        ctx.execute(cb_runs + c_runs)
        sample, per_seed = ctx.sample(c_runs, cb_runs, full)
        confirm_record["per_seed"] = per_seed
        return sample

    groups = layer_groups(ctx.units, ctx.group_layers)
    max_probes = args.max_probes or probe_budget(len(groups), max(len(m) for m in groups.values()),
                                                 max(ctx.n_levels.values()))
    alpha = (1 - args.confidence) / 2
    result = guarded_search(groups, ctx.n_levels, ctx.cost, evaluate, None if args.no_confirm else confirm,
                            ctx.budget, priority, alpha, max_probes)
    for p in result.probes:  # each probe's bound at its share of the error budget
        pid = ctx.plan_id(ctx.plan(dict(p.levels)))
        if pid in records:
            records[pid].update(gap=_iv(p.gap), fits=p.fits, why=p.why)
    (out / "probes.json").write_text(json.dumps(list(records.values()), indent=1))
    delivered = result.candidate if args.no_confirm else result.levels
    chosen = ctx.plan(delivered)
    ref_plan = dict(PrecisionPolicy.from_args(REFERENCE[0], list(REFERENCE[1])).resolve(ctx.names, ctx.num_layers))
    ref_ratio = plan_cost(ctx.shapes, ref_plan, ctx.target, ctx.fused).ratio(ctx.base_cost)
    other = plan_cost(ctx.shapes, ctx.baseline, ctx.target, not ctx.fused)  # the other quantization model
    other_ratios = {"chosen": plan_cost(ctx.shapes, chosen, ctx.target, not ctx.fused).ratio(other),
                    "reference": plan_cost(ctx.shapes, ref_plan, ctx.target, not ctx.fused).ratio(other)}
    ratio = ctx.cost(delivered)

    # 4. the confirmation ran inside guarded_search, on fresh seeds
    plan_path = out / "plan.yaml"
    confirm = None
    if result.confirmation is not None:
        g = result.confirmation
        confirm = {"iterations": full, "seeds": ctx.confirm_seeds, "gap": _iv(g), "fits": result.confirmed,
                   "alpha": result.confirm_alpha, "per_seed": confirm_record.get("per_seed", [])}
    if not any(result.candidate.values()):
        found = "the candidate is the baseline: nothing to confirm (its gap is 0 by construction)"
    elif confirm is None:
        found = "the candidate was NOT confirmed (--no-confirm): no guarantee holds for it"
    else:
        g = confirm["gap"]
        found = (f"confirmation on fresh seeds {ctx.confirm_seeds} at {full} iterations: gap {pct(g['mean'])}, "
                 f"one-sided {1 - result.confirm_alpha:.2%} bound {pct(g['hi'])} -- "
                 + (f"within +{ctx.budget:.2%}" if result.confirmed else
                    f"NOT within +{ctx.budget:.2%}: plan.yaml is the baseline, the candidate is candidate.yaml"))
    print(found, flush=True)
    if any(result.candidate.values()) and not result.confirmed and not args.no_confirm:
        ctx.write_plan(out / "candidate.yaml", ctx.plan(result.candidate),
                       {"levels": {k: v for k, v in result.candidate.items() if v}},
                       header=f"the search's candidate, NOT confirmed: {found}")
    summary = {
        "target": args.target, "baseline": args.baseline, "budget": ctx.budget, "seeds": ctx.seeds,
        "probe_iters": iters, "ladder": ctx.ladder.text(), "granularity": args.granularity,
        "levels": {k: v for k, v in delivered.items() if v}, "cost_ratio": ratio,
        "candidate_levels": {k: v for k, v in result.candidate.items() if v},
        "candidate_cost_ratio": ctx.cost(result.candidate), "confirmed": result.confirmed, "found": found,
        "confirm_seeds": ctx.confirm_seeds, "group_layers": ctx.group_layers, "max_probes": max_probes,
        "alpha": alpha, "probe_alpha": result.probe_alpha,
        "reference": {"plan": f"{REFERENCE[0]} with {', '.join(REFERENCE[1])}", "cost_ratio": ref_ratio},
        "all_cheapest_cost_ratio": ctx.cost(cheapest), "reason": result.reason, "confirmation": confirm,
        "fused_quantization": ctx.fused,
        "other_quantization_model": {"fused": not ctx.fused, **other_ratios},
        "priority": priority, "sensitivity": sens, "saving": saving, "assumptions": ASSUMPTIONS,
        "cost_model_target": ctx.target.description,
    }
    ctx.write_plan(plan_path, chosen, {
        "target": args.target, "baseline": args.baseline, "budget": ctx.budget,
        "cost_ratio_vs_baseline": round(ratio, 4), "cost_ratio_reference": round(ref_ratio, 4),
        "measured_gap": confirm["gap"] if confirm else None, "seeds": ctx.seeds,
        "evidence": f"{out / 'report.md'}",
    }, header=(f"written by launch/search_plan.py: --baseline {args.baseline}, budget +{ctx.budget:.2%} validation "
               f"loss, --target {args.target}\n{found}\nuse: --precision {plan_path}"))
    (out / "search.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "report.md").write_text(report(ctx, summary, result, records, chosen, cal_id))
    return summary


def _iv(gap: Interval) -> dict:
    return {"mean": gap.mean, "lo": gap.lo, "hi": gap.hi, "n": gap.n, "confidence": gap.confidence}


def pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:+.2f}%"


def report(ctx: Context, s: dict, result, records: dict, chosen: dict, cal_id: str) -> str:
    a = ctx.args
    lines = [f"# Plan search: --baseline {a.baseline}, budget +{ctx.budget:.2%}, --target {a.target}", "",
             (f"Seeds {ctx.seeds}, probes of {a.probe_iters} iterations, confirmation at {ctx.pargs.train_iters}; "
             f"ladder `{ctx.ladder.text()}`; units: {a.granularity}; {result.reason}."), "",
             "## Result", "",
             f"- plan: `{ctx.out / 'plan.yaml'}` (`--precision {ctx.out / 'plan.yaml'}`)",
             (f"- predicted linear-GEMM time on {ctx.target.description}: **{s['cost_ratio']:.3f} x** the baseline; "
             f"`{s['reference']['plan']}`: {s['reference']['cost_ratio']:.3f} x; all units at their cheapest "
             f"rung: {s['all_cheapest_cost_ratio']:.3f} x ({'fused' if ctx.fused else 'separate'} quantization "
             f"kernels; with {'separate' if ctx.fused else 'fused'} ones: chosen "
             f"{s['other_quantization_model']['chosen']:.3f} x, reference "
             f"{s['other_quantization_model']['reference']:.3f} x)")]
    lines.append(f"- {s['found']}")
    lines.append(f"- error budget: one-sided {s['alpha']:.2%} in all, {s['alpha'] / 2:.2%} over at most "
                 f"{s['max_probes']} probes ({s['probe_alpha']:.2e} each), {s['alpha'] / 2:.2%} on the confirmation; "
                 f"coarse groups of {s['group_layers']} layers per GEMM first")
    lines.append(f"- what is guaranteed: the delivered plan's true validation gap **at {ctx.pargs.train_iters} "
                 "iterations (--train-iters) on this data** exceeds the budget with probability at most the "
                 "confirmation's share, its bound from the confirmation runs' own spread; nothing is guaranteed "
                 "for a longer or larger production run")
    if s["confirmation"]:
        c = s["confirmation"]
        g = c["gap"]
        lines.append(f"- measured at {c['iterations']} iterations: validation loss {pct(g['mean'])} vs the "
                     f"baseline, {int(g['confidence'] * 100)}% interval [{pct(g['lo'])}, {pct(g['hi'])}] "
                     f"(n={g['n']}): {'within' if c['fits'] else 'NOT within'} the budget")
        for p in c["per_seed"]:
            lines.append(f"  - seed {p['seed']}: {p['val']:.4f} vs {p['baseline_val']:.4f} ({pct(p['rel_gap'])}; "
                         f"val-batch s.e. {pct(p['batch_se'])})")
    lines += ["", "## Units: what each got and why", "",
              ("Sensitivity from the calibration run (the all-cheapest plan, "
              f"`{cal_id}`, seed {ctx.seeds[0]}): nsr = summed noise-to-signal power of the GEMM's two operands "
              "(10^(-SQNR/10)); saving = modelled time saved by the unit alone at its cheapest rung (fraction "
              "of the baseline). Rank 1 is raised first."), "",
              "| rank | unit | chosen | SQNR dB (both operands) | clipped | flushed | saving | decided by |",
              "|---|---|---|---|---|---|---|---|"]
    decided = {}
    for p in result.probes:
        for word in ("raise", "lower"):
            if p.why.startswith(word) and p.why.split()[1] in s["sensitivity"]:
                unit = p.why.split()[1]
                decided.setdefault(unit, []).append(f"{p.why.split(' to ')[0].split()[0]} to rung "
                                                    f"{p.why.split('rung ')[1].split()[0]}: gap hi "
                                                    f"{pct(p.gap.hi)} ({'fits' if p.fits else 'over'})")
    for rank, k in enumerate(s["priority"], 1):
        sv = s["sensitivity"][k]
        lvl = result.levels.get(k, 0)
        rung = ctx.ladder.rungs[Gemm(k.split("/")[1])][lvl]
        why = "; ".join(decided.get(k, [])) or ("all-cheapest plan fit" if lvl == ctx.n_levels[k] - 1
                                                 else "not probed")
        lines.append(f"| {rank} | {k} | {rung}{' (higher)' if lvl < ctx.n_levels[k] - 1 else ''} | "
                     f"{sv['sqnr_db']:.1f} | {sv['clipped']:.2e} | {sv['flushed']:.2e} | {s['saving'][k]:.4f} | "
                     f"{why} |")
    lines += ["", "## Probes (paired by seed with the baseline's probe; gap = val / val_baseline - 1)", "",
              "| plan | move | modelled cost | gap (mean) | interval | fits |", "|---|---|---|---|---|---|"]
    for p in result.probes:
        lines.append(f"| {ctx.plan_id(ctx.plan(dict(p.levels)))} | {p.why} | {p.cost:.3f} | {pct(p.gap.mean)} | "
                     f"[{pct(p.gap.lo)}, {pct(p.gap.hi)}] | {p.fits} |")
    lines += ["", "## Chosen plan", "", "```", PrecisionPolicy.from_args(str(ctx.out / "plan.yaml"))
              .resolve(ctx.names, ctx.num_layers).table(), "```", "",
              "## Cost model assumptions", "", ASSUMPTIONS + ".", "",
              f"Peak rates ({ctx.target.name}): " + ", ".join(f"{k} {v:g} TFLOP/s" for k, v in
                                                           ctx.target.tflops.items())
              + f"; HBM {ctx.target.hbm_tb_s:g} TB/s (sources: precision/cost_model.py)."]
    return "\n".join(lines) + "\n"

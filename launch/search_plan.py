#!/usr/bin/env python
"""Search the cheapest per-layer, per-GEMM precision plan within a loss budget, on a target device.

    python launch/search_plan.py --out runs/plan --baseline bf16 --budget 1% --target b200 \\
        --seeds 0,1 --probe-iters 100 -- --model-size tiny --train-iters 300 --eval-iters 10

Flags after ``--`` are pretrain flags (model, data, iterations) every run gets; ``--train-iters``
there is the *full* length of the confirmation runs, ``--probe-iters`` the length of the probes.
Steps (each run lives in ``OUT/runs/NAME``, as in ``launch/sweep.py``; re-running skips finished
runs, so an interrupted search resumes where it stopped):

1. **calibration**: the all-cheapest plan's probe runs with ``--numerics-interval`` telemetry; per
   unit (layer x GEMM) the operands' SQNR, clipped and flushed fractions give its sensitivity;
2. **rank** the units by sensitivity per unit of modelled cost saving (``precision.cost_model``);
3. **probes** of candidate plans, most sensitive unit first (``pretrain.plan_search``), each paired
   by seed with the baseline's probe; a plan fits when the upper bound of its relative validation
   loss gap (Student-t over seeds; with one seed, the validation batches' paired s.e.) is within
   ``--budget``;
   The units are searched coarse first: per GEMM, groups of ``--group-layers`` consecutive layers
   (``layers0-7/wgrad``), then, inside each group kept above its cheapest rung, a bisection over its
   layers (least sensitive first). One error budget, ``alpha = (1 - --confidence) / 2`` (one-sided),
   is spent over every test: half over the probes (each bound at ``alpha / 2 / --max-probes``; the
   default ``--max-probes`` is the search's worst case), half on the confirmation. With two or more
   seeds a gap's spread is pooled over every plan measured (``pretrain.plan_search.SpentBounds``);
4. **confirmation** on seeds no probe used (``--confirm-seeds``, default as many as ``--seeds``
   after the largest): the candidate and the baseline at full length. Only a confirmed candidate
   becomes ``plan.yaml``; unconfirmed, ``plan.yaml`` is the baseline and ``candidate.yaml`` the
   candidate, and both files and ``report.md`` say what the confirmation measured (exit status 1).

How many probe runs: with the default 4 groups per GEMM (``--group-layers`` = layers / 4) and the
default 3-rung ladder, a 32-layer model's search runs at most ``1 + 12 x 3 + 12 x 2 x 4 = 133``
probes (the simulation in ``tests/launch/test_plan_search_guarantee.py``, 2 rungs and 12 groups of
8 units, ran 53 of its at most 73 on average), each of ``len(--seeds)`` runs of
``--probe-iters``, plus the calibration, the baseline's probe and ``2 x len(--confirm-seeds)``
full-length confirmation runs.

Output in ``OUT``: ``plan.yaml`` (``--precision OUT/plan.yaml`` takes it), ``report.md`` (which
units stayed in higher precision and why, predicted cost ratios against the baseline and against
``wgrad_hadamard`` with BF16 edge layers, the measured loss delta with its interval),
``probes.json`` (every probe) and ``plans/`` (one plan file per probe).
"""

from __future__ import annotations

import argparse
import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

from launch.sweep import split_passthrough
from precision import SpecError
from precision.cost_model import target_names
from pretrain.plan_search import DEFAULT_LADDER, GRANULARITIES
from pretrain.plan_search_run import Context, SearchError, pct, search


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (runs, plan.yaml, report.md, probes.json)")
    ap.add_argument("--baseline", default="bf16", help="the plan gaps are measured against: a preset, spec or "
                    "plan file (default bf16)")
    ap.add_argument("--budget", default="1%", help="relative validation-loss budget: plan <= baseline x (1 + "
                    "budget) at the same tokens, on the gap interval's upper bound (default 1%%)")
    ap.add_argument("--target", default="b200", choices=target_names(), help="device of the cost model")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds; every plan is paired with the "
                    "baseline by seed (default 0,1)")
    ap.add_argument("--ladder", default=DEFAULT_LADDER, help="per GEMM, recipes most precise first, e.g. "
                    f"'{DEFAULT_LADDER}'; each starts at the baseline's recipe")
    ap.add_argument("--granularity", default="layer-gemm", choices=GRANULARITIES,
                    help="a search unit: one GEMM of a transformer layer's linears (layer-gemm), of one linear, "
                    "or of every linear (gemm); the output layer keeps the baseline")
    ap.add_argument("--probe-iters", type=int, required=True, help="iterations of each probe run")
    ap.add_argument("--numerics-interval", type=int, default=10, help="telemetry interval of the calibration")
    ap.add_argument("--max-probes", type=int, default=None, help="at most this many candidate plans; the probes' "
                    "error budget is split over this many (default: the search's worst case)")
    ap.add_argument("--confirm-seeds", default=None, help="comma-separated seeds of the confirmation, none of them "
                    "in --seeds (default: as many as --seeds, after the largest)")
    ap.add_argument("--group-layers", type=int, default=None, help="coarse stage: per GEMM, groups of this many "
                    "consecutive layers, searched before single layers (default: a quarter of the layers; 1: "
                    "single layers only)")
    ap.add_argument("--confidence", type=float, default=0.95, help="two-sided interval level (default 0.95)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="processes per run (default 1)")
    ap.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary for the output layer's "
                    "cost (default: the built-in corpus's 4096; required with --tokenizer-model)")
    ap.add_argument("--fused-quantization", action="store_true", help="cost model: quantization fused into the "
                    "kernel producing each operand (only codes + scales are written; no BF16 read, amax or "
                    "rotation pass); default: separate quantization kernels")
    ap.add_argument("--no-confirm", action="store_true", help="skip the full-length confirmation runs")
    return ap


def main(argv=None) -> int:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        ctx = Context(args, extra)
        s = search(ctx)
    except (SearchError, SpecError) as e:
        print(f"search_plan.py: error: {e}", file=sys.stderr)
        return 2
    c = s["confirmation"]
    print(f"plan: {ctx.out / 'plan.yaml'} | modelled cost {s['cost_ratio']:.3f} x baseline "
          f"({s['reference']['plan']}: {s['reference']['cost_ratio']:.3f} x) | "
          + (f"confirmed gap {pct(c['gap']['mean'])} [{pct(c['gap']['lo'])}, {pct(c['gap']['hi'])}]"
             if c else "no confirmation") + f" | report: {ctx.out / 'report.md'}")
    return 0 if (c is None or c["fits"]) else 1  # an unconfirmed candidate: status 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Ablation sweeps over precision presets or the per-GEMM precision matrix, with seeds and intervals.

    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --parallel 2 -- --train-iters 50
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --slurm   # a SLURM job array
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --collect # tables + plots only

A sweep file (YAML)::

    base:                       # pretrain flags every run gets (Megatron-LM names, no leading --)
      model-size: tiny
      train-iters: 300
    nproc-per-node: 2           # processes per run (torchrun); default 1
    seeds: [0, 1, 2]            # every grid point is run once per seed (default: one run, base seed)
                                # ('{seed}' in a base or grid value becomes the run's seed, e.g. a
                                #  per-seed pretrained-checkpoint: runs/start/runs/start__seed-{seed}/checkpoints)
    baseline: fp8               # the precision the gaps and "extra tokens" are measured against
    equivalence_margin: 0.01    # optional: a val-loss gap inside +-0.01 may be shown "equivalent" (TOST)
    descent_steps: [8, 40]      # optional: compare during the descent (noise-free, --fixed-train-set runs)
    contrasts: [[wgrad_hadamard, mxfp4]]   # optional: a against b, paired by seed, in the same tables
    published: {source: arXiv 2605.09825, extra_tokens: {mxfp4: "+26-27%"}}  # printed beside it
    smooth: 300                 # optional: the training-loss window of the extra-tokens curves (default 10)
    grid:
      presets: [bf16, fp8, mxfp4_fprop, wgrad_hadamard, {fprop_only: "base=bf16,fprop=mxfp4"}]
      lr: [6e-4, 1e-3, 2e-3]    # any other key is a pretrain flag to range over (hyper-parameters)
    # or the per-GEMM matrix (every combination is one grid point):
    # grid:
    #   fprop: [fp8, mxfp4]
    #   dgrad: [fp8, mxfp4]
    #   wgrad: [fp8, mxfp4, mxfp4+sr, mxfp4+had16, mxfp4+rht16]
    # precision schedules (--precision-schedule), beside or instead of presets:
    #   schedules: [{fp8_warm: "0:fp8,100:mxfp4"}, {bf16_tail: "0:nvfp4,900:bf16"}]
    # or treatments: labelled flag sets, when a grid point is more than a precision:
    #   treatments: [{fp4_tis: {rollout-precision: mxfp4, rollout-correction: tis}}]

``script: rl`` runs ``launch/rl.py`` (RL post-training with FP4 rollouts) instead of
``pretrain.py``: base flags and treatments are rl.py's, the baseline is a treatment (e.g. BF16
rollouts), and the results are held-out accuracy, the area under the reward curve, the
trainer-vs-rollout mismatch and rollout speed and memory (``pretrain.rl.sweep_results``; plot
``OUT/rl_curves.png``); ``configs/sweeps/fp4_rollout.yaml`` is one.

Flags after ``--`` are appended to every run's command line (e.g. a smaller model, fewer
iterations). Each run lives in ``OUT/runs/NAME/`` (``train.log``, ``tensorboard/``,
``checkpoints/``, ``status.json``). Re-running the sweep skips finished runs and restarts failed
or interrupted ones (resuming from their last checkpoint); diverged runs (``pretrain.py`` wrote
``checkpoints/run_status.json`` with state ``diverged``) are a result and are not re-run unless
``--retry-diverged``. Results: ``OUT/results.csv`` (one row per run), ``OUT/summary.csv`` (one row
per grid point), ``OUT/results.md``, ``OUT/loss_curves.png``, ``OUT/loss_gap_curves.png`` (the paired
difference to the baseline over iterations), ``OUT/gap.png``.

How far to trust a gap (``pretrain.evaluation.stats``): runs with the same seed share their
initialization and data order, so each precision's gap to the baseline is **paired** by seed; the
tables give its mean over seeds with a 95% Student-t interval (unadjusted) and a verdict that is
Holm-adjusted over the table's comparisons: *worse*/*better*, *equivalent (±m)* (two one-sided
tests against the sweep's ``equivalence_margin``; the only verdict that means "no cost beyond m"),
*not shown to differ*, or *diverged in k of n seeds* (a diverged seed is never averaged away). The
validation loss's own sampling noise (its standard error over validation batches, and the paired
standard error of the gap) is reported beside it. With a hyper-parameter in the grid, a second
table compares every precision at its own best value (lowest mean validation loss over seeds),
since a precision's cost depends on e.g. the learning rate; its best values are chosen on the same
seeds its intervals use, which the table says.

With ``descent_steps: [first, last]`` the runs are also compared *during the descent*, on their
unsmoothed training losses: at every step s of the window, the step at which a run first reaches the
baseline's loss at s, in % more than s, averaged over the window, beside the mean excess loss
(``pretrain.evaluation.extra_tokens.descent_gap``). This is the comparison of a noise-free design
(``--fixed-train-set N`` with ``--global-batch-size N``: every step's gradient is exact), where runs
end memorizing the set and final losses no longer tell them apart; ``contrasts`` adds paired
comparisons between two treatments to that table, and every column's verdicts are Holm-adjusted over
all its comparisons (``OUT/descent.csv``; ``configs/sweeps/mxfp4_fullbatch_cpu.yaml`` is one). With
or without ``descent_steps``, ``contrasts`` also add rows ``a vs b`` to the end-of-run table (final
validation loss gap, extra tokens; same seed and hyper-parameters), inside its Holm adjustment
(``configs/sweeps/mxfp4_longhorizon_cpu.yaml`` asks whether the Hadamard recovers MXFP4 Wgrad's cost
this way).

"Extra tokens" is the study's metric (``pretrain.evaluation.extra_tokens``): how many more training
tokens a precision needs than the baseline for the same loss, in percent, both ways -- for a worse
run the step at which the baseline reached the run's final smoothed loss, for a better one the
step at which the run reached the baseline's -- and, beside it, the ratio from a fitted
``L(D) = E + A*D^-alpha`` per run at the baseline's final loss (marked when extrapolated). Runs
share the batch size and sequence length, so the ratio of iterations is the ratio of tokens. It is
paired by seed as well; a seed whose value is only a lower bound makes the mean a lower bound.

The library behind this command is ``pretrain.sweep``: ``spec`` (the sweep file and its grid),
``runner`` (status files, local and SLURM execution), ``results`` (TensorBoard reading and the
statistics) and ``report`` (tables and plots); this module keeps their names importable from here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

# The sweep's names stay importable from here (``import sweep`` with launch/ on the path).
from pretrain.sweep.plots import paired_gap_curve, write_plots
from pretrain.sweep.report import (
    COLUMNS,
    SUMMARY_COLUMNS,
    SUMMARY_EXTRA_COLUMNS,
    collect,
    collect_rl,
    summary_table,
    write_tables,
)
from pretrain.sweep.results import (
    analyse,
    best_points,
    extra_tokens_pct,
    fitted_extra_tokens_pct,
    read_scalars,
    read_val_batches,
    smooth,
    summarize,
    verdict,
)
from pretrain.sweep.runner import (
    RUN_STATUS_FILE,
    _todo,
    finish_run,
    read_status,
    run_command,
    run_dir,
    run_local,
    run_one,
    start_run,
    submit_slurm,
    write_status,
)
from pretrain.sweep.spec import (
    GEMMS,
    POINT_KEYS,
    RESERVED_FLAGS,
    SCRIPTS,
    SMOOTH_DEFAULT,
    SWEEP_KEYS,
    Run,
    SweepError,
    expand_runs,
    load_sweep,
)

__all__ = ["COLUMNS", "GEMMS", "POINT_KEYS", "RESERVED_FLAGS", "RUN_STATUS_FILE", "SCRIPTS", "SUMMARY_COLUMNS",
           "SUMMARY_EXTRA_COLUMNS", "SWEEP_KEYS", "Run", "SweepError", "_todo", "analyse", "best_points", "collect",
           "collect_rl", "expand_runs", "extra_tokens_pct", "finish_run", "fitted_extra_tokens_pct", "load_sweep",
           "main", "paired_gap_curve", "read_scalars", "read_status", "read_val_batches", "run_command", "run_dir",
           "run_local", "run_one", "smooth", "split_passthrough", "start_run", "submit_slurm", "summarize",
           "summary_table", "verdict", "write_plots", "write_status", "write_tables"]


# ---------------------------------------------------------------- CLI
def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(own arguments, flags after a bare --)``: the latter go to every run's command line."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv=None) -> int:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="sweep YAML file (see configs/sweeps/)")
    ap.add_argument("--out", required=True, help="output directory of the sweep")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time, locally (default 1)")
    ap.add_argument("--slurm", action="store_true", help="submit a SLURM job array instead of running locally")
    ap.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument (repeatable)")
    ap.add_argument("--collect", action="store_true", help="only collect results from existing runs")
    ap.add_argument("--retry-diverged", action="store_true",
                    help="run diverged runs again (by default divergence is a result and is kept)")
    ap.add_argument("--run-index", type=int, help=argparse.SUPPRESS)  # one run (SLURM array task)
    ap.add_argument("--smooth", type=int, default=None,
                    help="loss smoothing window in logged points (default: the sweep file's smooth:, else 10)")
    args = ap.parse_args(argv)
    try:
        if args.parallel < 1:
            raise SweepError(f"--parallel {args.parallel}: must be >= 1")
        sweep = load_sweep(args.sweep)
        runs = expand_runs(sweep, args.sweep)
        nproc = int(sweep.get("nproc-per-node", 1))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps({"sweep": sweep, "extra": extra,
                                                    "runs": [r.__dict__ for r in runs]}, indent=1))
        if args.run_index is not None:
            return run_one(out, runs, args.run_index, nproc, extra)
        if args.slurm:
            return submit_slurm(args.sweep, out, runs, extra, args.sbatch_arg, args.retry_diverged)
        failed = 0
        if not args.collect:
            seeds = sweep.get("seeds")
            print(f"sweep {args.sweep}: {len(runs)} runs ({len(runs) // len(seeds or [0])} grid points x "
                  f"{len(seeds or [0])} seed(s)), {args.parallel} at a time, {nproc} process(es) each")
            failed = run_local(out, runs, nproc, args.parallel, extra, args.retry_diverged)
        window = args.smooth or sweep.get("smooth", SMOOTH_DEFAULT)
        collect(out, runs, sweep.get("baseline"), window, sweep.get("equivalence_margin"),
                sweep.get("descent_steps"), sweep.get("published"), sweep.get("contrasts"))
        plots = ([out / "rl_curves.png"] if runs and runs[0].script == "rl"
                 else [out / "loss_curves.png", out / "loss_gap_curves.png", out / "gap.png"])
        print(f"results: {out / 'results.md'}, {out / 'results.csv'}, {out / 'summary.csv'}, plots: "
              + ", ".join(map(str, plots)))
        return 1 if failed else 0
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

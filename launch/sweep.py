#!/usr/bin/env python
"""Ablation sweeps over precision presets or the per-GEMM precision matrix, with seeds and intervals.

    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --parallel 2 -- --train-iters 100
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --slurm   # a SLURM job array
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --collect # tables + plots only

The sweep file's keys, the runs' layout under ``--out``, run identities, the statistics and the
extra-tokens metric are described in ``docs/sweeps.md``. Every run's flags go through ``pretrain.py``'s
(or ``rl.py``'s) parser and validation before any run starts. The library behind this command is
``pretrain.sweep`` (``spec``, ``runner``, ``results``, ``report``, ``cli``); this module keeps their
names importable from here.
"""

from __future__ import annotations

import argparse
import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

# The sweep's names stay importable from here (``import sweep`` with launch/ on the path).
from pretrain.sweep.cli import run_sweep
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
    ap.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                    help="run only these of the sweep file's seeds (a piece of a long sweep; the same runs, "
                         "names and --out as the whole, which a later call completes); the report covers "
                         "every finished run")
    ap.add_argument("--run-index", type=int, help=argparse.SUPPRESS)  # one run (SLURM array task)
    ap.add_argument("--smooth", type=int, default=None,
                    help="loss smoothing window in logged points (default: the sweep file's smooth:, else 10)")
    args = ap.parse_args(argv)
    try:
        return run_sweep(args, extra)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())

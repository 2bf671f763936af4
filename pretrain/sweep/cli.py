"""What ``launch/sweep.py`` does with its parsed arguments, in order: read the sweep file and expand
its runs (``spec``); refuse, before any run starts, a run whose flags its script refuses or whose
directory under ``--out`` was made by other flags (``runner``); run the unfinished runs locally,
printing each one's last training loss and the whole sweep's ETA as it finishes, or submit them as a
SLURM job array (``runner``); collect the tables and plots (``report``)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from pretrain.sweep.report import collect
from pretrain.sweep.results import read_scalars
from pretrain.sweep.runner import (
    _todo,
    changed_runs,
    run_dir,
    run_local,
    run_one,
    submit_slurm,
    validate_runs,
)
from pretrain.sweep.spec import SMOOTH_DEFAULT, Run, SweepError, expand_runs, load_sweep
from pretrain.trainer.tags import LOSS, series

__all__ = ["Progress", "run_sweep"]


class Progress:
    """``on_finish`` for ``runner.run_local``: a finished run's last training loss and the ETA of the
    runs left, from the mean duration of the runs finished so far in this invocation."""

    def __init__(self, out: Path, todo: int, parallel: int):
        self.out, self.left, self.parallel, self.took = out, todo, parallel, []

    def __call__(self, run: Run, state: str, seconds: float) -> str:
        self.took.append(seconds)
        self.left -= 1
        loss = series(read_scalars(run_dir(self.out, run) / "tensorboard"), LOSS)
        text = f", last loss {loss[-1][1]:.4f} at iteration {loss[-1][0]}" if loss else ""
        if self.left > 0:
            eta = sum(self.took) / len(self.took) * math.ceil(self.left / self.parallel)
            text += f"; {self.left} run(s) left, ETA {_hms(eta)}"
        return text


def _hms(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def run_sweep(args: argparse.Namespace, extra: list[str]) -> int:
    """``launch/sweep.py``'s work (its flags in ``args``, the flags after ``--`` in ``extra``); the exit
    status. A ``SweepError`` is one line for the caller to print."""
    if args.parallel < 1:
        raise SweepError(f"--parallel {args.parallel}: must be >= 1")
    sweep = load_sweep(args.sweep)
    runs = expand_runs(sweep, args.sweep)
    nproc = int(sweep.get("nproc-per-node", 1))
    out = Path(args.out)
    if changed := changed_runs(out, runs, nproc, extra):
        run, what = changed[0]
        raise SweepError(f"{args.sweep}: run {run.name} in --out {out} ran with other flags ({what}; "
                         f"{len(changed)} run(s) changed); give a new --out for the edited sweep, or remove "
                         f"{run_dir(out, run)} to run it again")
    chosen = runs if args.run_index is None else runs[args.run_index:args.run_index + 1]
    piece = runs  # what this call runs: the whole sweep, or the --seeds piece of it
    if args.seeds is not None:
        declared = sweep.get("seeds") or []
        if unknown := [s for s in args.seeds if s not in declared]:
            raise SweepError(f"--seeds {' '.join(map(str, unknown))}: not among {args.sweep}'s seeds "
                             f"({', '.join(map(str, declared)) or 'none declared'})")
        if args.slurm or args.run_index is not None:
            raise SweepError("--seeds runs a piece locally; give --slurm the whole sweep file")
        chosen = piece = [r for r in runs if r.seed in args.seeds]
    if not args.collect:  # the runs still to run (a finished run is not started again)
        pending = _todo(out, runs, args.retry_diverged)[0]
        validate_runs(out, [r for r in chosen if r in pending], nproc, extra)
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
              f"{len(seeds or [0])} seed(s)), {args.parallel} at a time, {nproc} process(es) each"
              + (f"; this piece: seed(s) {' '.join(map(str, args.seeds))}, {len(piece)} runs" if piece is not runs
                 else ""))
        todo = len(_todo(out, piece, args.retry_diverged)[0])
        t0 = time.time()
        failed = run_local(out, piece, nproc, args.parallel, extra, args.retry_diverged,
                           on_finish=Progress(out, todo, args.parallel))
        if todo:
            print(f"{todo} run(s) in {_hms(time.time() - t0)}")
    window = args.smooth or sweep.get("smooth", SMOOTH_DEFAULT)
    collect(out, runs, sweep.get("baseline"), window, sweep.get("equivalence_margin"),
            sweep.get("descent_steps"), sweep.get("published"), sweep.get("contrasts"))
    plots = ([out / "rl_curves.png"] if runs and runs[0].script == "rl"
             else [out / "loss_curves.png", out / "loss_gap_curves.png", out / "gap.png"])
    print(f"results: {out / 'results.md'}, {out / 'results.csv'}, {out / 'summary.csv'}, plots: "
          + ", ".join(map(str, plots)))
    return 1 if failed else 0

#!/usr/bin/env python
"""Ablation sweeps over precision presets or the per-GEMM precision matrix.

    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --parallel 2 -- --train-iters 50
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --slurm   # a SLURM job array
    python launch/sweep.py configs/sweeps/mxfp4_study.yaml --out runs/study --collect # tables + plots only

A sweep file (YAML)::

    base:                       # pretrain flags every run gets (Megatron-LM names, no leading --)
      model-size: tiny
      train-iters: 300
    nproc-per-node: 2           # processes per run (torchrun); default 1
    baseline: fp8               # the run the gaps and "extra tokens" are measured against
    grid:
      presets: [bf16, fp8, mxfp4_fprop, wgrad_hadamard]
    # or the per-GEMM matrix (every combination is one run):
    # grid:
    #   fprop: [fp8, mxfp4]
    #   dgrad: [fp8, mxfp4]
    #   wgrad: [fp8, mxfp4, mxfp4+sr, mxfp4+had16, mxfp4+rht16]

Flags after ``--`` are appended to every run's command line (e.g. a smaller model, fewer
iterations). Each run lives in ``OUT/runs/NAME/`` (``train.log``, ``tensorboard/``,
``checkpoints/``, ``status.json``). Re-running the sweep skips finished runs and restarts failed
or interrupted ones (resuming from their last checkpoint). Results: ``OUT/results.csv``,
``OUT/results.md``, ``OUT/loss_curves.png``, ``OUT/gap.png``.

"Extra tokens" is the study's metric: how many more training tokens a run needs than the baseline
to reach the baseline's final (smoothed) training loss, in percent; runs share the batch size and
sequence length, so the ratio of iterations is the ratio of tokens.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GEMMS = ("fprop", "dgrad", "wgrad")
SWEEP_KEYS = {"base", "grid", "baseline", "nproc-per-node", "name", "description"}


class SweepError(ValueError):
    """A bad sweep file or flag; the message names the file/key and what is valid."""


@dataclass
class Run:
    name: str
    precision: str
    flags: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- sweep file
def load_sweep(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file {path}: not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"sweep file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SweepError(f"sweep file {path}: expected a mapping with keys {', '.join(sorted(SWEEP_KEYS))}")
    unknown = sorted(set(data) - SWEEP_KEYS)
    if unknown:
        raise SweepError(f"sweep file {path}: unknown key(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(sorted(SWEEP_KEYS))}")
    if "grid" not in data or not isinstance(data["grid"], dict):
        raise SweepError(f"sweep file {path}: 'grid' must map 'presets' or fprop/dgrad/wgrad to lists")
    return data


def _flags_from_mapping(base) -> list[str]:
    if base is None:
        return []
    if isinstance(base, list):
        return [str(v) for v in base]
    flags = []
    for k, v in base.items():
        if v is True:
            flags.append(f"--{k}")
        elif v is False or v is None:
            continue
        elif isinstance(v, list):
            for item in v:
                flags += [f"--{k}", str(item)]
        else:
            flags += [f"--{k}", str(v)]
    return flags


def expand_runs(sweep: dict, path: str = "sweep") -> list[Run]:
    """The runs of a sweep, in a stable order, each with a validated precision."""
    from precision import LinearPrecision, SpecError, presets
    from precision.recipe import parse_gemm, Gemm

    grid = sweep["grid"]
    base = _flags_from_mapping(sweep.get("base"))
    runs: list[Run] = []
    if "presets" in grid:
        extra = sorted(set(grid) - {"presets"})
        if extra:
            raise SweepError(f"{path}: grid mixes 'presets' with {', '.join(extra)}; use one or the other")
        for name in grid["presets"]:
            try:
                presets.get(name)
            except ValueError as e:
                raise SweepError(f"{path}: grid.presets: {e}") from None
            runs.append(Run(name, name, base))
    else:
        bad = sorted(set(grid) - set(GEMMS))
        if bad:
            raise SweepError(f"{path}: grid key(s) {', '.join(bad)}; valid: presets, fprop, dgrad, wgrad")
        lists = []
        for g in GEMMS:
            values = grid.get(g, ["fp8"])
            for v in values:
                try:
                    parse_gemm(str(v), Gemm(g))
                except SpecError as e:
                    raise SweepError(f"{path}: grid.{g}: {e}") from None
            lists.append([str(v) for v in values])
        for combo in itertools.product(*lists):
            spec = ",".join(f"{g}={v}" for g, v in zip(GEMMS, combo))
            LinearPrecision.parse(spec)
            name = "__".join(f"{g}-{v}" for g, v in zip(GEMMS, combo)).replace("+", "_").replace("@", "x")
            runs.append(Run(name, spec, base))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SweepError(f"{path}: the grid has duplicate runs")
    baseline = sweep.get("baseline")
    if baseline is not None and baseline not in names:
        raise SweepError(f"{path}: baseline {baseline!r} is not one of the runs: {', '.join(names)}")
    return runs


# ---------------------------------------------------------------- running
def run_dir(out: Path, run: Run) -> Path:
    return out / "runs" / run.name


def read_status(out: Path, run: Run) -> str:
    f = run_dir(out, run) / "status.json"
    if not f.exists():
        return "pending"
    try:
        return json.loads(f.read_text()).get("state", "pending")
    except json.JSONDecodeError:
        return "pending"


def write_status(d: Path, **info) -> None:
    tmp = d / "status.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, d / "status.json")


def run_command(out: Path, run: Run, nproc: int, extra: list[str]) -> list[str]:
    d = run_dir(out, run)
    ckpt = d / "checkpoints"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "launch" / "pretrain.py"), *run.flags, "--precision", run.precision,
           "--tensorboard-dir", str(d / "tensorboard"), "--save", str(ckpt), *extra]
    if (ckpt / "latest_checkpointed_iteration.txt").exists():
        cmd += ["--load", str(ckpt)]  # a restarted run resumes where it stopped
    return cmd


def start_run(out: Path, run: Run, nproc: int, extra: list[str]) -> subprocess.Popen:
    d = run_dir(out, run)
    d.mkdir(parents=True, exist_ok=True)
    cmd = run_command(out, run, nproc, extra)
    write_status(d, state="running", command=shlex.join(cmd), started=time.time())
    log = open(d / "train.log", "a")
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def run_local(out: Path, runs: list[Run], nproc: int, parallel: int, extra: list[str]) -> int:
    todo = [r for r in runs if read_status(out, r) != "done"]
    skipped = len(runs) - len(todo)
    if skipped:
        print(f"skipping {skipped} finished run(s)")
    running: dict[str, tuple[Run, subprocess.Popen, float]] = {}
    failed = 0
    done = skipped
    while todo or running:
        while todo and len(running) < parallel:
            r = todo.pop(0)
            running[r.name] = (r, start_run(out, r, nproc, extra), time.time())
        time.sleep(1.0)
        for name, (r, proc, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[name]
            state = "done" if rc == 0 else "failed"
            done += rc == 0
            failed += rc != 0
            write_status(run_dir(out, r), state=state, returncode=rc, seconds=round(time.time() - t0, 1))
            print(f"[{state}] {name} ({time.time() - t0:.0f}s)" +
                  ("" if rc == 0 else f" -- see {run_dir(out, r) / 'train.log'}"))
        print(f"\rruns: {done} done, {len(running)} running, {failed} failed, {len(todo)} pending   ",
              end="", flush=True)
    print()
    return failed


def submit_slurm(sweep_path: str, out: Path, runs: list[Run], extra: list[str], sbatch_args: list[str]) -> int:
    todo = [i for i, r in enumerate(runs) if read_status(out, r) != "done"]
    if not todo:
        print("all runs finished; nothing to submit")
        return 0
    (out / "slurm").mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", f"--array={','.join(map(str, todo))}", "--output", str(out / "slurm" / "%A_%a.out"),
           *sbatch_args, str(ROOT / "launch" / "slurm" / "sweep_array.sbatch"), sweep_path, str(out), "--", *extra]
    print("$", shlex.join(cmd))
    return subprocess.call(cmd)


def run_one(out: Path, runs: list[Run], index: int, nproc: int, extra: list[str]) -> int:
    """One run of the sweep in this process's allocation (used by the SLURM job array)."""
    if not 0 <= index < len(runs):
        raise SweepError(f"--run-index {index}: valid 0..{len(runs) - 1}")
    r = runs[index]
    t0 = time.time()
    proc = start_run(out, r, nproc, extra)
    rc = proc.wait()
    write_status(run_dir(out, r), state="done" if rc == 0 else "failed", returncode=rc,
                 seconds=round(time.time() - t0, 1))
    return rc


# ---------------------------------------------------------------- results
def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                out.setdefault(tag, {})[e.step] = e.value  # later files win (resumed runs)
    return {t: sorted(v.items()) for t, v in out.items()}


def smooth(values: list[float], window: int) -> list[float]:
    res, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        res.append(sum(acc) / len(acc))
    return res


def analyse(name: str, scalars: dict, window: int) -> dict:
    loss = scalars.get("train/loss", [])
    steps = [s for s, _ in loss]
    vals = [v for _, v in loss]
    finite = [v for v in vals if math.isfinite(v)]
    sm = smooth(finite, window) if finite else []
    diverged = len(finite) < len(vals)
    spike = False
    if len(sm) > 2 * window:
        best = min(sm[: len(sm) // 2])
        spike = any(v > 1.5 * best for v in sm[len(sm) // 2:])
    val = scalars.get("val/loss", [])
    tps = [v for _, v in scalars.get("train/tokens_per_sec", [])]
    return {
        "run": name,
        "iterations": steps[-1] if steps else 0,
        "final_train_loss": sm[-1] if sm else float("nan"),
        "final_val_loss": val[-1][1] if val else float("nan"),
        "tokens_per_sec": sum(tps) / len(tps) if tps else float("nan"),
        "diverged": diverged,
        "spike": spike,
        "_curve": (steps[: len(sm)], sm),
    }


def extra_tokens_pct(run_curve, base_curve) -> float:
    """% more iterations the run needs to reach the baseline's final smoothed loss (inf if never)."""
    bs, bl = base_curve
    rs, rl = run_curve
    if not bl or not rl:
        return float("nan")
    target, base_steps = bl[-1], bs[-1]
    for s, v in zip(rs, rl):
        if v <= target:
            return 100.0 * (s - base_steps) / base_steps
    return float("inf")


def collect(out: Path, runs: list[Run], baseline: str | None, window: int = 10) -> list[dict]:
    rows = []
    for r in runs:
        tb = run_dir(out, r) / "tensorboard"
        row = analyse(r.name, read_scalars(tb) if tb.exists() else {}, window)
        row["precision"] = r.precision
        row["status"] = read_status(out, r)
        rows.append(row)
    base = next((row for row in rows if row["run"] == baseline), None)
    for row in rows:
        if base is not None:
            row["gap_train_loss"] = row["final_train_loss"] - base["final_train_loss"]
            row["gap_val_loss"] = row["final_val_loss"] - base["final_val_loss"]
            row["extra_tokens_pct"] = extra_tokens_pct(row["_curve"], base["_curve"])
        else:
            row["gap_train_loss"] = row["gap_val_loss"] = row["extra_tokens_pct"] = float("nan")
    write_tables(out, rows, baseline)
    write_plots(out, rows, baseline)
    return rows


COLUMNS = ["run", "status", "precision", "iterations", "final_train_loss", "final_val_loss", "gap_train_loss",
           "gap_val_loss", "extra_tokens_pct", "diverged", "spike", "tokens_per_sec"]


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "not reached"
        return f"{v:.4f}"
    return str(v)


def write_tables(out: Path, rows: list[dict], baseline: str | None) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for row in rows:
            w.writerow([row[c] for c in COLUMNS])
    lines = [f"# Sweep results ({len(rows)} runs, baseline: {baseline or 'none'})", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "/") for c in COLUMNS) + " |")
    lines += ["", "extra_tokens_pct: % more tokens than the baseline to reach the baseline's final smoothed "
              "training loss ('not reached' within the run). diverged: a NaN/Inf loss; spike: the smoothed loss "
              "rose above 1.5x its early minimum in the second half."]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def write_plots(out: Path, rows: list[dict], baseline: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        steps, sm = row["_curve"]
        if steps:
            ax.plot(steps, sm, label=row["run"], linewidth=2.5 if row["run"] == baseline else 1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (smoothed)")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["run"] for r in rows]
    gaps = [0.0 if math.isnan(r["gap_train_loss"]) else r["gap_train_loss"] for r in rows]
    colors = ["tab:red" if r["diverged"] or r["spike"] else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), gaps, color=colors)
    ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=7)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_ylabel(f"final train loss - {baseline or 'baseline'}")
    ax.set_title("Loss gap to the baseline (red: diverged or spiked)")
    fig.tight_layout()
    fig.savefig(out / "gap.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- CLI
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="sweep YAML file (see configs/sweeps/)")
    ap.add_argument("--out", required=True, help="output directory of the sweep")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time, locally (default 1)")
    ap.add_argument("--slurm", action="store_true", help="submit a SLURM job array instead of running locally")
    ap.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument (repeatable)")
    ap.add_argument("--collect", action="store_true", help="only collect results from existing runs")
    ap.add_argument("--run-index", type=int, help=argparse.SUPPRESS)  # one run (SLURM array task)
    ap.add_argument("--smooth", type=int, default=10, help="loss smoothing window in logged points")
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
            return submit_slurm(args.sweep, out, runs, extra, args.sbatch_arg)
        failed = 0
        if not args.collect:
            print(f"sweep {args.sweep}: {len(runs)} runs, {args.parallel} at a time, {nproc} process(es) each")
            failed = run_local(out, runs, nproc, args.parallel, extra)
        collect(out, runs, sweep.get("baseline"), args.smooth)
        print(f"results: {out / 'results.md'}, {out / 'results.csv'}, plots: {out / 'loss_curves.png'}, "
              f"{out / 'gap.png'}")
        return 1 if failed else 0
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

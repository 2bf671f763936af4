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
    baseline: fp8               # the precision the gaps and "extra tokens" are measured against
    equivalence_margin: 0.01    # optional: a val-loss gap inside +-0.01 may be shown "equivalent" (TOST)
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

"Extra tokens" is the study's metric (``pretrain.evaluation.extra_tokens``): how many more training
tokens a precision needs than the baseline for the same loss, in percent, both ways -- for a worse
run the step at which the baseline reached the run's final smoothed loss, for a better one the
step at which the run reached the baseline's -- and, beside it, the ratio from a fitted
``L(D) = E + A*D^-alpha`` per run at the baseline's final loss (marked when extrapolated). Runs
share the batch size and sequence length, so the ratio of iterations is the ratio of tokens. It is
paired by seed as well; a seed whose value is only a lower bound makes the mean a lower bound.
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

from launch.sweep_plots import paired_gap_curve, write_plots  # noqa: F401 -- paired_gap_curve: part of this API
from pretrain.evaluation.extra_tokens import (
    ExtraTokens,
    crossing_extra_pct,
    fit_power_law,
    fitted_extra_pct,
    summarize_extra,
)
from pretrain.evaluation.stats import (
    Interval,
    gap_verdict,
    paired_batch_se,
    paired_interval,
    spread,
    table_verdicts,
)

GEMMS = ("fprop", "dgrad", "wgrad")
SWEEP_KEYS = {"base", "grid", "baseline", "nproc-per-node", "name", "description", "seeds", "script",
              "equivalence_margin"}
# What a sweep runs: pretraining (the default) or RL post-training (``script: rl``).
SCRIPTS = {"pretrain": "pretrain.py", "rl": "rl.py"}
# The grid keys that name the runs' precision (or, for treatments, whole flag sets).
POINT_KEYS = ("presets", "schedules", "treatments")
# Flags a grid may not range over: the sweep sets them itself.
RESERVED_FLAGS = {"precision", "precision-schedule", "seed", "save", "load", "tensorboard-dir"}
RUN_STATUS_FILE = "run_status.json"  # written by pretrain.py into --save on divergence


class SweepError(ValueError):
    """A bad sweep file or flag; the message names the file/key and what is valid."""


@dataclass
class Run:
    """One training run: a grid point (precision ``label`` + hyper-parameter ``point``) at one seed."""

    name: str
    precision: str
    flags: list[str] = field(default_factory=list)
    label: str = ""  # the precision's name in tables (a preset name, or the matrix cell's name)
    point: dict = field(default_factory=dict)  # hyper-parameters of the grid, e.g. {"lr": 0.002}
    seed: int | None = None
    precision_flag: str = "--precision"  # or --precision-schedule; "" for a treatment (its flags say all)
    script: str = "pretrain"  # a key of SCRIPTS

    def __post_init__(self):
        self.label = self.label or self.name

    @property
    def group(self) -> str:
        """The grid point (everything but the seed): runs of one group differ only by seed."""
        return _point_name(self.label, self.point)


def _point_name(label: str, point: dict) -> str:
    return "__".join([label, *(f"{k}-{v}" for k, v in point.items())])


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
        raise SweepError(f"sweep file {path}: 'grid' must map presets, schedules, treatments or "
                         f"fprop/dgrad/wgrad to lists")
    script = data.get("script", "pretrain")
    if script not in SCRIPTS:
        raise SweepError(f"sweep file {path}: script {script!r}: valid: {', '.join(SCRIPTS)}")
    seeds = data.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds
                              or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
                              or len(set(seeds)) != len(seeds)):
        raise SweepError(f"sweep file {path}: seeds must be a list of distinct integers, e.g. [0, 1, 2]; "
                         f"got {seeds!r}")
    margin = data.get("equivalence_margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0):
        raise SweepError(f"sweep file {path}: equivalence_margin must be a positive number (a validation-loss "
                         f"gap for pretraining, an accuracy gap for script: rl), e.g. 0.01; got {margin!r}")
    return data


def _flags_from_mapping(base) -> list[str]:
    if base is None:
        return []
    if isinstance(base, list):
        return [str(v) for v in base]
    flags = []
    for k, v in base.items():
        flags += _flag(k, v)
    return flags


def _flag(k: str, v) -> list[str]:
    if v is True:
        return [f"--{k}"]
    if v is False or v is None:
        return []
    if isinstance(v, list):
        return [x for item in v for x in (f"--{k}", str(item))]
    return [f"--{k}", str(v)]


def _pretrain_options() -> set[str]:
    """Every long option ``launch/pretrain.py`` accepts, without the leading ``--``."""
    from pretrain.arguments import build_parser

    return _long_options(build_parser())


def _long_options(parser) -> set[str]:
    return {o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _script_options(script: str) -> set[str]:
    """The long options of the script a sweep runs (``launch/pretrain.py`` or ``launch/rl.py``)."""
    if script == "rl":
        import warnings

        with warnings.catch_warnings():  # megatron-core's import-time notices (apex missing) are no error
            warnings.simplefilter("ignore")
            from pretrain.rl.arguments import build_rl_parser

            return _long_options(build_rl_parser())
    return _pretrain_options()


def _hyper_grid(grid: dict, path: str, script: str = "pretrain") -> list[tuple[str, list]]:
    """The grid's non-precision keys: flags of the script with the values to range over."""
    keys = [k for k in grid if k not in (*POINT_KEYS, *GEMMS)]
    if not keys:
        return []
    options = _script_options(script)
    out = []
    for k in keys:
        if k in RESERVED_FLAGS:
            raise SweepError(f"{path}: grid.{k}: set by the sweep itself"
                             + ("; list seeds under 'seeds:'" if k == "seed" else "")
                             + ("; give precisions under 'presets:' or 'schedules:'" if k.startswith("precision")
                                else ""))
        if k not in options:
            raise SweepError(f"{path}: grid key(s) {k}; valid: {', '.join(POINT_KEYS)}, fprop, dgrad, wgrad, "
                             f"or a {SCRIPTS[script]} flag such as lr (python launch/{SCRIPTS[script]} --help)")
        values = grid[k]
        if not isinstance(values, list) or not values:
            raise SweepError(f"{path}: grid.{k}: expected a non-empty list of values")
        out.append((k, values))
    return out


def _labelled(item, where: str) -> tuple[str, object]:
    """A grid list item: a bare name (its own label) or a one-key mapping ``{label: value}``."""
    if isinstance(item, dict):
        if len(item) != 1:
            raise SweepError(f"{where}: expected a name or a one-key mapping {{label: value}}; got {item!r}")
        label, value = next(iter(item.items()))
        return str(label), value
    return str(item), item


def _treatment_flags(label: str, value, where: str, options: set[str]) -> list[str]:
    """A treatment's flags: a mapping of flag -> value (no leading --)."""
    if not isinstance(value, dict) or not value:
        raise SweepError(f"{where}: {label}: expected a mapping of flags, e.g. {{rollout-precision: mxfp4}}")
    for k in value:
        reserved = k in RESERVED_FLAGS - {"precision", "precision-schedule"}
        if reserved or k not in options:
            raise SweepError(f"{where}: {label}: {k}: " + ("set by the sweep itself" if reserved
                             else "not a flag of the script (see its --help)"))
    return [x for k, v in value.items() for x in _flag(k, v)]


def _precision_points(grid: dict, path: str, script: str = "pretrain") -> list[tuple[str, str, str, list[str]]]:
    """(label, precision, precision flag, extra flags) of every precision point of the grid, in a
    stable order: ``presets`` (a preset or ``{label: per-GEMM spec}``), ``schedules``
    (``{label: --precision-schedule value}``) and ``treatments`` (``{label: {flag: value, ...}}``:
    whole flag sets, e.g. an RL sweep's rollout precision x correction), or the per-GEMM matrix."""
    from precision import LinearPrecision, SpecError, presets
    from precision.recipe import Gemm, parse_gemm

    named = [k for k in POINT_KEYS if k in grid]
    if named:
        extra = sorted(set(grid) & set(GEMMS))
        if extra:
            raise SweepError(f"{path}: grid mixes {'/'.join(named)} with {', '.join(extra)}; use one or the other")
        points = []
        for item in grid.get("presets") or []:
            # a preset name, or {label: per-GEMM spec} for a precision no preset names
            label, spec = _labelled(item, f"{path}: grid.presets")
            try:
                if spec in presets.names():
                    presets.get(spec)
                elif isinstance(item, dict):
                    LinearPrecision.parse(str(spec))
                else:
                    presets.get(str(spec))
            except ValueError as e:
                where = f"grid.presets: {label}" if isinstance(item, dict) else "grid.presets"
                raise SweepError(f"{path}: {where}: {e}") from None
            points.append((label, str(spec), "--precision", []))
        for item in grid.get("schedules") or []:
            from precision.schedule import PrecisionSchedule

            label, text = _labelled(item, f"{path}: grid.schedules")
            try:
                PrecisionSchedule.parse(str(text))
            except ValueError as e:
                raise SweepError(f"{path}: grid.schedules: {label}: {e}") from None
            points.append((label, str(text), "--precision-schedule", []))
        if grid.get("treatments"):
            options = _script_options(script)
            for item in grid["treatments"]:
                label, value = _labelled(item, f"{path}: grid.treatments")
                flags = _treatment_flags(label, value, f"{path}: grid.treatments", options)
                points.append((label, " ".join(flags), "", flags))
        if not points:
            raise SweepError(f"{path}: grid.{named[0]}: expected a non-empty list")
        labels = [p[0] for p in points]
        if len(set(labels)) != len(labels):
            raise SweepError(f"{path}: the grid has duplicate labels: "
                             f"{', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
        return points
    if not set(grid) & set(GEMMS):
        raise SweepError(f"{path}: the grid names no precision: give presets, schedules, treatments, or "
                         f"fprop/dgrad/wgrad")
    lists = []
    for g in GEMMS:
        values = grid.get(g, ["fp8"])
        for v in values:
            try:
                parse_gemm(str(v), Gemm(g))
            except SpecError as e:
                raise SweepError(f"{path}: grid.{g}: {e}") from None
        lists.append([str(v) for v in values])
    points = []
    for combo in itertools.product(*lists):
        spec = ",".join(f"{g}={v}" for g, v in zip(GEMMS, combo))
        LinearPrecision.parse(spec)
        name = "__".join(f"{g}-{v}" for g, v in zip(GEMMS, combo)).replace("+", "_").replace("@", "x")
        points.append((name, spec, "--precision", []))
    return points


def expand_runs(sweep: dict, path: str = "sweep") -> list[Run]:
    """The runs of a sweep, in a stable order (grid points, then seeds), each with a validated precision."""
    grid = sweep["grid"]
    script = sweep.get("script", "pretrain")
    base = _flags_from_mapping(sweep.get("base"))
    hyper = _hyper_grid(grid, path, script)
    seeds = sweep.get("seeds") or [None]
    runs: list[Run] = []
    for label, precision, precision_flag, point_flags in _precision_points(grid, path, script):
        for values in itertools.product(*(v for _, v in hyper)):
            point = {k: v for (k, _), v in zip(hyper, values)}
            flags = base + point_flags + [x for k, v in point.items() for x in _flag(k, v)]
            for seed in seeds:
                name = _point_name(label, point) + ("" if seed is None else f"__seed-{seed}")
                runs.append(Run(name, precision, flags + ([] if seed is None else ["--seed", str(seed)]),
                                label, dict(point), seed, precision_flag, script))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SweepError(f"{path}: the grid has duplicate runs")
    baseline = sweep.get("baseline")
    labels = list(dict.fromkeys(r.label for r in runs))
    if baseline is not None and baseline not in labels:
        raise SweepError(f"{path}: baseline {baseline!r} is not one of the runs: {', '.join(labels)}")
    return runs


# ---------------------------------------------------------------- running
def run_dir(out: Path, run: Run) -> Path:
    return out / "runs" / run.name


def read_status(out: Path, run: Run) -> str:
    """pending | running | done | failed | diverged (pretrain.py's own verdict wins over the exit code)."""
    d = run_dir(out, run)
    diverged = d / "checkpoints" / RUN_STATUS_FILE
    if diverged.exists():
        try:
            if json.loads(diverged.read_text()).get("state") == "diverged":
                return "diverged"
        except json.JSONDecodeError:
            pass
    f = d / "status.json"
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
    precision = [run.precision_flag, run.precision] if run.precision_flag else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "launch" / SCRIPTS[run.script]), *run.flags, *precision,
           "--tensorboard-dir", str(d / "tensorboard"), "--save", str(ckpt), *extra]
    if (ckpt / "latest_checkpointed_iteration.txt").exists():
        cmd += ["--load", str(ckpt)]  # a restarted run resumes where it stopped
    return cmd


def start_run(out: Path, run: Run, nproc: int, extra: list[str]) -> subprocess.Popen:
    d = run_dir(out, run)
    d.mkdir(parents=True, exist_ok=True)
    (d / "checkpoints" / RUN_STATUS_FILE).unlink(missing_ok=True)  # a retried diverged run starts clean
    cmd = run_command(out, run, nproc, extra)
    write_status(d, state="running", command=shlex.join(cmd), started=time.time())
    log = open(d / "train.log", "a")  # noqa: SIM115 -- the child process writes to it after we return
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def finish_run(out: Path, run: Run, rc: int, seconds: float) -> str:
    """Record a finished run's state: done, diverged (pretrain.py said so) or failed."""
    state = "done" if rc == 0 else "failed"
    if rc != 0 and read_status(out, run) == "diverged":
        state = "diverged"
    write_status(run_dir(out, run), state=state, returncode=rc, seconds=round(seconds, 1))
    return state


def _todo(out: Path, runs: list[Run], retry_diverged: bool) -> tuple[list[Run], int, int]:
    todo, done, diverged = [], 0, 0
    for r in runs:
        st = read_status(out, r)
        if st == "done":
            done += 1
        elif st == "diverged" and not retry_diverged:
            diverged += 1
        else:
            todo.append(r)
    return todo, done, diverged


def run_local(out: Path, runs: list[Run], nproc: int, parallel: int, extra: list[str],
              retry_diverged: bool = False) -> int:
    todo, done, diverged = _todo(out, runs, retry_diverged)
    if done:
        print(f"skipping {done} finished run(s)")
    if diverged:
        print(f"skipping {diverged} diverged run(s) (a result; --retry-diverged runs them again)")
    running: dict[str, tuple[Run, subprocess.Popen, float]] = {}
    failed = 0
    tty = sys.stdout.isatty()
    last = None
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
            state = finish_run(out, r, rc, time.time() - t0)
            done += state == "done"
            diverged += state == "diverged"
            failed += state == "failed"
            if tty:
                print()
            print(f"[{state}] {name} ({time.time() - t0:.0f}s)" +
                  ("" if state == "done" else f" -- see {run_dir(out, r) / 'train.log'}"), flush=True)
        line = (f"runs: {done} done, {len(running)} running, {diverged} diverged, {failed} failed, "
                f"{len(todo)} pending")
        if tty:  # rewritten in place on a terminal; whole lines, only when it changes, in a log file
            print(f"\r{line}   ", end="", flush=True)
        elif line != last:
            print(line, flush=True)
        last = line
    if tty:
        print()
    return failed


def submit_slurm(sweep_path: str, out: Path, runs: list[Run], extra: list[str], sbatch_args: list[str],
                 retry_diverged: bool = False) -> int:
    todo = [i for i, r in enumerate(runs) if r in _todo(out, runs, retry_diverged)[0]]
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
    finish_run(out, r, rc, time.time() - t0)
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


def read_val_batches(tb_dir: Path) -> dict[int, list[float]]:
    """Per-batch validation losses by iteration (``val_batches.jsonl``; later lines win)."""
    f = tb_dir / "val_batches.jsonl"
    out: dict[int, list[float]] = {}
    if f.exists():
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            out[int(rec["iteration"])] = [float(v) for v in rec["batch_losses"]]
    return out


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
    # pretrain.py logs train/nonfinite_steps (a running count) every iteration; a diverging step's
    # loss may be finite while its gradient norm is not
    nonfinite = [v for _, v in scalars.get("train/nonfinite_steps", [])]
    norms = [v for _, v in scalars.get("train/grad_norm", [])]
    diverged = (len(finite) < len(vals) or (max(nonfinite) > 0 if nonfinite else False)
                or not all(math.isfinite(v) for v in norms))
    spike = False
    if len(sm) > 2 * window:
        best = min(sm[: len(sm) // 2])
        spike = any(v > 1.5 * best for v in sm[len(sm) // 2:])
    val = scalars.get("val/loss", [])
    sem = dict(scalars.get("val/loss_sem", []))
    tps = [v for _, v in scalars.get("train/tokens_per_sec", [])]
    return {
        "run": name,
        "iterations": steps[-1] if steps else 0,
        "final_train_loss": sm[-1] if sm else float("nan"),
        "final_val_loss": val[-1][1] if val else float("nan"),
        "val_loss_sem": sem.get(val[-1][0], float("nan")) if val else float("nan"),
        "tokens_per_sec": sum(tps) / len(tps) if tps else float("nan"),
        "diverged": diverged,
        "spike": spike,
        "_curve": (steps[: len(sm)], sm),
        "_val_step": val[-1][0] if val else None,
    }


def extra_tokens_pct(run_curve, base_curve) -> ExtraTokens:
    """% more tokens the run needs than the baseline for the same smoothed loss, measured both ways
    (``pretrain.evaluation.extra_tokens.crossing_extra_pct``): positive for a worse run, negative
    for a better one, ``censored`` (a lower bound) when the crossing lies beyond a run's end."""
    return crossing_extra_pct(run_curve, base_curve)


def fitted_extra_tokens_pct(row: dict, base: dict) -> ExtraTokens:
    """The token ratio at the baseline's final loss from each run's fitted ``L(D) = E + A*D^-alpha``."""
    for r in (row, base):
        if "_fit" not in r:
            r["_fit"] = fit_power_law(*r["_curve"])
    return fitted_extra_pct(row["_fit"], base["_fit"], base["final_train_loss"])


def _paired_base(rows: list[dict], baseline: str | None, hyper_equal: bool) -> dict[str, dict]:
    """For each run, the baseline run it is compared with: same seed, and the same hyper-parameters
    (``hyper_equal``) or the baseline's best ones."""
    pairs = {}
    base_rows = [r for r in rows if r["_run"].label == baseline]
    for row in rows:
        run = row["_run"]
        for b in base_rows:
            if b["_run"].seed == run.seed and (not hyper_equal or b["_run"].point == run.point):
                pairs[row["run"]] = b
    return pairs


def _diverged(row: dict) -> bool:
    return bool(row["diverged"] or row["status"] == "diverged")


def _pair_numbers(row: dict, base: dict) -> dict:
    nan = float("nan")
    if _diverged(row) or _diverged(base):  # no finite comparison: a result, reported as diverged
        extra = fit = ExtraTokens(nan)
    elif row is base:
        extra = fit = ExtraTokens(0.0)
    else:
        extra, fit = extra_tokens_pct(row["_curve"], base["_curve"]), fitted_extra_tokens_pct(row, base)
    lost = _diverged(row) or _diverged(base)
    out = {"gap_train_loss": nan if lost else row["final_train_loss"] - base["final_train_loss"],
           "gap_val_loss": nan if lost else row["final_val_loss"] - base["final_val_loss"],
           "extra_tokens_pct": extra.pct, "extra_tokens_censored": extra.censored,
           "extra_tokens_fit_pct": fit.pct, "extra_tokens_fit_extrapolated": fit.extrapolated,
           "extra_tokens_fit_censored": fit.censored, "_extra": extra, "_extra_fit": fit,
           "gap_val_batch_se": nan}
    a, b = row["_val_batches"].get(row["_val_step"]), base["_val_batches"].get(base["_val_step"])
    if a and b:
        out["gap_val_batch_se"] = 0.0 if row is base else paired_batch_se(a, b)
    return out


def summarize(rows: list[dict], baseline: str | None, groups: list[str] | None = None,
              base_group: dict[int | None, dict] | None = None, margin: float | None = None) -> list[dict]:
    """One row per grid point: mean and spread over seeds, paired gaps with 95% intervals, verdicts
    Holm-adjusted over the rows (``margin``: the sweep's ``equivalence_margin``).

    ``base_group`` maps a seed to the baseline run that seed's runs are paired with (default: the
    baseline at the same hyper-parameters). A diverged seed's gap is NaN and kept (the verdict
    reports it); a pair whose baseline diverged is left out (the baseline's row reports it)."""
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["_run"].group, []).append(row)
    out = []
    for group in groups or list(by_group):
        members = by_group[group]
        run = members[0]["_run"]
        val_mean, val_sd = spread([m["final_val_loss"] for m in members])
        train_mean, train_sd = spread([m["final_train_loss"] for m in members])
        gaps, extras, fits, ses = [], [], [], []
        for m in members:
            if base_group is not None:
                b = base_group.get(m["_run"].seed)
            else:
                b = next((r for r in rows if r["_run"].label == baseline and r["_run"].seed == m["_run"].seed
                          and r["_run"].point == m["_run"].point), None)
            if b is None or (_diverged(b) and b is not m):
                continue
            p = _pair_numbers(m, b)
            if not _diverged(m) and not math.isfinite(p["gap_val_loss"]):
                continue  # no validation loss yet (a pending or failed run): no pair
            gaps.append(p["gap_val_loss"])
            extras.append(p["_extra"])
            fits.append(p["_extra_fit"])
            ses.append(p["gap_val_batch_se"])
        gap = paired_interval(gaps)
        n_diverged = sum(1 for m in members if _diverged(m))
        extra = summarize_extra(extras, n_diverged)
        fit = summarize_extra(fits, n_diverged)
        ses = [s for s in ses if math.isfinite(s)]
        out.append({
            "point": group, "precision": run.label, **{k: v for k, v in run.point.items()},
            "seeds": len(members),
            "val_loss_mean": val_mean, "val_loss_sd": val_sd,
            "train_loss_mean": train_mean, "train_loss_sd": train_sd,
            "val_loss_sem": spread([m["val_loss_sem"] for m in members])[0],
            "gap_val": gap,
            "gap_val_batch_se": sum(ses) / len(ses) if ses else float("nan"),
            "extra_tokens": extra.interval, "_extra": extra,
            "extra_not_reached": extra.censored,
            "extra_tokens_fit": fit.interval, "_extra_fit": fit,
            "extra_tokens_fit_extrapolated": fit.extrapolated,
            "diverged": n_diverged,
            "is_baseline": run.label == baseline,
            "verdict_unadjusted": verdict(gap, run.label == baseline, margin),
        })
    for s, v in zip(out, table_verdicts([s["gap_val"] for s in out], [s["is_baseline"] for s in out],
                                        margin=margin)):
        s["verdict"] = v
    return out


def verdict(gap: Interval, is_baseline: bool, margin: float | None = None) -> str:
    """One gap's verdict on its own (unadjusted); tables use ``table_verdicts`` (Holm)."""
    return gap_verdict(gap, is_baseline, margin=margin)  # a validation-loss gap: higher is worse


def best_points(summary: list[dict]) -> dict[str, dict]:
    """Each precision's grid point with the lowest mean validation loss (its best hyper-parameters)."""
    best: dict[str, dict] = {}
    for s in summary:
        cur = best.get(s["precision"])
        if math.isfinite(s["val_loss_mean"]) and (cur is None or s["val_loss_mean"] < cur["val_loss_mean"]):
            best[s["precision"]] = s
    return best


def collect(out: Path, runs: list[Run], baseline: str | None, window: int = 10,
            margin: float | None = None) -> list[dict]:
    """Analyse every run, write results.csv / summary.csv / results.md and the plots; return the run
    rows. ``margin``: the sweep's ``equivalence_margin`` (none: no equivalence verdicts)."""
    if runs and runs[0].script == "rl":
        return collect_rl(out, runs, baseline, margin)
    rows = []
    for r in runs:
        tb = run_dir(out, r) / "tensorboard"
        row = analyse(r.name, read_scalars(tb) if tb.exists() else {}, window)
        row["precision"] = r.precision
        row["status"] = read_status(out, r)
        row["seed"] = r.seed
        row["_run"] = r
        row["_val_batches"] = read_val_batches(tb) if tb.exists() else {}
        rows.append(row)
    pairs = _paired_base(rows, baseline, hyper_equal=True)
    for row in rows:
        base = pairs.get(row["run"])
        if base is not None:
            row.update(_pair_numbers(row, base))
        else:
            row.update(gap_train_loss=float("nan"), gap_val_loss=float("nan"), extra_tokens_pct=float("nan"),
                       extra_tokens_censored=False, extra_tokens_fit_pct=float("nan"),
                       extra_tokens_fit_extrapolated=False, extra_tokens_fit_censored=False,
                       gap_val_batch_se=float("nan"))
    summary = summarize(rows, baseline, margin=margin)
    tuned = []
    hyper = sorted({k for r in runs for k in r.point})
    if hyper:
        best = best_points(summary)
        if baseline in best:
            base_runs = {m["_run"].seed: m for m in rows if m["_run"].group == best[baseline]["point"]}
            groups = [best[p]["point"] for p in dict.fromkeys(r.label for r in runs) if p in best]
            tuned = summarize(rows, baseline, groups, base_runs, margin=margin)
    write_tables(out, rows, summary, tuned, baseline, hyper)
    write_plots(out, rows, summary, tuned or summary, baseline, base_runs if tuned else None)
    return rows


def collect_rl(out: Path, runs: list[Run], baseline: str | None, margin: float | None = None) -> list[dict]:
    """An RL sweep's results (``pretrain.rl.sweep_results``): accuracy, reward AUC, mismatch, speed."""
    from pretrain.rl.sweep_results import analyse_rl, read_summary, summarize_rl, write_rl_results

    rows = []
    for r in runs:
        d = run_dir(out, r)
        tb = d / "tensorboard"
        row = analyse_rl(r.name, read_scalars(tb) if tb.exists() else {},
                         read_summary(d / "checkpoints" / "rl_summary.json"))
        row.update(status=read_status(out, r), label=r.label, seed=r.seed, _run=r)
        rows.append(row)
    write_rl_results(out, rows, summarize_rl(rows, baseline, margin), baseline,
                     sorted({k for r in runs for k in r.point}))
    return rows


COLUMNS = ["run", "status", "precision", "seed", "iterations", "final_train_loss", "final_val_loss",
           "val_loss_sem", "gap_train_loss", "gap_val_loss", "gap_val_batch_se", "extra_tokens_pct",
           "diverged", "spike", "tokens_per_sec", "extra_tokens_censored", "extra_tokens_fit_pct",
           "extra_tokens_fit_extrapolated", "extra_tokens_fit_censored"]
SUMMARY_COLUMNS = ["point", "precision", "seeds", "val_loss_mean", "val_loss_sd", "val_loss_sem",
                   "gap_val_mean", "gap_val_lo", "gap_val_hi", "gap_val_batch_se", "extra_tokens_mean",
                   "extra_tokens_lo", "extra_tokens_hi", "extra_not_reached", "diverged", "verdict"]
# after the hyper-parameter columns, so the columns above keep their places
SUMMARY_EXTRA_COLUMNS = ["gap_val_n", "gap_val_excluded", "gap_val_p", "verdict_unadjusted",
                         "extra_tokens_fit_mean", "extra_tokens_fit_lo", "extra_tokens_fit_hi",
                         "extra_tokens_fit_extrapolated"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "not reached"
        return f"{v:.4f}"
    return str(v)


def _summary_csv_row(s: dict, hyper: list[str]) -> list:
    g, e, f = s["gap_val"], s["extra_tokens"], s["extra_tokens_fit"]
    flat = {**s, "gap_val_mean": g.mean, "gap_val_lo": g.lo, "gap_val_hi": g.hi,
            "extra_tokens_mean": e.mean, "extra_tokens_lo": e.lo, "extra_tokens_hi": e.hi,
            "gap_val_n": g.n, "gap_val_excluded": g.excluded, "gap_val_p": g.p_value(),
            "extra_tokens_fit_mean": f.mean, "extra_tokens_fit_lo": f.lo, "extra_tokens_fit_hi": f.hi}
    return [flat[c] for c in SUMMARY_COLUMNS] + [s.get(h) for h in hyper] + [flat[c] for c in SUMMARY_EXTRA_COLUMNS]


def _mean_sd(mean: float, sd: float) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4f}" if math.isnan(sd) else f"{mean:.4f} ± {sd:.4f}"


def summary_table(summary: list[dict], hyper: list[str]) -> list[str]:
    """Markdown rows: one per grid point, every gap with its interval and noise verdict."""
    k = sum(1 for s in summary if not s["is_baseline"] and s["gap_val"].n >= 2 and not s["gap_val"].excluded)
    head = ["precision", *hyper, "seeds", "val loss (mean ± sd)", "val s.e.",
            "gap to baseline (95% CI, unadjusted)", "gap s.e. (val batches)", "extra tokens % (95% CI)",
            "extra tokens % from fitted L(D)", f"verdict (Holm over {k})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        verdict_text = s["verdict"]
        if s["diverged"] and not s["verdict"].startswith("diverged"):
            verdict_text += f"; {s['diverged']} diverged"
        cells = [s["precision"], *(str(s.get(h)) for h in hyper), str(s["seeds"]),
                 _mean_sd(s["val_loss_mean"], s["val_loss_sd"]), _fmt(s["val_loss_sem"]),
                 s["gap_val"].text(4, seeds=True), _fmt(s["gap_val_batch_se"]), s["_extra"].text(1),
                 s["_extra_fit"].text(1), verdict_text]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def write_tables(out: Path, rows: list[dict], summary: list[dict], tuned: list[dict],
                 baseline: str | None, hyper: list[str]) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for row in rows:
            w.writerow([row[c] for c in COLUMNS])
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_COLUMNS + hyper + SUMMARY_EXTRA_COLUMNS)
        for s in summary:
            w.writerow(_summary_csv_row(s, hyper))
    seeds = max((s["seeds"] for s in summary), default=0)
    lines = [(f"# Sweep results ({len(rows)} runs, {len(summary)} grid points x {seeds} seed(s), "
              f"baseline: {baseline or 'none'})"), "",
             "## Per grid point (gaps paired by seed against the baseline at the same hyper-parameters)", ""]
    lines += summary_table(summary, hyper)
    if tuned:
        lines += ["", (f"## Each precision at its own best {', '.join(hyper)} (lowest mean val loss), "
                       "paired with the baseline at its best"), "",
                  (f"The best {', '.join(hyper)} was chosen on the same seeds these intervals use, so the "
                   "intervals and verdicts are optimistic (selection and estimation share seeds); confirm a "
                   "choice on seeds not in this sweep."), ""]
        lines += summary_table(tuned, hyper)
    lines += ["", "## Runs", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "/") for c in COLUMNS) + " |")
    lines += ["", ("gap: final validation loss minus the baseline's, per seed (same initialization and data "
              "order), mean over the seeds it used ± the half-width of its unadjusted 95% Student-t interval. "
              "verdict: Holm-adjusted over the table's comparisons, so the chance of any false worse/better "
              "in the table stays below 5%; *worse*/*better*: shown to differ; *equivalent (±m)*: two one-sided "
              "tests show the gap inside the sweep's equivalence_margin m (the only verdict that means no cost "
              "beyond m); *not shown to differ*: neither -- it does not mean no cost; *diverged in k of n "
              "seeds*: those seeds are a result, not averaged away. val s.e.: standard error of the validation "
              "loss over its batches; gap s.e. (val batches): standard error of the gap from the choice of "
              "validation batches (paired per-batch differences). extra tokens: % more training tokens than "
              "the baseline for the same smoothed training loss, paired by seed -- for a worse run, the "
              "baseline's step at the run's final loss; for a better one, the run's step at the baseline's "
              "final loss. From fitted L(D): the same ratio at the baseline's final loss from E + A*D^-alpha "
              "fitted to each run ('extrapolated': beyond the run; '>': a lower bound, the run's fitted floor E "
              "lies above the baseline's final loss, so it never reaches it; a mean with a lower bound in it "
              "is a lower bound and has no interval). diverged: a NaN/Inf loss; spike: the smoothed loss "
              "rose above 1.5x its early minimum in the second half.")]
    (out / "results.md").write_text("\n".join(lines) + "\n")


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
            return submit_slurm(args.sweep, out, runs, extra, args.sbatch_arg, args.retry_diverged)
        failed = 0
        if not args.collect:
            seeds = sweep.get("seeds")
            print(f"sweep {args.sweep}: {len(runs)} runs ({len(runs) // len(seeds or [0])} grid points x "
                  f"{len(seeds or [0])} seed(s)), {args.parallel} at a time, {nproc} process(es) each")
            failed = run_local(out, runs, nproc, args.parallel, extra, args.retry_diverged)
        collect(out, runs, sweep.get("baseline"), args.smooth, sweep.get("equivalence_margin"))
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

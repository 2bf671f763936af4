"""Running a sweep's runs: validation, identities, status files, local execution (a few at a time)
and a SLURM job array.

Each run lives in ``OUT/runs/NAME/`` (``train.log``, ``tensorboard/``, ``checkpoints/``,
``status.json``). ``validate_runs`` puts every run's command line through its script's own parser and
validation before any run starts. A run is identified by a hash of its command (script, processes,
flags; ``run_identity``), recorded in ``status.json`` when it starts: ``changed_runs`` finds a run
directory made by other flags (an edited sweep file, other flags after ``--``), which the sweep
refuses rather than report old results under new flags. ``read_status`` gives pending / running /
done / failed / diverged (the training script's own ``run_status.json`` verdict, ``pretrain.status``,
wins over the exit code); re-running skips finished runs, restarts failed or interrupted ones from
their last checkpoint and keeps diverged ones unless asked to retry them. ``run_local`` runs them with torchrun on this machine,
``submit_slurm`` submits the unfinished ones as ``launch/slurm/sweep_array.sbatch``, whose tasks
call ``run_one``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pretrain.status import RUN_STATUS as RUN_STATUS_FILE  # written by pretrain.py into --save on divergence
from pretrain.sweep.spec import SCRIPTS, Run, SweepError

__all__ = ["ROOT", "RUN_STATUS_FILE", "changed_runs", "finish_run", "read_status", "run_args", "run_command",
           "run_dir", "run_identity", "run_local", "run_one", "start_run", "submit_slurm", "validate_runs",
           "write_status"]

ROOT = Path(__file__).resolve().parents[2]  # the repository: launch/ holds the scripts a sweep runs


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


def run_args(run: Run, extra: list[str]) -> list[str]:
    """The run's own flags: the sweep file's base and grid point, its precision, the flags after ``--``."""
    precision = [run.precision_flag, run.precision] if run.precision_flag else []
    return [*run.flags, *precision, *extra]


def run_identity(run: Run, nproc: int, extra: list[str]) -> str:
    """A hash of everything that decides what the run computes: script, processes and flags."""
    return hashlib.sha256(json.dumps([run.script, nproc, run_args(run, extra)]).encode()).hexdigest()[:16]


def changed_runs(out: Path, runs: list[Run], nproc: int, extra: list[str]) -> list[tuple[Run, str]]:
    """``(run, what changed)`` for each run whose directory was made by another command."""
    changed = []
    for r in runs:
        f = run_dir(out, r) / "status.json"
        try:
            old = json.loads(f.read_text()) if f.exists() else {}
        except json.JSONDecodeError:
            old = {}
        if "identity" in old and old["identity"] != run_identity(r, nproc, extra):
            before, now = old.get("args", []), run_args(r, extra)
            if before == now:
                changed.append((r, f"{old.get('nproc')} -> {nproc} process(es) per run"))
                continue
            i = next((i for i, (a, b) in enumerate(zip(before, now)) if a != b), min(len(before), len(now)))
            changed.append((r, f"{_flag_at(before, i)} -> {_flag_at(now, i)}"))
    return changed


def _flag_at(tokens: list[str], i: int) -> str:
    """The flag (with its value) that token ``i`` belongs to, or ``(nothing)``."""
    if i >= len(tokens):
        return "(nothing)"
    j = i - 1 if i > 0 and not tokens[i].startswith("--") and tokens[i - 1].startswith("--") else i
    end = j + 2 if j + 1 < len(tokens) and not tokens[j + 1].startswith("--") else j + 1
    return shlex.join(tokens[j:end])


def validate_runs(out: Path, runs: list[Run], nproc: int, extra: list[str]) -> None:
    """Every run's command line through its script's own parser and validation (``pretrain.py``:
    ``parse_run_config``; ``rl.py``: ``parse_rl_args``), before any run starts; the first refusal is
    a ``SweepError`` naming the run."""
    import torch

    from pretrain import runtime

    runtime.filter_expected_warnings()  # validation imports megatron-core: its expected warnings stay quiet
    from pretrain.arguments import ConfigError, parse_run_config
    from pretrain.rl.arguments import parse_rl_args

    cuda = torch.cuda.is_available()
    for r in runs:
        argv = run_command(out, r, nproc, extra)
        argv = argv[argv.index(str(ROOT / "launch" / SCRIPTS[r.script])) + 1:]
        try:
            (parse_rl_args if r.script == "rl" else parse_run_config)(argv, nproc, cuda)
        except ConfigError as e:
            raise SweepError(f"run {r.name}: {SCRIPTS[r.script]} refuses its flags: {e}") from None


def run_command(out: Path, run: Run, nproc: int, extra: list[str]) -> list[str]:
    d = run_dir(out, run)
    ckpt = d / "checkpoints"
    own = run_args(run, [])
    resume = (ckpt / "latest_checkpointed_iteration.txt").exists()
    if resume and "--ckpt-step" in own:  # --ckpt-step picks the starting checkpoint's iteration, not the run's own
        i = own.index("--ckpt-step")
        own = own[:i] + own[i + 2:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "launch" / SCRIPTS[run.script]), *own,
           "--tensorboard-dir", str(d / "tensorboard"), "--save", str(ckpt), *extra]
    if resume:
        cmd += ["--load", str(ckpt)]  # a restarted run resumes where it stopped, at its latest iteration
    return cmd


def start_run(out: Path, run: Run, nproc: int, extra: list[str]) -> subprocess.Popen:
    d = run_dir(out, run)
    d.mkdir(parents=True, exist_ok=True)
    (d / "checkpoints" / RUN_STATUS_FILE).unlink(missing_ok=True)  # a retried diverged run starts clean
    cmd = run_command(out, run, nproc, extra)
    write_status(d, state="running", command=shlex.join(cmd), started=time.time(),
                 identity=run_identity(run, nproc, extra), nproc=nproc, args=run_args(run, extra))
    log = open(d / "train.log", "a")  # noqa: SIM115 -- the child process writes to it after we return
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def finish_run(out: Path, run: Run, rc: int, seconds: float) -> str:
    """Record a finished run's state: done, diverged (pretrain.py said so) or failed."""
    state = "done" if rc == 0 else "failed"
    if rc != 0 and read_status(out, run) == "diverged":
        state = "diverged"
    d = run_dir(out, run)
    try:
        started = json.loads((d / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        started = {}
    keep = {k: started[k] for k in ("identity", "nproc", "args", "command") if k in started}
    write_status(d, state=state, returncode=rc, seconds=round(seconds, 1), **keep)
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
              retry_diverged: bool = False, on_finish: Callable[[Run, str, float], str] | None = None) -> int:
    """Run the unfinished runs, ``parallel`` at a time; ``on_finish(run, state, seconds)`` adds to each
    run's finishing line (e.g. its last loss and the sweep's ETA). Returns how many failed."""
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
            more = on_finish(r, state, time.time() - t0) if on_finish else ""
            print(f"[{state}] {name} ({time.time() - t0:.0f}s{more})" +
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
    if shutil.which("sbatch") is None:
        raise SweepError("--slurm: sbatch not found on PATH; submit from a SLURM login node, or drop --slurm "
                         "to run the sweep on this machine (--parallel N)")
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

"""How a pretraining run ends: exit statuses and ``run_status.json``.

Exit status of every rank of ``launch/pretrain.py`` (torchrun itself exits 1 whenever a worker exits
non-zero, so tools read ``run_status.json``, not torchrun's status):

    0  done, or stopped cleanly (SIGTERM, ``--exit-interval``) after saving
    2  bad input: one line ``pretrain.py: error: <flag or path>: ...`` (EXIT_BAD_INPUT)
    3  diverged: a non-finite loss or gradient norm (``--check-for-nan-in-loss-and-grad``, past
       ``--skip-nonfinite-steps``); nothing was saved for that iteration (EXIT_DIVERGED)
    4  a checkpoint could not be written (e.g. a full disk); the previous one is intact
       (EXIT_SAVE_FAILED)

Contract with ``launch/sweep.py`` (and any other tool that launches runs): with ``--save``, global
rank 0 writes ``<--save>/run_status.json`` atomically (temporary file, fsync, ``os.replace``) for
every ending, before any rank exits::

    {"state": "done", "exit_status": 0, "iteration": 200, "last_good_checkpoint": "<iter_* dir>"}
    {"state": "stopped", "exit_status": 0, "iteration": 120, ..., "reason": "SIGTERM"}
    {"state": "diverged", "exit_status": 3, "iteration": N, "last_good_checkpoint": "<dir or null>",
     "reason": "loss nan, grad norm nan"}
    {"state": "refused", "exit_status": 2, "reason": "--lr-warmup-iters 20 (from ...) exceeds ..."}
    {"state": "save_failed", "exit_status": 4, "iteration": N, "last_good_checkpoint": ..., "reason": ...}

``last_good_checkpoint`` is the newest checkpoint this run saved or resumed from (complete and
loadable: a diverged state is never saved). A refusal found while the flags are parsed is recorded
when ``--save`` can be read from the command line and written to (an unwritable ``--save`` is itself
the refusal, and is then only the error line). A failed save is recorded when the directory still
takes a small file (a full disk may refuse it: then only the error line and the exit status remain).
A run started again with the same ``--save`` removes a stale ``run_status.json`` when it begins
training, so the file describes the latest attempt only. Without ``--save`` nothing is written; the
exit status and the error line remain.
"""

from __future__ import annotations

import json
import os

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_SAVE_FAILED = 4
RUN_STATUS = "run_status.json"


def write_run_status(save_dir: str, **status) -> str:
    """Write ``save_dir/run_status.json`` atomically; returns its path."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, RUN_STATUS)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(status, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def record_ending(save_dir: str | None, state: str, exit_status: int, **fields) -> str | None:
    """Write this run's ending to ``save_dir/run_status.json`` (see the module docstring); the path, or
    None without ``save_dir`` or when it cannot be written (the error line and exit status remain)."""
    if not save_dir:
        return None
    try:
        return write_run_status(save_dir, state=state, exit_status=exit_status, **fields)
    except OSError:
        return None


def save_dir_of(argv: list[str]) -> str | None:
    """``--save``'s value in a command line (for a refusal found before the flags parsed), else None."""
    for i, token in enumerate(argv):
        if token == "--save" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--save="):
            return token.split("=", 1)[1]
    return None


def clear_run_status(save_dir: str) -> bool:
    """Remove a previous attempt's ``run_status.json``; True if there was one."""
    path = os.path.join(save_dir, RUN_STATUS)
    if os.path.isfile(path):
        os.remove(path)
        return True
    return False

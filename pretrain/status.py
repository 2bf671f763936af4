"""How a pretraining run ends: exit statuses and ``run_status.json``.

Exit status of every rank of ``launch/pretrain.py`` (torchrun itself exits 1 whenever a worker exits
non-zero, so tools read ``run_status.json``, not torchrun's status):

    0  done, or stopped cleanly (SIGTERM, ``--exit-interval``) after saving
    2  bad input: one line ``pretrain.py: error: <flag or path>: ...`` (EXIT_BAD_INPUT)
    3  diverged: a non-finite loss or gradient norm (``--check-for-nan-in-loss-and-grad``, past
       ``--skip-nonfinite-steps``); nothing was saved for that iteration (EXIT_DIVERGED)
    4  a checkpoint could not be written (e.g. a full disk); the previous one is intact
       (EXIT_SAVE_FAILED)

Contract with ``launch/sweep.py`` (and any other tool that launches runs): on divergence, global
rank 0 writes ``<--save>/run_status.json`` atomically (temporary file, fsync, ``os.replace``)::

    {"state": "diverged", "iteration": N, "last_good_checkpoint": "<iter_* directory or null>",
     "reason": "loss nan, grad norm nan"}

before any rank exits with ``EXIT_DIVERGED``. ``last_good_checkpoint`` is the newest checkpoint this
run saved or resumed from (complete and loadable: the diverged state is never saved). A run started
again with the same ``--save`` removes a stale ``run_status.json`` when it begins training, so the
file describes the latest attempt only. Without ``--save`` nothing is written; the exit status and
the error line remain.
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


def clear_run_status(save_dir: str) -> bool:
    """Remove a previous attempt's ``run_status.json``; True if there was one."""
    path = os.path.join(save_dir, RUN_STATUS)
    if os.path.isfile(path):
        os.remove(path)
        return True
    return False

"""A checkpoint save as a transaction, shared by both on-disk formats (``pretrain.checkpointing``'s
legacy rank files and ``pretrain.dist_checkpoint``'s ``torch_dist``): :func:`begin_save` opens the
temporary directory, :func:`publish_save` checksums, renames and moves the tracker (or removes the
partial directory and raises the same one line on every rank), ``--save-retain`` retention, the
one-line account of a failed write, and the RNG states every format saves the way Megatron-LM does.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil

import numpy as np
import torch
from megatron.core import parallel_state

from pretrain.checkpoint_files import (
    CHECKSUMS,
    TRACKER,
    CheckpointError,
    CheckpointSaveError,
    _agree,
    _fsync_dir,
    _gather,
    _write_atomic_text,
    iter_dir_name,
    read_tracker,
    saved_iterations,
)


def get_rng_state() -> dict:
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": None,
    }
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["rng_tracker_states"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
        if state.get("rng_tracker_states"):
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def gather_rng_states() -> list[dict]:
    """Every data-parallel rank's RNG state (same list on all of them), as Megatron-LM saves them."""
    group = parallel_state.get_data_parallel_group()
    states = [None] * group.size()
    torch.distributed.all_gather_object(states, get_rng_state(), group=group)
    return states


def _write_failure(e: BaseException) -> OSError | None:
    """The operating system's error behind a failed write, or None for an error of another kind.

    A full disk under ``torch.save``: its zip writer first gets ``OSError`` (ENOSPC) from the file,
    then, closing the archive on the way out, raises ``RuntimeError: [enforce fail at
    inline_container.cc:...] unexpected pos ...`` with the ``OSError`` as its context. The first
    ``OSError`` in the chain is the cause a person can act on; a zip-writer error without one (a
    writer that reports no errno) still is a failed write."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    if isinstance(e, RuntimeError) and "inline_container" in str(e):
        return OSError(errno.EIO, f"the checkpoint writer failed: {' '.join(str(e).split())[:160]}")
    return None


def _save_problem(save_dir: str, iteration: int, e: OSError) -> str:
    """The one line of a save that could not be completed (see :class:`CheckpointSaveError`)."""
    what = e.strerror or str(e)
    where = f": {e.filename}" if e.filename else ""
    try:
        intact = read_tracker(save_dir)
    except CheckpointError:
        intact = None
    if intact is not None and intact != iteration:
        kept = (f"iteration {intact} ({os.path.join(save_dir, iter_dir_name(intact))}) is intact and {TRACKER} "
                f"still names it; free space (or give another --save) and resume with --load {save_dir}")
    else:
        kept = "no earlier checkpoint exists; free space or give another --save"
    return (f"--save {save_dir}: could not write iteration {iteration} ({what}{where}); the partial checkpoint "
            f"was removed; {kept}")


def _remove_dir(path: str) -> None:
    """Rename ``path`` out of the ``iter_*`` namespace, then delete it (a half-deleted directory is
    never mistaken for a checkpoint)."""
    if not os.path.exists(path):
        return
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".old_{name}" if not name.startswith(".") else name)
    if doomed != path:
        os.rename(path, doomed)
    shutil.rmtree(doomed)


def _retain(save_dir: str, newest: int, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints up to ``newest`` (global rank 0)."""
    older = [it for it in saved_iterations(save_dir) if it < newest]
    for it in older[: max(0, len(older) - (keep - 1))]:
        path = os.path.join(save_dir, iter_dir_name(it))
        try:
            _remove_dir(path)
        except OSError as e:  # the new checkpoint is complete; an old one left behind is only reported
            print(f"note: --save-retain {keep}: could not remove {path} ({e})", flush=True)


def _give_up(save_dir: str, iteration: int, problem: str):
    """Every rank: remove the partial directory (global rank 0) and raise the same one line."""
    if torch.distributed.get_rank() == 0:  # best effort: the next save removes leftovers too
        shutil.rmtree(os.path.join(save_dir, f".tmp_{iter_dir_name(iteration)}"), ignore_errors=True)
    raise CheckpointSaveError(problem)


def begin_save(save_dir: str, iteration: int) -> str:
    """Collective start of a save: global rank 0 removes stale partial saves of crashed runs and
    creates the (empty) temporary directory ``DIR/.tmp_iter_N`` that every rank writes into;
    returns it. Raises :class:`CheckpointSaveError` on every rank if it cannot be created."""
    tmp = os.path.join(save_dir, f".tmp_{iter_dir_name(iteration)}")
    problem = None
    if torch.distributed.get_rank() == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            for name in os.listdir(save_dir):  # stale partial saves of crashed runs
                if name.startswith((".tmp_iter_", ".old_iter_")):
                    shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            problem = _save_problem(save_dir, iteration, e)
    if problem := _agree(problem):
        _give_up(save_dir, iteration, problem)
    return tmp


def publish_save(save_dir: str, iteration: int, tmp: str, problem: str | None, files: dict,
                 retain: int | None = None, extra: dict | None = None) -> str:
    """Collective end of a save: if no rank has a ``problem``, global rank 0 writes
    ``checksums.json`` (every rank's ``files`` entries, plus ``extra`` keys) into ``tmp``, renames it
    to ``DIR/iter_N``, replaces the tracker and applies ``retain``; returns the directory. Any
    problem: the partial directory is removed and every rank raises :class:`CheckpointSaveError`."""
    rank = torch.distributed.get_rank()
    final = os.path.join(save_dir, iter_dir_name(iteration))
    gathered = _gather((problem, files))
    if problem := next((p for p, _ in gathered if p), None):
        _give_up(save_dir, iteration, problem)

    if rank == 0:
        try:
            every = {rel.replace(os.sep, "/"): e for _, f in gathered for rel, e in f.items()}
            _write_atomic_text(os.path.join(tmp, CHECKSUMS), json.dumps(
                {"iteration": iteration, "files": every, **(extra or {})}, indent=1, sort_keys=True))
            old = os.path.join(save_dir, f".old_{iter_dir_name(iteration)}")
            if os.path.exists(final):  # re-saving an iteration (e.g. --finetune into the same --save)
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(save_dir)
            _write_atomic_text(os.path.join(save_dir, TRACKER), str(iteration))
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            problem = _save_problem(save_dir, iteration, e)
            if os.path.isdir(final) and read_tracker(save_dir) != iteration:  # published, not tracked
                os.rename(final, tmp)
                if os.path.isdir(old):
                    os.rename(old, final)
    if problem := _agree(problem):
        _give_up(save_dir, iteration, problem)
    if rank == 0 and retain:
        _retain(save_dir, iteration, retain)
    torch.distributed.barrier()
    return final

"""What a checkpoint directory holds beside the model's bytes, and how its files are checked.

The names of the layout (tracker, per-rank file, ``checksums.json``, ``run_config.json``, the
tokenizer copy), the errors, the collective agreement on a problem, the checksums written while a
file is written and checked before it is read, and ``run_config.json`` with the tokenizer copy
(``pretrain.checkpointing``'s module docstring describes all of it; it saves and loads with these).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import zipfile

import torch

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
CHECKSUMS = "checksums.json"
RUN_CONFIG = "run_config.json"
TOKENIZER_DIR = "tokenizer"
SP_TOKENIZER = "SentencePieceTokenizer"
# what a Hugging Face tokenizer folder's copy keeps (pretrain.hf_convert.TOKENIZER_FILES: no weights)
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                       "vocab.json", "merges.txt", "added_tokens.json")
CHECKPOINT_VERSION = 3.0
_ITER_DIR = re.compile(r"iter_(\d{7,})")
_HASH_CHUNK = 1 << 24


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming ``--load`` and the path."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (e.g. a full disk); one line naming ``--save``, the
    iteration that was not written and the intact one. Raised on every rank alike."""


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{iteration:07d}"


def overwrite_problem(save: str | None, load: str | None) -> str | None:
    """Why a pretraining run must not start (one line), or None: a run never overwrites another run's
    checkpoints, so a --save directory that already holds some is resumed (--load equal to --save) or
    refused, instead of a fresh run saving over them at its first save."""
    tracker = os.path.join(save, TRACKER) if save is not None else None
    if tracker is None or not os.path.isfile(tracker):
        return None
    if load is not None and os.path.abspath(load) == os.path.abspath(save):
        return None
    with open(tracker) as f:
        latest = f.read().strip()
    started = f"--load {load} starts from another checkpoint" if load is not None else "no --load"
    return (f"--save {save} already holds a run's checkpoints (latest iteration {latest}) and {started}: this run "
            f"would overwrite them; add --load {save} to resume that run, or give an empty --save directory")


def rank_file(ckpt_dir: str, tp_rank: int, pp_rank: int | None = None) -> str:
    """Megatron's per-rank path: ``mp_rank_XX`` (TP rank), ``mp_rank_XX_YYY`` with pipeline
    parallelism (``pp_rank`` given only when the pipeline has more than one stage)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_rank is None else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(ckpt_dir, name, FILE)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def read_tracker(load_dir: str) -> int | str | None:
    """The iteration in ``load_dir``'s tracker file (``"release"`` allowed), or None without one."""
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"--load: {path} holds {text!r}, not an iteration number") from None


# ================================================================================================
# Collective agreement, checksums
# ================================================================================================


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _gather(obj) -> list:
    """Every rank's ``obj`` (the same list on all ranks); collective."""
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    torch.distributed.all_gather_object(out, obj)
    return out


def _agree(problem: str | None) -> str | None:
    """The lowest rank's problem, or None if no rank has one -- the same on every rank; collective."""
    return next((p for p in _gather(problem) if p), None)


class _HashingWriter:
    """A binary file that counts and sha256-hashes what ``torch.save`` writes through it."""

    def __init__(self, f):
        self._f, self.name, self.bytes, self._sha = f, f.name, 0, hashlib.sha256()

    def write(self, data) -> int:
        n = self._f.write(data)
        self._sha.update(memoryview(data)[:n])
        self.bytes += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def entry(self) -> dict:
        return {"bytes": self.bytes, "sha256": self._sha.hexdigest()}


def file_entry(path: str) -> dict:
    """``{"bytes", "sha256"}`` of a file, read in chunks."""
    sha, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": sha.hexdigest()}


def read_checksums(ckpt_dir: str) -> dict | None:
    """``ckpt_dir``'s ``checksums.json`` ``files`` mapping (relative path -> entry), or None for a
    checkpoint written before checksums existed."""
    path = os.path.join(ckpt_dir, CHECKSUMS)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--load: {path} is unreadable ({e.__class__.__name__}: {e}); "
                              f"{_advice(os.path.dirname(ckpt_dir), ckpt_dir)}") from None
    return files


def _complete(ckpt_dir: str) -> bool:
    """Cheap completeness check of an ``iter_*`` directory: every file its checksums list, at its
    size (without checksums: at least one rank file)."""
    try:
        files = read_checksums(ckpt_dir)
    except CheckpointError:
        return False
    if files is None:
        return any(os.path.isfile(os.path.join(ckpt_dir, d, FILE)) for d in os.listdir(ckpt_dir)
                   if d.startswith("mp_rank_"))
    return bool(files) and all(
        os.path.isfile(p := os.path.join(ckpt_dir, rel)) and os.path.getsize(p) == e["bytes"]
        for rel, e in files.items()
    )


def saved_iterations(save_dir: str) -> list[int]:
    """The iterations of the ``iter_*`` directories in ``save_dir``, ascending."""
    names = os.listdir(save_dir) if os.path.isdir(save_dir) else []
    return sorted(int(m.group(1)) for n in names if (m := _ITER_DIR.fullmatch(n)))


def _advice(load_dir: str, ckpt_dir: str) -> str:
    """What to do about an unloadable ``ckpt_dir``: the newest earlier complete iteration, if any."""
    m = _ITER_DIR.fullmatch(os.path.basename(ckpt_dir))
    bad = int(m.group(1)) if m else None
    for it in reversed(saved_iterations(load_dir)):
        if (bad is None or it < bad) and _complete(os.path.join(load_dir, iter_dir_name(it))):
            return (f"iteration {it} ({os.path.join(load_dir, iter_dir_name(it))}) is complete: resume from it "
                    f"with --ckpt-step {it}, or restore the file from a copy")
    return f"no earlier complete checkpoint in {load_dir}: restore the file from a copy, or start without --load"


def _verify(path: str, ckpt_dir: str, files: dict | None, load_dir: str) -> None:
    """Raise a one-line :class:`CheckpointError` if ``path`` differs from its recorded size or hash."""
    if files is None:
        return
    rel = os.path.relpath(path, ckpt_dir).replace(os.sep, "/")
    expected = files.get(rel)
    if expected is None:
        raise CheckpointError(f"--load: {path} is not listed in {os.path.join(ckpt_dir, CHECKSUMS)}; "
                              f"{_advice(load_dir, ckpt_dir)}")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise CheckpointError(f"--load: {path} is truncated ({size} of {expected['bytes']} bytes written at "
                              f"save time); {_advice(load_dir, ckpt_dir)}")
    if file_entry(path)["sha256"] != expected["sha256"]:
        raise CheckpointError(f"--load: {path} is corrupt (its sha256 differs from the one recorded at save "
                              f"time, size unchanged); {_advice(load_dir, ckpt_dir)}")


# torch.load's errors for a file cut short or overwritten (zip reader, unpickler)
_UNREADABLE = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, KeyError)


def _torch_load(path: str, ckpt_dir: str, load_dir: str, **kwargs) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, **kwargs)  # our files: python objects
    except _UNREADABLE as e:
        what = " ".join(str(e).split())[:160]
        raise CheckpointError(f"--load: {path} cannot be read ({e.__class__.__name__}: {what}); "
                              f"{_advice(load_dir, ckpt_dir)}") from None


# ================================================================================================
# run_config.json and the tokenizer copy
# ================================================================================================


def _write_run_config(ckpt_dir: str, iteration: int, state: dict) -> dict:
    """``run_config.json`` and the tokenizer copy in ``ckpt_dir`` (module docstring); returns their
    checksum entries. Only for states with a ``model_config``."""
    if not state.get("model_config"):
        return {}
    args = state.get("args") or {}
    source = state.get("tokenizer_model") or args.get("tokenizer_model")
    tokenizer, written = None, []
    if source and os.path.exists(source):
        dest = os.path.join(ckpt_dir, TOKENIZER_DIR)
        os.makedirs(dest)
        names = [n for n in _HF_TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))] if os.path.isdir(source) \
            else [os.path.basename(source)]  # fmt: skip
        for name in names:
            shutil.copyfile(os.path.join(source, name) if os.path.isdir(source) else source, os.path.join(dest, name))
            written.append(os.path.join(dest, name))
        rel = TOKENIZER_DIR if os.path.isdir(source) else f"{TOKENIZER_DIR}/{names[0]}"
        tokenizer = {"type": args.get("tokenizer_type", SP_TOKENIZER), "path": rel,
                     "source": os.path.abspath(source), "bytes": sum(os.path.getsize(p) for p in written)}
    config = {"iteration": iteration, "tokenizer": tokenizer, "model_config": state["model_config"], "args": args}
    path = os.path.join(ckpt_dir, RUN_CONFIG)
    with open(path, "w") as f:
        json.dump(config, f, indent=1, sort_keys=True, default=repr)  # args may hold non-JSON values
        f.flush()
        os.fsync(f.fileno())
    return {os.path.relpath(p, ckpt_dir).replace(os.sep, "/"): file_entry(p) for p in [*written, path]}


def read_run_config(ckpt_dir: str) -> dict | None:
    """``ckpt_dir``'s ``run_config.json`` (an ``iter_*`` directory), or None for a checkpoint written
    before it existed (or by a state without a ``model_config``)."""
    path = os.path.join(ckpt_dir, RUN_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load: {path} is unreadable ({e.__class__.__name__}: {e}); "
                              f"{_advice(os.path.dirname(ckpt_dir), ckpt_dir)}") from None


def checkpoint_tokenizer(ckpt_dir: str, ckpt: dict | None = None) -> tuple[str | None, str | None]:
    """``(path, tokenizer type)`` of the tokenizer the run that wrote ``ckpt_dir`` used: the copy in
    the checkpoint; for older checkpoints (no ``run_config.json``) the ``--tokenizer-model`` file or
    folder recorded in ``ckpt`` (its ``args`` / ``tokenizer_model``) if it still exists; else
    ``(None, None)``."""
    tok = (read_run_config(ckpt_dir) or {}).get("tokenizer")
    if tok and os.path.exists(path := os.path.join(ckpt_dir, tok["path"])):
        return path, tok.get("type", SP_TOKENIZER)
    args = (ckpt or {}).get("args") or {}
    path = args.get("tokenizer_model") or (ckpt or {}).get("tokenizer_model")
    if path and os.path.exists(path):
        return path, args.get("tokenizer_type", SP_TOKENIZER)
    return None, None

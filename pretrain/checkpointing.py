"""Checkpoints in Megatron-LM's layout, written atomically, checksummed; exact resume on CPU and GPU.

    DIR/latest_checkpointed_iteration.txt      "10": the newest *complete* checkpoint
    DIR/iter_0000010/mp_rank_00/model_optim_rng.pt
    DIR/iter_0000010/mp_rank_01/model_optim_rng.pt  one file per tensor-parallel rank
    DIR/iter_0000010/checksums.json            size and sha256 of every file above

Each file (written by data-parallel rank 0 of its TP rank; plain ``torch.save``) holds Megatron-LM's
keys ``checkpoint_version``, ``iteration``, ``model`` (the unwrapped model's ``state_dict``: every
policy linear's ``_extra_state`` is its ``LayerQuantState`` -- stochastic-rounding call counters
and amax histories), ``optimizer``, ``opt_param_scheduler``, ``rng_state`` (one entry per data
parallel rank: python, numpy, torch CPU, CUDA and megatron's CUDA RNG tracker), ``args`` (a dict),
and ours: ``consumed_train_samples`` (the data position), ``precision_plan``
(``PrecisionPlan.to_dict()``), ``model_config`` (``dataclasses.asdict(ModelConfig)``, vocabulary
included) and ``tokenizer_model`` (the tokenizer file the run used). Load with
``torch.load(..., weights_only=False)``: RNG states hold numpy arrays.

Beside them global rank 0 writes how the checkpoint was made, so that every entry point that loads
it (evaluation, generation, RL, export) needs no flag the run already had:

    DIR/iter_0000010/run_config.json           {"iteration", "args", "model_config", "tokenizer"}
    DIR/iter_0000010/tokenizer/tokenizer.model a copy of the run's tokenizer (sentencepiece file, or a
                                               Hugging Face folder's tokenizer files)

``tokenizer`` is ``{"type": --tokenizer-type, "path": "tokenizer/...", "source": the file the run
read, "bytes"}`` or null; :func:`checkpoint_tokenizer` finds it (for checkpoints without
``run_config.json``: the saved ``--tokenizer-model`` path, where it still exists). Both are written
for states that carry a ``model_config`` (every training run's), and listed in ``checksums.json``.

Atomicity: all ranks write into ``DIR/.tmp_iter_0000010``; after a barrier global rank 0 writes
``checksums.json`` there, renames it to ``DIR/iter_0000010`` and then replaces the tracker file
(written beside it, fsynced, ``os.replace``). A crash at any point leaves either the previous
checkpoint and tracker, or the new ones; a stale ``.tmp_*`` directory is never read and is removed
by the next save. ``retain=N`` (``--save-retain``) then removes all but the newest N complete
checkpoints -- only after the new one is published.

Integrity: ``checksums.json`` is ``{"iteration": 10, "files": {"mp_rank_00/model_optim_rng.pt":
{"bytes": ..., "sha256": ...}, ...}}``, hashed while the files are written (``distrib_optim.pt`` is
read back once). Loading checks each file's size and hash before ``torch.load``, so a truncated or
silently corrupted file is one line naming it and the newest earlier complete iteration (load it
with ``--ckpt-step N``); a checkpoint without ``checksums.json`` (older versions) loads unchecked,
with an unreadable file reported the same way.

Failures are collective: each rank's problem is gathered (``all_gather_object``) so that every rank
raises the same one-line :class:`CheckpointError` (load) or :class:`CheckpointSaveError` (a save
that could not be completed, e.g. a full disk: the partial directory is removed and the previous
checkpoint stays the tracker's) -- no rank is left waiting in a collective the others abandoned.

``--ckpt-format torch_dist`` writes megatron-core's sharded format instead (``pretrain.dist_checkpoint``:
same tracker, temporary directory, checksums, publication and retention, through ``begin_save`` /
``publish_save`` here); :func:`load_checkpoint` reads either, recognising ``torch_dist`` by its
``metadata.json``.

Here: saving, loading (resharding a model over another TP size), RNG states. The layout's names, the
errors, checksums and ``run_config.json`` with the tokenizer copy: ``pretrain.checkpoint_files``.
"""

from __future__ import annotations

import os

import torch
from megatron.core import parallel_state

from model.gpt import ModelConfig
from pretrain.checkpoint_files import (  # noqa: F401 - the layout's names, re-exported (loaders, tests)
    _HF_TOKENIZER_FILES,
    _ITER_DIR,
    CHECKPOINT_VERSION,
    CHECKSUMS,
    FILE,
    RUN_CONFIG,
    SP_TOKENIZER,
    TOKENIZER_DIR,
    TRACKER,
    CheckpointError,
    CheckpointSaveError,
    _advice,
    _agree,
    _complete,
    _fsync_dir,
    _gather,
    _HashingWriter,
    _torch_load,
    _verify,
    _world,
    _write_atomic_text,
    _write_run_config,
    checkpoint_tokenizer,
    file_entry,
    iter_dir_name,
    rank_file,
    read_checksums,
    read_run_config,
    read_tracker,
    saved_iterations,
)
from pretrain.checkpoint_transaction import (  # noqa: F401 - re-exported (dist_checkpoint, tests)
    _give_up,
    _remove_dir,
    _retain,
    _save_problem,
    _write_failure,
    begin_save,
    gather_rng_states,
    get_rng_state,
    publish_save,
    set_rng_state,
)
from pretrain.dist_checkpoint import is_dist_checkpoint
from pretrain.reshard import reshard

# ================================================================================================
# Save / load
# ================================================================================================


def this_rank_file(ckpt_dir: str) -> str:
    """This rank's file in ``ckpt_dir``: ``mp_rank_XX`` by TP rank, ``mp_rank_XX_YYY`` with pipeline
    stages."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else None
    return rank_file(ckpt_dir, parallel_state.get_tensor_model_parallel_rank(), pp_rank)


def save_checkpoint(save_dir: str, iteration: int, state: dict, write_beside=None, retain: int | None = None) -> str:
    """Write this rank's ``state`` (``rng_state`` is added here) for ``iteration``; collective.

    Returns the checkpoint directory. Only data-parallel rank 0 of each model-parallel (TP, PP)
    rank writes (model and optimizer are replicated over data parallelism); global rank 0
    publishes the directory with the checksums of every file and, with ``retain``, deletes all but
    the ``retain`` newest checkpoints. ``write_beside(rank_dir)``, if given, is called on *every*
    rank with the directory of its rank file, for collective writers of further files (megatron's
    distributed optimizer gathers its sharded state over data parallelism into ``distrib_optim.pt``).
    Raises :class:`CheckpointSaveError` on every rank if any rank could not write (the partial
    directory is removed; the previous checkpoint and tracker are untouched).
    """
    rank = torch.distributed.get_rank()
    tmp = begin_save(save_dir, iteration)
    rng_states = gather_rng_states()

    path = this_rank_file(tmp)
    files, problem = {}, None
    try:
        if write_beside is not None:
            write_beside(os.path.dirname(path))
        if parallel_state.get_data_parallel_rank() == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            payload = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, **state,
                       "rng_state": rng_states}  # fmt: skip
            with open(path, "wb") as f:
                writer = _HashingWriter(f)
                torch.save(payload, writer)
                f.flush()
                os.fsync(f.fileno())
            files[os.path.relpath(path, tmp)] = writer.entry()
            rank_dir = os.path.dirname(path)
            for name in sorted(os.listdir(rank_dir)):  # e.g. distrib_optim.pt, written by write_beside
                if name != FILE:
                    files[os.path.relpath(os.path.join(rank_dir, name), tmp)] = file_entry(os.path.join(rank_dir, name))
    except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's zip writer after an OSError
        if (failure := _write_failure(e)) is None:
            raise
        problem = _save_problem(save_dir, iteration, failure)
    if rank == 0 and problem is None:
        try:
            files.update(_write_run_config(tmp, iteration, state))
        except OSError as e:
            problem = _save_problem(save_dir, iteration, e)
    return publish_save(save_dir, iteration, tmp, problem, files, retain)


def saved_parallel_sizes(ckpt_dir: str) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of an ``iter_*`` directory, read from its ``mp_rank_XX`` /
    ``mp_rank_XX_YYY`` names; (0, 0) when it has none."""
    tp_ranks, pp_ranks = set(), set()
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else ():
        parts = name.removeprefix("mp_rank_").split("_") if name.startswith("mp_rank_") else []
        if 1 <= len(parts) <= 2 and all(p.isdigit() for p in parts):
            tp_ranks.add(int(parts[0]))
            pp_ranks.add(int(parts[1]) if len(parts) == 2 else 0)
    return len(tp_ranks), len(pp_ranks)


# Entries of a rank file that belong to its TP shard of the *training state*; not resharded.
NOT_RESHARDED = ("optimizer", "opt_param_scheduler", "rng_state", "consumed_train_samples")


def _tp_refusal(ckpt_dir: str, saved: int, tp_size: int) -> CheckpointError:
    return CheckpointError(
        f"--load: {ckpt_dir} was saved with --tensor-model-parallel-size {saved}, this run uses {tp_size}; "
        f"resuming needs the same size (--finetune loads its model weights at any size, and so does "
        f"launch/evaluate.py)"
    )


def _incomplete(ckpt_dir: str, saved: int, found: int) -> CheckpointError:
    return CheckpointError(f"--load: {ckpt_dir} was saved with --tensor-model-parallel-size {saved} but "
                           f"holds {found} tensor-parallel rank director{'y' if found == 1 else 'ies'}")


def _load_resharded(load_dir: str, ckpt_dir: str, saved_tp: int, tp_size: int) -> dict:
    """This rank's model, resharded from all ``saved_tp`` rank files (see ``load_checkpoint``)."""
    files = [rank_file(ckpt_dir, r) for r in range(saved_tp)]
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"--load: missing {path} ({ckpt_dir} has {saved_tp} tensor-parallel ranks)")
    checksums = read_checksums(ckpt_dir)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for path in files[rank :: _world()]:  # every rank reads every file; each verifies its share
        _verify(path, ckpt_dir, checksums, load_dir)
    # mmap: only the model's tensors are read, not the optimizer states beside them
    shards = [_torch_load(path, ckpt_dir, load_dir, mmap=True) for path in files]
    first = shards[0]
    saved_args_tp = first.get("args", {}).get("tensor_model_parallel_size", saved_tp)
    if saved_args_tp != saved_tp:
        raise _incomplete(ckpt_dir, saved_args_tp, saved_tp)
    if not first.get("model_config"):
        raise CheckpointError(f"--load: {ckpt_dir} has no model_config (saved by an older version), so it "
                              f"cannot be resharded; load it with --tensor-model-parallel-size {saved_tp}")
    cfg = ModelConfig(**first["model_config"])
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    try:
        (model,) = reshard([s["model"] for s in shards], cfg, tp_size, ranks=[tp_rank])
    except ValueError as e:
        raise CheckpointError(f"--load: cannot reshard {ckpt_dir} from --tensor-model-parallel-size "
                              f"{saved_tp} to {tp_size}: {e}") from None
    kept = {k: v for k, v in first.items() if k not in NOT_RESHARDED and k != "model"}
    return {**kept, "model": model, "path": ckpt_dir, "resharded": True}


def load_checkpoint(
    load_dir: str, tp_size: int, *, reshard_model: bool = False, iteration: int | None = None,
    model_entry: bool = True,
) -> dict | None:
    """This rank's checkpoint dict from ``load_dir``'s latest iteration (``iteration``, if given:
    ``--ckpt-step``), or None if there is none yet; collective (ranks agree on any refusal).

    The dict is the rank file's (see the module docstring) plus ``path`` (the ``iter_*`` directory)
    and ``resharded`` (False). Raises :class:`CheckpointError` if the tracker points to a missing
    directory, a file differs from its recorded size or sha256 or cannot be read, or the checkpoint
    was written with another pipeline-parallel size, or with another tensor-parallel size and
    ``reshard_model`` is False -- on every rank, whichever rank found the problem.

    ``reshard_model=True`` (``--finetune``, evaluation): a checkpoint saved at another TP size is
    loaded for its model only. Every rank reads all saved rank files (memory-mapped), and
    ``pretrain.reshard`` merges their ``model`` entries and cuts out this rank's part for
    ``tp_size`` (vocabulary re-padded, quantization state merged; rules there). The dict then has
    ``model`` (this rank's state dict, fit for ``load_state_dict(strict=True)``), ``resharded``
    True and rank 0's ``iteration``, ``args`` (with the *saved* ``tensor_model_parallel_size``),
    ``precision_plan``, ``model_config``, ``tokenizer_model``, ``checkpoint_version``; not
    ``optimizer``, ``opt_param_scheduler``, ``rng_state`` or ``consumed_train_samples`` (training
    state is not resharded: resuming needs the saved TP size). Needs the checkpoint's
    ``model_config``. At the saved TP size the option changes nothing.
    """
    ckpt, problem = None, None
    try:
        ckpt = _load(load_dir, tp_size, reshard_model, iteration)
    except CheckpointError as e:
        problem = str(e)
    if problem := _agree(problem):
        raise CheckpointError(problem)
    if ckpt is not None and ckpt.get("checkpoint_format") == "torch_dist":
        ckpt = _load_dist(load_dir, ckpt["path"], tp_size, model_entry)
    return ckpt


def _load_dist(load_dir: str, ckpt_dir: str, tp_size: int, model_entry: bool) -> dict:
    """A ``torch_dist`` checkpoint (``pretrain.dist_checkpoint``): its common state, checked; with
    ``model_entry`` also ``model``, this rank's state dict at ``tp_size`` (megatron-core's load into
    a model built from the checkpoint's ``model_config``: it reshards any TP size); collective."""
    from pretrain.dist_checkpoint import load_common, load_dist_state

    ckpt = {**load_common(ckpt_dir, load_dir), "path": ckpt_dir}
    saved_tp = (ckpt.get("args") or {}).get("tensor_model_parallel_size", tp_size)
    ckpt["resharded"] = saved_tp != tp_size
    if not model_entry:
        return ckpt
    if not ckpt.get("model_config"):
        raise CheckpointError(f"--load: {ckpt_dir} has no model_config, so its model cannot be built to load it")
    from model.gpt import build_gpt

    model = build_gpt(ModelConfig(**ckpt["model_config"]))
    load_dist_state(ckpt, model, optimizer=False, rng=False)
    ckpt["model"] = model.state_dict()
    for key in NOT_RESHARDED if ckpt["resharded"] else ():
        ckpt.pop(key, None)
    return ckpt


def _load(load_dir: str, tp_size: int, reshard_model: bool, iteration: int | None) -> dict | None:
    """``load_checkpoint`` on this rank alone."""
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None
    ckpt_dir = os.path.join(load_dir, iter_dir_name(iteration))
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"--load: missing {ckpt_dir} (" + (
            f"the tracker {os.path.join(load_dir, TRACKER)} names iteration {iteration})"
            if iteration == read_tracker(load_dir) else f"--ckpt-step {iteration})"))
    if is_dist_checkpoint(ckpt_dir):  # read collectively by load_checkpoint
        return {"path": ckpt_dir, "checkpoint_format": "torch_dist"}
    saved_tp, saved_pp = saved_parallel_sizes(ckpt_dir)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    path = this_rank_file(ckpt_dir)
    if saved_tp and saved_pp != pp_size:
        raise CheckpointError(
            f"--load: {ckpt_dir} was saved with --pipeline-model-parallel-size {saved_pp}, this run uses "
            f"{pp_size}; resharding pipeline stages is not supported"
        )
    if saved_tp and saved_tp != tp_size:
        if not reshard_model:
            raise _tp_refusal(ckpt_dir, saved_tp, tp_size)
        if pp_size > 1:
            raise CheckpointError(f"--load: {ckpt_dir}: resharding pipeline-parallel checkpoints is not "
                                  f"supported")
        return _load_resharded(load_dir, ckpt_dir, saved_tp, tp_size)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"--load: missing {path} (the tracker {os.path.join(load_dir, TRACKER)} names "
            f"iteration {iteration})"
        )
    _verify(path, ckpt_dir, read_checksums(ckpt_dir), load_dir)
    ckpt = _torch_load(path, ckpt_dir, load_dir)
    saved_args_tp = ckpt.get("args", {}).get("tensor_model_parallel_size", tp_size)
    if saved_args_tp != tp_size:  # the directory holds fewer rank files than the run that wrote it had
        if reshard_model:
            raise _incomplete(ckpt_dir, saved_args_tp, saved_tp)
        raise _tp_refusal(ckpt_dir, saved_args_tp, tp_size)
    ckpt["path"] = ckpt_dir
    ckpt["resharded"] = False
    return ckpt


def restore_rng_state(ckpt: dict) -> bool:
    """Set this rank's RNGs from ``ckpt``; False (nothing set) if the data-parallel size changed."""
    states = ckpt.get("rng_state") or []
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if len(states) != dp_size:
        return False
    set_rng_state(states[dp_rank])
    return True

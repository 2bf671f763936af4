"""Checkpoints in Megatron-LM's layout, written atomically; exact resume on CPU and GPU.

    DIR/latest_checkpointed_iteration.txt      "10": the newest *complete* checkpoint
    DIR/iter_0000010/mp_rank_00/model_optim_rng.pt
    DIR/iter_0000010/mp_rank_01/model_optim_rng.pt  one file per tensor-parallel rank

Each file (written by data-parallel rank 0 of its TP rank; plain ``torch.save``) holds Megatron-LM's
keys ``checkpoint_version``, ``iteration``, ``model`` (the unwrapped model's ``state_dict``: every
policy linear's ``_extra_state`` is its ``LayerQuantState`` -- stochastic-rounding call counters
and amax histories), ``optimizer``, ``opt_param_scheduler``, ``rng_state`` (one entry per data
parallel rank: python, numpy, torch CPU, CUDA and megatron's CUDA RNG tracker), ``args`` (a dict),
and ours: ``consumed_train_samples`` (the data position), ``precision_plan``
(``PrecisionPlan.to_dict()``), ``model_config`` (``dataclasses.asdict(ModelConfig)``, vocabulary
included) and ``tokenizer_model`` (the tokenizer file the run used). Load with
``torch.load(..., weights_only=False)``: RNG states hold numpy arrays.

Atomicity: all ranks write into ``DIR/.tmp_iter_0000010``; after a barrier global rank 0 renames it
to ``DIR/iter_0000010`` and then replaces the tracker file (written beside it, fsynced,
``os.replace``). A crash at any point leaves either the previous checkpoint and tracker, or the new
ones; a stale ``.tmp_*`` directory is never read and is removed by the next save.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
from megatron.core import parallel_state

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming ``--load`` and the path."""


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{iteration:07d}"


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
# RNG state
# ================================================================================================


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


# ================================================================================================
# Save / load
# ================================================================================================


def this_rank_file(ckpt_dir: str) -> str:
    """This rank's file in ``ckpt_dir``: ``mp_rank_XX`` by TP rank, ``mp_rank_XX_YYY`` with pipeline
    stages."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else None
    return rank_file(ckpt_dir, parallel_state.get_tensor_model_parallel_rank(), pp_rank)


def save_checkpoint(save_dir: str, iteration: int, state: dict, write_beside=None) -> str:
    """Write this rank's ``state`` (``rng_state`` is added here) for ``iteration``; collective.

    Returns the checkpoint directory. Only data-parallel rank 0 of each model-parallel (TP, PP)
    rank writes (model and optimizer are replicated over data parallelism); global rank 0
    publishes the directory. ``write_beside(rank_dir)``, if given, is called on *every* rank with
    the directory of its rank file, for collective writers of further files (megatron's
    distributed optimizer gathers its sharded state over data parallelism into ``distrib_optim.pt``).
    """
    rank = torch.distributed.get_rank()
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = os.path.join(save_dir, f".tmp_{iter_dir_name(iteration)}")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        for name in os.listdir(save_dir):  # stale partial saves of crashed runs
            if name.startswith((".tmp_iter_", ".old_iter_")):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        os.makedirs(tmp)
    rng_states = gather_rng_states()
    torch.distributed.barrier()

    path = this_rank_file(tmp)
    if write_beside is not None:
        write_beside(os.path.dirname(path))
    if parallel_state.get_data_parallel_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        payload = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            **state,
            "rng_state": rng_states,
        }
        with open(path, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    torch.distributed.barrier()

    if rank == 0:
        if os.path.exists(final):  # re-saving an iteration (e.g. --finetune into the same --save)
            old = os.path.join(save_dir, f".old_{iter_dir_name(iteration)}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(save_dir)
        _write_atomic_text(os.path.join(save_dir, TRACKER), str(iteration))
    torch.distributed.barrier()
    return final


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


def _load_resharded(ckpt_dir: str, saved_tp: int, tp_size: int) -> dict:
    """This rank's model, resharded from all ``saved_tp`` rank files (see ``load_checkpoint``)."""
    from model.gpt import ModelConfig
    from pretrain.reshard import reshard

    files = [rank_file(ckpt_dir, r) for r in range(saved_tp)]
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"--load: missing {path} ({ckpt_dir} has {saved_tp} tensor-parallel ranks)")
    # mmap: only the model's tensors are read, not the optimizer states beside them
    shards = [torch.load(path, map_location="cpu", weights_only=False, mmap=True) for path in files]
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


def load_checkpoint(load_dir: str, tp_size: int, *, reshard_model: bool = False) -> dict | None:
    """This rank's checkpoint dict from ``load_dir``'s latest iteration, or None if there is none yet.

    The dict is the rank file's (see the module docstring) plus ``path`` (the ``iter_*`` directory)
    and ``resharded`` (False). Raises :class:`CheckpointError` if the tracker points to a missing
    directory, or the checkpoint was written with another pipeline-parallel size, or with another
    tensor-parallel size and ``reshard_model`` is False.

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
    iteration = read_tracker(load_dir)
    if iteration is None:
        return None
    ckpt_dir = os.path.join(load_dir, iter_dir_name(iteration))
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
        return _load_resharded(ckpt_dir, saved_tp, tp_size)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"--load: missing {path} (the tracker {os.path.join(load_dir, TRACKER)} names "
            f"iteration {iteration})"
        )
    ckpt = torch.load(path, map_location="cpu", weights_only=False)  # our own files: python objects inside
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

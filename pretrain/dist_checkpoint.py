"""Checkpoints in megatron-core's ``torch_dist`` format (``--ckpt-format torch_dist``).

    DIR/latest_checkpointed_iteration.txt      "10", as in the legacy layout
    DIR/iter_0000010/metadata.json             megatron's: {"sharded_backend": "torch_dist", ...}
    DIR/iter_0000010/common.pt                 everything that is not a sharded tensor (rank 0's)
    DIR/iter_0000010/.metadata, __0_0.distcp   torch.distributed.checkpoint's files (each rank's shards)
    DIR/iter_0000010/checksums.json            size and sha256 of every file above
    DIR/iter_0000010/run_config.json, tokenizer/   as in the legacy layout

What is saved is Megatron-LM's sharded state dict: ``model`` is the model's ``sharded_state_dict()``
(megatron's GPTModel: every TP-sharded weight a ``ShardedTensor`` with its global shape, offset and
replica id, SwiGLU's ``linear_fc1`` through megatron's chunking factory, each policy linear's
quantization state a ``ShardedObject`` held by TP rank 0; the output layer's, which megatron's
GPTModel leaves out, is added under ``model.output_layer._extra_state``); ``optimizer`` is the
optimizer's sharded state dict (megatron's optimizers' ``sharded_state_dict``; the torch engine's
AdamW through megatron's ``optim_state_to_sharding_state``: ``exp_avg`` / ``exp_avg_sq`` sharded as
their parameters, the step counts in common); ``rng_state`` is a ``ShardedObject`` of every
data-parallel rank's RNG state per (PP, TP) rank (Megatron-LM's). With ``--bf16`` on the torch engine
the model's entries are the FP32 main weights (as in the legacy layout). The rest (iteration, lr
schedule, samples consumed, precision plan and schedule, model config, args) goes to ``common.pt``
with ``checkpoint_format`` and ``checkpoint_writer`` (which path wrote the files).

Writers. On CUDA the files are written by megatron-core's own ``dist_checkpointing.save`` with its
default ``torch_dist`` strategy. On CPU that strategy cannot run (megatron-core 0.16 moves tensors
and its failure flag to CUDA), so the same ``dist_checkpointing.save`` is given a synchronous
strategy that does what megatron's does -- its own conversion of the sharded tensors
(``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``) and its planner
(``MCoreSavePlanner``) -- and writes with ``torch.distributed.checkpoint``'s ``FileSystemWriter``;
megatron writes ``common.pt`` and ``metadata.json`` either way. ``checkpoint_writer`` is
``"megatron.core.dist_checkpointing"`` or ``"torch.distributed.checkpoint"`` respectively. Every
checkpoint is read by megatron-core's ``dist_checkpointing.load`` (CPU and CUDA alike), which
reshards: a checkpoint saved at one TP size loads at any other, optimizer state included.

Guarantees, as for the legacy layout (``pretrain.checkpointing``): all ranks write into
``DIR/.tmp_iter_N``, global rank 0 hashes every file into ``checksums.json`` and publishes the
directory by a rename, then replaces the tracker; ``--save-retain``; failures are one line on every
rank; loading checks every file's size and sha256 first.
"""

from __future__ import annotations

import contextlib
import os

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.checkpoint_files import (
    CHECKPOINT_VERSION,
    CHECKSUMS,
    CheckpointError,
    _advice,
    _agree,
    _write_run_config,
    file_entry,
    read_checksums,
)
from pretrain.checkpoint_transaction import (
    _save_problem,
    _write_failure,
    begin_save,
    gather_rng_states,
    publish_save,
)

FORMATS = ("torch_dist", "legacy")
METADATA = "metadata.json"  # megatron's marker of a dist_checkpointing directory
WRITER_MEGATRON = "megatron.core.dist_checkpointing"
WRITER_DCP = "torch.distributed.checkpoint"
_SHARDED = ("model", "optimizer", "rng_state")  # the sharded parts; the rest is common.pt


def is_dist_checkpoint(ckpt_dir: str) -> bool:
    """Whether ``ckpt_dir`` (an ``iter_*`` directory) is a ``torch_dist`` checkpoint."""
    return os.path.isfile(os.path.join(ckpt_dir, METADATA))


class _DCPSaveStrategy(SaveShardedStrategy):
    """megatron's ``torch_dist`` save strategy without its CUDA-only steps: the same conversion and
    planner, written synchronously by ``torch.distributed.checkpoint.FileSystemWriter``."""

    def __init__(self):
        super().__init__("torch_dist", 1)

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir):
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner,
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        dcp_save(pyt_state_dict, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))


def writer_name() -> str:
    return WRITER_MEGATRON if torch.cuda.is_available() else WRITER_DCP


# ================================================================================================
# The sharded state dict
# ================================================================================================


def model_sharded_state_dict(model: torch.nn.Module, prefix: str = "") -> dict:
    """``model.sharded_state_dict(prefix)`` plus the output layer's quantization state (a policy
    output layer's ``_extra_state``, which megatron's GPTModel refuses to hold; saved as a
    ``ShardedObject`` like every other linear's). A plain megatron model's is unchanged."""
    out = getattr(model, "output_layer", None)
    policy_out = out is not None and hasattr(out, "quant_state")
    if policy_out:
        out.get_extra_state = lambda: None  # GPTModel.sharded_state_dict asserts it is empty
    try:
        sd = model.sharded_state_dict(prefix=prefix)
    finally:
        if policy_out:
            del out.get_extra_state
    if policy_out:
        key = f"{prefix}output_layer._extra_state"
        sd[key] = make_sharded_object_for_checkpoint(out.get_extra_state(), key)
    return sd


def _torch_optimizer_sharded(optimizer: torch.optim.Optimizer, model_sd: dict, params: list, *,
                             is_loading: bool) -> tuple[dict, dict]:
    """(sharded state, step counts) of a torch AdamW over ``params`` (the model's parameters, in
    the optimizer's order), its tensors sharded as the parameters they belong to (megatron's
    ``optim_state_to_sharding_state``). Loading: the state is allocated first (zeros) so that every
    tensor the checkpoint holds has a place."""
    if is_loading:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not optimizer.state[p]:
                    optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    state = optimizer.state_dict()
    steps = {i: s["step"].clone() for i, s in state["state"].items() if "step" in s}
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    return state, steps


def _with_steps(states: dict, steps: dict, path: str) -> dict:
    """AdamW's per-parameter step counts put back into the loaded state. ``steps`` is global rank 0's
    (common state), indexed by its optimizer's parameter order, which another expert-parallel or
    pipeline layout changes; AdamW steps every parameter every iteration, so one count shared by all
    is given to every parameter of this layout. Counts that differ are restored by index, only where
    the layout holds the same parameters; otherwise one line."""
    counts = {float(s) for s in steps.values()}
    if len(counts) == 1:
        step = next(iter(steps.values()))
        return {i: {**s, "step": step.clone()} for i, s in states.items()}
    if set(steps) != set(states):
        raise CheckpointError(f"--load: {path}: its AdamW step counts differ between parameters and this run's "
                              f"parallel layout orders the parameters differently; resume with the saved "
                              f"--expert-model-parallel-size, or start the optimizer afresh with --no-load-optim")
    return {i: {**s, "step": steps[i].clone()} for i, s in states.items()}


def _optimizer_params(engine) -> list:
    """The model parameters of the torch engine's optimizer, in its order (an FP32 main stands for
    its model parameter: the model's sharded state dict is built while the model holds the mains)."""
    model_of = {}
    if engine.main is not None:
        model_of = {id(main): p for p, (_, main) in zip(engine.main.model_params, engine.main.named, strict=True)}
    return [model_of.get(id(p), p) for g in engine.optimizer.param_groups for p in g["params"]]


def _rng_sharded(rng_states: list) -> ShardedObject:
    """Megatron-LM's ``rng_state`` entry: every DP rank's states, one object per (PP, TP) rank."""
    pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", rng_states, (pp, tp),
                         (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


@contextlib.contextmanager
def _weights_for_checkpoint(engine):
    """Within: the model's parameters hold what a checkpoint holds (the torch engine's FP32 mains
    with ``--bf16``)."""
    with engine.full_precision_weights() if engine is not None else contextlib.nullcontext():
        yield


def _sharded(model, engine, *, optimizer: bool, rng_states: list | None, is_loading: bool) -> tuple[dict, dict]:
    """(sharded state dict, common additions) of the model, optimizer and RNG states."""
    sd = {"model": model_sharded_state_dict(model)}
    common = {}
    if optimizer and engine is not None:
        if engine.name == "megatron":
            sd["optimizer"] = engine.optimizer.sharded_state_dict(sd["model"], is_loading=is_loading)
        else:
            sd["optimizer"], steps = _torch_optimizer_sharded(engine.optimizer, sd["model"], _optimizer_params(engine),
                                                              is_loading=is_loading)
            common["optimizer_steps"] = steps
    if rng_states is not None:
        sd["rng_state"] = _rng_sharded(rng_states)
    return sd, common


# ================================================================================================
# Save
# ================================================================================================


def save_dist_checkpoint(save_dir: str, iteration: int, state: dict, model, engine, retain: int | None = None) -> str:
    """Write ``iteration`` in the ``torch_dist`` format; collective. ``state`` is the checkpoint's
    non-sharded part (what the legacy layout's rank file holds besides ``model`` and
    ``optimizer``); ``model`` and ``engine`` give the sharded part. Returns the directory; raises
    :class:`CheckpointSaveError` on every rank if any rank could not write (the previous
    checkpoint and tracker are untouched)."""
    tmp = begin_save(save_dir, iteration)
    rng_states = gather_rng_states()
    writer = writer_name()
    common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, **state,
              "checkpoint_format": "torch_dist", "checkpoint_writer": writer}  # fmt: skip
    problem = None
    try:
        with _weights_for_checkpoint(engine):
            sd, extra = _sharded(model, engine, optimizer=True, rng_states=rng_states, is_loading=False)
            strategy = None if writer == WRITER_MEGATRON else _DCPSaveStrategy()
            dist_checkpointing.save({**common, **extra, **sd}, tmp, sharded_strategy=strategy,
                                    content_metadata={"checkpoint_writer": writer})
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP gathers every rank's failure into one
        failure = _write_failure(e) or _dcp_failure(e)
        if failure is None:
            raise
        problem = _save_problem(save_dir, iteration, failure)
    files = {}
    if torch.distributed.get_rank() == 0 and not _agree(problem):
        try:
            files.update(_write_run_config(tmp, iteration, common))
            for root, _, names in os.walk(tmp):
                for name in names:
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, tmp).replace(os.sep, "/")
                    if rel not in files and rel != CHECKSUMS:
                        files[rel] = file_entry(path)
        except OSError as e:
            problem = _save_problem(save_dir, iteration, e)
    elif torch.distributed.get_rank() != 0:
        _agree(problem)
    return publish_save(save_dir, iteration, tmp, problem, files, retain,
                        extra={"format": "torch_dist", "writer": writer})


def _reason(e: BaseException, limit: int = 300) -> str:
    """``Class: message`` of ``e`` on one line; for a ``CheckpointException``, of the first rank's
    failure inside it (its own text is every rank's traceback)."""
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return _reason(inner, limit)
    return f"{e.__class__.__name__}: {' '.join(str(e).split())[:limit]}"


def _dcp_failure(e: BaseException) -> OSError | None:
    """The first ``OSError`` among a ``torch.distributed.checkpoint`` ``CheckpointException``'s
    per-rank failures (it does not chain them)."""
    for failure in (getattr(e, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, BaseException) and (inner := _dcp_failure(exc)) is not None:
            return inner
    return None


# ================================================================================================
# Load
# ================================================================================================


def verify_dist_checkpoint(ckpt_dir: str, load_dir: str) -> None:
    """Every file ``checksums.json`` lists, at its size and sha256 (each rank checks its share);
    a one-line :class:`CheckpointError` on every rank for the first bad one; collective."""
    from pretrain.checkpoint_files import _verify, _world

    problem = None
    try:
        files = read_checksums(ckpt_dir)
        if files is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            for rel in sorted(files)[rank :: _world()]:
                path = os.path.join(ckpt_dir, rel)
                if not os.path.isfile(path):
                    raise CheckpointError(f"--load: missing {path} (listed in {os.path.join(ckpt_dir, CHECKSUMS)}); "
                                          f"{_advice(load_dir, ckpt_dir)}")
                _verify(path, ckpt_dir, files, load_dir)
    except CheckpointError as e:
        problem = str(e)
    if problem := _agree(problem):
        raise CheckpointError(problem)


def load_common(ckpt_dir: str, load_dir: str) -> dict:
    """The non-sharded part of a ``torch_dist`` checkpoint (``common.pt``), checked first."""
    verify_dist_checkpoint(ckpt_dir, load_dir)
    try:
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - megatron and torch.load raise many kinds
        raise CheckpointError(f"--load: {ckpt_dir}: megatron-core cannot read its common state ({_reason(e)}); "
                              f"{_advice(load_dir, ckpt_dir)}") from None
    common.pop("content_metadata", None)
    return common


def load_dist_state(ckpt: dict, model, engine=None, *, optimizer: bool = True, rng: bool = True) -> dict:
    """Load a ``torch_dist`` checkpoint (``ckpt``: :func:`load_common`'s dict plus ``path``) into
    ``model`` (and ``engine``'s optimizer, with ``optimizer``) at this run's parallel sizes through
    megatron-core's ``dist_checkpointing.load``; collective. Returns ``{"rng_state": [...]}`` (every
    DP rank's states, where ``rng`` and the checkpoint's TP and PP sizes are this run's; else an
    empty list). With ``--bf16`` on the torch engine the FP32 values go to the mains."""
    path = ckpt["path"]
    args = ckpt.get("args") or {}
    same_mp = (args.get("tensor_model_parallel_size", 1) == parallel_state.get_tensor_model_parallel_world_size()
               and args.get("pipeline_model_parallel_size", 1) == parallel_state.get_pipeline_model_parallel_world_size())
    want_rng = rng and same_mp
    out, problem = {"rng_state": []}, None
    with _weights_for_checkpoint(engine):
        sd, _ = _sharded(model, engine, optimizer=optimizer, rng_states=[None] if want_rng else None, is_loading=True)
        try:
            loaded = dist_checkpointing.load(sd, path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - one that does not fit this model: one line
            problem = f"--load: {path} does not fit this model ({_reason(e)})"
        if not (problem := _agree(problem)):
            try:
                model.load_state_dict(loaded["model"], strict=True)
            except RuntimeError as e:
                problem = f"--load: {path} does not fit this model: {' '.join(str(e).split())[:300]}"
        if problem := _agree(problem):
            raise CheckpointError(problem)
    if engine is not None and engine.name == "megatron":
        engine.weights_loaded()
    if optimizer and engine is not None:
        if engine.name == "megatron":
            engine.optimizer.load_state_dict(loaded["optimizer"])
        else:
            state = loaded["optimizer"]
            state["state"] = _with_steps(state["state"], ckpt.get("optimizer_steps") or {}, path)
            state["param_groups"] = [{**g, "params": list(g["params"])} for g in state["param_groups"]]
            engine.optimizer.load_state_dict(state)
    if want_rng:
        out["rng_state"] = loaded["rng_state"]
    return out

"""Build a model for evaluation (one process, TP=1) from any of our weight files.

    init_single_process()
    loaded = load_for_eval("ckpt/llama1b", precision="bf16")     # -> LoadedModel
    loaded.model, loaded.cfg, loaded.plan, loaded.tokenizer_dir

``--load`` may name:
  - a converted Hugging Face checkpoint: ``DIR/hf_converted.pt`` or the file itself
    (``pretrain.hf_convert``; tokenizer in ``DIR/hf_tokenizer`` when the HF dir had one);
  - a training checkpoint directory (``DIR/latest_checkpointed_iteration.txt``, Megatron layout,
    ``pretrain.checkpointing``), saved at any tensor-parallel size (TP>1 shards are merged,
    ``pretrain.reshard``);
  - a plain ``torch.save`` file ``{"model": TP=1 state dict, "model_config": asdict(ModelConfig)}``.

Precision: ``precision=None`` uses the checkpoint's own plan when it has one (a training
checkpoint's ``precision_plan``), else ``bf16``; a name or spec (``--precision``) plus
``--precision-rule`` values resolve a new plan as training does.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from argparse import Namespace

import torch

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from pretrain import hf_convert


@dataclasses.dataclass
class LoadedModel:
    model: torch.nn.Module
    cfg: ModelConfig
    plan: object  # precision.PrecisionPlan
    kind: str  # "hf_converted" | "checkpoint" | "plain"
    path: str
    tokenizer_dir: str | None = None  # HF tokenizer files that came with the weights
    tokenizer_model: str | None = None  # sentencepiece model a training checkpoint was trained with


def init_single_process() -> None:
    """torch.distributed (gloo, world size 1) and megatron parallel_state at TP=1, if not yet set up."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def _plan(model, cfg: ModelConfig, precision: str | None, rules, saved: dict | None):
    from precision import PrecisionPlan, PrecisionPolicy

    if precision is None and saved:
        return PrecisionPlan.from_dict(saved)
    policy = PrecisionPolicy.from_args(precision or "bf16", list(rules or ()))
    return policy.resolve(policy_linear_names(model), cfg.num_layers)


def _build(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_gpt(cfg, seed=seed)


def load_for_eval(
    path: str,
    *,
    precision: str | None = None,
    precision_rules: tuple[str, ...] | list[str] = (),
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 1234,
) -> LoadedModel:
    """The model at ``path`` (see module docstring), plan applied, in eval mode on ``device``.

    ``vocab_size`` (the tokenizer's) is needed only for training checkpoints whose ``args`` do not
    name a readable ``--tokenizer-model``.
    """
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, hf_convert.FILE_NAME)):
        path = os.path.join(path, hf_convert.FILE_NAME)
    if os.path.isdir(path):
        from pretrain.checkpointing import TRACKER

        if not os.path.isfile(os.path.join(path, TRACKER)):
            raise ValueError(f"--load {path}: neither {hf_convert.FILE_NAME} nor a training checkpoint "
                             f"({TRACKER}) is in this directory")
        return load_training_checkpoint(path, precision=precision, precision_rules=precision_rules,
                                        vocab_size=vocab_size, device=device, seed=seed)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load {path}: no such file or directory")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "model" not in payload or "model_config" not in payload:
        raise ValueError(f"--load {path}: expected a dict with 'model' and 'model_config' "
                         f"(an hf_converted.pt or plain file)")
    kind = "hf_converted" if payload.get("format") == hf_convert.FORMAT else "plain"
    cfg = ModelConfig(**payload["model_config"])
    model = _build(cfg, seed)
    hf_convert.load_converted_state_dict(model, payload["model"], cfg)
    plan = _plan(model, cfg, precision, precision_rules, payload.get("precision_plan"))
    apply_precision_plan(model, plan)
    tok_dir = hf_convert.converted_tokenizer_dir(payload, path)
    return LoadedModel(model.to(device).eval(), cfg, plan, kind, path, tokenizer_dir=tok_dir)


# ================================================================================================
# Training checkpoints (pretrain/checkpointing.py's Megatron layout).
# WIRE-UP POINT: this depends on the training loop's checkpoint format (keys "model", "args",
# "precision_plan"; args as saved by pretrain/train.py). Revisit when that format changes.
# ================================================================================================


def load_training_checkpoint(
    load_dir: str,
    *,
    precision: str | None = None,
    precision_rules=(),
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 1234,
) -> LoadedModel:
    """A training checkpoint from ``load_dir`` (latest iteration), as a TP=1 model for evaluation.
    Its tokenizer is the one the run used (``pretrain.checkpointing.checkpoint_tokenizer``).

    The model config is the checkpoint's ``model_config`` (``dataclasses.asdict(ModelConfig)``) when
    it has one, else rebuilt from its ``args`` (``pretrain.arguments.model_config``) with the
    vocabulary size from ``vocab_size`` or the saved ``--tokenizer-model``. Strict load, including
    the linears' quantization state. A checkpoint saved at TP>1 has its shards merged
    (``load_checkpoint(..., reshard_model=True)``: vocabulary re-padded for TP=1, amax histories the
    maximum over shards); resharding needs its ``model_config``, which every training run saves.
    """
    from pretrain.arguments import model_config
    from pretrain.checkpointing import checkpoint_tokenizer, load_checkpoint

    ckpt = load_checkpoint(load_dir, tp_size=1, reshard_model=True)
    if ckpt is None:
        raise ValueError(f"--load {load_dir}: the tracker names no checkpoint")
    args = Namespace(**ckpt.get("args", {}))
    tokenizer_model = getattr(args, "tokenizer_model", None)
    hf = getattr(args, "tokenizer_type", "SentencePieceTokenizer") == "HuggingFaceTokenizer"
    if ckpt.get("model_config"):  # saved by runs whose config is not all flags (e.g. from --load-hf-converted)
        cfg = ModelConfig(**ckpt["model_config"])
    elif vocab_size is None:
        if not tokenizer_model or not (os.path.isdir if hf else os.path.isfile)(tokenizer_model):
            raise ValueError(f"--load {load_dir}: its --tokenizer-model {tokenizer_model!r} is not readable; "
                             f"pass --tokenizer-model")
        from pretrain.data import HFTokenizer, Tokenizer

        cfg = model_config(args, (HFTokenizer if hf else Tokenizer)(tokenizer_model).vocab_size)
    else:
        cfg = model_config(args, vocab_size)
    model = _build(cfg, seed)
    try:
        model.load_state_dict(ckpt["model"], strict=True)
    except RuntimeError as e:
        raise ValueError(f"--load {ckpt['path']} does not fit its own args: {' '.join(str(e).split())[:300]}") from None
    plan = _plan(model, cfg, precision, precision_rules, ckpt.get("precision_plan"))
    apply_precision_plan(model, plan)
    tok_path, tok_type = checkpoint_tokenizer(ckpt["path"], ckpt)  # the run's own, also the built-in one
    hf = tok_type == "HuggingFaceTokenizer"
    return LoadedModel(model.to(device).eval(), cfg, plan, "checkpoint", ckpt["path"],
                       tokenizer_dir=tok_path if hf else None, tokenizer_model=None if hf else tok_path)

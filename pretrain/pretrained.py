"""``--pretrained-checkpoint``: start training (e.g. QAT) from an existing model's weights.

    pre = read_pretrained("ckpt/llama1b")        # cheap: config and metadata, tensors not read
    pre.cfg, pre.kind, pre.tokenizer_model, pre.tokenizer_type
    ...build the model from pre.cfg at this run's TP size...
    load_pretrained_weights(model, pre)           # this rank's shard of every parameter

Megatron-LM's semantics: ``--pretrained-checkpoint`` gives the *initial* weights and is used only
when ``--load`` holds no checkpoint yet, so one command line both starts a fine-tuning run and
resumes it after an interruption (``--load`` = ``--save``). Only model weights are taken; the
iteration count, optimizer, schedule and data position start fresh, and every policy linear keeps
its own fresh quantization state (amax histories fill during ``--qat-warmup-iters``).

``PATH`` may be:
  - a converted Hugging Face checkpoint (``launch/convert_hf.py``): its output directory or the
    ``hf_converted.pt`` file. The TP=1 weights are sharded for any tensor-parallel size. When the
    conversion copied the HF tokenizer (``OUT/hf_tokenizer``), that is the run's default tokenizer.
  - a training checkpoint directory of this project (``DIR/latest_checkpointed_iteration.txt``),
    saved at any tensor-parallel size (resharded when it differs). Its tokenizer is the default.

The model shape (layers, widths, heads, norms, activation, positions, vocabulary, ...) comes from
the checkpoint; a shape flag given on the command line that disagrees is refused in one line.
``--seq-length`` stays the run's own (RoPE models train at any length; a learned position table
must be at least that long).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from model.gpt import ModelConfig
from pretrain import hf_convert
from pretrain.checkpointing import (
    FILE,
    TRACKER,
    CheckpointError,
    checkpoint_tokenizer,
    iter_dir_name,
    load_checkpoint,
    read_tracker,
)
from pretrain.config.model import SHAPE_FROM_CONFIG, shape_of  # noqa: F401 - SHAPE_FROM_CONFIG re-exported

HF_TOKENIZER_TYPE = "HuggingFaceTokenizer"
SP_TOKENIZER_TYPE = "SentencePieceTokenizer"


class PretrainedError(ValueError):
    """A ``--pretrained-checkpoint`` that cannot be used; one line naming the flag and the path."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
    kind: str  # "hf_converted" | "checkpoint"
    path: str  # the hf_converted.pt file, or the training checkpoint's directory
    cfg: ModelConfig
    tokenizer_model: str | None  # the tokenizer that came with the weights, if it is readable
    tokenizer_type: str | None
    iteration: int | str | None = None  # of a training checkpoint


def _converted_file(path: str) -> str | None:
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, hf_convert.FILE_NAME)):
        return os.path.join(path, hf_convert.FILE_NAME)
    if os.path.isfile(path):
        return path
    return None


def _checkpoint_rank0_file(ckpt_dir: str) -> str | None:
    """The first rank file of a training checkpoint directory (any TP/PP layout)."""
    if not os.path.isdir(ckpt_dir):
        return None
    ranks = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("mp_rank_"))
    return os.path.join(ckpt_dir, ranks[0], FILE) if ranks else None


def read_pretrained(path: str) -> Pretrained:
    """Config and metadata of ``path`` (see module docstring) without reading its tensors."""
    flag = f"--pretrained-checkpoint {path}"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, TRACKER)):
        try:
            iteration = read_tracker(path)
        except CheckpointError as e:
            raise PretrainedError(f"{flag}: {e}") from None
        first = _checkpoint_rank0_file(os.path.join(path, iter_dir_name(iteration)))
        if first is None:
            raise PretrainedError(f"{flag}: its tracker names iteration {iteration}, which has no rank files")
        ckpt = torch.load(first, map_location="cpu", weights_only=False, mmap=True)
        if not ckpt.get("model_config"):
            raise PretrainedError(f"{flag}: {first} has no model_config (saved by an older version)")
        try:  # the copy the checkpoint carries; older ones: the saved --tokenizer-model, if it still exists
            tok, tok_type = checkpoint_tokenizer(os.path.dirname(os.path.dirname(first)), ckpt)
        except CheckpointError as e:
            raise PretrainedError(f"{flag}: {e}") from None
        return Pretrained("checkpoint", path, ModelConfig(**ckpt["model_config"]), tok, tok_type, iteration)
    file = _converted_file(path)
    if file is None:
        raise PretrainedError(
            f"{flag}: neither a launch/convert_hf.py output ({hf_convert.FILE_NAME}) nor a training "
            f"checkpoint directory ({TRACKER})"
        )
    try:
        payload = hf_convert.read_converted(file, mmap=True)
    except hf_convert.HFConvertError as e:
        raise PretrainedError(f"{flag}: {e}") from None
    except Exception as e:  # noqa: BLE001 - torch.load's many errors for a file that is no checkpoint
        raise PretrainedError(f"{flag}: cannot read {file} ({type(e).__name__}); expected a "
                              f"launch/convert_hf.py output") from None
    tok_dir = hf_convert.converted_tokenizer_dir(payload, file)
    return Pretrained(
        "hf_converted", file, ModelConfig(**payload["model_config"]), tok_dir,
        HF_TOKENIZER_TYPE if tok_dir else None,
    )  # fmt: skip


shape_args = shape_of  # the model flags that reproduce a config's shape (pretrain.config.model)


@torch.no_grad()
def load_pretrained_weights(model: torch.nn.Module, pre: Pretrained, tp_size: int) -> None:
    """Copy this rank's shard of ``pre``'s weights into ``model`` (built from ``pre.cfg`` at TP
    ``tp_size``, unwrapped). The policy linears' quantization state stays the model's own."""
    flag = f"--pretrained-checkpoint {pre.path}"
    if pre.kind == "hf_converted":
        state, cfg, _ = hf_convert.load_converted(pre.path)
        try:
            hf_convert.load_converted_state_dict(model, state, cfg)
        except hf_convert.HFConvertError as e:
            raise PretrainedError(f"{flag}: {e}") from None
        return
    ckpt = load_checkpoint(pre.path, tp_size, reshard_model=True)
    weights = {k: v for k, v in ckpt["model"].items() if not k.endswith("._extra_state")}
    own = model.state_dict()
    missing = sorted(k for k in own if not k.endswith("._extra_state") and k not in weights)
    unknown = sorted(k for k in weights if k not in own)
    if missing or unknown:
        raise PretrainedError(f"{flag}: weights do not fit this model: missing {missing[:3]}, unexpected {unknown[:3]}")
    for name, value in weights.items():
        if own[name].shape != value.shape:
            raise PretrainedError(f"{flag}: {name} is {tuple(value.shape)} in the checkpoint, "
                                  f"{tuple(own[name].shape)} in this model")
    model.load_state_dict(weights, strict=False)

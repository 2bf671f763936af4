"""Command line of ``launch/pretrain.py``: Megatron-LM flag names, model-size files, early validation.

    run = parse_run_config(argv, world_size, cuda)   # parse + validate + freeze: pretrain.config.RunConfig
    args = parse_args(argv)                   # argparse + configs/models/NAME.yaml; one-line errors
    args = validate_args(args, world_size)    # everything checkable before torch.distributed / build
    cfg = model_config(args, vocab_size)      # model.gpt.ModelConfig

The flags themselves (names, defaults, ``--help`` text, groups) are the fields of the typed configs in
``pretrain.config``; :func:`build_parser` generates its groups from them. This module is the glue:
model-size files, ``--pretrained-checkpoint``'s shape, derived defaults and the one-line validation.

Precedence: parser defaults < ``--model-size`` file < flags given on the command line.
``--precision-schedule`` (``precision.schedule``) replaces ``--precision`` (which then defaults to
nothing, else to ``bf16``); ``precision_schedule(args)`` is the run's schedule either way
(``--qat-warmup-iters N`` is ``0:observe,N:PRECISION``). A model-size
file (``configs/models/NAME.yaml``, or any ``.yaml`` path) maps argument names (``hidden_size``,
``lr``, ...; a flag's name with ``_`` for ``-``) to values; an unknown key is an error.

Every refusal is one line on stderr, ``pretrain.py: error: <flag or path>: <what is valid>``, and
exit status 2 (:func:`fail`); argparse's own errors (unknown flag, bad number) use the same format.
``parse_args_or_raise`` raises :class:`ConfigError` instead of exiting, for ``pretrain.train.main``,
which lets all ranks of a torchrun job agree on the error before rank 0 prints it (once).
``validate_args`` needs only the world size, which torchrun puts in the environment, so bad input is
refused before ``torch.distributed``, data or model are touched. It imports ``model.gpt`` (and so
megatron-core) only for its last check, the model shape.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn

import yaml

from model.kv_cache import KVFormat
from pretrain.checkpoint_files import TRACKER, iter_dir_name, overwrite_problem
from pretrain.config import (  # noqa: F401 - re-exported: launchers, RL and the sweep import them from here
    GROUPS,
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    MODEL_SIZES_DIR,
    WD_INCR_STYLES,
    RunConfig,
    TrainingConfig,
    add_group,
    model_config,
    model_sizes,
)
from pretrain.config.config_file import ConfigFileArgs, ConfigFileError, config_argv
from pretrain.config.megatron_flags import (
    PARSE_TIME,
    MegatronFlags,
    train_iters_from_samples,
    translate,
    unread_problem,
    unrecognized,
)
from pretrain.config.precision import RunPrecision, phase_precisions, precision_schedule  # noqa: F401 - re-exported
from pretrain.config.run import LoggingConfig

PROG = "pretrain.py"


class ConfigError(ValueError):
    """Bad input; the message is one line naming the flag or path and what is valid."""


def fail(message: str) -> NoReturn:
    """Print ``pretrain.py: error: message`` (one line) to stderr and exit with status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + error; we raise one line
        raise ConfigError(unrecognized(message, self._option_string_actions))


def build_parser() -> argparse.ArgumentParser:
    """The parser, its groups generated from the run's config classes (``pretrain.config.GROUPS``)."""
    p = _Parser(
        prog=PROG,
        description="Pretrain a megatron-core GPT under a per-GEMM precision policy.",
        allow_abbrev=False,
    )
    for title, classes in GROUPS:
        add_group(p, title, *classes)
    add_group(p, "run configuration file", ConfigFileArgs)
    add_group(p, "Megatron-LM spellings (rewritten into the flags above; printed at start-up, never saved)",
              MegatronFlags)
    return p


# =================================================================================================
# Parsing
# =================================================================================================


def _model_size_file(value: str) -> str:
    if value.endswith((".yaml", ".yml")) or os.sep in value:
        if not os.path.isfile(value):
            raise ConfigError(f"--model-size: no such file: {value}")
        return value
    path = os.path.join(MODEL_SIZES_DIR, f"{value}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(
            f"--model-size: unknown size {value!r}; valid: {', '.join(model_sizes())} or a .yaml file"
        )
    return path


def load_model_size(parser: argparse.ArgumentParser, value: str) -> dict:
    path = _model_size_file(value)
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--model-size: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model-size: {path} must be a mapping of argument names to values")
    dests = {a.dest for a in parser._actions} - {"help", "model_size"}
    unknown = sorted(set(data) - dests)
    if unknown:
        raise ConfigError(
            f"--model-size: {path}: unknown key(s) {', '.join(unknown)}; keys are flag names "
            f"with '_' for '-', e.g. hidden_size"
        )
    return data


def given_flags(argv: list[str] | None, parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Argument names given explicitly on the command line (of ``parser``, by default pretraining's)."""
    parser = parser or build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _apply_pretrained(args: argparse.Namespace, given: set[str]) -> None:
    """``--pretrained-checkpoint``: the model shape (and, unless given, the tokenizer) from the
    checkpoint; a shape value given by a flag or the ``--model-size`` file must agree with it."""
    from pretrain.pretrained import (  # loads megatron-core: only with the flag
        PretrainedError,
        read_pretrained,
        shape_args,
    )

    try:
        pre = read_pretrained(args.pretrained_checkpoint)
    except PretrainedError as e:
        raise ConfigError(str(e)) from None
    for name, value in shape_args(pre.cfg).items():
        if name in given and getattr(args, name) != value:
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(args, name)} disagrees with --pretrained-checkpoint "
                f"{args.pretrained_checkpoint} ({value}); drop the flag (the shape comes from the checkpoint)"
            )
        setattr(args, name, value)
    if args.seq_length is None:
        raise ConfigError(
            f"--pretrained-checkpoint {args.pretrained_checkpoint}: give --seq-length (the training "
            f"sequence length; the checkpoint allows up to {pre.cfg.seq_length})"
        )
    if pre.cfg.position_embedding == "learned_absolute" and args.seq_length > pre.cfg.seq_length:
        raise ConfigError(
            f"--seq-length {args.seq_length} exceeds the {pre.cfg.seq_length} learned positions of "
            f"--pretrained-checkpoint {args.pretrained_checkpoint}"
        )
    same_type = "tokenizer_type" not in given or args.tokenizer_type == pre.tokenizer_type
    if args.tokenizer_model is None and pre.tokenizer_model is not None and same_type:
        args.tokenizer_model, args.tokenizer_type = pre.tokenizer_model, pre.tokenizer_type
    args.pretrained_vocab_size = pre.cfg.vocab_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` over the model-size file's values; fill derived defaults. Exits 2 on bad input."""
    try:
        return parse_args_or_raise(argv)
    except ConfigError as e:
        fail(str(e))


def parse_args_or_raise(argv: list[str] | None = None) -> argparse.Namespace:
    """:func:`parse_args`, raising :class:`ConfigError` (one line) on bad input (``--help`` exits 0)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    from_config: set[str] = set()
    if args.config:  # the file's flags before the command line's; a flag given on the command line wins
        try:
            tokens, from_config = config_argv(parser, args.config, skip=given_flags(argv))
            parser.parse_args(tokens)  # the file's values alone: errors name the file
        except (ConfigFileError, ConfigError) as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("--config") else f"--config {args.config}: {msg}") from None
        argv = tokens + argv
        args = parser.parse_args(argv)
    from_file = {}
    if args.model_size:
        from_file = load_model_size(parser, args.model_size)
        parser.set_defaults(**from_file)
        args = parser.parse_args(argv)
    args.pretrained_vocab_size = None  # set from --pretrained-checkpoint's model config
    given = given_flags(argv)  # with the --config file's flags
    origins = {k: f"from --model-size {args.model_size}" for k in from_file if k not in given}
    origins.update({k: f"from --config {args.config}" for k in from_config})
    try:  # Megatron-LM's spellings, rewritten into this project's flags (pretrain.config.megatron_flags)
        if (note := train_iters_from_samples(args, given)) is not None:
            origins["train_iters"] = note
        args.megatron_flags = translate(args, given)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in PARSE_TIME:  # read: the Namespace holds the run's flags only
        delattr(args, name)
    if args.pretrained_checkpoint:
        _apply_pretrained(args, given_flags(argv) | set(from_file))
    required = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters")
    missing = [f"--{k.replace('_', '-')}" for k in required if getattr(args, k) is None]
    if missing:
        sizes = ", ".join(model_sizes())
        raise ConfigError(f"missing {', '.join(missing)} (give them, or --model-size NAME with NAME in {sizes})")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        origins["ffn_hidden_size"] = "= 4 x --hidden-size"
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
        origins["lr_decay_iters"] = "= --train-iters"
    if args.precision is None and args.precision_schedule is None:
        args.precision = "bf16"
    if _starts_with_observe(args):
        # QAT after a BF16 warm-up runs at a constant low lr (the HiF8 QAT recipe): a decay, or a
        # model-size file's pretraining lr warm-up, running through the BF16 warm-up would start QAT
        # at an lr set by the warm-up's length, not by --lr. Flags given on the command line win.
        if "lr_decay_style" not in given:
            args.lr_decay_style = "constant"
            origins["lr_decay_style"] = "the QAT default after a BF16 warm-up"
        if "lr_warmup_iters" not in given and "lr_warmup_fraction" not in given:
            args.lr_warmup_iters = 0
            origins["lr_warmup_iters"] = "the QAT default after a BF16 warm-up"
    args.value_origins = origins
    return args


def with_origins(message: str, args: argparse.Namespace) -> str:
    """``message`` with each ``--flag VALUE`` whose value did not come from the command line followed by
    its origin: ``--lr-warmup-iters 20 (from --model-size tiny) exceeds --lr-decay-iters 10``."""
    origins = getattr(args, "value_origins", None) or {}

    def note(m: re.Match) -> str:
        dest = m.group(1)[2:].replace("-", "_")
        if dest in origins and str(getattr(args, dest, None)) == m.group(2):
            return f"{m.group(0)} ({origins[dest]})"
        return m.group(0)

    return re.sub(r"(--[a-z][a-z0-9-]*) ([^\s,;:()\[\]]+)(?! \((?:from|=))", note, message)


def _starts_with_observe(args: argparse.Namespace) -> bool:
    """Whether the run's precision schedule opens with a BF16 observe phase (``--qat-warmup-iters``)."""
    if getattr(args, "qat_warmup_iters", 0):
        return True
    text = (getattr(args, "precision_schedule", None) or "").replace(" ", "")
    return text.startswith("0:observe,")


# =================================================================================================
# Validation (before torch.distributed, data or model)
# =================================================================================================


def _positive(args, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and (value < 0 if allow_zero else value <= 0):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be {bound}")


def _check_precision(args) -> RunPrecision:
    """The precision flags parsed once (:class:`pretrain.config.precision.RunPrecision`), or the first
    problem as one line naming the flag."""
    if args.precision_schedule is not None:
        if args.precision is not None:
            raise ConfigError("--precision-schedule and --precision: give each phase's precision in the schedule "
                              f"(e.g. --precision-schedule '0:{args.precision},200:bf16'), not --precision; "
                              "--precision-rule applies in every phase")
        if args.qat_warmup_iters:
            raise ConfigError(f"--precision-schedule and --qat-warmup-iters {args.qat_warmup_iters}: spell the "
                              f"warm-up as an observe phase, e.g. --precision-schedule "
                              f"'0:observe,{args.qat_warmup_iters}:hif8_w8a8'")
    try:  # the messages name --precision, --precision-schedule, --qat-warmup-iters or --precision-rule
        resolved = RunPrecision.parse(args.precision, args.precision_schedule, args.qat_warmup_iters,
                                      args.precision_rule, train_iters=args.train_iters, num_layers=args.num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for flag in ("numerics_interval", "qat_warmup_iters"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    if args.amax_history_len is not None and args.amax_history_len < 1:
        raise ConfigError(f"--amax-history-len {args.amax_history_len}: must be >= 1")
    if args.kv_quant is not None and args.num_attention_heads:
        try:
            KVFormat.parse(args.kv_quant).check_head_dim(
                getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return resolved


def data_prefixes(paths: list[str]) -> list[str]:
    """The prefixes of a megatron ``--data-path`` list (``P1 P2`` or ``W1 P1 W2 P2``)."""

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(paths) > 1 and is_number(paths[0]):
        if len(paths) % 2 or not all(is_number(w) for w in paths[::2]):
            raise ConfigError(
                f"--data-path: expected PREFIX ... or WEIGHT PREFIX WEIGHT PREFIX ..., got {' '.join(paths)}"
            )
        return list(paths[1::2])
    return list(paths)


def _check_data(args) -> None:
    from pretrain.data.indexed import (
        check_indexed_prefix,  # pretrain.data loads megatron-core: not for --help
    )

    for flag, paths in (("--data-path", args.data_path), ("--valid-data-path", args.valid_data_path)):
        for prefix in data_prefixes(paths or []):
            try:
                check_indexed_prefix(prefix, flag)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
    if args.valid_data_path and not args.data_path:
        raise ConfigError("--valid-data-path needs --data-path (without it the built-in corpus is used)")
    _check_tokenizer(args.tokenizer_model, args.tokenizer_type)
    if args.data_path and args.tokenizer_model is None:
        raise ConfigError(
            "--data-path needs --tokenizer-model (the tokenizer the data was tokenized with: a sentencepiece "
            ".model, or a Hugging Face tokenizer folder with --tokenizer-type HuggingFaceTokenizer)"
        )


def _check_tokenizer(model: str | None, tokenizer_type: str) -> None:
    """``--tokenizer-model`` is what ``--tokenizer-type`` reads: a file (sentencepiece) or a folder (HF)."""
    if tokenizer_type == "HuggingFaceTokenizer":
        from pretrain.data.hf_tokenizer import (  # pretrain.data: megatron-core
            FLAG,
            HINT,
            hf_tokenizer_dir_problem,
        )

        if model is None:
            raise ConfigError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR ({HINT})")
        problem = hf_tokenizer_dir_problem(model)
        if problem is not None:
            raise ConfigError(f"{FLAG}: {problem} ({HINT})")
    elif model is not None and os.path.isdir(model):
        raise ConfigError(
            f"--tokenizer-model: {model} is a directory, not a sentencepiece .model; for a Hugging Face "
            f"tokenizer folder add --tokenizer-type HuggingFaceTokenizer"
        )
    elif model is not None and not os.path.isfile(model):
        raise ConfigError(f"--tokenizer-model: no such file: {model} (a sentencepiece .model)")


def _check_checkpoints(args) -> None:
    if args.load is not None and not os.path.isdir(args.load):
        same_as_save = args.save is not None and os.path.abspath(args.load) == os.path.abspath(args.save)
        if os.path.exists(args.load) or not same_as_save:
            raise ConfigError(
                f"--load: no such checkpoint directory: {args.load} (give a --save directory of an "
                f"earlier run; --load equal to --save may not exist yet)"
            )
    if args.finetune:
        if args.load is None:
            raise ConfigError("--finetune needs --load (the checkpoint whose weights to start from)")
        if not os.path.isfile(os.path.join(args.load, TRACKER)):
            raise ConfigError(f"--finetune: no checkpoint in --load {args.load} ({TRACKER} missing)")
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path is not None:
            _check_writable_dir(flag, path)
    if msg := LoggingConfig.wandb_problem(args):
        raise ConfigError(msg)
    if args.skip_nonfinite_steps and not args.check_for_nan_in_loss_and_grad:
        raise ConfigError("--skip-nonfinite-steps needs --check-for-nan-in-loss-and-grad (the check that finds "
                          "non-finite steps; drop --no-check-for-nan-in-loss-and-grad)")
    if args.save_retain is not None and args.save is None:
        raise ConfigError("--save-retain needs --save (the directory whose old checkpoints it deletes)")
    if args.ckpt_step is not None:
        if args.load is None:
            raise ConfigError("--ckpt-step needs --load (the directory holding that iteration)")
        step_dir = os.path.join(args.load, iter_dir_name(args.ckpt_step))
        if not os.path.isdir(step_dir):
            names = os.listdir(args.load) if os.path.isdir(args.load) else []
            steps = sorted(int(n[5:]) for n in names if re.fullmatch(r"iter_\d+", n))
            there = f"iterations there: {', '.join(map(str, steps))}" if steps else "no iter_* checkpoints there"
            raise ConfigError(f"--ckpt-step {args.ckpt_step}: no checkpoint {step_dir}; {there}")


def _check_writable_dir(flag: str, path: str) -> None:
    """One line unless ``path`` is (or can be made as) a directory this process can write: the run
    would otherwise fail at its first save or TensorBoard write, after the model was built."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} exists and is not a directory")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag} {path}: cannot create it: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write there ({probe} is not writable by this user); "
                          "give a directory you can write to")


def _check_mixed_precision_and_memory(args, cuda: bool) -> dict:
    """``--bf16`` / ``--num-workers`` defaults by device (returned: ``{dest: value}``); ``--recompute-*``
    combinations."""
    bf16 = cuda if args.bf16 is None else args.bf16
    num_workers = (2 if cuda else 0) if args.num_workers is None else args.num_workers
    if num_workers < 0:
        raise ConfigError(f"--num-workers {num_workers}: must be >= 0")
    granularity, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if granularity != "full" and (method is not None or n is not None):
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        raise ConfigError(f"{flag} needs --recompute-granularity full (selective recomputes core attention "
                          f"only; without the flag nothing is recomputed)")
    if granularity == "full":
        from model.gpt import RecomputeConfig  # megatron-core: only with --recompute-granularity full

        layers = args.num_layers // args.pipeline_model_parallel_size
        try:
            RecomputeConfig("full", method or "uniform", 1 if n is None else n).check(layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return {"bf16": bf16, "num_workers": num_workers}


def _check_parallel(args, world_size: int, cuda: bool) -> int:
    """The parallel layout's flags; returns the global batch size (``--global-batch-size``, or by
    default one micro-batch per data-parallel rank)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not divide "
            f"the world size {world_size} (torchrun --nproc-per-node x nodes)"
        )
    if pp > 1:
        if not cuda:
            raise ConfigError(
                f"--pipeline-model-parallel-size {pp}: pipeline parallelism needs CUDA (megatron-core's "
                "schedules are CUDA-only); use 1 on CPU"
            )
        if args.ddp_impl == "torch":
            raise ConfigError(
                f"--pipeline-model-parallel-size {pp} needs --ddp-impl megatron (megatron-core's pipeline "
                "schedules and gradient finalization); --ddp-impl torch has no pipeline parallelism"
            )
        if args.num_layers % pp:
            raise ConfigError(
                f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
            )
    if args.ddp_impl == "megatron" and not cuda:
        raise ConfigError(
            "--ddp-impl megatron needs CUDA (megatron-core's DDP buffers and schedules are CUDA-only); "
            "use torch or auto on CPU"
        )
    if args.use_distributed_optimizer and (not cuda or args.ddp_impl == "torch"):
        raise ConfigError(
            "--use-distributed-optimizer needs the megatron engine on CUDA (--ddp-impl megatron or auto "
            + ("on a GPU machine)" if not cuda else "; not torch)")
        )
    if args.sequence_parallel and tp > 1 and not cuda:
        raise ConfigError(
            "--sequence-parallel needs CUDA (megatron-core's sequence-parallel collectives allocate "
            "on the GPU); drop it on CPU"
        )
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(
            f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    dp = world_size // (tp * pp)
    gbs = args.micro_batch_size * dp if args.global_batch_size is None else args.global_batch_size
    if gbs % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {args.micro_batch_size * dp}"
        )
    n = getattr(args, "fixed_train_set", None)
    if n is not None and (n < 1 or n % gbs):
        raise ConfigError(
            f"--fixed-train-set {n}: must be a positive multiple of --global-batch-size "
            f"{gbs} (equal to it: every step trains on the whole set)"
        )
    return gbs


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> argparse.Namespace:
    """Raise :class:`ConfigError` (one line) for anything wrong that needs no process group or model;
    return the validated values: a new Namespace, ``args`` with the defaults that depend on the
    device and the world size filled in (``--bf16``, ``--num-workers``, ``--global-batch-size``).
    ``args`` itself is never changed."""
    return _validate(args, world_size, cuda)[0]


def _validate(args: argparse.Namespace, world_size: int, cuda: bool) -> tuple[argparse.Namespace, RunPrecision]:
    """:func:`validate_args`, and the precision flags parsed on the way (once)."""
    if msg := unread_problem(args):  # another program's parser (RL) that did not read them
        raise ConfigError(msg)
    _positive(
        args,
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "lr_decay_iters",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "log_interval",
        "save_interval",
        "save_retain",
        "exit_interval",
        "make_vocab_size_divisible_by",
    )
    _positive(
        args,
        "lr",
        "min_lr",
        "lr_warmup_iters",
        "weight_decay",
        "clip_grad",
        "eval_interval",
        "eval_iters",
        "init_method_std",
        "skip_nonfinite_steps",
        "ckpt_step",
        allow_zero=True,
    )
    if getattr(args, "exit_duration_in_mins", None) is not None and not args.exit_duration_in_mins > 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins}: must be > 0 (minutes)")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if msg := TrainingConfig.schedule_problem(args):
        raise ConfigError(msg)
    global_batch_size = _check_parallel(args, world_size, cuda)
    by_device = _check_mixed_precision_and_memory(args, cuda)
    args = argparse.Namespace(**{**vars(args), "global_batch_size": global_batch_size, **by_device})
    resolved = _check_precision(args)
    _check_data(args)
    _check_checkpoints(args)
    try:
        from model.gpt import (  # megatron-core: not before this last check
            validate_config,
            validate_plan_shapes,
        )

        cfg, tp = model_config(args, vocab_size=1), args.tensor_model_parallel_size
        validate_config(cfg, tp)
        qkv = [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(args.num_layers)]
        for policy in resolved.policies.values():
            validate_plan_shapes(cfg, tp, policy.resolve(qkv, args.num_layers))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return args, resolved


def validate_and_freeze(args: argparse.Namespace, world_size: int, cuda: bool) -> tuple[argparse.Namespace, RunConfig]:
    """:func:`validate_args` and the frozen :class:`pretrain.config.RunConfig` of its values (the
    precision flags parsed once, on the way); for parsers that add groups of their own (RL)."""
    try:
        valid, resolved = _validate(args, world_size, cuda)
    except ConfigError as e:
        raise ConfigError(with_origins(str(e), args)) from None
    return valid, RunConfig.from_namespace(valid, resolved)


def parse_run_config(argv: list[str] | None, world_size: int, cuda: bool) -> RunConfig:
    """Parse, validate and freeze: the run's :class:`pretrain.config.RunConfig` (:class:`ConfigError`
    on bad input, one line)."""
    args, run = validate_and_freeze(parse_args_or_raise(argv), world_size, cuda)
    if msg := overwrite_problem(args.save, args.load):  # pretraining's: an RL run resumes from its --save
        raise ConfigError(with_origins(msg, args))
    return run

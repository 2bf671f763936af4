"""Command line of ``launch/pretrain.py``: Megatron-LM flag names, model-size files, early validation.

    args = parse_args(argv)                   # argparse + configs/models/NAME.yaml; one-line errors
    validate_args(args, world_size)           # everything checkable before torch.distributed / build
    cfg = model_config(args, vocab_size)      # model.gpt.ModelConfig

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
import sys
from typing import NoReturn

import yaml

from kernels.backends import GEMM_BACKENDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_SIZES_DIR = os.path.join(REPO, "configs", "models")
PROG = "pretrain.py"

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""``--lr-decay-style`` choices, the styles of megatron-core's ``OptimizerParamScheduler.get_lr`` (``pretrain.optim``)."""
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
"""``--lr-wsd-decay-style`` choices: how WSD anneals over its last ``--lr-wsd-decay-iters``."""
WD_INCR_STYLES = ("constant", "linear", "cosine")
"""``--weight-decay-incr-style`` choices."""



class ConfigError(ValueError):
    """Bad input; the message is one line naming the flag or path and what is valid."""


def fail(message: str) -> NoReturn:
    """Print ``pretrain.py: error: message`` (one line) to stderr and exit with status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + error; we raise one line
        raise ConfigError(message)


def model_sizes() -> list[str]:
    """Names of the model-size files in ``configs/models``."""
    if not os.path.isdir(MODEL_SIZES_DIR):
        return []
    return sorted(f[: -len(".yaml")] for f in os.listdir(MODEL_SIZES_DIR) if f.endswith(".yaml"))


def build_parser() -> argparse.ArgumentParser:
    from precision.formats import AmaxAlgo  # valid values come from the format registry

    p = _Parser(
        prog=PROG,
        description="Pretrain a megatron-core GPT under a per-GEMM precision policy.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    add = g.add_argument
    add(
        "--model-size",
        metavar="NAME|FILE",
        help=f"model shape and recommended hyper-parameters from configs/models/NAME.yaml "
        f"({', '.join(model_sizes())}) or a .yaml file; explicit flags override it",
    )
    add("--num-layers", type=int)
    add("--hidden-size", type=int)
    add("--ffn-hidden-size", type=int, help="default: 4 * hidden size")
    add("--num-attention-heads", type=int)
    add("--num-query-groups", type=int, help="grouped-query attention groups (default: = heads)")
    add("--seq-length", type=int)
    add("--normalization", choices=["RMSNorm", "LayerNorm"], default="RMSNorm")
    add(
        "--swiglu", action=argparse.BooleanOptionalAction, default=True, help="SwiGLU MLP (--no-swiglu: GeLU)"
    )
    add("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    add("--rotary-base", type=int, default=10000)
    add(
        "--use-rope-scaling",
        action="store_true",
        help="Llama 3.x RoPE frequency scaling (--rope-scaling-factor)",
    )
    add("--rope-scaling-factor", type=float, default=8.0)
    add("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction, default=True)
    add("--add-bias-linear", action="store_true", default=False)
    add("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    add("--add-qkv-bias", action="store_true", help="bias on linear_qkv only (Qwen2)")
    add("--init-method-std", type=float, default=0.02)
    add("--norm-epsilon", type=float, default=1e-5)
    add("--hidden-dropout", type=float, default=0.0)
    add("--attention-dropout", type=float, default=0.0)
    add("--make-vocab-size-divisible-by", type=int, default=128)

    g = p.add_argument_group("precision")
    add = g.add_argument
    add(
        "--precision",
        metavar="NAME|SPEC|FILE",
        help="default recipe of every linear: a preset (precision.presets), a per-GEMM spec, "
        "or a YAML/JSON file (default: bf16; not with --precision-schedule)",
    )
    add(
        "--precision-schedule",
        metavar="START:PRECISION,...",
        help="a precision per phase instead of --precision (precision.schedule): START:P runs P from "
        "iteration START+1 on (after START iterations); P is anything --precision takes, or observe (BF16 "
        "GEMMs filling the next phase's amax histories); --precision-rule applies in every phase. E.g. "
        "'0:fp8,200:wgrad_hadamard,900:bf16', the NVFP4 paper's BF16 end '0:nvfp4,900:bf16', an FP8-to-MXFP4 "
        "warm start '0:fp8,100:mxfp4', QAT '0:observe,500:hif8_w8a8' (= --qat-warmup-iters 500)",
    )
    add(
        "--precision-rule",
        action="append",
        default=[],
        metavar="SELECTOR=VALUE",
        help="per-layer override, first match wins, e.g. first:1=bf16 or 'kind:mlp=wgrad=mxfp4+had16' "
        "(repeatable)",
    )
    add(
        "--gemm-backend",
        choices=GEMM_BACKENDS,
        default="auto",
        help="auto: per GEMM, the device's tensor cores where they support the recipe (FP8 on sm_89+, "
        "MX/NVFP4 on sm_100), else on CUDA BF16 tensor cores for every BF16-exact format (bf16_mm), "
        "else emulated; emulated: fused torch.compile quantizers in FP32; reference: the eager spec "
        "(bit-identical, slower); fp8_scaled_mm / mx_scaled_mm / bf16_mm: force that hardware path",
    )
    add(
        "--numerics-interval",
        type=int,
        default=0,
        metavar="N",
        help="every N iterations log per layer x GEMM x operand: SQNR, clipped, flushed, amax "
        "(TensorBoard numerics/<layer>/<gemm>/<operand>/<metric>; launch/report.py renders them); 0: off",
    )
    add(
        "--amax-algo",
        choices=AmaxAlgo.values(),  # the registry's names (precision.formats)
        help="delayed-scaling amax algorithm for every per-tensor operand (FP8, HiF8) of the plan",
    )
    add("--amax-history-len", type=int, metavar="N", help="amax history window (steps) for --amax-algo")
    add(
        "--qat-backward",
        choices=("hp", "ste"),
        default="hp",
        help="what Dgrad and Wgrad consume: hp -- the high-precision w and x, each quantized by its own "
        "GEMM's recipe (default; TE's override_linear_precision, the hif8_w8a8 recipe); ste -- Fprop's "
        "quantized Q(w) and Q(x), the fake-quant straight-through estimator (dx = dy Q(w), dw = dy^T Q(x))",
    )
    add(
        "--fp8-margin",
        type=int,
        metavar="N",
        help="Megatron-LM/TransformerEngine's margin for every per-tensor operand (FP8, HiF8) of the plan: "
        "scale = target / amax / 2^N, target the format's scale target (FP8: its max normal, as TE; "
        "HiF8: 2^3); N >= 0 for FP8, N >= -12 for HiF8 (-12: amax -> 2^15, TE's FP8 rule); default: "
        "the plan's own (0)",
    )
    add(
        "--qat-warmup-iters",
        type=int,
        default=0,
        metavar="N",
        help="train the first N iterations in BF16 while the amax histories fill, then switch to the "
        "quantized plan (HiF8 QAT recipe: 500); the same as --precision-schedule 0:observe,N:PRECISION "
        "with --precision PRECISION (not with --precision-schedule). Either spelling makes "
        "--lr-decay-style default to constant and --lr-warmup-iters to 0: warm-up and QAT at --lr",
    )
    add(
        "--kv-quant",
        metavar="FORMAT",
        help="fake-quantize K and V in the training forward exactly as a rollout KV-cache in FORMAT "
        "stores them (along the head dimension, straight-through gradient; model.kv_cache), e.g. "
        "mxfp4, nvfp4, fp8; default: off",
    )

    g = p.add_argument_group("mixed precision and memory")
    add = g.add_argument
    add(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="BF16 parameters and activations with FP32 main parameters and gradients (megatron-core's "
        "mixed-precision optimizer on the megatron engine, an FP32 main copy on the torch engine); "
        "default: on with CUDA, off on CPU (--no-bf16: FP32 throughout)",
    )
    add(
        "--recompute-granularity",
        choices=["full", "selective"],
        help="activation recomputation (megatron-core's TransformerBlock): full: whole transformer "
        "layers (--recompute-method, --recompute-num-layers); selective: core attention only",
    )
    add(
        "--recompute-method",
        choices=["uniform", "block"],
        help="with --recompute-granularity full: uniform (default): every layer, in chunks of "
        "--recompute-num-layers; block: only the first --recompute-num-layers layers of each pipeline stage",
    )
    add(
        "--recompute-num-layers",
        type=int,
        metavar="N",
        help="layers per recomputed chunk (uniform) or recomputed layers per stage (block); default 1",
    )

    g = p.add_argument_group("parallelism")
    add = g.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--sequence-parallel", action="store_true", help="CUDA only; needs TP > 1")
    add(
        "--ddp-impl",
        choices=["auto", "torch", "megatron"],
        default="auto",
        help="megatron: megatron-core DDP, optimizer and pipeline schedules (CUDA only); torch: torch DDP "
        "and our AdamW loop (CPU or GPU; no pipeline parallelism); auto: megatron on CUDA, torch on CPU",
    )
    add(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard the optimizer state over data-parallel ranks (megatron-core's distributed optimizer; "
        "needs the megatron engine, so CUDA)",
    )

    g = p.add_argument_group("training")
    add = g.add_argument
    add("--micro-batch-size", type=int, default=1)
    add("--global-batch-size", type=int, help="default: micro batch size * data-parallel size")
    add("--train-iters", type=int)
    add("--lr", type=float, default=3e-4)
    add("--min-lr", type=float, default=0.0)
    add("--lr-warmup-iters", type=int, default=0, help="linear warm-up from --lr-warmup-init to --lr")
    add("--lr-warmup-fraction", type=float, help="warm-up over this fraction of --lr-decay-iters (instead of "
        "--lr-warmup-iters)")
    add("--lr-warmup-init", type=float, default=0.0, help="the lr the warm-up starts from")
    add("--lr-decay-iters", type=int, help="the decay reaches --min-lr here (default: --train-iters)")
    add("--lr-decay-style", choices=list(LR_DECAY_STYLES), default="cosine",
        help="after the warm-up (megatron-core's OptimizerParamScheduler; Megatron-LM's default is linear); "
        "WSD: --lr until the last --lr-wsd-decay-iters of --lr-decay-iters, which anneal to --min-lr")
    add("--lr-wsd-decay-iters", type=int, help="WSD: the annealing length (needed with --lr-decay-style WSD)")
    add("--lr-wsd-decay-style", choices=list(LR_WSD_DECAY_STYLES), default="exponential",
        help="WSD: the annealing's shape")
    add("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
        help="at --load, take the lr schedule's values from this run's flags (the default here; Megatron-LM "
        "refuses a difference without one of these two flags)")
    add("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", action="store_true",
        help="at --load, take the lr schedule's values from the checkpoint")
    add("--weight-decay", type=float, default=0.1)
    add("--start-weight-decay", type=float, help="with --weight-decay-incr-style linear/cosine")
    add("--end-weight-decay", type=float, help="with --weight-decay-incr-style linear/cosine")
    add("--weight-decay-incr-style", choices=list(WD_INCR_STYLES), default="constant",
        help="weight decay from --start-weight-decay to --end-weight-decay over --train-iters")
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.95)
    add("--adam-eps", type=float, default=1e-8)
    add("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    add("--seed", type=int, default=1234)
    add("--exit-interval", type=int, help="save (with --save) and exit after an iteration divisible by this")
    add(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a non-finite loss or gradient norm ends the run as diverged: exit status 3, "
        "--save/run_status.json, the last good checkpoint named (pretrain/status.py); "
        "--no-check-for-nan-in-loss-and-grad: train on",
    )
    add(
        "--skip-nonfinite-steps",
        type=int,
        default=0,
        metavar="N",
        help="skip up to N non-finite steps (no parameter or optimizer update, counted in "
        "train/nonfinite_steps) before the next one ends the run as diverged",
    )

    g = p.add_argument_group("data")
    add = g.add_argument
    add(
        "--data-path",
        nargs="+",
        metavar="PREFIX",
        help="indexed-dataset prefixes (PREFIX.bin/.idx), optionally weighted: W1 P1 W2 P2; "
        "default: the built-in stdlib corpus",
    )
    add("--valid-data-path", nargs="+", metavar="PREFIX", help="separate validation prefixes")
    add("--split", default="99,1,0", help="train,valid,test document split of --data-path (default 99,1,0)")
    add(
        "--fixed-train-set",
        type=int,
        metavar="N",
        help="train on N fixed sequences of the training data, repeated (evenly spaced windows, "
        "independent of --seed); with --global-batch-size N every step's gradient is the exact "
        "gradient of the set (full batch). N must be a multiple of --global-batch-size",
    )
    add(
        "--tokenizer-model",
        metavar="PATH",
        help="sentencepiece .model file, or a Hugging Face tokenizer folder with --tokenizer-type "
        "HuggingFaceTokenizer (required with --data-path)",
    )
    add(
        "--tokenizer-type",
        choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"),
        default="SentencePieceTokenizer",
        help="what --tokenizer-model is (default SentencePieceTokenizer; without --data-path, "
        "HuggingFaceTokenizer tokenizes the built-in corpus with it)",
    )
    add(
        "--num-workers",
        type=int,
        metavar="N",
        help="data-loader worker processes per rank (torch DataLoader; 0: load in the training process; "
        "default: 2 with CUDA, 0 on CPU); batches go to pinned memory on CUDA",
    )
    add(
        "--data-cache-dir",
        default=os.path.join(os.path.expanduser("~"), ".cache", "lowprec-pretrain"),
        help="built-in corpus and dataset index cache (default ~/.cache/lowprec-pretrain)",
    )

    g = p.add_argument_group("checkpoints, evaluation, logging")
    add = g.add_argument
    add(
        "--save",
        metavar="DIR",
        help="checkpoint directory (Megatron layout: DIR/iter_0000010/mp_rank_00/...)",
    )
    add("--save-interval", type=int, help="save every N iterations (and always at the end and on SIGTERM)")
    add(
        "--save-retain",
        type=int,
        metavar="N",
        help="keep the newest N complete checkpoints in --save; older ones are deleted only after a newer "
        "one is complete (default: keep all)",
    )
    add(
        "--load",
        metavar="DIR",
        help="resume from DIR's latest checkpoint; may equal --save and not exist yet",
    )
    add(
        "--ckpt-step",
        type=int,
        metavar="N",
        help="with --load: load iteration N instead of the one latest_checkpointed_iteration.txt names",
    )
    add(
        "--finetune", action="store_true", help="with --load: load model weights only, restart at iteration 0"
    )
    add(
        "--pretrained-checkpoint",
        metavar="PATH",
        help="initial model weights, used while --load holds no checkpoint yet: a launch/convert_hf.py "
        "output (directory or hf_converted.pt) or a training checkpoint directory (any TP size); the "
        "model shape and the default tokenizer come from it",
    )
    add(
        "--eval-interval",
        type=int,
        default=1000,
        help="held-out evaluation every N iterations (0: only at the end)",
    )
    add("--eval-iters", type=int, default=10, help="global batches per evaluation (0: no evaluation)")
    add("--log-interval", type=int, default=10)
    add("--tensorboard-dir", metavar="DIR")
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


def _load_model_size(parser: argparse.ArgumentParser, value: str) -> dict:
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


def _given_flags(argv: list[str] | None) -> set[str]:
    """Argument names given explicitly on the command line."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _apply_pretrained(args: argparse.Namespace, given: set[str]) -> None:
    """``--pretrained-checkpoint``: the model shape (and, unless given, the tokenizer) from the
    checkpoint; a shape value given by a flag or the ``--model-size`` file must agree with it."""
    from pretrain.pretrained import PretrainedError, read_pretrained, shape_args

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
    args = parser.parse_args(argv)
    from_file = {}
    if args.model_size:
        from_file = _load_model_size(parser, args.model_size)
        parser.set_defaults(**from_file)
        args = parser.parse_args(argv)
    args.pretrained_vocab_size = None  # set from --pretrained-checkpoint's model config
    if args.pretrained_checkpoint:
        _apply_pretrained(args, _given_flags(argv) | set(from_file))
    required = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters")
    missing = [f"--{k.replace('_', '-')}" for k in required if getattr(args, k) is None]
    if missing:
        sizes = ", ".join(model_sizes())
        raise ConfigError(f"missing {', '.join(missing)} (give them, or --model-size NAME with NAME in {sizes})")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.precision is None and args.precision_schedule is None:
        args.precision = "bf16"
    if _starts_with_observe(args):
        # QAT after a BF16 warm-up runs at a constant low lr (the HiF8 QAT recipe): a decay, or a
        # model-size file's pretraining lr warm-up, running through the BF16 warm-up would start QAT
        # at an lr set by the warm-up's length, not by --lr. Flags given on the command line win.
        given = _given_flags(argv)
        if "lr_decay_style" not in given:
            args.lr_decay_style = "constant"
        if "lr_warmup_iters" not in given and "lr_warmup_fraction" not in given:
            args.lr_warmup_iters = 0
    return args


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


def precision_schedule(args):
    """The run's ``precision.schedule.PrecisionSchedule``: ``--precision-schedule``, or ``--precision``
    with ``--qat-warmup-iters N`` spelled ``0:observe,N:PRECISION`` (one phase without a warm-up).
    Raises ``SpecError`` (one line naming the flag). ``args`` may lack the schedule flags (callers
    with their own parsers): then it is ``--precision`` alone."""
    from precision.schedule import PrecisionSchedule

    text = getattr(args, "precision_schedule", None)
    if text is not None:
        return PrecisionSchedule.parse(text)
    return PrecisionSchedule.qat_warmup(getattr(args, "qat_warmup_iters", 0) or 0, args.precision or "bf16")


def _check_precision(args) -> None:
    from precision import PrecisionPolicy, SpecError
    from precision.policy import Rule

    if args.precision_schedule is not None:
        if args.precision is not None:
            raise ConfigError("--precision-schedule and --precision: give each phase's precision in the schedule "
                              f"(e.g. --precision-schedule '0:{args.precision},200:bf16'), not --precision; "
                              "--precision-rule applies in every phase")
        if args.qat_warmup_iters:
            raise ConfigError(f"--precision-schedule and --qat-warmup-iters {args.qat_warmup_iters}: spell the "
                              f"warm-up as an observe phase, e.g. --precision-schedule "
                              f"'0:observe,{args.qat_warmup_iters}:hif8_w8a8'")
    if args.precision_schedule is None:
        try:  # what --precision takes is what PrecisionPolicy.from_args takes
            PrecisionPolicy.from_args(args.precision)
        except ValueError as e:  # SpecError, or an unknown preset named by base=; a plan file names itself
            raise ConfigError(str(e) if str(e).startswith("--precision") else f"--precision: {e}") from None
    try:  # the schedule's messages name --precision-schedule (or --qat-warmup-iters)
        schedule = precision_schedule(args)
        if args.precision_schedule is not None and args.train_iters is not None:
            schedule.check_train_iters(args.train_iters)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for rule in args.precision_rule:
        try:
            Rule.parse(rule)
        except ValueError as e:
            msg = str(e)
            raise ConfigError(
                msg if msg.startswith("--precision-rule") else f"--precision-rule {rule!r}: {msg}"
            ) from None
    for precision in phase_precisions(schedule):
        try:  # layer numbers beyond the model; rules that match no layer are refused in build_model
            PrecisionPolicy.from_args(precision, args.precision_rule).check_rules(args.num_layers)
        except SpecError as e:
            raise ConfigError(str(e)) from None
    for flag in ("numerics_interval", "qat_warmup_iters"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    if args.amax_history_len is not None and args.amax_history_len < 1:
        raise ConfigError(f"--amax-history-len {args.amax_history_len}: must be >= 1")
    if args.kv_quant is not None and args.num_attention_heads:
        from model.kv_cache import KVFormat

        try:
            KVFormat.parse(args.kv_quant).check_head_dim(args.hidden_size // args.num_attention_heads)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def phase_precisions(schedule) -> list[str]:
    """The distinct precisions of a schedule's quantized phases, in order (observe phases hold the next
    phase's plan)."""
    return list(dict.fromkeys(p.precision for p in schedule.phases if not p.observe))


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
    from pretrain.data.indexed import check_indexed_prefix

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
        from pretrain.data.hf_tokenizer import FLAG, HINT, hf_tokenizer_dir_problem

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
        from pretrain.checkpointing import TRACKER

        if args.load is None:
            raise ConfigError("--finetune needs --load (the checkpoint whose weights to start from)")
        if not os.path.isfile(os.path.join(args.load, TRACKER)):
            raise ConfigError(f"--finetune: no checkpoint in --load {args.load} ({TRACKER} missing)")
    if args.save is not None and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise ConfigError(f"--save: {args.save} exists and is not a directory")
    if args.skip_nonfinite_steps and not args.check_for_nan_in_loss_and_grad:
        raise ConfigError("--skip-nonfinite-steps needs --check-for-nan-in-loss-and-grad (the check that finds "
                          "non-finite steps; drop --no-check-for-nan-in-loss-and-grad)")
    if args.save_retain is not None and args.save is None:
        raise ConfigError("--save-retain needs --save (the directory whose old checkpoints it deletes)")
    if args.ckpt_step is not None:
        from pretrain.checkpointing import iter_dir_name

        if args.load is None:
            raise ConfigError("--ckpt-step needs --load (the directory holding that iteration)")
        step_dir = os.path.join(args.load, iter_dir_name(args.ckpt_step))
        if not os.path.isdir(step_dir):
            raise ConfigError(f"--ckpt-step {args.ckpt_step}: no checkpoint {step_dir}")


def _check_mixed_precision_and_memory(args, cuda: bool) -> None:
    """``--bf16`` / ``--num-workers`` defaults by device; ``--recompute-*`` combinations."""
    if args.bf16 is None:
        args.bf16 = cuda
    if args.num_workers is None:
        args.num_workers = 2 if cuda else 0
    if args.num_workers < 0:
        raise ConfigError(f"--num-workers {args.num_workers}: must be >= 0")
    granularity, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if granularity != "full" and (method is not None or n is not None):
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        raise ConfigError(f"{flag} needs --recompute-granularity full (selective recomputes core attention "
                          f"only; without the flag nothing is recomputed)")
    if granularity == "full":
        from model.gpt import RecomputeConfig

        layers = args.num_layers // args.pipeline_model_parallel_size
        try:
            RecomputeConfig("full", method or "uniform", 1 if n is None else n).check(layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_parallel(args, world_size: int, cuda: bool) -> None:
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
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {args.micro_batch_size * dp}"
        )
    n = getattr(args, "fixed_train_set", None)
    if n is not None and (n < 1 or n % args.global_batch_size):
        raise ConfigError(
            f"--fixed-train-set {n}: must be a positive multiple of --global-batch-size "
            f"{args.global_batch_size} (equal to it: every step trains on the whole set)"
        )


def _check_lr_schedule(args: argparse.Namespace) -> None:
    """The lr / weight-decay schedule flags: what megatron-core's ``OptimizerParamScheduler`` asserts,
    as one-line errors naming the flag."""
    if args.lr_warmup_iters > args.lr_decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters {args.lr_decay_iters}"
        )
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is not None:
        if args.lr_warmup_iters:
            raise ConfigError(f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {args.lr_warmup_iters}: "
                              "give one of them")
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction {fraction}: must be in [0, 1)")
    init = getattr(args, "lr_warmup_init", 0.0)
    if not 0.0 <= init <= args.lr:
        raise ConfigError(f"--lr-warmup-init {init}: must be in [0, --lr {args.lr}]")
    wsd = getattr(args, "lr_wsd_decay_iters", None)
    if args.lr_decay_style == "WSD":
        if wsd is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters N (the annealing length, "
                              f"0 <= N <= --lr-decay-iters {args.lr_decay_iters})")
        if not 0 <= wsd <= args.lr_decay_iters:
            raise ConfigError(f"--lr-wsd-decay-iters {wsd}: must be in [0, --lr-decay-iters {args.lr_decay_iters}]")
    elif wsd is not None:
        raise ConfigError(f"--lr-wsd-decay-iters {wsd}: used only with --lr-decay-style WSD "
                          f"(this run's is {args.lr_decay_style})")
    if getattr(args, "override_opt_param_scheduler", False) and getattr(args, "use_checkpoint_opt_param_scheduler",
                                                                        False):
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one of them")
    incr = getattr(args, "weight_decay_incr_style", "constant")
    start, end = getattr(args, "start_weight_decay", None), getattr(args, "end_weight_decay", None)
    if incr == "constant":
        if start is not None or end is not None:
            raise ConfigError("--start-weight-decay / --end-weight-decay: used only with --weight-decay-incr-style "
                              "linear or cosine (the constant style uses --weight-decay)")
    elif start is None or end is None:
        raise ConfigError(f"--weight-decay-incr-style {incr} needs --start-weight-decay and --end-weight-decay")
    elif not 0.0 <= start <= end:
        raise ConfigError(f"--start-weight-decay {start} / --end-weight-decay {end}: need 0 <= start <= end")


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> None:
    """Raise :class:`ConfigError` (one line) for anything wrong that needs no process group or model."""
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
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    _check_lr_schedule(args)
    _check_parallel(args, world_size, cuda)
    _check_mixed_precision_and_memory(args, cuda)
    _check_precision(args)
    _check_data(args)
    _check_checkpoints(args)
    try:
        from model.gpt import validate_config, validate_plan_shapes
        from precision import PrecisionPolicy

        cfg, tp = model_config(args, vocab_size=1), args.tensor_model_parallel_size
        validate_config(cfg, tp)
        qkv = [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(args.num_layers)]
        for precision in phase_precisions(precision_schedule(args)):
            plan = PrecisionPolicy.from_args(precision, args.precision_rule).resolve(qkv, args.num_layers)
            validate_plan_shapes(cfg, tp, plan)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def recompute_config(args: argparse.Namespace):
    """The ``model.gpt.RecomputeConfig`` of ``--recompute-*`` (None: no recomputation)."""
    from model.gpt import RecomputeConfig

    if args.recompute_granularity is None:
        return None
    if args.recompute_granularity == "selective":
        return RecomputeConfig("selective")
    n = 1 if args.recompute_num_layers is None else args.recompute_num_layers
    return RecomputeConfig("full", args.recompute_method or "uniform", n)


def model_config(args: argparse.Namespace, vocab_size: int):
    """The ``model.gpt.ModelConfig`` of ``args`` for a tokenizer of ``vocab_size`` tokens."""
    from model.gpt import ModelConfig

    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        seq_length=args.seq_length,
        vocab_size=vocab_size,
        normalization=args.normalization,
        activation="swiglu" if args.swiglu else "gelu",
        position_embedding=args.position_embedding_type,
        untie_embeddings=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        init_method_std=args.init_method_std,
        rotary_base=args.rotary_base,
        rope_scaling_factor=args.rope_scaling_factor if args.use_rope_scaling else None,
        layernorm_epsilon=args.norm_epsilon,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        kv_quant=args.kv_quant,
    )

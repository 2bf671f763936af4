"""Megatron-LM's precision and run-control flags, accepted as spellings of this project's own flags.

A script written for Megatron-LM passes ``--fp8-format hybrid --fp8-recipe tensorwise`` or
``--fp4-format e2m1 --fp4-recipe nvfp4 --first-last-layers-bf16``; here the plan is one
``--precision`` (+ ``--precision-rule``) and nothing else. :func:`translate` rewrites the Megatron
flags into those flags while the command line is parsed, before validation, and returns the one line
``pretrain.py`` prints at start-up::

    --fp8-format hybrid --fp8-recipe tensorwise -> --precision fp8

so ``--precision`` stays the one source of truth: the Megatron flags are never saved (the
``--precision`` they became is), and nothing downstream knows they were given. Each flag maps onto a
plan exactly (megatron-core's ``TransformerConfig`` and ``fp8_utils``/``fp4_utils`` semantics) or is
refused in one line naming the nearest plan here:

=====================================  =========================================================
Megatron-LM                            here
=====================================  =========================================================
``--fp8-format hybrid``                E4M3 ``x`` and ``w``, E5M2 ``dy`` (``fp8`` in a spec)
``--fp8-format e4m3``                  E4M3 for every operand (``fp8_e4m3``)
``--fp8-recipe tensorwise``            per-tensor current scaling (the ``fp8`` preset for hybrid)
``--fp8-recipe delayed`` (default)     ``+delayed(ALGO,N)`` on every GEMM, ALGO/N from
                                       ``--fp8-amax-compute-algo`` / ``--fp8-amax-history-len``
                                       (Megatron's defaults: most_recent, 1)
``--fp8-recipe mxfp8``                 ``mxfp8_e4m3`` (``mxfp8_e5m2`` for ``dy`` with hybrid), the
                                       E8M0 scale rounded up (``rceil``, TE's MXFP8BlockScaling)
``--no-fp8-wgrad`` (delayed only)      ``wgrad=bf16`` (TE's ``override_linear_precision``)
``--fp8-recipe blockwise``             refused: no 1x128 / 128x128 FP32-scaled blocks here
``--fp8-margin N``                     this project's own flag; with Megatron's flags only with
                                       ``delayed`` (TE's current-scaling recipes take no margin)
``--fp4-format e2m1 --fp4-recipe       the ``nvfp4`` preset (TE's NVFP4BlockScaling)
nvfp4``
``--first-last-layers-bf16``,          ``--precision-rule first:N=bf16 --precision-rule
``--num-layers-at-{start,end}-in-bf16``  last:M=bf16`` (N, M default 1, as Megatron)
``--train-samples N``                  ``--train-iters N / --global-batch-size``
=====================================  =========================================================

Megatron's FP8/FP4 contexts wrap the transformer layers only; the output layer stays BF16, as every
preset here keeps it. With Megatron's flags ``--precision``, ``--precision-schedule``,
``--amax-algo`` and ``--amax-history-len`` are refused (two sources of one plan).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pretrain.config.config_file import ConfigFileArgs
from pretrain.config.fields import arg, flag_name


@dataclass(frozen=True)
class MegatronFlags:
    """Megatron-LM's spellings (group "Megatron-LM spellings"): rewritten into the flags above by
    :func:`translate` while parsing; never part of the run's ``RunConfig``."""

    fp8_format: str | None = arg(
        "--fp8-format", choices=("e4m3", "hybrid"),
        help="Megatron-LM: FP8 on every transformer-layer linear; hybrid: E4M3 x and w, E5M2 dy; e4m3: E4M3 "
        "throughout. Becomes a --precision spec (printed at start-up); not with --precision")
    """Megatron's ``TransformerConfig.fp8``."""
    fp8_recipe: str | None = arg(
        "--fp8-recipe", choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
        help="Megatron-LM (with --fp8-format): tensorwise (per-tensor current scaling), delayed (default: "
        "an amax history), mxfp8 (32-element blocks, E8M0 scales); blockwise and custom are refused, "
        "naming the nearest plan")
    """Megatron's ``TransformerConfig.fp8_recipe`` (default ``delayed``)."""
    fp8_amax_history_len: int | None = arg(
        "--fp8-amax-history-len", type=int, metavar="N",
        help="Megatron-LM, --fp8-recipe delayed: the amax window (default 1)")
    """Megatron's ``fp8_amax_history_len``."""
    fp8_amax_compute_algo: str | None = arg(
        "--fp8-amax-compute-algo", choices=("max", "most_recent"),
        help="Megatron-LM, --fp8-recipe delayed: the amax of the window (default most_recent)")
    """Megatron's ``fp8_amax_compute_algo``."""
    no_fp8_wgrad: bool = arg(
        "--no-fp8-wgrad", action="store_true",
        help="Megatron-LM, --fp8-recipe delayed: Wgrad in BF16 (TE's override_linear_precision): wgrad=bf16")
    """Megatron's ``fp8_wgrad=False``."""
    fp4_format: str | None = arg(
        "--fp4-format", choices=("e2m1",),
        help="Megatron-LM: FP4 on every transformer-layer linear (with --fp4-recipe nvfp4: --precision nvfp4)")
    """Megatron's ``TransformerConfig.fp4``."""
    fp4_recipe: str | None = arg(
        "--fp4-recipe", choices=("nvfp4", "custom"),
        help="Megatron-LM (with --fp4-format): nvfp4 (default; TE's NVFP4BlockScaling); custom is refused")
    """Megatron's ``TransformerConfig.fp4_recipe`` (default ``nvfp4``)."""
    first_last_layers_bf16: bool = arg(
        "--first-last-layers-bf16", action="store_true",
        help="Megatron-LM: keep the first and last transformer layers in BF16 (--precision-rule first:N=bf16 "
        "and last:M=bf16)")
    """Megatron's ``first_last_layers_bf16``."""
    num_layers_at_start_in_bf16: int | None = arg(
        "--num-layers-at-start-in-bf16", type=int, metavar="N",
        help="Megatron-LM, with --first-last-layers-bf16: N first layers in BF16 (default 1)")
    """Megatron's ``num_layers_at_start_in_bf16``."""
    num_layers_at_end_in_bf16: int | None = arg(
        "--num-layers-at-end-in-bf16", type=int, metavar="N",
        help="Megatron-LM, with --first-last-layers-bf16: N last layers in BF16 (default 1)")
    """Megatron's ``num_layers_at_end_in_bf16``."""
    train_samples: int | None = arg(
        "--train-samples", type=int, metavar="N",
        help="Megatron-LM: train on N samples, i.e. --train-iters N / --global-batch-size (N must be a "
        "multiple of it); not with --train-iters")
    """Megatron's ``--train-samples`` (no batch-size ramp-up here: a fixed number of iterations)."""


PRECISION_FLAGS = tuple(f.name for f in dataclasses.fields(MegatronFlags) if f.name != "train_samples")
"""The Megatron flags that spell a precision plan."""
PARSE_TIME = tuple(f.name for cls in (ConfigFileArgs, MegatronFlags) for f in dataclasses.fields(cls))
"""The flags read while parsing (``--config``, Megatron-LM's spellings), then removed from the Namespace."""


def given_megatron_flags(args: argparse.Namespace) -> list[str]:
    """The Megatron flags set on ``args`` (not yet translated), as ``--flag VALUE`` strings, in order."""
    out = []
    for f in dataclasses.fields(MegatronFlags):
        v = getattr(args, f.name, None)
        if v is True:
            out.append(flag_name(f.name))
        elif v not in (None, False):
            out.append(f"{flag_name(f.name)} {v}")
    return out


def _clear(args: argparse.Namespace) -> None:
    for f in dataclasses.fields(MegatronFlags):
        if hasattr(args, f.name):
            setattr(args, f.name, False if f.type == "bool" else None)


def _fp8_spec(fmt: str, recipe: str, algo: str, history_len: int, wgrad: bool = True) -> str:
    """The per-GEMM ``--precision`` spec of Megatron's ``--fp8-format fmt --fp8-recipe recipe``
    (``wgrad=False``: ``--no-fp8-wgrad``, delayed only)."""
    if recipe == "mxfp8":
        pair = "mxfp8_e5m2@mxfp8_e4m3" if fmt == "hybrid" else "mxfp8_e4m3"  # dy's format first
        return f"fprop=mxfp8_e4m3+rceil,dgrad={pair}+rceil,wgrad={pair}+rceil"
    op = "fp8" if fmt == "hybrid" else "fp8_e4m3"  # 'fp8' is the hybrid pair (E5M2 for dy)
    if recipe == "tensorwise":
        return "fp8" if fmt == "hybrid" else f"fprop={op},dgrad={op},wgrad={op}"
    mod = f"+delayed({algo},{history_len})"
    return f"fprop={op}{mod},dgrad={op}{mod},wgrad=" + (f"{op}{mod}" if wgrad else "bf16")


def translate(args: argparse.Namespace, given: set[str]) -> str | None:
    """Rewrite Megatron's precision flags on ``args`` (parsed; ``given``: the dests given explicitly)
    into ``--precision`` / ``--precision-rule``; return the start-up line saying what they became
    (None without Megatron precision flags). ``ValueError`` (one line naming the flag) for a
    combination with no exact plan here, or given together with this project's own spelling."""
    tokens = [t for t in given_megatron_flags(args) if t.split()[0][2:].replace("-", "_") in PRECISION_FLAGS]
    if not tokens:
        return None
    first = tokens[0]
    fp8, fp4 = args.fp8_format, args.fp4_format
    for own in ("precision", "precision_schedule", "amax_algo", "amax_history_len"):
        if own in given and getattr(args, own) is not None:
            raise ValueError(
                f"{first} and {flag_name(own)} {getattr(args, own)}: two spellings of one plan; give Megatron's "
                f"flags or this project's (pretrain.py prints the --precision Megatron's flags become), not both")
    if fp8 and fp4:
        raise ValueError(f"--fp8-format {fp8} and --fp4-format {fp4}: one of them (megatron-core refuses both: "
                         "'fp4 and fp8 cannot be used simultaneously')")
    fp8_only = [n for n in ("fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "no_fp8_wgrad")
                if getattr(args, n) not in (None, False)]
    if not fp8 and fp8_only:
        given_as = next(t for t in tokens if t.split()[0] == flag_name(fp8_only[0]))
        raise ValueError(f"{given_as} needs --fp8-format e4m3|hybrid "
                         "(Megatron turns FP8 on with --fp8-format; without it the flag has no effect)")
    if not fp4 and args.fp4_recipe is not None:
        raise ValueError(f"--fp4-recipe {args.fp4_recipe} needs --fp4-format e2m1 (Megatron turns FP4 on with "
                         "--fp4-format; without it the flag has no effect)")
    if not fp8 and not fp4:
        raise ValueError(f"{first} needs --fp8-format or --fp4-format (Megatron keeps every layer in BF16 without "
                         "them); with --precision spell it --precision-rule first:N=bf16 --precision-rule last:M=bf16")
    margin = getattr(args, "fp8_margin", None)
    if fp8:
        recipe = args.fp8_recipe or "delayed"
        if recipe == "blockwise":
            raise ValueError(
                "--fp8-recipe blockwise: TE's Float8BlockScaling (1x128 activation/gradient and 128x128 weight blocks, "
                f"FP32 scales) has no format here; the nearest plans are --fp8-format {fp8} --fp8-recipe mxfp8 "
                "(32-element blocks, E8M0 scales) or --fp8-recipe tensorwise (per-tensor)")
        if recipe == "custom":
            raise ValueError("--fp8-recipe custom: TE's quantizer-factory hook has no counterpart; a custom recipe "
                             "here is a per-GEMM --precision spec (e.g. 'fprop=fp8,dgrad=fp8,wgrad=mxfp4+had16')")
        if recipe != "delayed":
            for n in ("fp8_amax_history_len", "fp8_amax_compute_algo"):
                if getattr(args, n) is not None:
                    raise ValueError(f"{flag_name(n)} {getattr(args, n)}: only --fp8-recipe delayed keeps an amax "
                                     f"history (Megatron ignores it with --fp8-recipe {recipe}); drop it")
            if args.no_fp8_wgrad:
                raise ValueError(f"--no-fp8-wgrad: Megatron honours it only with --fp8-recipe delayed (with {recipe} "
                                 "Wgrad stays FP8); drop it, or spell the plan with wgrad=bf16 in --precision")
            if margin is not None and margin != 0:
                raise ValueError(f"--fp8-margin {margin}: Megatron applies the margin only with --fp8-recipe delayed "
                                 f"(TE's --fp8-recipe {recipe} takes none); drop it, or spell the plan as "
                                 f"--precision 'fprop=fp8+margin({margin}),dgrad=fp8+margin({margin}),"
                                 f"wgrad=fp8+margin({margin})'")
        history = 1 if args.fp8_amax_history_len is None else args.fp8_amax_history_len
        if history < 1:
            raise ValueError(f"--fp8-amax-history-len {history}: must be >= 1")
        spec = _fp8_spec(fp8, recipe, args.fp8_amax_compute_algo or "most_recent", history, not args.no_fp8_wgrad)
        if args.first_last_layers_bf16 and recipe == "delayed":
            raise ValueError(
                "--first-last-layers-bf16 with --fp8-recipe delayed: megatron-core refuses it ('Delayed scaling "
                "does not support first / last layer in BF16'); here the plan is "
                f"--precision '{spec}' --precision-rule first:1=bf16 --precision-rule last:1=bf16")
    else:
        recipe = args.fp4_recipe or "nvfp4"
        if recipe == "custom":
            raise ValueError("--fp4-recipe custom: TE's quantizer-factory hook has no counterpart; a custom recipe "
                             "here is a per-GEMM --precision spec (e.g. 'fprop=nvfp4,dgrad=nvfp4/sr@nvfp4,"
                             "wgrad=nvfp4/sr@nvfp4+rht16_te')")
        if margin is not None and margin != 0:
            raise ValueError(f"--fp8-margin {margin} with --fp4-format {fp4}: Megatron applies no margin to NVFP4 "
                             "(block scales); drop it")
        spec = "nvfp4"
    rules = []
    counts = {"start": args.num_layers_at_start_in_bf16, "end": args.num_layers_at_end_in_bf16}
    if args.first_last_layers_bf16:
        per_stage = args.num_layers // max(1, getattr(args, "pipeline_model_parallel_size", 1) or 1)
        for where, n in counts.items():
            n = 1 if n is None else n
            if not 0 <= n <= per_stage:
                raise ValueError(f"--num-layers-at-{where}-in-bf16 {n}: must be between 0 and the layers per "
                                 f"pipeline stage ({per_stage}), as in megatron-core")
            if n:
                rules.append(f"{'first' if where == 'start' else 'last'}:{n}=bf16")
    else:
        for where, n in counts.items():
            if n is not None:
                raise ValueError(f"--num-layers-at-{where}-in-bf16 {n} needs --first-last-layers-bf16 (Megatron "
                                 "ignores it without)")
    args.precision = spec
    args.precision_rule = rules + list(args.precision_rule or [])
    _clear(args)
    became = f"--precision {spec}" if "(" not in spec and "," not in spec else f"--precision '{spec}'"
    became += "".join(f" --precision-rule {r}" for r in rules)
    if margin is not None:
        became += f" --fp8-margin {margin}"
    return f"Megatron-LM flags {' '.join(tokens)} -> {became}"


def train_iters_from_samples(args: argparse.Namespace, given: set[str]) -> str | None:
    """``--train-samples N`` -> ``--train-iters N / global batch`` on ``args``; returns the origin note
    of ``train_iters`` (None without the flag). ``ValueError`` (one line) with ``--train-iters``
    given, without a global batch size, or for N not a multiple of it."""
    n = getattr(args, "train_samples", None)
    if n is None:
        return None
    if "train_iters" in given:
        raise ValueError(f"--train-samples {n} and --train-iters {args.train_iters}: give one of them (as Megatron-LM)")
    gbs = args.global_batch_size
    if gbs is None:
        raise ValueError(f"--train-samples {n} needs --global-batch-size (iterations = samples / global batch)")
    if n <= 0 or n % gbs:
        near = sorted({max(gbs, n // gbs * gbs), (max(n, 0) // gbs + 1) * gbs})
        raise ValueError(f"--train-samples {n} is not a positive multiple of --global-batch-size {gbs}; give "
                         f"{' or '.join(map(str, near))} (every iteration trains on one global batch)")
    args.train_iters, args.train_samples = n // gbs, None
    return f"= --train-samples {n} / --global-batch-size {gbs}"


def unread_problem(args: argparse.Namespace) -> str | None:
    """``--config`` and Megatron's spellings are read (and removed from the Namespace) by
    ``pretrain.arguments.parse_args_or_raise``; on the Namespace of a parser that did not read them
    (RL's) they are one line here rather than ignored."""
    if getattr(args, "config", None):
        return f"--config {args.config}: this program takes its flags on the command line (--config is pretrain.py's)"
    if given := given_megatron_flags(args):
        return (f"{given[0]}: this program takes this project's spelling (--precision, --precision-rule, "
                "--train-iters); Megatron-LM's flags are pretrain.py's")
    return None


NOT_HERE = {
    "--fp8-param-gather": "keeps FP8 copies of the parameters (TE's memory saving); here every GEMM quantizes its "
                          "operands from the high-precision weights by its recipe: drop it",
    "--fp4-param-gather": "keeps FP4 copies of the parameters (TE's memory saving); here every GEMM quantizes its "
                          "operands from the high-precision weights by its recipe: drop it",
    "--fp8-dot-product-attention": "the plan quantizes the linear layers; attention's own matmuls run in the "
                                   "model's dtype (--kv-quant FORMAT fake-quantizes K and V): drop it",
    "--fp8-multi-head-attention": "the plan quantizes the linear layers; attention's own matmuls run in the "
                                  "model's dtype (--kv-quant FORMAT fake-quantizes K and V): drop it",
    "--fp8-interval": "deprecated since TransformerEngine 1.8 and ignored by Megatron-LM: drop it",
    "--fp8-quantizer-factory": "a custom recipe here is a per-GEMM --precision spec (docs/precision.md)",
    "--fp4-quantizer-factory": "a custom recipe here is a per-GEMM --precision spec (docs/precision.md)",
    "--lr-decay-samples": "the schedule is counted in iterations: --lr-decay-iters N (samples / --global-batch-size)",
    "--lr-warmup-samples": "the schedule is counted in iterations: --lr-warmup-iters N (samples / --global-batch-size)",
    "--rampup-batch-size": "no batch-size ramp-up here: one --global-batch-size for the whole run",
}
"""Megatron-LM flags with no counterpart here, and why (an unknown flag's one-line error says so)."""


def unrecognized(message: str, options) -> str:
    """argparse's ``unrecognized arguments: ...`` made actionable: a Megatron-LM flag with no counterpart
    here says why (:data:`NOT_HERE`); another unknown flag names the nearest one of ``options``."""
    import difflib

    if not message.startswith("unrecognized arguments: "):
        return message
    first = next((t for t in message.split(": ", 1)[1].split() if t.startswith("--")), None)
    if first is None:
        return message
    flag = first.split("=", 1)[0]
    if flag in NOT_HERE:
        return f"{flag}: Megatron-LM's flag has no counterpart here: {NOT_HERE[flag]}"
    near = difflib.get_close_matches(flag, [o for o in options if o.startswith("--")], n=1, cutoff=0.75)
    return f"{message}; did you mean {near[0]}?" if near else message

"""The run's typed configuration: one frozen dataclass per group of flags, and ``RunConfig`` of them all.

Each field is a flag (``pretrain.config.fields.arg``: its names, argparse keywords and ``--help``
text) with a docstring under it; ``pretrain.arguments.build_parser`` generates the argparse groups
from these classes, in this order. After validation ``RunConfig.from_namespace`` freezes the values;
the trainer, the engines, the lr schedule and the optimizer read these, never the Namespace.

A new training flag that a sweep can range over is one field here (its ``arg(...)``; the sweep's
grid takes any ``build_parser`` flag) -- plus, where the default check does not cover it, a line of
validation in ``pretrain.arguments``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from kernels.backends import GEMM_BACKENDS
from precision.formats import AmaxAlgo
from pretrain.config.fields import arg, from_namespace, to_flat_dict, value
from pretrain.config.model import ModelArgs
from pretrain.config.precision import RunPrecision

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""``--lr-decay-style`` choices, the styles of megatron-core's ``OptimizerParamScheduler.get_lr`` (``pretrain.optim``)."""
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
"""``--lr-wsd-decay-style`` choices: how WSD anneals over its last ``--lr-wsd-decay-iters``."""
WD_INCR_STYLES = ("constant", "linear", "cosine")
"""``--weight-decay-incr-style`` choices."""
DEFAULT_DATA_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "lowprec-pretrain")


def _amax_algos():
    return AmaxAlgo.values()  # valid values come from the format registry


@dataclass(frozen=True)
class PrecisionRunConfig:
    """How the run's GEMMs are quantized (group "precision"); the plan is resolved from these once."""

    precision: str | None = arg(
        "--precision", metavar="NAME|SPEC|FILE",
        help="default recipe of every linear: a preset (precision.presets), a per-GEMM spec, "
        "or a YAML/JSON file (default: bf16; not with --precision-schedule)")
    """Every linear's default recipe (``None`` only with ``precision_schedule``)."""
    precision_schedule: str | None = arg(
        "--precision-schedule", metavar="START:PRECISION,...",
        help="a precision per phase instead of --precision (precision.schedule): START:P runs P from "
        "iteration START+1 on (after START iterations); P is anything --precision takes, or observe (BF16 "
        "GEMMs filling the next phase's amax histories); --precision-rule applies in every phase. E.g. "
        "'0:fp8,200:wgrad_hadamard,900:bf16', the NVFP4 paper's BF16 end '0:nvfp4,900:bf16', an FP8-to-MXFP4 "
        "warm start '0:fp8,100:mxfp4', QAT '0:observe,500:hif8_w8a8' (= --qat-warmup-iters 500)")
    """A precision per phase (``precision.schedule``) instead of ``precision``."""
    precision_rule: tuple[str, ...] = arg(
        "--precision-rule", action="append", default=[], metavar="SELECTOR=VALUE",
        help="per-layer override, first match wins, e.g. first:1=bf16 or 'kind:mlp=wgrad=mxfp4+had16' "
        "(repeatable)")
    """Per-layer overrides, first match wins, before the preset's own rules."""
    gemm_backend: str = arg(
        "--gemm-backend", choices=GEMM_BACKENDS, default="auto",
        help="auto: per GEMM, the device's tensor cores where they support the recipe (FP8 on sm_89+, "
        "MX/NVFP4 on sm_100), else on CUDA BF16 tensor cores for every BF16-exact format (bf16_mm), "
        "else emulated; emulated: fused torch.compile quantizers in FP32; reference: the eager spec "
        "(bit-identical, slower); fp8_scaled_mm / mx_scaled_mm / bf16_mm: force that hardware path")
    """Which implementation runs each GEMM (``kernels.backends``)."""
    numerics_interval: int = arg(
        "--numerics-interval", type=int, default=0, metavar="N",
        help="every N iterations log per layer x GEMM x operand: SQNR, clipped, flushed, amax "
        "(TensorBoard numerics/<layer>/<gemm>/<operand>/<metric>; launch/report.py renders them); 0: off")
    """Per-operand numerics telemetry every N iterations (0: off)."""
    amax_algo: str | None = arg(
        "--amax-algo", choices=_amax_algos,  # the registry's names (precision.formats)
        help="delayed-scaling amax algorithm for every per-tensor operand (FP8, HiF8) of the plan")
    """Overrides every per-tensor operand's amax algorithm (``None``: the plan's own)."""
    amax_history_len: int | None = arg("--amax-history-len", type=int, metavar="N",
                                       help="amax history window (steps) for --amax-algo")
    """Overrides the amax history window (steps)."""
    qat_backward: str = arg(
        "--qat-backward", choices=("hp", "ste"), default="hp",
        help="what Dgrad and Wgrad consume: hp -- the high-precision w and x, each quantized by its own "
        "GEMM's recipe (default; TE's override_linear_precision, the hif8_w8a8 recipe); ste -- Fprop's "
        "quantized Q(w) and Q(x), the fake-quant straight-through estimator (dx = dy Q(w), dw = dy^T Q(x))")
    """hp (each GEMM quantizes its own high-precision operands) or ste (Fprop's Q(w), Q(x) reused)."""
    fp8_margin: int | None = arg(
        "--fp8-margin", type=int, metavar="N",
        help="Megatron-LM/TransformerEngine's margin for every per-tensor operand (FP8, HiF8) of the plan: "
        "scale = target / amax / 2^N, target the format's scale target (FP8: its max normal, as TE; "
        "HiF8: 2^3); N >= 0 for FP8, N >= -12 for HiF8 (-12: amax -> 2^15, TE's FP8 rule); default: "
        "the plan's own (0)")
    """Overrides every per-tensor operand's margin (``None``: the plan's own)."""
    qat_warmup_iters: int = arg(
        "--qat-warmup-iters", type=int, default=0, metavar="N",
        help="train the first N iterations in BF16 while the amax histories fill, then switch to the "
        "quantized plan (HiF8 QAT recipe: 500); the same as --precision-schedule 0:observe,N:PRECISION "
        "with --precision PRECISION (not with --precision-schedule). Either spelling makes "
        "--lr-decay-style default to constant and --lr-warmup-iters to 0: warm-up and QAT at --lr")
    """BF16 iterations filling the amax histories before the quantized plan (``0:observe,N:P``)."""
    kv_quant: str | None = arg(
        "--kv-quant", metavar="FORMAT",
        help="fake-quantize K and V in the training forward exactly as a rollout KV-cache in FORMAT "
        "stores them (along the head dimension, straight-through gradient; model.kv_cache), e.g. "
        "mxfp4, nvfp4, fp8; default: off")
    """K and V fake-quantized as a rollout KV-cache in this format stores them (``None``: off)."""

    resolved: RunPrecision | None = dataclasses.field(default=None, compare=False, repr=False,
                                                      metadata={"flags": (), "saved": False})
    """The flags above parsed once (``pretrain.config.precision.RunPrecision``): validation hands it in;
    a config built otherwise parses its flags here, on construction. Not saved (the flags are)."""
    megatron_flags: str | None = dataclasses.field(default=None, compare=False, repr=False,
                                                   metadata={"flags": (), "saved": False})
    """The start-up line saying which Megatron-LM flags spelled this plan and the ``--precision`` they
    became (``pretrain.config.megatron_flags``); ``None`` without them. Not saved (``precision`` is)."""

    def __post_init__(self):
        if self.resolved is None:
            object.__setattr__(self, "resolved", RunPrecision.parse(
                self.precision, self.precision_schedule, self.qat_warmup_iters, self.precision_rule))

    def schedule(self):
        """The run's ``precision.schedule.PrecisionSchedule`` (one phase without ``--precision-schedule``)."""
        return self.resolved.schedule


@dataclass(frozen=True)
class MemoryConfig:
    """Parameter dtype and activation recomputation (group "mixed precision and memory")."""

    bf16: bool | None = arg(
        "--bf16", action=argparse.BooleanOptionalAction, default=None,
        help="BF16 parameters and activations with FP32 main parameters and gradients (megatron-core's "
        "mixed-precision optimizer on the megatron engine, an FP32 main copy on the torch engine); "
        "default: on with CUDA, off on CPU (--no-bf16: FP32 throughout)")
    """BF16 parameters with FP32 mains; validation fills ``None`` with whether CUDA is present."""
    recompute_granularity: str | None = arg(
        "--recompute-granularity", choices=["full", "selective"],
        help="activation recomputation (megatron-core's TransformerBlock): full: whole transformer "
        "layers (--recompute-method, --recompute-num-layers); selective: core attention only")
    """full, selective or ``None`` (no recomputation)."""
    recompute_method: str | None = arg(
        "--recompute-method", choices=["uniform", "block"],
        help="with --recompute-granularity full: uniform (default): every layer, in chunks of "
        "--recompute-num-layers; block: only the first --recompute-num-layers layers of each pipeline stage")
    """uniform or block (full recomputation only)."""
    recompute_num_layers: int | None = arg(
        "--recompute-num-layers", type=int, metavar="N",
        help="layers per recomputed chunk (uniform) or recomputed layers per stage (block); default 1")
    """Layers per chunk (uniform) or per stage (block)."""

    def recompute(self):
        """The ``model.gpt.RecomputeConfig`` (``None``: no recomputation)."""
        from model.gpt import RecomputeConfig

        if self.recompute_granularity is None:
            return None
        if self.recompute_granularity == "selective":
            return RecomputeConfig("selective")
        n = 1 if self.recompute_num_layers is None else self.recompute_num_layers
        return RecomputeConfig("full", self.recompute_method or "uniform", n)


@dataclass(frozen=True)
class ParallelConfig:
    """Model and data parallelism, and which engine runs the step (group "parallelism")."""

    tensor_model_parallel_size: int = arg("--tensor-model-parallel-size", type=int, default=1)
    """TP: every linear's weight split over this many ranks."""
    pipeline_model_parallel_size: int = arg("--pipeline-model-parallel-size", type=int, default=1)
    """PP: the layers split into this many stages (CUDA, the megatron engine)."""
    sequence_parallel: bool = arg("--sequence-parallel", action="store_true", help="CUDA only; needs TP > 1")
    """Megatron's sequence parallelism (TP > 1, CUDA)."""
    ddp_impl: str = arg(
        "--ddp-impl", choices=["auto", "torch", "megatron"], default="auto",
        help="megatron: megatron-core DDP, optimizer and pipeline schedules (CUDA only); torch: torch DDP "
        "and our AdamW loop (CPU or GPU; no pipeline parallelism); auto: megatron on CUDA, torch on CPU")
    """The engine (``pretrain.engine``): torch, megatron, or auto (megatron on CUDA)."""
    use_distributed_optimizer: bool = arg(
        "--use-distributed-optimizer", action="store_true",
        help="shard the optimizer state over data-parallel ranks (megatron-core's distributed optimizer; "
        "needs the megatron engine, so CUDA)")
    """ZeRO-1: the optimizer state sharded over data-parallel ranks (megatron engine)."""


@dataclass(frozen=True)
class TrainingConfig:
    """Batch, optimizer, lr / weight-decay schedule, seed and the non-finite policy (group "training")."""

    micro_batch_size: int = arg("--micro-batch-size", type=int, default=1)
    """Samples per micro-batch on each data-parallel rank."""
    global_batch_size: int | None = arg("--global-batch-size", type=int,
                                        help="default: micro batch size * data-parallel size")
    """Samples per iteration over all ranks; validation fills ``None`` with micro x DP."""
    train_iters: int | None = arg("--train-iters", type=int)
    """Iterations (optimizer steps) of the run."""
    lr: float = arg("--lr", type=float, default=3e-4)
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float = arg("--min-lr", type=float, default=0.0)
    """The floor the decay reaches at ``lr_decay_iters``."""
    lr_warmup_iters: int = arg("--lr-warmup-iters", type=int, default=0,
                               help="linear warm-up from --lr-warmup-init to --lr")
    """Linear warm-up length in iterations."""
    lr_warmup_fraction: float | None = arg(
        "--lr-warmup-fraction", type=float,
        help="warm-up over this fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    """Warm-up as a fraction of ``lr_decay_iters`` (instead of ``lr_warmup_iters``)."""
    lr_warmup_init: float = arg("--lr-warmup-init", type=float, default=0.0, help="the lr the warm-up starts from")
    """The lr at step 0 of the warm-up."""
    lr_decay_iters: int | None = arg("--lr-decay-iters", type=int,
                                     help="the decay reaches --min-lr here (default: --train-iters)")
    """The step at which the decay reaches ``min_lr``; parsing fills ``None`` with ``train_iters``."""
    lr_decay_style: str = arg(
        "--lr-decay-style", choices=list(LR_DECAY_STYLES), default="cosine",
        help="after the warm-up (megatron-core's OptimizerParamScheduler; Megatron-LM's default is linear); "
        "WSD: --lr until the last --lr-wsd-decay-iters of --lr-decay-iters, which anneal to --min-lr")
    """One of :data:`LR_DECAY_STYLES`."""
    lr_wsd_decay_iters: int | None = arg("--lr-wsd-decay-iters", type=int,
                                         help="WSD: the annealing length (needed with --lr-decay-style WSD)")
    """WSD's annealing length, the last steps before ``lr_decay_iters``."""
    lr_wsd_decay_style: str = arg("--lr-wsd-decay-style", choices=list(LR_WSD_DECAY_STYLES), default="exponential",
                                  help="WSD: the annealing's shape")
    """One of :data:`LR_WSD_DECAY_STYLES`."""
    override_opt_param_scheduler: bool = arg(
        "--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
        help="at --load, take the lr schedule's values from this run's flags (the default here; Megatron-LM "
        "refuses a difference without one of these two flags)")
    """At ``--load``, this run's schedule values win (the default here)."""
    use_checkpoint_opt_param_scheduler: bool = arg(
        "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", action="store_true",
        help="at --load, take the lr schedule's values from the checkpoint")
    """At ``--load``, the checkpoint's schedule values win."""
    weight_decay: float = arg("--weight-decay", type=float, default=0.1)
    """AdamW's decoupled weight decay on matrices (biases and norms: none)."""
    start_weight_decay: float | None = arg("--start-weight-decay", type=float,
                                           help="with --weight-decay-incr-style linear/cosine")
    """The weight decay at step 0 of a linear / cosine increase."""
    end_weight_decay: float | None = arg("--end-weight-decay", type=float,
                                         help="with --weight-decay-incr-style linear/cosine")
    """The weight decay at ``train_iters`` of a linear / cosine increase."""
    weight_decay_incr_style: str = arg(
        "--weight-decay-incr-style", choices=list(WD_INCR_STYLES), default="constant",
        help="weight decay from --start-weight-decay to --end-weight-decay over --train-iters")
    """One of :data:`WD_INCR_STYLES`."""
    adam_beta1: float = arg("--adam-beta1", type=float, default=0.9)
    """Adam's first-moment decay."""
    adam_beta2: float = arg("--adam-beta2", type=float, default=0.95)
    """Adam's second-moment decay."""
    adam_eps: float = arg("--adam-eps", type=float, default=1e-8)
    """Adam's epsilon."""
    clip_grad: float = arg("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    """The global gradient norm is clipped to this (0: no clipping)."""
    seed: int = arg("--seed", type=int, default=1234)
    """Seeds initial weights, data order, dropout and stochastic rounding."""
    exit_interval: int | None = arg("--exit-interval", type=int,
                                    help="save (with --save) and exit after an iteration divisible by this")
    """Save and exit 0 after an iteration divisible by this."""
    exit_duration_in_mins: float | None = arg(
        "--exit-duration-in-mins", type=float, metavar="MIN",
        help="save (with --save) and exit after the first iteration that ends more than MIN minutes after "
        "the process started (Megatron-LM's flag; run_status.json state stopped)")
    """Save and exit 0 after the first iteration ending past this many minutes of the process's life."""
    check_for_nan_in_loss_and_grad: bool = arg(
        "--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
        help="a non-finite loss or gradient norm ends the run as diverged: exit status 3, "
        "--save/run_status.json, the last good checkpoint named (pretrain/status.py); "
        "--no-check-for-nan-in-loss-and-grad: train on")
    """A non-finite loss or gradient norm is divergence (exit 3)."""
    skip_nonfinite_steps: int = arg(
        "--skip-nonfinite-steps", type=int, default=0, metavar="N",
        help="skip up to N non-finite steps (no parameter or optimizer update, counted in "
        "nonfinite-steps) before the next one ends the run as diverged")
    """Non-finite steps rolled back before the next one is divergence."""

    @staticmethod
    def schedule_problem(args: argparse.Namespace) -> str | None:
        """One line saying what is wrong with the lr / weight-decay schedule flags of ``args`` (what
        megatron-core's ``OptimizerParamScheduler`` asserts), or ``None`` (validation)."""
        if args.lr_warmup_iters > args.lr_decay_iters:
            return f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters {args.lr_decay_iters}"
        fraction = getattr(args, "lr_warmup_fraction", None)
        if fraction is not None:
            if args.lr_warmup_iters:
                return f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {args.lr_warmup_iters}: give one of them"
            if not 0.0 <= fraction < 1.0:
                return f"--lr-warmup-fraction {fraction}: must be in [0, 1)"
        init = getattr(args, "lr_warmup_init", 0.0)
        if not 0.0 <= init <= args.lr:
            return f"--lr-warmup-init {init}: must be in [0, --lr {args.lr}]"
        wsd = getattr(args, "lr_wsd_decay_iters", None)
        if args.lr_decay_style == "WSD":
            if wsd is None:
                return ("--lr-decay-style WSD needs --lr-wsd-decay-iters N (the annealing length, "
                        f"0 <= N <= --lr-decay-iters {args.lr_decay_iters})")
            if not 0 <= wsd <= args.lr_decay_iters:
                return f"--lr-wsd-decay-iters {wsd}: must be in [0, --lr-decay-iters {args.lr_decay_iters}]"
        elif wsd is not None:
            return (f"--lr-wsd-decay-iters {wsd}: used only with --lr-decay-style WSD "
                    f"(this run's is {args.lr_decay_style})")
        if getattr(args, "override_opt_param_scheduler", False) and \
                getattr(args, "use_checkpoint_opt_param_scheduler", False):
            return "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one of them"
        incr = getattr(args, "weight_decay_incr_style", "constant")
        start, end = getattr(args, "start_weight_decay", None), getattr(args, "end_weight_decay", None)
        if incr == "constant":
            if start is not None or end is not None:
                return ("--start-weight-decay / --end-weight-decay: used only with --weight-decay-incr-style "
                        "linear or cosine (the constant style uses --weight-decay)")
        elif start is None or end is None:
            return f"--weight-decay-incr-style {incr} needs --start-weight-decay and --end-weight-decay"
        elif not 0.0 <= start <= end:
            return f"--start-weight-decay {start} / --end-weight-decay {end}: need 0 <= start <= end"
        return None


@dataclass(frozen=True)
class DataConfig:
    """Datasets, tokenizer and loading (group "data")."""

    data_path: tuple[str, ...] | None = arg(
        "--data-path", nargs="+", metavar="PREFIX",
        help="indexed-dataset prefixes (PREFIX.bin/.idx), optionally weighted: W1 P1 W2 P2; "
        "default: the built-in stdlib corpus")
    """Indexed-dataset prefixes, optionally weighted (``None``: the built-in corpus)."""
    valid_data_path: tuple[str, ...] | None = arg("--valid-data-path", nargs="+", metavar="PREFIX",
                                                  help="separate validation prefixes")
    """Separate validation prefixes."""
    split: str = arg("--split", default="99,1,0", help="train,valid,test document split of --data-path (default 99,1,0)")
    """train,valid,test document split of ``data_path``."""
    fixed_train_set: int | None = arg(
        "--fixed-train-set", type=int, metavar="N",
        help="train on N fixed sequences of the training data, repeated (evenly spaced windows, "
        "independent of --seed); with --global-batch-size N every step's gradient is the exact "
        "gradient of the set (full batch). N must be a multiple of --global-batch-size")
    """Train on N fixed sequences, repeated (``None``: the whole training data)."""
    tokenizer_model: str | None = arg(
        "--tokenizer-model", metavar="PATH",
        help="sentencepiece .model file, or a Hugging Face tokenizer folder with --tokenizer-type "
        "HuggingFaceTokenizer (required with --data-path)")
    """A sentencepiece ``.model`` or a Hugging Face tokenizer folder (``None``: the built-in one)."""
    tokenizer_type: str = arg(
        "--tokenizer-type", choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"),
        default="SentencePieceTokenizer",
        help="what --tokenizer-model is (default SentencePieceTokenizer; without --data-path, "
        "HuggingFaceTokenizer tokenizes the built-in corpus with it)")
    """What ``tokenizer_model`` is."""
    num_workers: int | None = arg(
        "--num-workers", type=int, metavar="N",
        help="data-loader worker processes per rank (torch DataLoader; 0: load in the training process; "
        "default: 2 with CUDA, 0 on CPU); batches go to pinned memory on CUDA")
    """Data-loader workers per rank; validation fills ``None`` (2 with CUDA, 0 on CPU)."""
    data_cache_dir: str = arg("--data-cache-dir", "--data-cache-path", default=DEFAULT_DATA_CACHE_DIR,
                              help="built-in corpus and dataset index cache (default ~/.cache/lowprec-pretrain; "
                              "--data-cache-path is Megatron-LM's name)")
    """Where the built-in corpus and the dataset indices are cached."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, resuming and initial weights (group "checkpoints, evaluation, logging", first part)."""

    save: str | None = arg("--save", metavar="DIR",
                           help="checkpoint directory (DIR/iter_0000010/..., in the --ckpt-format layout)")
    """Checkpoint directory (``None``: nothing saved)."""
    ckpt_format: str = arg(
        "--ckpt-format", default="legacy", choices=("legacy", "torch", "torch_dist"),
        help="how --save writes: legacy (Megatron-LM's 'torch' layout, mp_rank_XX/model_optim_rng.pt per TP rank; "
        "'torch' is accepted as its Megatron-LM name) or torch_dist (megatron-core dist_checkpointing: sharded, loads "
        "at any TP size); --load reads either")
    """Checkpoint layout written by ``--save`` (``pretrain.dist_checkpoint`` for ``torch_dist``)."""
    save_interval: int | None = arg("--save-interval", type=int,
                                    help="save every N iterations (and always at the end and on SIGTERM)")
    """Save every N iterations (and at the end and on SIGTERM)."""
    save_retain: int | None = arg(
        "--save-retain", type=int, metavar="N",
        help="keep the newest N complete checkpoints in --save; older ones are deleted only after a newer "
        "one is complete (default: keep all)")
    """Keep the newest N complete checkpoints (``None``: all)."""
    load: str | None = arg("--load", metavar="DIR",
                           help="resume from DIR's latest checkpoint; may equal --save and not exist yet")
    """Resume from this directory's latest checkpoint."""
    ckpt_step: int | None = arg(
        "--ckpt-step", type=int, metavar="N",
        help="with --load: load iteration N instead of the one latest_checkpointed_iteration.txt names")
    """Load this iteration instead of the tracker's."""
    finetune: bool = arg("--finetune", action="store_true",
                         help="with --load: load model weights only, restart at iteration 0")
    """Load model weights only and restart at iteration 0."""
    no_load_optim: bool = arg("--no-load-optim", action="store_true",
                              help="with --load: do not load the optimizer state (fresh Adam moments; the "
                              "iteration, lr schedule and data position are resumed)")
    """Resume without the optimizer state (Megatron-LM's ``--no-load-optim``)."""
    no_load_rng: bool = arg("--no-load-rng", action="store_true",
                            help="with --load: do not restore the RNG states (python, numpy, torch, CUDA)")
    """Resume without the RNG states (Megatron-LM's ``--no-load-rng``)."""
    pretrained_checkpoint: str | None = arg(
        "--pretrained-checkpoint", metavar="PATH",
        help="initial model weights, used while --load holds no checkpoint yet: a launch/convert_hf.py "
        "output (directory or hf_converted.pt) or a training checkpoint directory (any TP size); the "
        "model shape and the default tokenizer come from it")
    """Initial weights while ``load`` holds no checkpoint yet."""


@dataclass(frozen=True)
class LoggingConfig:
    """Evaluation and logging cadences (group "checkpoints, evaluation, logging", second part)."""

    eval_interval: int = arg("--eval-interval", type=int, default=1000,
                             help="held-out evaluation every N iterations (0: only at the end)")
    """Held-out evaluation every N iterations (0: only at the end)."""
    eval_iters: int = arg("--eval-iters", type=int, default=10, help="global batches per evaluation (0: no evaluation)")
    """Global batches per evaluation (0: none)."""
    log_interval: int = arg("--log-interval", type=int, default=10)
    """A progress line every N iterations."""
    tensorboard_dir: str | None = arg("--tensorboard-dir", metavar="DIR")
    """TensorBoard event files (and ``val_batches.jsonl``) here; ``None``: none."""
    print_model: bool = arg("--print-model", action="store_true",
                            help="print the model's module tree (each linear with its per-GEMM precision) at "
                            "start-up; the plan is printed either way, grouped by rule")
    """Print ``print(model)`` at start-up (off: the start-up output stays one screen)."""
    log_throughput: bool = arg("--log-throughput", action="store_true",
                               help="model TFLOP/s per device and MFU (known GPUs) in the progress line, and the "
                               "TensorBoard scalars throughput and mfu (Megatron-LM's flag)")
    """Model TFLOP/s per device (Megatron's "throughput per GPU") and MFU, printed and logged."""
    log_memory_to_tensorboard: bool = arg("--log-memory-to-tensorboard", action="store_true",
                                          help="memory scalars every iteration: CUDA's mem-reserved-bytes, "
                                          "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count; "
                                          "on a CPU mem-max-rss-bytes (host peak RSS)")
    """Megatron-LM's memory scalars (``pretrain.trainer.metrics.memory_scalars``)."""
    wandb_project: str | None = arg("--wandb-project", metavar="NAME",
                                    help="also log every scalar to Weights & Biases, this project (rank 0; offline "
                                    "unless WANDB_MODE is set; needs the wandb extra: pip install "
                                    "'lowprec-pretrain[wandb]')")
    """W&B project (``None``: no W&B)."""
    wandb_exp_name: str | None = arg("--wandb-exp-name", metavar="NAME", help="the W&B run's name (with --wandb-project)")
    """W&B run name."""
    wandb_save_dir: str | None = arg("--wandb-save-dir", metavar="DIR",
                                     help="W&B's local files (default: <--save>/wandb, else <--tensorboard-dir>/wandb)")
    """W&B's directory (``None``: ``--save``'s, else ``--tensorboard-dir``'s ``wandb/``)."""

    @staticmethod
    def wandb_problem(args: argparse.Namespace) -> str | None:
        """One line saying what is wrong with the W&B flags of ``args``, or ``None`` (validation)."""
        project, name, directory = args.wandb_project, args.wandb_exp_name, args.wandb_save_dir
        if not project:
            return None if not (name or directory) else (
                "--wandb-exp-name/--wandb-save-dir need --wandb-project (W&B logging is off without it)")
        if not name:
            return "--wandb-project needs --wandb-exp-name (the run's name in the project), as in Megatron-LM"
        if not (directory or args.save or args.tensorboard_dir):
            return "--wandb-project needs --wandb-save-dir (or --save, whose wandb/ subdirectory is the default)"
        try:
            import wandb  # noqa: F401
        except ImportError:
            return ("--wandb-project: the wandb package is not installed; install the extra: "
                    "pip install 'lowprec-pretrain[wandb]' (or pip install wandb)")
        return None


# (argparse group title, the classes whose fields it holds), in --help order
GROUPS = (
    ("model", (ModelArgs,)),
    ("precision", (PrecisionRunConfig,)),
    ("mixed precision and memory", (MemoryConfig,)),
    ("parallelism", (ParallelConfig,)),
    ("training", (TrainingConfig,)),
    ("data", (DataConfig,)),
    ("checkpoints, evaluation, logging", (CheckpointConfig, LoggingConfig)),
)


@dataclass(frozen=True)
class RunConfig:
    """Everything a pretraining run is configured with, validated and frozen (``parse_run_config``)."""

    model: ModelArgs
    precision: PrecisionRunConfig
    memory: MemoryConfig
    parallel: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    pretrained_vocab_size: int | None = value(None)
    """The vocabulary of ``--pretrained-checkpoint``'s embedding table (it fixes the model's)."""

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, resolved: RunPrecision | None = None) -> RunConfig:
        """The validated Namespace (``pretrain.arguments.validate_args``), frozen by group; ``resolved``:
        its precision flags as validation parsed them (else they are parsed here)."""
        return cls(
            model=from_namespace(ModelArgs, args), precision=from_namespace(PrecisionRunConfig, args, resolved=resolved),
            memory=from_namespace(MemoryConfig, args), parallel=from_namespace(ParallelConfig, args),
            training=from_namespace(TrainingConfig, args), data=from_namespace(DataConfig, args),
            checkpoint=from_namespace(CheckpointConfig, args), logging=from_namespace(LoggingConfig, args),
            pretrained_vocab_size=getattr(args, "pretrained_vocab_size", None),
        )  # fmt: skip

    def to_dict(self) -> dict:
        """Every value under its flag's ``dest`` (the Namespace's form): what checkpoints save as ``args``."""
        return to_flat_dict(self)

    def model_config(self, vocab_size: int):
        """The ``model.gpt.ModelConfig`` of the run for a tokenizer of ``vocab_size`` tokens."""
        return self.model.to_model_config(vocab_size, self.precision.kv_quant)

"""Command line of ``launch/rl.py``: pretraining's flags plus an RL group, one-line errors.

    args, cfg = parse_rl_args(argv, world_size, cuda)   # argparse Namespace (pretraining's part) + RLConfig

The parser is ``pretrain.arguments.build_parser()`` (model shape, ``--precision`` /
``--precision-rule``, ``--kv-quant``, parallelism, optimizer, ``--save`` / ``--load`` /
``--save-interval``, ``--tensorboard-dir``, ``--seed``, ...) with the group "reinforcement
learning" added (:func:`add_rl_arguments`). RL-specific defaults (``RL_DEFAULTS``): ``--lr 1e-4``,
``--lr-decay-style constant`` and ``--weight-decay 0`` (as verl's actor), ``--eval-interval 10``,
``--log-interval 1``, and ``--gemm-backend reference`` on CPU (``auto`` on CUDA): the eager
reference quantizers, the same bits as the fused ``torch.compile`` ones, which recompile for the new
batch shapes of every iteration (a ``wgrad_hadamard`` trainer: 6 iterations in 18 s instead of 2 min
18 s, measured). ``--train-iters`` is derived: the run's optimizer steps,
``--rl-iters`` x ``--ppo-epochs`` x ``--ppo-mini-batches`` (the lr schedule's length).

Where the model shape comes from: ``--load`` names the starting policy, a pretraining checkpoint
(any TP size; weights only, RL iteration 0, like ``--finetune``) or a checkpoint ``launch/rl.py``
wrote (exact resume). Its ``model_config`` fixes the shape (a shape flag that disagrees is refused),
``--seq-length`` (default: the checkpoint's) and the tokenizer (default: the checkpoint's). Without
``--load`` the shape flags (or ``--model-size``) are needed, and a random-init policy is trained.

Every refusal is one line naming the flag or file and what is valid (:class:`ConfigError`):
``--group-size 1``, a correction threshold out of range (``pretrain.rl.objective.Correction``), a
task seed file that does not parse (``pretrain.rl.task.load_task``), a rollout plan that does not
parse; a rollout plan the built model cannot take is refused the same way when the model is built
(``pretrain.rl.trainer``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pretrain.arguments import ConfigError, build_parser, validate_args

__all__ = ["PROG", "RLConfig", "RLRun", "add_rl_arguments", "build_rl_parser", "parse_rl_args", "rl_config", "rl_run"]

PROG = "rl.py"

# RL defaults that differ from pretraining's (verl's actor: constant lr, no weight decay)
RL_DEFAULTS = {"gemm_backend": None, "lr": 1e-4, "min_lr": 0.0, "lr_decay_style": "constant", "weight_decay": 0.0,
               "eval_interval": 10,               "log_interval": 1, "micro_batch_size": 1}


@dataclass(frozen=True)
class RLConfig:
    """The RL group of flags, validated once (the loop reads this, never the Namespace's RL part)."""

    task: str
    """Task seed file (``pretrain.rl.task``), e.g. configs/rl/arith.yaml."""
    rl_iters: int
    """RL iterations: each samples, scores and updates once (``--ppo-epochs`` x ``--ppo-mini-batches`` steps)."""
    prompts_per_step: int
    """Prompts per iteration over all data-parallel ranks (each rank takes an equal slice)."""
    group_size: int
    """G responses per prompt (>= 2: GRPO normalizes rewards within a prompt's group)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    rollout_precision: str
    """Rollout plan (``model.rollout_plan``): bf16, fp8, mxfp4, nvfp4, mxfp4_w4a16 (+had16/+had32) or a spec."""
    rollout_precision_rules: tuple[str, ...]
    advantage_estimator: str
    """grpo | dr_grpo (no division by the group's reward std)."""
    loss_agg_mode: str
    """How token losses become the batch loss (``pretrain.rl.objective.LOSS_AGG_MODES``)."""
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    """Dual-clip bound c (> 1, verl's clip_ratio_c): a negative-advantage token's loss is at most -A c."""
    entropy_coeff: float
    """Entropy bonus (verl's entropy_coeff): the loss minus this x the aggregated entropy of the policy."""
    overlong_buffer_len: int
    """DAPO's soft overlong punishment over the last N tokens of --max-new-tokens (0: off)."""
    overlong_penalty_factor: float
    """The punishment at --max-new-tokens (verl's overlong_buffer.penalty_factor)."""
    overlong_filter: bool
    """Truncated responses (no stop token) take no part in the loss (DAPO's overlong filtering)."""
    ppo_epochs: int
    ppo_mini_batches: int
    kl_coef: float
    """Weight of the KL penalty to the starting policy (0: no reference model)."""
    kl_type: str
    correction: object
    """``pretrain.rl.objective.Correction``: none, tis, mis, seq_tis, seq_mis, geo_mis + thresholds."""
    rollout_qat: str
    """none | rtn | replay (``pretrain.rl.qat``)."""
    rollout_qat_layers: tuple[str, ...]
    rollout_qat_kv: bool
    rollout_fallback: str | None
    """METRIC=THRESHOLD[,to=bf16|fp8][,layers=K] (``pretrain.rl.fallback``), or None."""
    reward_function: str | None
    """FILE.py:NAME, a function (problem, response text, spec) -> float instead of the task's reward."""
    eval_interval: int
    """Held-out greedy accuracy every N iterations (0: only at the end)."""
    eval_prompts: int | None
    """How many of the task's held-out problems each evaluation uses (None: all)."""
    max_prompt_tokens: int
    """Longest prompt in tokens the run allows (prompt + --max-new-tokens <= --seq-length)."""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True)
class RLRun:
    """Pretraining's flags that the RL loop reads (the rest build the model and optimizer at setup)."""

    seed: int
    """--seed: initialisation, and (with the iteration and DP rank) each iteration's sampling seed."""
    clip_grad: float
    """--clip-grad: the global gradient-norm bound of every optimizer step."""
    log_interval: int
    """--log-interval: a progress line every N iterations."""
    save: str | None
    """--save: the run's checkpoint directory (also where it resumes from)."""
    save_interval: int | None
    """--save-interval: a checkpoint every N iterations."""
    save_retain: int | None
    """--save-retain: how many checkpoints to keep."""
    exit_interval: int | None
    """--exit-interval: stop (and save) after every N iterations."""
    load: str | None
    """--load: the starting policy (or an RL checkpoint to resume)."""
    ckpt_step: int | None
    """--ckpt-step: the iteration of --load to read (default: its latest)."""
    tensor_model_parallel_size: int
    seq_length: int
    tensorboard_dir: str | None
    precision: str
    lr: float


def rl_run(args) -> RLRun:
    """The :class:`RLRun` of a validated Namespace."""
    return RLRun(args.seed, args.clip_grad, args.log_interval, args.save, args.save_interval, args.save_retain,
                 args.exit_interval, args.load, args.ckpt_step, args.tensor_model_parallel_size, args.seq_length,
                 args.tensorboard_dir, args.precision, args.lr)


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    """The "reinforcement learning" group (names as verl / TRL users know them)."""
    from model.rollout_plan import ROLLOUT_PRESETS
    from pretrain.rl.objective import ADVANTAGE_ESTIMATORS, CORRECTIONS, KL_KINDS, LOSS_AGG_MODES
    from pretrain.rl.qat import QAT_MODES

    g = p.add_argument_group("reinforcement learning")
    add = g.add_argument
    add("--task", metavar="FILE", help="task seed file (pretrain/rl/task.py), e.g. configs/rl/arith.yaml (required)")
    add("--rl-iters", type=int, default=100, help="RL iterations (sample, score, update)")
    add("--prompts-per-step", type=int, default=32, help="prompts per iteration, over all data-parallel ranks")
    add("--group-size", type=int, default=8, metavar="G", help="responses sampled per prompt (>= 2)")
    add("--max-new-tokens", type=int, default=8, help="longest response in tokens")
    add("--temperature", type=float, default=1.0, help="sampling temperature (> 0; the trainer scores at it)")
    add("--top-p", type=float, default=1.0)
    add("--top-k", type=int, default=0, help="0: off")
    add("--rollout-precision", default="bf16", metavar="PRESET_OR_SPEC",
        help=f"rollout plan (model.rollout_plan): {', '.join(ROLLOUT_PRESETS)} (+had16/+had32), or "
        "base=PRESET,kv=FORMAT / linear=X@W,kv=FORMAT")
    add("--rollout-precision-rule", action="append", default=[], metavar="SELECTOR=VALUE",
        help="per-layer rollout recipe with --precision-rule selectors, e.g. first:1=bf16 (repeatable)")
    add("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo",
        help="grpo: (r - group mean) / group std; dr_grpo: r - group mean (and, unless --loss-agg-mode is "
        "given, seq-mean-token-sum-norm)")
    add("--loss-agg-mode", choices=LOSS_AGG_MODES, default=None,
        help="default: token-mean (grpo), seq-mean-token-sum-norm (dr_grpo)")
    add("--clip-ratio-low", type=float, default=0.2, help="PPO clip: ratio >= 1 - this")
    add("--clip-ratio-high", type=float, default=0.2, help="PPO clip: ratio <= 1 + this")
    add("--clip-ratio-c", type=float, default=3.0,
        help="dual-clip PPO bound (> 1; verl's clip_ratio_c): a token with a negative advantage loses at most "
        "-A x this")
    add("--entropy-coeff", type=float, default=0.0,
        help="entropy bonus (verl's entropy_coeff): loss -= this x the entropy of the sampling distribution, "
        "aggregated as --loss-agg-mode")
    add("--overlong-buffer-len", type=int, default=0, metavar="N",
        help="DAPO's overlong penalty (verl's reward_model.overlong_buffer.len): a response longer than "
        "--max-new-tokens - N loses up to --overlong-penalty-factor of reward, linearly (0: off)")
    add("--overlong-penalty-factor", type=float, default=1.0,
        help="the overlong penalty at --max-new-tokens (verl's overlong_buffer.penalty_factor)")
    add("--overlong-filter", action=argparse.BooleanOptionalAction, default=False,
        help="DAPO's overlong filtering: responses cut at --max-new-tokens (no stop token) get no loss")
    add("--ppo-epochs", type=int, default=1, help="passes over each iteration's rollouts")
    add("--ppo-mini-batches", type=int, default=1, help="optimizer steps per pass (the batch split by prompts)")
    add("--kl-coef", type=float, default=0.0, help="KL penalty to the starting policy (0: no reference model)")
    add("--kl-type", choices=KL_KINDS, default="low_var_kl",
        help="KL estimator (verl's kl_penalty): k1, abs, mse (k2), low_var_kl (k3)")
    add("--rollout-correction", choices=CORRECTIONS, default="none",
        help="trainer/rollout mismatch correction: tis (truncated IS), mis (masked IS / IcePop), seq_tis, "
        "seq_mis, geo_mis (geometric-mean sequence rejection)")
    add("--rollout-is-threshold", type=float, default=None, help="IS weight cap (tis, seq_tis; default as verl)")
    add("--rollout-rs-threshold", default=None, metavar="U|LOWER_UPPER",
        help="rejection bound (mis, seq_mis, geo_mis): U keeps rho = pi_trainer / pi_rollout in [1/U, U] "
        "(or [--rollout-rs-threshold-lower, U]); verl's LOWER_UPPER bounds pi_rollout / pi_trainer, so "
        "0.8_2.0 keeps rho in [0.5, 1.25]")
    add("--rollout-rs-threshold-lower", type=float, default=None,
        help="rejection lower bound on rho = pi_trainer / pi_rollout (default 1 / U)")
    add("--rollout-qat", choices=QAT_MODES, default="none",
        help="rollout-guided QAT (pretrain/rl/qat.py): none; rtn: the trainer's forward fake-quantizes as the "
        "rollout plan; replay: as rtn, replaying the rollout's recorded rounding")
    add("--rollout-qat-layers", action="append", default=None, metavar="SELECTOR",
        help="linears whose rounding --rollout-qat replay replays (repeatable; default all)")
    add("--rollout-qat-kv", action=argparse.BooleanOptionalAction, default=True,
        help="--rollout-qat also fake-quantizes K/V as the rollout's KV-cache")
    add("--rollout-fallback", default=None, metavar="METRIC=THRESHOLD[,to=bf16|fp8][,layers=K]",
        help="move the layers with the largest attributed mismatch back to BF16/FP8 rollouts when METRIC "
        "(e.g. k3_kl=0.02) crosses THRESHOLD")
    add("--reward-function", default=None, metavar="FILE.py:NAME",
        help="custom reward (problem, response_text, spec) -> float instead of the task's exact-answer reward")
    add("--eval-prompts", type=int, default=None, help="held-out problems per evaluation (default: all)")


def build_rl_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = PROG
    p.description = "GRPO post-training of a megatron-core GPT with rollouts under their own precision."
    add_rl_arguments(p)
    p.set_defaults(**RL_DEFAULTS)
    return p


def _given(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """Argument names given on the command line."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _shape_from_load(args, given: set[str]) -> None:
    """The model shape, ``--seq-length`` and tokenizer from the ``--load`` checkpoint."""
    from pretrain.pretrained import PretrainedError, read_pretrained, shape_args

    try:
        pre = read_pretrained(args.load)
    except PretrainedError as e:
        raise ConfigError(str(e).replace("--pretrained-checkpoint", "--load", 1)) from None
    for name, value in shape_args(pre.cfg).items():
        if name in given and getattr(args, name) != value:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} disagrees with --load {args.load} "
                              f"({value}); drop the flag (the shape comes from the checkpoint)")
        setattr(args, name, value)
    if args.seq_length is None:
        args.seq_length = pre.cfg.seq_length
    if args.tokenizer_model is None and pre.tokenizer_model is not None:
        args.tokenizer_model, args.tokenizer_type = pre.tokenizer_model, pre.tokenizer_type
    args.pretrained_vocab_size = pre.cfg.vocab_size


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from pretrain.arguments import _load_model_size

    parser = build_rl_parser()
    args = parser.parse_args(argv)
    if args.model_size:
        parser.set_defaults(**_load_model_size(parser, args.model_size))
        args = parser.parse_args(argv)
    args.pretrained_vocab_size = None
    if args.task is None:
        raise ConfigError("--task is required: a task seed file, e.g. --task configs/rl/arith.yaml")
    from pretrain.checkpointing import TRACKER

    if args.load and os.path.isfile(os.path.join(args.load, TRACKER)):
        _shape_from_load(args, _given(build_rl_parser(), argv))
    missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
               if getattr(args, k) is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}: give --load (a starting-policy checkpoint, whose shape is "
                          f"used) or the shape flags / --model-size")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if getattr(args, "precision_schedule", None) is not None:
        raise ConfigError("--precision-schedule: rl.py trains under one plan; give --precision (+ --precision-rule)")
    if args.precision is None:
        args.precision = "bf16"
    return args


def _positive_rl(args) -> None:
    for name in ("rl_iters", "prompts_per_step", "max_new_tokens", "ppo_epochs", "ppo_mini_batches", "eval_prompts"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {v}: must be > 0")
    for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "top_k", "eval_interval"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    if args.group_size < 2:
        raise ConfigError(f"--group-size {args.group_size}: must be >= 2 (GRPO normalizes each prompt's rewards "
                          f"within its group of responses)")
    if args.temperature <= 0:
        raise ConfigError(f"--temperature {args.temperature}: must be > 0 (RL samples; the trainer scores at "
                          f"the same temperature)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.clip_ratio_low >= 1:
        raise ConfigError(f"--clip-ratio-low {args.clip_ratio_low}: must be < 1 (the ratio's lower clip is 1 - it)")
    if not args.clip_ratio_c > 1:
        raise ConfigError(f"--clip-ratio-c {args.clip_ratio_c}: the dual-clip bound must be > 1 (verl's default 3.0)")
    if not 0 <= args.overlong_buffer_len <= args.max_new_tokens:
        raise ConfigError(f"--overlong-buffer-len {args.overlong_buffer_len}: must be in [0, --max-new-tokens "
                          f"{args.max_new_tokens}] (0: no overlong penalty)")
    if args.overlong_penalty_factor < 0:
        raise ConfigError(f"--overlong-penalty-factor {args.overlong_penalty_factor}: must be >= 0")


def rl_config(args, dp_size: int) -> RLConfig:
    """Validate the RL flags of ``args`` (pretraining's part already validated) into an :class:`RLConfig`."""
    from model.rollout_plan import parse_rollout
    from precision.policy import Rule
    from precision.recipe import SpecError
    from pretrain.rl.objective import Correction
    from pretrain.rl.task import TaskError, load_task

    _positive_rl(args)
    try:
        load_task(args.task, "--task")
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if args.prompts_per_step % dp_size:
        raise ConfigError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the data-parallel size "
                          f"{dp_size} (each rank takes an equal share of the prompts)")
    per_rank = args.prompts_per_step // dp_size
    if per_rank % args.ppo_mini_batches:
        raise ConfigError(f"--ppo-mini-batches {args.ppo_mini_batches} does not divide the {per_rank} prompts of "
                          f"each data-parallel rank (--prompts-per-step {args.prompts_per_step} / DP {dp_size})")
    try:
        parse_rollout(args.rollout_precision)
    except (SpecError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("--rollout-precision") else f"--rollout-precision: {msg}") from None
    for rule in args.rollout_precision_rule:  # the selector's syntax; the value's is the rollout plan's
        if "=" not in rule:
            raise ConfigError(f"--rollout-precision-rule {rule!r}: expected SELECTOR=PRESET_OR_SPEC, e.g. first:1=bf16")
        try:
            Rule.parse(rule.split("=", 1)[0].strip() + "=bf16")
        except ValueError as e:
            raise ConfigError(f"--rollout-precision-rule {rule!r}: {e}") from None
    try:
        corr = Correction.from_args(args.rollout_correction, args.rollout_is_threshold, args.rollout_rs_threshold,
                                    args.rollout_rs_threshold_lower)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.rollout_fallback is not None:
        from pretrain.rl.fallback import RolloutFallback

        try:
            RolloutFallback.parse(args.rollout_fallback, "--rollout-fallback")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.rollout_qat_layers and args.rollout_qat != "replay":
        raise ConfigError("--rollout-qat-layers selects the layers --rollout-qat replay replays; add --rollout-qat "
                          "replay or drop it")
    if args.max_new_tokens >= args.seq_length:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --seq-length "
                          f"{args.seq_length} (the model's positions)")
    agg = args.loss_agg_mode or ("seq-mean-token-sum-norm" if args.advantage_estimator == "dr_grpo" else "token-mean")
    return RLConfig(
        task=args.task, rl_iters=args.rl_iters, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        rollout_precision=args.rollout_precision, rollout_precision_rules=tuple(args.rollout_precision_rule),
        advantage_estimator=args.advantage_estimator, loss_agg_mode=agg, clip_ratio_low=args.clip_ratio_low,
        clip_ratio_high=args.clip_ratio_high, clip_ratio_c=args.clip_ratio_c, entropy_coeff=args.entropy_coeff,
        overlong_buffer_len=args.overlong_buffer_len, overlong_penalty_factor=args.overlong_penalty_factor,
        overlong_filter=args.overlong_filter, ppo_epochs=args.ppo_epochs, ppo_mini_batches=args.ppo_mini_batches,
        kl_coef=args.kl_coef, kl_type=args.kl_type, correction=corr, rollout_qat=args.rollout_qat,
        rollout_qat_layers=tuple(args.rollout_qat_layers or ("all",)), rollout_qat_kv=args.rollout_qat_kv,
        rollout_fallback=args.rollout_fallback, reward_function=args.reward_function,
        eval_interval=args.eval_interval, eval_prompts=args.eval_prompts,
        max_prompt_tokens=args.seq_length - args.max_new_tokens,
    )  # fmt: skip


def parse_rl_args(argv: list[str] | None, world_size: int, cuda: bool) -> tuple[argparse.Namespace, RLConfig]:
    """Parse and validate everything checkable before torch.distributed; :class:`ConfigError` (one line) else."""
    args = _parse(argv)
    if args.gemm_backend is None:  # RL batches change shape every iteration: no torch.compile on CPU
        args.gemm_backend = "auto" if cuda else "reference"
    # the optimizer steps of the whole run fix the lr schedule's length
    args.train_iters = args.rl_iters * args.ppo_epochs * args.ppo_mini_batches
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args = validate_args(args, world_size, cuda)
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    return args, rl_config(args, dp)

"""Command line of ``launch/rl.py``: pretraining's flags plus an RL group, one-line errors.

    run, cfg = parse_rl_args(argv, world_size, cuda)   # frozen: pretrain.config.RunConfig + RLConfig

The parser is ``pretrain.arguments.build_parser()`` (model shape, ``--precision`` /
``--precision-rule``, ``--kv-quant``, parallelism, optimizer, ``--save`` / ``--load`` /
``--save-interval``, ``--tensorboard-dir``, ``--seed``, ...) with the group "reinforcement
learning" generated from :class:`RLConfig`'s fields, as pretraining's groups are from theirs (a new
RL flag is one field). RL-specific defaults (``RL_DEFAULTS``): ``--lr 1e-4``,
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
import dataclasses
import os
from dataclasses import dataclass

from model.rollout_plan import ROLLOUT_PRESETS, parse_rollout
from precision.policy import Rule
from precision.recipe import SpecError
from pretrain.arguments import ConfigError, build_parser, given_flags, load_model_size, validate_and_freeze
from pretrain.checkpoint_files import TRACKER
from pretrain.config import RunConfig, add_group, arg, from_namespace, to_flat_dict
from pretrain.config.fields import value
from pretrain.pretrained import PretrainedError, read_pretrained, shape_args
from pretrain.rl.objective import ADVANTAGE_ESTIMATORS, CORRECTIONS, KL_KINDS, LOSS_AGG_MODES, Correction
from pretrain.rl.task import TaskError, load_task

__all__ = ["PROG", "RLConfig", "build_rl_parser", "parse_rl_args", "rl_config"]

PROG = "rl.py"

# RL defaults that differ from pretraining's (verl's actor: constant lr, no weight decay)
RL_DEFAULTS = {"gemm_backend": None, "lr": 1e-4, "min_lr": 0.0, "lr_decay_style": "constant", "weight_decay": 0.0,
               "eval_interval": 10,               "log_interval": 1, "micro_batch_size": 1}


def _qat_modes():
    from pretrain.rl.qat import QAT_MODES  # pretrain.rl.qat imports megatron-core: not for --help

    return QAT_MODES


@dataclass(frozen=True)
class RLConfig:
    """The "reinforcement learning" group of flags (names as verl / TRL users know them), validated and
    frozen (:func:`rl_config`); the loop reads this, never a Namespace. A new RL flag is one field here."""

    task: str | None = arg("--task", metavar="FILE",
                           help="task seed file (pretrain/rl/task.py), e.g. configs/rl/arith.yaml (required)")
    """Task seed file (``pretrain.rl.task``), e.g. configs/rl/arith.yaml."""
    task_replicate: int | None = arg("--task-replicate", type=int, default=None, metavar="R",
                                     help="true replicate R (0, 1, ...): its own prompt stream and held-out sample "
                                          "(overrides the task file's replicate)")
    """A true replicate: its own training prompt stream and evaluation sample (``TaskSpec.replicate``)."""
    rl_iters: int = arg("--rl-iters", type=int, default=100, help="RL iterations (sample, score, update)")
    """RL iterations: each samples, scores and updates once (``--ppo-epochs`` x ``--ppo-mini-batches`` steps)."""
    prompts_per_step: int = arg("--prompts-per-step", type=int, default=32,
                                help="prompts per iteration, over all data-parallel ranks")
    """Prompts per iteration over all data-parallel ranks (each rank takes an equal slice)."""
    group_size: int = arg("--group-size", type=int, default=8, metavar="G", help="responses sampled per prompt (>= 2)")
    """G responses per prompt (>= 2: GRPO normalizes rewards within a prompt's group)."""
    max_new_tokens: int = arg("--max-new-tokens", type=int, default=8, help="longest response in tokens")
    """Longest response in tokens."""
    temperature: float = arg("--temperature", type=float, default=1.0,
                             help="sampling temperature (> 0; the trainer scores at it)")
    """Sampling temperature; the trainer scores at the same one."""
    top_p: float = arg("--top-p", type=float, default=1.0)
    """Nucleus sampling's mass (1: off)."""
    top_k: int = arg("--top-k", type=int, default=0, help="0: off")
    """Top-k sampling (0: off)."""
    rollout_precision: str = arg(
        "--rollout-precision", default="bf16", metavar="PRESET_OR_SPEC",
        help=lambda: f"rollout plan (model.rollout_plan): {', '.join(ROLLOUT_PRESETS)} (+had16/+had32), or "
        "base=PRESET,kv=FORMAT / linear=X@W,kv=FORMAT")
    """Rollout plan (``model.rollout_plan``): bf16, fp8, mxfp4, nvfp4, mxfp4_w4a16 (+had16/+had32) or a spec."""
    rollout_precision_rule: tuple[str, ...] = arg(
        "--rollout-precision-rule", action="append", default=[], metavar="SELECTOR=VALUE",
        help="per-layer rollout recipe with --precision-rule selectors, e.g. first:1=bf16 (repeatable)")
    """Per-layer rollout recipes, first match wins."""
    advantage_estimator: str = arg(
        "--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo",
        help="grpo: (r - group mean) / group std; dr_grpo: r - group mean (and, unless --loss-agg-mode is "
        "given, seq-mean-token-sum-norm)")
    """grpo | dr_grpo (no division by the group's reward std)."""
    loss_agg_mode: str | None = arg("--loss-agg-mode", choices=LOSS_AGG_MODES, default=None,
                                    help="default: token-mean (grpo), seq-mean-token-sum-norm (dr_grpo)")
    """As given (``None``: by the estimator); :attr:`loss_agg` is the mode in force."""
    clip_ratio_low: float = arg("--clip-ratio-low", type=float, default=0.2, help="PPO clip: ratio >= 1 - this")
    """PPO's lower clip: ratio >= 1 - this."""
    clip_ratio_high: float = arg("--clip-ratio-high", type=float, default=0.2, help="PPO clip: ratio <= 1 + this")
    """PPO's upper clip: ratio <= 1 + this."""
    clip_ratio_c: float = arg(
        "--clip-ratio-c", type=float, default=3.0,
        help="dual-clip PPO bound (> 1; verl's clip_ratio_c): a token with a negative advantage loses at most "
        "-A x this")
    """Dual-clip bound c (> 1, verl's clip_ratio_c): a negative-advantage token's loss is at most -A c."""
    entropy_coeff: float = arg(
        "--entropy-coeff", type=float, default=0.0,
        help="entropy bonus (verl's entropy_coeff): loss -= this x the entropy of the sampling distribution, "
        "aggregated as --loss-agg-mode")
    """Entropy bonus (verl's entropy_coeff): the loss minus this x the aggregated entropy of the policy."""
    overlong_buffer_len: int = arg(
        "--overlong-buffer-len", type=int, default=0, metavar="N",
        help="DAPO's overlong penalty (verl's reward_model.overlong_buffer.len): a response longer than "
        "--max-new-tokens - N loses up to --overlong-penalty-factor of reward, linearly (0: off)")
    """DAPO's soft overlong punishment over the last N tokens of --max-new-tokens (0: off)."""
    overlong_penalty_factor: float = arg(
        "--overlong-penalty-factor", type=float, default=1.0,
        help="the overlong penalty at --max-new-tokens (verl's overlong_buffer.penalty_factor)")
    """The punishment at --max-new-tokens (verl's overlong_buffer.penalty_factor)."""
    overlong_filter: bool = arg(
        "--overlong-filter", action=argparse.BooleanOptionalAction, default=False,
        help="DAPO's overlong filtering: responses cut at --max-new-tokens (no stop token) get no loss")
    """Truncated responses (no stop token) take no part in the loss (DAPO's overlong filtering)."""
    ppo_epochs: int = arg("--ppo-epochs", type=int, default=1, help="passes over each iteration's rollouts")
    """Passes over each iteration's rollouts."""
    ppo_mini_batches: int = arg("--ppo-mini-batches", type=int, default=1,
                                help="optimizer steps per pass (the batch split by prompts)")
    """Optimizer steps per pass (the batch split by prompts)."""
    kl_coef: float = arg("--kl-coef", type=float, default=0.0,
                         help="KL penalty to the starting policy (0: no reference model)")
    """Weight of the KL penalty to the starting policy (0: no reference model)."""
    kl_type: str = arg("--kl-type", choices=KL_KINDS, default="low_var_kl",
                       help="KL estimator (verl's kl_penalty): k1, abs, mse (k2), low_var_kl (k3)")
    """The KL estimator (verl's kl_penalty)."""
    rollout_correction: str = arg(
        "--rollout-correction", choices=CORRECTIONS, default="none",
        help="trainer/rollout mismatch correction: tis (truncated IS), mis (masked IS / IcePop), seq_tis, "
        "seq_mis, geo_mis (geometric-mean sequence rejection)")
    """The correction's kind; :attr:`correction` holds it with its thresholds."""
    rollout_is_threshold: float | None = arg("--rollout-is-threshold", type=float, default=None,
                                             help="IS weight cap (tis, seq_tis; default as verl)")
    """The IS weight cap (``None``: verl's default)."""
    rollout_rs_threshold: str | None = arg(
        "--rollout-rs-threshold", default=None, metavar="U|LOWER_UPPER",
        help="rejection bound (mis, seq_mis, geo_mis): U keeps rho = pi_trainer / pi_rollout in [1/U, U] "
        "(or [--rollout-rs-threshold-lower, U]); verl's LOWER_UPPER bounds pi_rollout / pi_trainer, so "
        "0.8_2.0 keeps rho in [0.5, 1.25]")
    """The rejection bound, as given."""
    rollout_rs_threshold_lower: float | None = arg(
        "--rollout-rs-threshold-lower", type=float, default=None,
        help="rejection lower bound on rho = pi_trainer / pi_rollout (default 1 / U)")
    """The rejection lower bound (``None``: 1 / U)."""
    rollout_qat: str = arg(
        "--rollout-qat", choices=_qat_modes, default="none",
        help="rollout-guided QAT (pretrain/rl/qat.py): none; rtn: the trainer's forward fake-quantizes as the "
        "rollout plan; replay: as rtn, replaying the rollout's recorded rounding")
    """none | rtn | replay (``pretrain.rl.qat``)."""
    rollout_qat_layers: tuple[str, ...] | None = arg(
        "--rollout-qat-layers", action="append", default=None, metavar="SELECTOR",
        help="linears whose rounding --rollout-qat replay replays (repeatable; default all)")
    """As given (``None``: all); :attr:`qat_replay_layers` is the selection in force."""
    rollout_qat_kv: bool = arg("--rollout-qat-kv", action=argparse.BooleanOptionalAction, default=True,
                               help="--rollout-qat also fake-quantizes K/V as the rollout's KV-cache")
    """--rollout-qat also fake-quantizes K/V as the rollout's KV-cache."""
    routing_replay: bool = arg(
        "--routing-replay", action=argparse.BooleanOptionalAction, default=False,
        help="mixture-of-experts policies: the trainer's recompute and update reuse the experts the rollout chose "
        "for each token (routing replay); default: the trainer routes afresh")
    """MoE: the trainer scores and updates with the rollout's expert choices (``pretrain.rl.routing``)."""
    rollout_fallback: str | None = arg(
        "--rollout-fallback", default=None, metavar="METRIC=THRESHOLD[,to=bf16|fp8][,layers=K]",
        help="move the layers with the largest attributed mismatch back to BF16/FP8 rollouts when METRIC "
        "(e.g. k3_kl=0.02) crosses THRESHOLD")
    """METRIC=THRESHOLD[,to=bf16|fp8][,layers=K] (``pretrain.rl.fallback``), or None."""
    reward_function: str | None = arg(
        "--reward-function", default=None, metavar="FILE.py:NAME",
        help="custom reward (problem, response_text, spec) -> float instead of the task's exact-answer reward")
    """FILE.py:NAME, a function (problem, response text, spec) -> float instead of the task's reward."""
    eval_prompts: int | None = arg("--eval-prompts", type=int, default=None,
                                   help="held-out problems per evaluation (default: all)")
    """How many of the task's held-out problems each evaluation uses (None: all)."""

    # ---------------------------------------------------------------- derived while validating
    loss_agg: str = value("token-mean", saved=False)
    """How token losses become the batch loss (``pretrain.rl.objective.LOSS_AGG_MODES``)."""
    correction: Correction | None = value(None, saved=False)  # noqa: RUF009 - a field, not a call per instance
    """``pretrain.rl.objective.Correction``: none, tis, mis, seq_tis, seq_mis, geo_mis + thresholds."""
    qat_replay_layers: tuple[str, ...] = value(("all",), saved=False)
    """The linears whose rounding --rollout-qat replay replays."""
    eval_interval: int = value(10, saved=False)
    """Held-out greedy accuracy every N iterations (0: only at the end; pretraining's ``--eval-interval``)."""
    max_prompt_tokens: int = value(0, saved=False)
    """Longest prompt in tokens the run allows (prompt + --max-new-tokens <= --seq-length)."""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def to_dict(self) -> dict:
        """The RL flags under their ``dest`` (what checkpoints and ``rl_summary.json`` record)."""
        return to_flat_dict(self)


def build_rl_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = PROG
    p.description = "GRPO post-training of a megatron-core GPT with rollouts under their own precision."
    add_group(p, "reinforcement learning", RLConfig)
    p.set_defaults(**RL_DEFAULTS)
    return p


def _shape_from_load(args, given: set[str]) -> None:
    """The model shape, ``--seq-length`` and tokenizer from the ``--load`` checkpoint."""
    try:
        pre = read_pretrained(args.load)
    except PretrainedError as e:
        raise ConfigError(str(e).replace("--pretrained-checkpoint", "--load", 1)) from None
    for name, shape in shape_args(pre.cfg).items():
        if name in given and getattr(args, name) != shape:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} disagrees with --load {args.load} "
                              f"({shape}); drop the flag (the shape comes from the checkpoint)")
        setattr(args, name, shape)
    if args.seq_length is None:
        args.seq_length = pre.cfg.seq_length
    if args.tokenizer_model is None and pre.tokenizer_model is not None:
        args.tokenizer_model, args.tokenizer_type = pre.tokenizer_model, pre.tokenizer_type
    args.pretrained_vocab_size = pre.cfg.vocab_size


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_rl_parser()
    args = parser.parse_args(argv)
    if args.model_size:
        parser.set_defaults(**load_model_size(parser, args.model_size))
        args = parser.parse_args(argv)
    args.pretrained_vocab_size = None
    if args.task is None:
        raise ConfigError("--task is required: a task seed file, e.g. --task configs/rl/arith.yaml")
    if args.load and os.path.isfile(os.path.join(args.load, TRACKER)):
        _shape_from_load(args, given_flags(argv, build_rl_parser()))
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


def _positive_rl(c: RLConfig) -> None:
    for name in ("rl_iters", "prompts_per_step", "max_new_tokens", "ppo_epochs", "ppo_mini_batches", "eval_prompts"):
        v = getattr(c, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {v}: must be > 0")
    for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "top_k", "eval_interval"):
        if getattr(c, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(c, name)}: must be >= 0")
    if c.group_size < 2:
        raise ConfigError(f"--group-size {c.group_size}: must be >= 2 (GRPO normalizes each prompt's rewards "
                          f"within its group of responses)")
    if c.temperature <= 0:
        raise ConfigError(f"--temperature {c.temperature}: must be > 0 (RL samples; the trainer scores at "
                          f"the same temperature)")
    if not 0 < c.top_p <= 1:
        raise ConfigError(f"--top-p {c.top_p}: must be in (0, 1]")
    if c.clip_ratio_low >= 1:
        raise ConfigError(f"--clip-ratio-low {c.clip_ratio_low}: must be < 1 (the ratio's lower clip is 1 - it)")
    if not c.clip_ratio_c > 1:
        raise ConfigError(f"--clip-ratio-c {c.clip_ratio_c}: the dual-clip bound must be > 1 (verl's default 3.0)")
    if not 0 <= c.overlong_buffer_len <= c.max_new_tokens:
        raise ConfigError(f"--overlong-buffer-len {c.overlong_buffer_len}: must be in [0, --max-new-tokens "
                          f"{c.max_new_tokens}] (0: no overlong penalty)")
    if c.overlong_penalty_factor < 0:
        raise ConfigError(f"--overlong-penalty-factor {c.overlong_penalty_factor}: must be >= 0")


def rl_config(args: argparse.Namespace, run: RunConfig, dp_size: int) -> RLConfig:
    """Validate the RL flags of the parsed ``args`` (pretraining's part already validated into ``run``)
    into a frozen :class:`RLConfig`."""
    c = from_namespace(RLConfig, args, eval_interval=run.logging.eval_interval)
    _positive_rl(c)
    try:
        load_task(c.task, "--task", c.task_replicate)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if c.prompts_per_step % dp_size:
        raise ConfigError(f"--prompts-per-step {c.prompts_per_step} is not divisible by the data-parallel size "
                          f"{dp_size} (each rank takes an equal share of the prompts)")
    per_rank = c.prompts_per_step // dp_size
    if per_rank % c.ppo_mini_batches:
        raise ConfigError(f"--ppo-mini-batches {c.ppo_mini_batches} does not divide the {per_rank} prompts of "
                          f"each data-parallel rank (--prompts-per-step {c.prompts_per_step} / DP {dp_size})")
    try:
        parse_rollout(c.rollout_precision)
    except (SpecError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("--rollout-precision") else f"--rollout-precision: {msg}") from None
    for rule in c.rollout_precision_rule:  # the selector's syntax; the value's is the rollout plan's
        if "=" not in rule:
            raise ConfigError(f"--rollout-precision-rule {rule!r}: expected SELECTOR=PRESET_OR_SPEC, e.g. first:1=bf16")
        try:
            Rule.parse(rule.split("=", 1)[0].strip() + "=bf16")
        except ValueError as e:
            raise ConfigError(f"--rollout-precision-rule {rule!r}: {e}") from None
    try:
        corr = Correction.from_args(c.rollout_correction, c.rollout_is_threshold, c.rollout_rs_threshold,
                                    c.rollout_rs_threshold_lower)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if c.rollout_fallback is not None:
        from pretrain.rl.fallback import RolloutFallback  # imports the rollout engine: only when asked for

        try:
            RolloutFallback.parse(c.rollout_fallback, "--rollout-fallback")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if c.rollout_qat_layers and c.rollout_qat != "replay":
        raise ConfigError("--rollout-qat-layers selects the layers --rollout-qat replay replays; add --rollout-qat "
                          "replay or drop it")
    if c.routing_replay and run.model.num_experts is None:
        raise ConfigError("--routing-replay replays a mixture-of-experts policy's expert choices; the model has no "
                          "experts (add --num-experts, or drop the flag)")
    seq_length = run.model.seq_length
    if c.max_new_tokens >= seq_length:
        raise ConfigError(f"--max-new-tokens {c.max_new_tokens} leaves no room for a prompt in --seq-length "
                          f"{seq_length} (the model's positions)")
    agg = c.loss_agg_mode or ("seq-mean-token-sum-norm" if c.advantage_estimator == "dr_grpo" else "token-mean")
    return dataclasses.replace(c, loss_agg=agg, correction=corr, qat_replay_layers=tuple(c.rollout_qat_layers or ("all",)),
                               max_prompt_tokens=seq_length - c.max_new_tokens)


def parse_rl_args(argv: list[str] | None, world_size: int, cuda: bool) -> tuple[RunConfig, RLConfig]:
    """Parse and validate everything checkable before torch.distributed: the frozen run (pretraining's
    flags) and RL configs; :class:`ConfigError` (one line) else."""
    args = _parse(argv)
    if args.gemm_backend is None:  # RL batches change shape every iteration: no torch.compile on CPU
        args.gemm_backend = "auto" if cuda else "reference"
    # the optimizer steps of the whole run fix the lr schedule's length
    args.train_iters = args.rl_iters * args.ppo_epochs * args.ppo_mini_batches
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args, run = validate_and_freeze(args, world_size, cuda)
    p = run.parallel
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    return run, rl_config(args, run, dp)

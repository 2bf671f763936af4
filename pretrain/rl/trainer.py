"""The RL post-training loop behind ``launch/rl.py``: GRPO with rollouts under their own precision.

    torchrun --nproc-per-node 2 launch/rl.py --load SFT_CKPT --task configs/rl/arith.yaml \\
        --precision wgrad_hadamard --rollout-precision mxfp4 --rollout-correction tis \\
        --rl-iters 100 --save runs/rl --tensorboard-dir runs/rl/tb

One iteration (every rank; ``RLTrainer.step``): rollout (``pretrain.rl.rollout``) -> score
(``pretrain.rl.score``) -> update (``pretrain.rl.update``) -> refresh and fallback::

    problems   pretrain.rl.task.train_problems(spec, iteration, prompts/DP, rank_offset=DP rank * that):
               a pure function of (task seed, iteration, index) -- resuming needs no data state
    rollout    model.generate.Engine under the rollout plan (model.rollout: packed weights, KV format),
               G responses per prompt (rows p0 x G, p1 x G, ...), sampled with a generator seeded from
               (--seed, iteration, DP rank); stop at the tokenizer's end-of-document id
    reward     pretrain.rl.task.reward of each response's text (+ DAPO's --overlong-buffer-len penalty)
    advantage  pretrain.rl.objective.group_advantages (grpo | dr_grpo) within each prompt's group
    recompute  the trainer's log-probs of the sampled tokens under --precision, of the distribution the
               engine sampled from (temperature, top-k, top-p; no grad; inside the rollout-guided QAT
               forward of pretrain.rl.qat, and then once more without it), the reference's (--kl-coef)
    mismatch   pretrain.rl.mismatch.mismatch_metrics(trainer's own numerics, rollout), global batch
    correct    pretrain.rl.objective.rollout_correction: IS weights and rejection mask (--rollout-correction)
    update     --ppo-epochs x --ppo-mini-batches optimizer steps: clipped surrogate (policy_loss,
               --clip-ratio-c) - --entropy-coeff x entropy + KL, backward through the trainer's per-GEMM
               plan, gradients summed over data-parallel ranks, clipped (--clip-grad), lr from the
               schedule, AdamW (FP32 mains with --bf16)
    refresh    RolloutModel.update(): the engine's packed weights requantized from the new policy
    fallback   --rollout-fallback: if the metric crossed its threshold, the layers with the largest
               attributed mismatch go back to BF16/FP8 rollouts (pretrain.rl.fallback)

The loop reads the frozen ``RunConfig`` and ``RLConfig`` (``pretrain.rl.arguments``), never a Namespace.

Held-out accuracy: greedy generation on the task's held-out problems with the trainer's own numerics
(``Engine`` without a rollout plan, the policy under --precision), the same for every rollout plan;
and under the rollout plan (how the rollout engine serves the policy).

Checkpoints and ``rl_summary.json``: ``pretrain.rl.checkpoint`` (exact resume; the same command continues a
stopped run). SIGTERM: finish the iteration, save, exit 0.

TensorBoard (rank 0; step = iteration): ``rl/reward_mean``, ``rl/heldout_accuracy``,
``rl/heldout_accuracy_rollout`` (the same under the rollout plan), ``rl/response_length``, ``rl/entropy``, ``rl/kl_ref`` (with --kl-coef), ``rl/pg_loss``,
``rl/clipfrac``, ``rl/ppo_kl``, ``rl/grad_norm``, ``rl/lr``, ``rl/truncated_fraction``, ``rl/entropy_loss``
(with --entropy-coeff), ``mismatch/<key>`` for every key of ``mismatch_metrics`` (the part after
``rollout_corr/`` or ``training/``, e.g. ``mismatch/k3_kl``; the rollout against the trainer's own
numerics), ``mismatch/ess_raw``, ``mismatch/outside_support_fraction``, ``qat/k3_kl`` (--rollout-qat),
``correction/<metric>`` (``ess``, ``masked_fraction``, ``is_weight_mean``, ...),
``rollout/tokens_per_sec``, ``rollout/kv_bytes_per_token``, ``rollout/packed_weight_bytes``,
``rollout/peak_memory_bytes`` (CUDA's peak, else the engine's KV-cache + packed weights),
``fallback/num_layers``. At the end (and when stopped) rank 0 writes ``<--save>/rl_summary.json``:
``final_heldout_accuracy`` (and ``_rollout``, ``initial_*``), ``reward_auc`` (mean reward over all
iterations), ``mean_k3_kl``, ``tokens_per_sec`` and ``seconds_per_iteration`` (the first iteration,
a warm-up, left out), ``peak_memory_bytes``, ``kv_bytes_per_token``, ``packed_weight_bytes``,
``iterations``, the curves (``heldout_accuracy`` [iteration, accuracy, under the rollout plan],
``reward_mean``, ``k3_kl``), the fallback's moves and events, the rollout plan and ``args``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state

if TYPE_CHECKING:  # annotations only
    from torch.utils.tensorboard import SummaryWriter

    from pretrain.data.hf_tokenizer import HFTokenizer
    from pretrain.data.tokenizer import Tokenizer

from model.generate import Engine
from model.gpt import ModelConfig, policy_linears
from model.moe_replay import RoutingTap
from model.rollout import RolloutModel
from model.rollout_plan import RolloutPlan
from precision import PrecisionPlan
from pretrain import runtime
from pretrain.arguments import ConfigError
from pretrain.config import RunConfig
from pretrain.data import load_tokenizer
from pretrain.engine import TorchEngine, dp_rank_size, dp_sum
from pretrain.optim import LRSchedule, MainParams
from pretrain.rl import checkpoint as rl_checkpoint
from pretrain.rl import rollout as rollout_side
from pretrain.rl.arguments import PROG, RLConfig, parse_rl_args
from pretrain.rl.checkpoint import SUMMARY_FILE
from pretrain.rl.fallback import RolloutFallback
from pretrain.rl.qat import RolloutQAT
from pretrain.rl.score import policy_logprobs, score
from pretrain.rl.task import TaskSpec, eval_problems, load_task, reward
from pretrain.rl.update import RLDiverged, update
from pretrain.runtime import is_rank0, rank0_print
from pretrain.status import EXIT_DIVERGED
from pretrain.train import build_model, init_distributed, open_tensorboard, seed_everything
from pretrain.trainer.metrics import ScalarWriter, open_wandb
from pretrain.trainer.stopper import Stopper

__all__ = ["SUMMARY_FILE", "RLTrainer", "policy_logprobs", "setup", "train"]



@dataclass
class RLTrainer:
    """Everything one rank trains with; ``iteration`` is the number of RL iterations done."""

    run: RunConfig  # pretraining's flags, frozen (model, optimizer, seed, checkpoints, logging)
    cfg: RLConfig  # the RL flags, frozen
    spec: TaskSpec
    model: torch.nn.Module
    main: MainParams | None  # the FP32 mains with --bf16
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    plan: PrecisionPlan  # the trainer's
    model_config: ModelConfig
    tokenizer: Tokenizer | HFTokenizer
    device: torch.device
    vocab_size: int  # the tokenizer's
    train_engine: TorchEngine | None = None  # the optimizer step shared with pretraining
    flags: dict = field(default_factory=dict)  # every flag's value, as checkpoints and rl_summary.json record them
    fallback: RolloutFallback | None = None  # --rollout-fallback
    ref_state: dict | None = None  # the reference policy's parameters (--kl-coef)
    iteration: int = 0
    history: list[dict] = field(default_factory=list)  # one dict of scalars per iteration (rl_summary.json)
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (iteration, accuracy, under the rollout plan)
    last_saved: int | None = None
    tb: SummaryWriter | None = None  # rank 0's, with --tensorboard-dir
    rollout_plan: RolloutPlan | None = None  # built by build_rollout
    rollout: RolloutModel | None = None  # the rollout engine's packed weights and KV format
    engine: Engine | None = None  # the generation engine under the rollout plan
    qat: RolloutQAT | None = None  # --rollout-qat
    reward_fn: Callable | None = None  # (problem, response text, spec) -> float; None: pretrain.rl.task.reward
    routing: RoutingTap | None = None  # MoE policies: the routers' record / replay hooks (pretrain.rl.routing)

    # ---------------------------------------------------------------- the pieces the sides use
    def build_rollout(self) -> None:
        rollout_side.build_rollout(self)

    def generate(self, iteration: int):
        """This rank's prompts, G responses each; returns (problems, generation, seconds)."""
        return rollout_side.generate(self, iteration)

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt's token ids: its text tokenized (as ``launch/rl_task.py --evaluate`` prompts the
        starting policy, so the held-out accuracies agree)."""
        return list(self.tokenizer.tokenize(prompt))

    def response_text(self, ids: list[int]) -> str:
        return self.tokenizer.detokenize([t for t in ids if t != self.tokenizer.eod])

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the FP32 mains with --bf16, else the model's parameters."""
        return self.main.parameters() if self.main is not None else [p for p in self.model.parameters()
                                                                     if p.requires_grad]

    @contextlib.contextmanager
    def reference_weights(self):
        """Inside: the model holds the reference policy's parameters (--kl-coef)."""
        params = dict(self.model.named_parameters())
        saved = {n: p.data for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data = self.ref_state[n].to(p.dtype)
            yield
        finally:
            for n, p in params.items():
                p.data = saved[n]

    def qat_forward(self, records, rows=None):
        if self.cfg.rollout_qat == "none":
            return contextlib.nullcontext()
        if records is not None and rows is not None:
            records = [records[i] for i in rows]
        return self.qat.trainer_forward(records, kv_amax=self.rollout.kv_amax)

    # ---------------------------------------------------------------- one iteration
    def step(self) -> dict:
        """One RL iteration: rollout -> score -> update -> refresh (module docstring); returns its
        scalars (the same on every rank)."""
        t_start = time.perf_counter()
        problems, gen, gen_seconds = self.generate(self.iteration)
        scored = score(self, problems, gen)
        scalars = update(self, scored)
        self.iteration += 1

        # === refresh the rollout's packed weights; the fallback check ===
        memory = rollout_side.rollout_memory(self, scored.batch)
        self.rollout.update()
        moved = rollout_side.fallback_check(self, scored.mismatch, scored.batch) if self.fallback is not None else []
        timing = torch.tensor([float(scored.batch.response_mask.sum()), gen_seconds, gen_seconds], dtype=torch.float64)
        group = parallel_state.get_data_parallel_group()
        if group.size() > 1:
            torch.distributed.all_reduce(timing[:2], group=group)
            slowest = timing[2:].clone()
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX, group=group)
            timing[2] = slowest[0]
        out = {
            **scored.scalars, **scalars,
            "rollout/tokens_per_sec": float(timing[0]) / max(float(timing[2]), 1e-9),
            **{f"rollout/{k}": float(v) for k, v in memory.items()},
            "fallback/num_layers": float(len(self.fallback.moved)) if self.fallback is not None else 0.0,
            "time/seconds_per_iteration": time.perf_counter() - t_start,
            "time/rollout_seconds": float(timing[2]),
        }
        if moved:
            rank0_print(f"iteration {self.iteration}: --rollout-fallback moved {', '.join(moved)} to "
                        f"{self.fallback.to} rollouts")
        return out

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> float:
        """Held-out greedy accuracy of the policy, over all DP ranks: with the trainer's own numerics
        (``Engine`` without a rollout plan: the same measurement for every --rollout-precision;
        ``rl/heldout_accuracy``) and under the rollout plan (the policy as the rollout engine serves
        it; ``rl/heldout_accuracy_rollout``). Returns the first."""
        problems = eval_problems(self.spec)[: self.cfg.eval_prompts]
        dp_rank, dp = dp_rank_size()
        mine = problems[dp_rank::dp]
        correct = [0.0, 0.0]
        if mine:
            prompts = [self.prompt_ids(p.prompt) for p in mine]
            for k, engine in enumerate((Engine(self.model, vocab_size=self.vocab_size), self.engine)):
                gen = engine.generate(prompts, rollout_side.sampling(self, 0, greedy=True))
                correct[k] = sum(reward(p, self.response_text(t), self.spec) == 1.0 for p, t in zip(mine, gen.tokens))
        total = dp_sum(torch.tensor(correct, dtype=torch.float64)) / len(problems)
        acc, acc_rollout = float(total[0]), float(total[1])
        self.evals.append((self.iteration, acc, acc_rollout))
        if self.tb is not None:
            self.tb.add_scalar("rl/heldout_accuracy", acc, self.iteration)
            self.tb.add_scalar("rl/heldout_accuracy_rollout", acc_rollout, self.iteration)
            self.tb.flush()
        return acc

    def should_evaluate(self, iteration: int) -> bool:
        """Whether held-out accuracy is measured after ``iteration``: every ``--eval-interval`` and at the end."""
        every = self.cfg.eval_interval
        return bool(every) and iteration % every == 0 or iteration == self.cfg.rl_iters

    # ---------------------------------------------------------------- checkpoints, summary (pretrain.rl.checkpoint)
    def should_save(self, iteration: int) -> bool:
        """Whether ``iteration`` is a ``--save-interval`` iteration (with ``--save``)."""
        c = self.run.checkpoint
        return bool(c.save and c.save_interval) and iteration % c.save_interval == 0

    def save(self) -> str:
        return rl_checkpoint.save(self)

    def load(self) -> None:
        rl_checkpoint.load(self)

    def summary(self) -> dict:
        return rl_checkpoint.summary(self)

    def write_summary(self) -> str | None:
        return rl_checkpoint.write_summary(self)

    # ---------------------------------------------------------------- logging
    def log(self, scalars: dict) -> None:
        self.history.append({"iteration": self.iteration, **scalars})
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, self.iteration)
        if self.iteration % self.run.logging.log_interval == 0 or self.iteration == self.cfg.rl_iters:
            acc = (f"{self.evals[-1][1]:.3f} (rollout plan {self.evals[-1][2]:.3f}, it {self.evals[-1][0]})"
                   if self.evals else "-")
            width = len(str(self.cfg.rl_iters))
            rank0_print(
                f"iteration {self.iteration:>{width}}/{self.cfg.rl_iters} | reward {scalars['rl/reward_mean']:.3f}"
                f" | heldout acc {acc} | k3_kl {scalars['mismatch/k3_kl']:.3e}"
                f" | ess {scalars.get('correction/ess', float('nan')):.4f}"
                f" | len {scalars['rl/response_length']:.1f} | pg_loss {scalars['rl/pg_loss']:.4f}"
                f" | grad norm {scalars['rl/grad_norm']:.3f}"
                f" | rollout {scalars['rollout/tokens_per_sec']:,.0f} tokens/s"
                f" | {scalars['time/seconds_per_iteration']:.2f} s/it"
            )
            if self.tb is not None:
                self.tb.flush()


# ================================================================================================
# Setup and loop
# ================================================================================================


def load_reward_function(value: str):
    """``--reward-function FILE.py:NAME``: a function ``(problem, response_text, spec) -> float``
    used instead of the task's exact-answer reward (verl's custom_reward_function)."""
    import importlib.util

    path, _, name = value.rpartition(":")
    if not path or not name or not path.endswith(".py"):
        raise ConfigError(f"--reward-function {value!r}: expected FILE.py:FUNCTION")
    if not os.path.isfile(path):
        raise ConfigError(f"--reward-function {value!r}: no such file {path}")
    spec = importlib.util.spec_from_file_location(f"_rl_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any error in the user's file, one line
        raise ConfigError(f"--reward-function {value!r}: {path} does not import ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"--reward-function {value!r}: {path} has no function {name}")
    return fn


def setup(run: RunConfig, cfg: RLConfig) -> RLTrainer:
    """Process group, tokenizer, model + trainer plan, optimizer, --load, the rollout side."""
    t, d, c = run.training, run.data, run.checkpoint
    if parallel_state.model_parallel_is_initialized():  # in-process use (tests, notebooks): seeds only
        device = seed_everything(t.seed)
    else:
        device = init_distributed(run)
    tp = run.parallel.tensor_model_parallel_size
    rank0_print(f"world size {torch.distributed.get_world_size()} = TP {tp} x DP "
                f"{parallel_state.get_data_parallel_world_size()} | device {device.type} | seed {t.seed}")
    try:
        tokenizer = load_tokenizer(d.tokenizer_model, d.data_cache_dir, tokenizer_type=d.tokenizer_type)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    vocab = run.pretrained_vocab_size or tokenizer.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"--tokenizer-model {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                          f"{vocab} of --load {c.load}")
    model, plan, whole_plan = build_model(run, vocab, device)
    if device.type == "cpu" and run.precision.gemm_backend == "auto":
        # auto is the emulated backend on CPU; named so, the engine runs the eager reference quantizers
        # while it generates (decode shapes change every step: each would recompile a fused quantizer)
        for _, module in policy_linears(model):
            module.gemm_backend = "emulated"
    engine = TorchEngine(model, run, device)  # FP32 mains with --bf16, AdamW, the non-finite policy
    main, optimizer = engine.main, engine.optimizer
    flags = {**run.to_dict(), **cfg.to_dict()}  # every flag's value, as checkpoints and rl_summary.json record them
    trainer = RLTrainer(run, cfg, load_task(cfg.task, "--task", cfg.task_replicate), model, main, optimizer, LRSchedule.from_training(optimizer, t),
                        plan, run.model_config(vocab), tokenizer, device, tokenizer.vocab_size, train_engine=engine,
                        flags=flags)
    if cfg.reward_function:
        trainer.reward_fn = load_reward_function(cfg.reward_function)
    if cfg.rollout_fallback:
        trainer.fallback = RolloutFallback.parse(cfg.rollout_fallback, "--rollout-fallback")
    trainer.load()
    if cfg.kl_coef > 0 and trainer.ref_state is None:  # the starting policy is the reference
        trainer.ref_state = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    trainer.build_rollout()
    rank0_print(f"precision plan of the trainer (--precision {run.precision.precision}):\n{whole_plan.table()}")
    rank0_print(f"rollout plan (--rollout-precision {cfg.rollout_precision}):\n{trainer.rollout_plan.table()}")
    rank0_print(f"task {trainer.spec.name} ({cfg.task}) | {cfg.prompts_per_step} prompts x G {cfg.group_size} per "
                f"iteration | {cfg.advantage_estimator}, {cfg.loss_agg} | correction {cfg.correction.kind} | "
                f"QAT {cfg.rollout_qat} | KL {cfg.kl_coef} | lr {t.lr}")
    if (run.logging.tensorboard_dir or run.logging.wandb_project) and is_rank0():  # W&B: the same scalars
        tb = open_tensorboard(run.logging.tensorboard_dir, trainer.iteration) if run.logging.tensorboard_dir else None
        trainer.tb = ScalarWriter(tb, open_wandb(run.logging, run.checkpoint.save, flags))
        trainer.tb.add_text("rollout_plan", "```\n" + trainer.rollout_plan.table() + "\n```", trainer.iteration)
        trainer.tb.add_text("args", "```\n" + "\n".join(f"{k}: {v}" for k, v in sorted(flags.items())) + "\n```",
                            trainer.iteration)
    return trainer


def train(trainer: RLTrainer, sigterm) -> int:
    """The loop; returns the exit status (0)."""
    c, save = trainer.cfg, trainer.run.checkpoint.save
    stopper = Stopper(sigterm, trainer.run.training.exit_interval, c.rl_iters,  # pretraining's
                      trainer.run.training.exit_duration_in_mins)
    if trainer.iteration == 0:
        trainer.evaluate()
        _, acc, acc_rollout = trainer.evals[-1]
        rank0_print(f"held-out accuracy of the starting policy (greedy): {acc:.3f}, under the rollout plan "
                    f"{acc_rollout:.3f}")
    while trainer.iteration < c.rl_iters:
        scalars = trainer.step()
        it = trainer.iteration
        if trainer.should_evaluate(it):
            trainer.evaluate()
        trainer.log(scalars)
        if trainer.should_save(it):
            trainer.save()
        if stop := stopper.should_stop(it):
            if save and trainer.last_saved != it:
                trainer.save()
            trainer.write_summary()  # the iterations so far; the resumed run rewrites it
            rank0_print(f"{stop}: stopping after iteration {it}" + ("" if save else " (no --save: nothing saved)"))
            return 0
    if save and trainer.last_saved != trainer.iteration:
        trainer.save()
    path = trainer.write_summary()
    s = trainer.summary()
    rank0_print(f"done: {trainer.iteration} iterations | held-out accuracy {s['initial_heldout_accuracy']} -> "
                f"{s['final_heldout_accuracy']} | reward AUC {s['reward_auc']:.4f} | mean k3_kl {s['mean_k3_kl']:.3e}"
                + (f" | summary {path}" if path else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``launch/rl.py`` on pretraining's runtime (``pretrain.runtime.run``: parse and agree, refusals
    as one line, SIGTERM, the process group): exit status 0 done, 2 bad input, 3 diverged, 4 a
    checkpoint could not be written (``pretrain.status``)."""
    def run_rl(parsed, signals) -> int:
        trainer = None
        try:
            trainer = setup(*parsed)
            return train(trainer, signals)
        except RLDiverged as e:
            runtime.refuse(f"diverged: {e}", EXIT_DIVERGED, PROG)
        finally:
            if trainer is not None and trainer.tb is not None:
                trainer.tb.close()

    return runtime.run(run_rl, prog=PROG, parse=lambda world, cuda: parse_rl_args(argv, world, cuda))

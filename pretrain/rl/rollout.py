"""The rollout side of an RL iteration: the engine under the rollout plan, its samples, its memory
and the automatic fallback that changes the plan.

    build_rollout(t)                   rollout plan over the model's linears (+ the fallback's rules),
                                       packed weights (model.rollout), the QAT view, the engine
    problems, gen, s = generate(t, i)  this rank's prompts of iteration i, G responses each
    rollout_memory(t, batch)           KV-cache bytes per token, packed weights, peak
    fallback_check(t, metrics, batch)  --rollout-fallback on the step's metrics; rebuilds the plan

``t`` is the :class:`pretrain.rl.trainer.RLTrainer` (its typed ``cfg`` and ``run``; no argparse
Namespace). Sampling (:func:`sampling`): temperature, top-k, top-p of ``--temperature/--top-k/--top-p``;
the engine's log-probs are of that truncated, renormalised distribution, the one the trainer scores
(``pretrain.rl.score``).
"""

from __future__ import annotations

import time

import torch
from megatron.core import parallel_state

from model.generate import Engine, SamplingParams
from model.gpt import policy_linear_names
from model.moe_replay import RoutingTap, moe_routers
from model.rollout import RolloutModel
from model.rollout_plan import resolve_rollout_plan
from pretrain.arguments import ConfigError
from pretrain.engine import dp_rank_size
from pretrain.rl.qat import RolloutQAT
from pretrain.rl.task import train_problems

__all__ = ["build_rollout", "fallback_check", "generate", "rollout_memory", "sampling"]


def rollout_rules(t) -> list[str]:
    """The user's --rollout-precision-rule values, then the fallback's (``layers:I-I=bf16``; first match wins,
    so a layer a user rule sets stays the user's -- the fallback's attribution skips it alike)."""
    user = list(t.cfg.rollout_precision_rule)
    extra = t.fallback.rollout_rules() if t.fallback is not None else []
    return user + [r for r in extra if r not in user]


def build_rollout(t) -> None:
    """The rollout plan over the model's linears, its packed weights, the QAT view and the engine;
    a plan the model cannot take is one line naming the flag."""
    c = t.model_config
    try:
        plan = resolve_rollout_plan(t.cfg.rollout_precision, rollout_rules(t), policy_linear_names(t.model),
                                    c.num_layers, c.hidden_size // c.num_attention_heads)
        rollout = RolloutModel(t.model, plan)
    except ValueError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("--rollout") else f"--rollout-precision "
                          f"{t.cfg.rollout_precision}: {msg}") from None
    rollout.update()
    if t.qat is None:
        try:
            t.qat = RolloutQAT(t.model, plan, t.cfg.rollout_qat, replay_layers=t.cfg.qat_replay_layers,
                               kv=t.cfg.rollout_qat_kv)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        t.qat.update_plan(plan)
    t.rollout_plan, t.rollout = plan, rollout
    if t.routing is None and moe_routers(t.model):
        try:
            t.routing = RoutingTap(t.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if t.cfg.routing_replay and t.routing is None:
        raise ConfigError("--routing-replay replays a mixture-of-experts policy's expert choices; the model has no "
                          "MoE layer (drop the flag)")
    t.engine = Engine(t.model, vocab_size=t.vocab_size, rollout=rollout, record_layers=t.qat.record_layers or ())


def sampling(t, seed: int, greedy: bool = False):
    c, eod = t.cfg, t.tokenizer.eod
    if greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=c.max_new_tokens, stop_tokens=(eod,))
    return SamplingParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, max_new_tokens=c.max_new_tokens,
                          stop_tokens=(eod,), seed=seed)


def sampling_seed(t, iteration: int) -> int:
    return (t.run.training.seed * 1_000_003 + iteration * 7_919 + dp_rank_size()[0]) % 2**62


def generate(t, iteration: int):
    """This rank's prompts, G responses each; returns (problems, generation, seconds)."""
    dp_rank, dp = dp_rank_size()
    n = t.cfg.prompts_per_step // dp
    problems = train_problems(t.spec, iteration, n, rank_offset=dp_rank * n)
    prompts = [t.prompt_ids(p.prompt) for p in problems for _ in range(t.cfg.group_size)]
    longest = max(len(p) for p in prompts)
    if longest > t.cfg.max_prompt_tokens:
        raise ConfigError(f"--seq-length {t.run.model.seq_length}: a prompt of {longest} tokens + --max-new-tokens "
                          f"{t.cfg.max_new_tokens} exceeds it; raise --seq-length (at most the model's "
                          f"positions) or lower --max-new-tokens")
    if t.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    gen = t.engine.generate(prompts, sampling(t, sampling_seed(t, iteration)))
    return problems, gen, time.perf_counter() - t0


def rollout_memory(t, batch) -> dict[str, float]:
    """The rollout's memory, the whole model's (summed over TP ranks): KV-cache bytes per token,
    packed linear weights, and the peak -- CUDA's peak while generating (each rank's, summed),
    else the engine's KV-cache of the batch (every slot of every row) plus every parameter's bytes
    (packed linears, embeddings and norms at their dtype)."""
    w = t.rollout.weight_bytes()
    slots = int(batch.prompt_mask.shape[0] * (batch.prompt_mask.shape[1] + batch.response_mask.shape[1]))
    kv = t.engine.kv_bytes_per_token()
    peak = float(torch.cuda.max_memory_allocated()) if t.device.type == "cuda" else kv * slots + sum(w.values())
    numbers = torch.tensor([kv, float(w["packed_linears"]), peak], dtype=torch.float64)
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() > 1:
        torch.distributed.all_reduce(numbers, group=group)
    return {"kv_bytes_per_token": float(numbers[0]), "packed_weight_bytes": float(numbers[1]),
            "peak_memory_bytes": float(numbers[2])}


def fallback_check(t, metrics: dict, batch) -> list[str]:
    """--rollout-fallback on the step's global metrics -- the rollout against the trainer's own
    numerics (``--precision``), also under --rollout-qat -- : rank 0's choice (every rank attributes
    its own batch, so TP collectives stay matched), then the new rollout plan on every rank. The
    attribution re-scores the batch with the updated policy on both sides (trainer and rollout
    plans), the weights the next rollout will use."""
    if not t.fallback.triggered(metrics):
        return []
    moved = t.fallback.choose(t.model, batch, vocab_size=t.vocab_size, rollout=t.cfg.rollout_precision,
                              rules=list(t.cfg.rollout_precision_rule), iteration=t.iteration,
                              temperature=t.cfg.temperature)
    if torch.distributed.get_world_size() > 1:
        state = [t.fallback.state_dict()]
        torch.distributed.broadcast_object_list(state, src=0)
        t.fallback.load_state_dict(state[0])
        moved = t.fallback.events[-1]["moved"] if t.fallback.events else []
    if moved:
        build_rollout(t)
    return list(moved)

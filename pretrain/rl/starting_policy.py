"""The RL task's starting policy: its SFT corpus, the commands that train it, and a checkpoint's
held-out accuracy on the task (``launch/rl_task.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from pretrain.rl.task import eval_problems, extract_answer, reward, sft_examples

_SPECIAL_IDS = 256 + 3 + 1  # byte pieces, <unk> <s> </s>, and "\n" (pretrain.data.tokenizer.train_tokenizer)


# ================================================================================================
# The corpus
# ================================================================================================


def tokenizer_vocab_size(texts) -> int:
    """The sentencepiece vocabulary that holds exactly one piece per character of ``texts`` (digits are
    split by the tokenizer anyway; no merges, so every number is spelled digit by digit)."""
    return _SPECIAL_IDS + len({c for t in texts for c in t if c != "\n"})


def write_corpus(spec, out: str, n_sft: int) -> dict:
    """``out/sft.jsonl`` (``n_sft`` documents) and ``out/eval.jsonl`` (the held-out problems) of the task
    ``spec``; returns their counts and the tokenizer vocabulary that fits them."""
    os.makedirs(out, exist_ok=True)
    texts = sft_examples(spec, n_sft)
    with open(os.path.join(out, "sft.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    held = eval_problems(spec)
    with open(os.path.join(out, "eval.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in held)
    return {"sft": len(texts), "eval": len(held), "vocab": tokenizer_vocab_size(texts)}


# The starting policy's training run. On a shared CPU machine run it with OMP_NUM_THREADS=1: under a
# load of ~30-50 runnable threads on 2 cores, OpenMP's spinning workers made the same run 20-40x slower
# (130-400 tokens/s instead of 2,000-6,000).
SFT_MODEL = "--model-size tiny --num-layers 3 --num-attention-heads 4 --num-query-groups 2 --seq-length 32"
SFT_BATCH = "--micro-batch-size 32 --global-batch-size 32 --precision bf16 --lr-warmup-iters 30"


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """A MoE starting policy's experts: every layer's MLP a MoE layer (softmax top-k router, FP32 as
    the trainer's), ``experts`` routed experts of width ``expert_ffn`` and one shared expert of width
    ``shared_ffn``, the switch load-balancing loss at ``aux_loss``."""

    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int
    aux_loss: float

    def flags(self) -> str:
        return (f"--num-experts {self.experts} --moe-router-topk {self.topk} --moe-ffn-hidden-size "
                f"{self.expert_ffn} --moe-shared-expert-intermediate-size {self.shared_ffn} "
                f"--moe-aux-loss-coeff {self.aux_loss:g}")


@dataclasses.dataclass(frozen=True)
class SftRecipe:
    """One starting policy's width and schedule (configs/sweeps/fp4_rollout.md: how each was chosen);
    the FFN is 4 x hidden and the lr decays to a tenth of its peak. ``moe``: the MoE policy's experts
    (configs/sweeps/moe_rollout.md), else dense."""

    hidden: int
    lr: float
    iters: int
    save_interval: int
    save_dir: str  # under --out
    moe: MoeShape | None = None

    def flags(self) -> str:
        moe = f" {self.moe.flags()}" if self.moe is not None else ""
        return (f"{SFT_MODEL} --hidden-size {self.hidden} --ffn-hidden-size {4 * self.hidden}{moe} {SFT_BATCH} "
                f"--lr {self.lr:g} --min-lr {self.lr / 10:g} --train-iters {self.iters} "
                f"--eval-interval {self.iters} --eval-iters 4 --log-interval 100")


# hidden 128: 3,000 iterations, greedy held-out 0.586 (the fp4_rollout sweep's start). hidden 256: the
# same corpus at half the peak lr (3e-3 left it at 0.064 after 3,000 iterations); its iteration 2000
# (0.678) is the fp4_rollout_h256 sweep's start, its last (4000) reaches 0.857.
SFT_RECIPES = {
    128: SftRecipe(128, 3e-3, 3000, 500, "sft"),
    256: SftRecipe(256, 1.5e-3, 4000, 1000, "sft_h256"),
}

# The moe_rollout study's starting policy (configs/sweeps/moe_rollout.yaml loads DIR/sft_moe): the hidden-128
# recipe with every MLP a MoE layer -- 4 routed experts of width 128, top-2, one shared expert of width 256:
# 2 x 128 + 256 = 512 active expert columns per token, the dense recipe's FFN.
MOE_RECIPES = {
    128: dataclasses.replace(SFT_RECIPES[128], save_dir="sft_moe", moe=MoeShape(4, 2, 128, 256, 1e-2)),
}


def recipe(width: int = 128, moe: bool = False) -> SftRecipe:
    """The starting policy's recipe of hidden size ``width``, dense or MoE; a combination without one is
    refused in one line naming the flags."""
    table = MOE_RECIPES if moe else SFT_RECIPES
    if width not in table:
        kind = "MoE" if moe else "dense"
        raise ValueError(f"--policy-width {width}{' --policy-moe' if moe else ''}: no {kind} starting policy of "
                         f"that width; {kind} widths: {', '.join(map(str, sorted(table)))}")
    return table[width]


def commands(out: str, vocab: int, width: int = 128, moe: bool = False) -> list[str]:
    """The two commands that train the starting policy of hidden size ``width`` (``moe``: the MoE one)
    on ``out``'s corpus."""
    r = recipe(width, moe)
    tok = os.path.join(out, "tokenizer.model")
    return [
        (f"python launch/preprocess_data.py --input {out}/sft.jsonl --output-prefix {out}/sft "
         f"--tokenizer-model {tok} --train-tokenizer {vocab} --append-eod"),
        (f"OMP_NUM_THREADS=1 python launch/pretrain.py {r.flags()} --data-path {out}/sft_text_document "
         f"--tokenizer-model {tok} --split 98,2,0 --save {os.path.join(out, r.save_dir)} "
         f"--load {os.path.join(out, r.save_dir)} --save-interval {r.save_interval}"),
    ]


# ================================================================================================
# Evaluation of a checkpoint
# ================================================================================================


def evaluate(args, spec) -> dict:
    """``launch/rl_task.py --evaluate``'s result: greedy held-out accuracy of the checkpoint under the
    rollout plan and, with ``--group-size``, the reward statistics of sampled groups."""
    # torch, megatron and the engine only here: writing the corpus runs without them (seconds at start-up)
    import torch

    from model.generate import Engine, SamplingParams
    from model.rollout import packed_rollout
    from pretrain.data.tokenizer import Tokenizer
    from pretrain.evaluation.loading import init_single_process, load_for_eval

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    init_single_process()
    tok_path = args.tokenizer_model
    vocab = Tokenizer(tok_path).vocab_size if tok_path else None
    loaded = load_for_eval(args.evaluate, vocab_size=vocab, device=args.device, seed=args.seed)
    tok_path = tok_path or loaded.tokenizer_model
    if not tok_path or not os.path.isfile(tok_path):
        raise ValueError(f"--evaluate {args.evaluate}: its tokenizer {tok_path!r} is not readable; pass --tokenizer-model")
    tok = Tokenizer(tok_path)
    cfg = loaded.cfg
    rollout = packed_rollout(loaded.model, cfg, args.rollout_precision, args.rollout_precision_rule)
    engine = Engine(loaded.model, vocab_size=tok.vocab_size, rollout=rollout)
    problems = eval_problems(spec)
    max_new = max(len(p.answer) for p in problems) + 2

    def run(probs, params):
        gen_tokens = []
        for k, start in enumerate(range(0, len(probs), args.batch_size)):
            chunk = probs[start : start + args.batch_size]
            params_k = dataclasses.replace(params, seed=params.seed + k)
            gen_tokens += engine.generate([tok.tokenize(p.prompt) for p in chunk], params_k).tokens
        texts = [tok.detokenize([t for t in ids if t != tok.eod]) for ids in gen_tokens]
        stopped = [bool(ids) and ids[-1] == tok.eod for ids in gen_tokens]
        return texts, stopped, gen_tokens

    t0 = time.perf_counter()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_tokens=(tok.eod,), seed=args.seed)
    texts, stopped, ids = run(problems, greedy)
    rewards = [reward(p, t, spec) for p, t in zip(problems, texts)]
    result = {
        "checkpoint": os.path.abspath(args.evaluate), "task": os.path.abspath(args.task), "task_name": spec.name,
        "rollout_precision": args.rollout_precision, "rollout_precision_rule": args.rollout_precision_rule,
        "heldout_problems": len(problems), "heldout_accuracy": sum(r == 1.0 for r in rewards) / len(problems),
        "well_formed": sum(extract_answer(t) is not None for t in texts) / len(problems),
        "stopped": sum(stopped) / len(problems), "greedy_tokens": sum(len(x) for x in ids),
        "examples": [{"prompt": p.prompt, "answer": p.answer, "response": t}
                     for p, t in list(zip(problems, texts))[:8]],
    }
    if args.group_size:
        probs = problems[: args.group_prompts]
        sampled = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_tokens=(tok.eod,), seed=args.seed + 1)
        rep = [p for p in probs for _ in range(args.group_size)]
        s_texts, _, _ = run(rep, sampled)
        s_rewards = [reward(p, t, spec) for p, t in zip(rep, s_texts)]
        groups = [s_rewards[i : i + args.group_size] for i in range(0, len(rep), args.group_size)]
        result.update({
            "group_size": args.group_size, "group_prompts": len(probs),
            "sampled_reward_mean": sum(s_rewards) / len(s_rewards),
            "groups_with_reward_variance": sum(len(set(g)) > 1 for g in groups) / len(groups),
            "groups_all_correct": sum(min(g) == 1.0 for g in groups) / len(groups),
            "groups_all_wrong": sum(max(g) < 1.0 for g in groups) / len(groups),
        })
    result["seconds"] = time.perf_counter() - t0
    return result

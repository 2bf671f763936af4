"""The RL task's data and its starting policy: write the SFT corpus, or evaluate a checkpoint on it.

    python launch/rl_task.py --task configs/rl/arith.yaml --out DIR [--policy-width 256]
    python launch/rl_task.py --task configs/rl/arith.yaml --out DIR --policy-moe
    # -> DIR/sft.jsonl (the starting policy's corpus: {"text": "12+345=357"} per line),
    #    DIR/eval.jsonl (the held-out problems: {"prompt", "answer"}), and prints the
    #    launch/preprocess_data.py and launch/pretrain.py commands that train the starting policy
    #    (3 layers of hidden 128 into DIR/sft, or with --policy-width 256 of hidden 256 into DIR/sft_h256,
    #    or with --policy-moe the mixture-of-experts one of the moe_rollout study into DIR/sft_moe)

    python launch/rl_task.py --task configs/rl/arith.yaml --evaluate CKPT_DIR --rollout-precision mxfp4 \\
        --group-size 8 --out DIR
    # greedy held-out accuracy of a checkpoint through model.generate.Engine under the rollout plan
    # (default bf16); --group-size G also samples G responses at temperature 1 for each of the first
    # --group-prompts held-out prompts (how often a group's rewards disagree: GRPO's signal);
    # prints one line and writes DIR/eval_<rollout-precision>.json

Exit status 0, or 2 with one line ``rl_task.py: error: ...`` on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain.rl.starting_policy import (
    SFT_RECIPES,
    commands,
    evaluate,
    recipe,
    tokenizer_vocab_size,  # noqa: F401 (launch.rl_task's public name)
    write_corpus,
)
from pretrain.rl.task import TaskError, load_task

_PROG = "rl_task.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--task", required=True, metavar="FILE", help="task seed file, e.g. configs/rl/arith.yaml")
    add("--out", required=True, metavar="DIR", help="output directory")
    add("--sft-examples", type=int, default=50000, help="documents in DIR/sft.jsonl (default 50000)")
    add("--policy-width", type=int, choices=sorted(SFT_RECIPES), default=128,
        help="hidden size of the starting policy whose training command is printed (default 128)")
    add("--policy-moe", action="store_true",
        help="print the mixture-of-experts starting policy's command instead (every MLP 4 routed experts, top-2, "
        "+ a shared expert; into DIR/sft_moe, what configs/sweeps/moe_rollout.yaml loads); width 128 only")
    g = p.add_argument_group("evaluation of a checkpoint (--evaluate)")
    add = g.add_argument
    add("--evaluate", metavar="CKPT_DIR", help="a training checkpoint directory (launch/pretrain.py --save)")
    add("--rollout-precision", default="bf16", metavar="PRESET_OR_SPEC",
        help="the engine's rollout plan (model.rollout_plan), e.g. bf16, mxfp4, nvfp4 (default bf16)")
    add("--rollout-precision-rule", action="append", default=[], metavar="SELECTOR=VALUE",
        help="per-layer rollout recipe (repeatable)")
    add("--tokenizer-model", default=None, help="default: the checkpoint's --tokenizer-model")
    add("--batch-size", type=int, default=50, help="prompts per engine batch (default 50)")
    add("--group-size", type=int, default=0, metavar="G",
        help="also sample G responses at temperature 1 per prompt (0: off; else >= 2)")
    add("--group-prompts", type=int, default=32, help="held-out prompts sampled with --group-size (default 32)")
    add("--seed", type=int, default=1234, help="sampling seed")
    add("--device", default="cpu", help="cpu or cuda")
    return p


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_task(args.task)
    except TaskError as e:
        return _fail(str(e))
    if args.sft_examples < 1:
        return _fail(f"--sft-examples {args.sft_examples}: must be >= 1")
    if args.batch_size < 1:
        return _fail(f"--batch-size {args.batch_size}: must be >= 1")
    if args.group_size == 1 or args.group_size < 0:
        return _fail(f"--group-size {args.group_size}: must be 0 (off) or >= 2 (a group needs two responses)")
    if args.group_prompts < 1:
        return _fail(f"--group-prompts {args.group_prompts}: must be >= 1")
    if args.evaluate is None:
        try:
            recipe(args.policy_width, args.policy_moe)
        except ValueError as e:
            return _fail(str(e))
        info = write_corpus(spec, args.out, args.sft_examples)
        print(f"{args.out}/sft.jsonl: {info['sft']} documents; {args.out}/eval.jsonl: {info['eval']} held-out "
              f"problems (task {spec.name!r}, seed {spec.seed})")
        print("train the starting policy with:")
        for cmd in commands(args.out, info["vocab"], args.policy_width, args.policy_moe):
            print(f"  {cmd}")
        return 0
    if not os.path.isdir(args.evaluate):
        return _fail(f"--evaluate {args.evaluate}: no such checkpoint directory (give a launch/pretrain.py --save DIR)")
    try:
        result = evaluate(args, spec)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0].replace("--load", "--evaluate", 1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"eval_{args.rollout_precision.replace('/', '_')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    line = (f"held-out accuracy {result['heldout_accuracy']:.3f} ({result['heldout_problems']} problems, greedy, "
            f"rollout {args.rollout_precision}; well-formed {result['well_formed']:.2f}, stopped {result['stopped']:.2f})")
    if args.group_size:
        line += (f"; G={args.group_size} at T=1: reward {result['sampled_reward_mean']:.3f}, groups with variance "
                 f"{result['groups_with_reward_variance']:.2f}")
    print(f"{line} in {result['seconds']:.1f}s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

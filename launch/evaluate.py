"""Evaluate a checkpoint on lm-eval tasks; compare two evaluated runs.

    python launch/evaluate.py --load ckpt/llama1b --tasks local_python_mc,hellaswag --out eval/bf16
    python launch/evaluate.py --load ckpt/qat --precision hif8_w8a8 --tasks local_python_mc --out eval/qat
    python launch/evaluate.py --compare eval/bf16 eval/qat --labels BF16 QAT --out eval/compare

``--load`` takes a converted HF checkpoint (``launch/convert_hf.py --save DIR``: DIR or its
``hf_converted.pt``), a training checkpoint directory saved at any tensor-parallel size (TP>1
shards are merged, ``pretrain/reshard.py``), or a plain ``{"model", "model_config"}`` file
(``pretrain/evaluation/loading.py``). The tokenizer is ``--tokenizer-model`` (sentencepiece),
``--hf-tokenizer DIR``, or else the one that came with the weights. Tasks are local ones from
``configs/eval/`` (offline) or any lm-eval task name (their data needs the network or a filled
HF datasets cache). Runs in one process at TP=1, on CUDA when available.

Writes ``OUT/results.csv`` (task, metric, value, stderr), ``OUT/results.md``, ``OUT/results.json``
and ``OUT/samples.jsonl`` (every document's scores and gold negative log-likelihood); ``--compare A B``
writes ``OUT/compare.csv`` / ``compare.md``: a paired test over the documents both runs scored, per
task and metric ``B - A`` in percentage points for accuracies, the relative change, the 95% paired
interval and a Holm-adjusted verdict, and the loss (nll) / perplexity-ratio gap
(pretrain/evaluation/results.py).
"""

from __future__ import annotations

import argparse
import os
import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain.evaluation.results import write_comparison
from pretrain.runtime import filter_expected_warnings

_PROG = "evaluate.py"


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--load", help="converted HF dir/file, training checkpoint dir (any TP size), or plain weights file")
    add("--tasks", help="comma-separated task names (local: configs/eval/*.yaml; or lm-eval's)")
    add("--out", required=True, help="output directory for the result tables")
    add("--compare", nargs=2, metavar=("A_DIR", "B_DIR"), help="write the B - A delta table of two --out dirs")
    add("--labels", nargs=2, metavar=("A", "B"), default=None, help="column names for --compare")
    add("--label", default=None, help="run name in the tables (default: --load's name and the precision)")
    add("--tokenizer-model", default=None, help="sentencepiece model (pretrain.data.Tokenizer)")
    add("--hf-tokenizer", default=None, help="local Hugging Face tokenizer directory")
    add("--precision", default=None, help="precision preset or spec (default: the checkpoint's plan, else bf16)")
    add("--precision-rule", action="append", default=[], help="per-layer rule, as in training (repeatable)")
    add("--seq-length", type=int, default=None, help="context length (default: the model config's)")
    add("--batch-size", type=int, default=8)
    add("--max-gen-toks", type=int, default=256, help="default generation budget for generate_until tasks")
    add("--use-cache", action=argparse.BooleanOptionalAction, default=True,
        help="KV cache for generate_until (HF's use_cache); --no-use-cache recomputes the prefix each step")
    add("--num-fewshot", type=int, default=None)
    add("--limit", type=float, default=None, help="documents per task (<1: a fraction); for quick checks")
    add("--bootstrap-iters", type=int, default=1000, help="bootstrap samples for stderrs (0: none)")
    add("--add-bos-token", action="store_true", help="prefix every context with BOS (as HFLM's add_bos_token)")
    add("--device", default="auto", help="cpu, cuda, or auto (default)")
    add("--seed", type=int, default=1234)
    return p


def main(argv: list[str] | None = None) -> int:
    filter_expected_warnings()  # megatron-core's notes on TransformerEngine / Apex being absent
    args = build_parser().parse_args(argv)
    if args.compare:
        labels = tuple(args.labels) if args.labels else tuple(os.path.basename(os.path.normpath(d)) for d in args.compare)
        try:
            write_comparison(*args.compare, args.out, labels=labels)
        except FileNotFoundError as e:
            return _fail(str(e))
        print(_read(os.path.join(args.out, "compare.md")))
        return 0
    if not args.load or not args.tasks:
        return _fail("--load and --tasks are required (or use --compare A_DIR B_DIR)")
    from pretrain.evaluate_run import evaluate  # torch and megatron-core: not loaded for --help or --compare

    try:
        evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0])
    print(_read(os.path.join(args.out, "results.md")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

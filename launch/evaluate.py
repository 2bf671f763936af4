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
import time

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

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


def _tokenizer(args, loaded):
    from pretrain.data.tokenizer import Tokenizer
    from pretrain.evaluation.hf_tokenizer import HFTokenizer

    if args.tokenizer_model:
        return Tokenizer(args.tokenizer_model)
    if args.hf_tokenizer:
        return HFTokenizer(args.hf_tokenizer)
    if loaded.tokenizer_dir:
        return HFTokenizer(loaded.tokenizer_dir)
    if loaded.tokenizer_model and os.path.isfile(loaded.tokenizer_model):
        return Tokenizer(loaded.tokenizer_model)
    raise ValueError(f"--load {args.load}: no tokenizer came with it; pass --tokenizer-model or --hf-tokenizer")


def evaluate(args) -> list[dict]:
    """Run ``args.tasks`` on ``args.load``; write and return the result rows."""
    import torch

    from pretrain.evaluation import mc_task
    from pretrain.evaluation.results import result_rows, sample_rows, write_results

    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    specs, needs_builtin = mc_task.resolve_tasks(names)
    if not needs_builtin:  # local data only: never touch the network
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import lm_eval

    from pretrain.evaluation.lm_eval_adapter import MegatronLM
    from pretrain.evaluation.loading import init_single_process, load_for_eval

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    init_single_process()
    vocab = None
    if args.tokenizer_model:
        from pretrain.data.tokenizer import Tokenizer

        vocab = Tokenizer(args.tokenizer_model).vocab_size
    t0 = time.perf_counter()
    loaded = load_for_eval(args.load, precision=args.precision, precision_rules=args.precision_rule,
                           vocab_size=vocab, device=device, seed=args.seed)
    tokenizer = _tokenizer(args, loaded)
    if tokenizer.vocab_size > loaded.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, the model only {loaded.cfg.vocab_size}")
    seq_length = args.seq_length or loaded.cfg.seq_length
    lm = MegatronLM(loaded.model, tokenizer, seq_length=seq_length, batch_size=args.batch_size,
                    vocab_size=loaded.cfg.vocab_size, add_bos_token=args.add_bos_token,
                    max_gen_toks=args.max_gen_toks, use_cache=args.use_cache, device=device)
    precision = args.precision or ("checkpoint plan" if loaded.kind == "checkpoint" else "bf16")
    print(f"loaded {loaded.kind} {loaded.path} ({time.perf_counter() - t0:.1f}s), precision {precision}, "
          f"{tokenizer!r}, seq_length {seq_length}, device {device}")
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=specs,
        task_manager=mc_task.task_manager(needs_builtin),
        num_fewshot=args.num_fewshot,
        limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
        bootstrap_iters=args.bootstrap_iters,
        log_samples=True,  # per-sample results: --compare's paired test
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    rows = result_rows(out["results"])
    samples = sample_rows(out.get("samples") or {})
    label = args.label or f"{os.path.basename(os.path.normpath(args.load))} ({precision})"
    write_results(rows, args.out, label=label, extra={
        "load": os.path.abspath(loaded.path), "kind": loaded.kind, "precision": precision,
        "precision_plan": loaded.plan.to_dict(), "tasks": names, "limit": args.limit,
        "num_fewshot": args.num_fewshot, "seq_length": seq_length, "tokenizer": repr(tokenizer),
        "n_samples": out.get("n-samples"), "versions": out.get("versions"),
        "lm_eval_version": getattr(lm_eval, "__version__", None),
    }, samples=samples)
    return rows


def main(argv: list[str] | None = None) -> int:
    from pretrain.runtime import filter_expected_warnings

    filter_expected_warnings()  # megatron-core's notes on TransformerEngine / Apex being absent
    args = build_parser().parse_args(argv)
    if args.compare:
        from pretrain.evaluation.results import write_comparison

        labels = tuple(args.labels) if args.labels else tuple(os.path.basename(os.path.normpath(d)) for d in args.compare)
        try:
            write_comparison(*args.compare, args.out, labels=labels)
        except FileNotFoundError as e:
            return _fail(str(e))
        print(_read(os.path.join(args.out, "compare.md")))
        return 0
    if not args.load or not args.tasks:
        return _fail("--load and --tasks are required (or use --compare A_DIR B_DIR)")
    try:
        evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0])
    print(_read(os.path.join(args.out, "results.md")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``launch/evaluate.py``'s work: a checkpoint on lm-eval tasks, its result tables written; and the
loading shared with ``launch/generate.py`` (``--load`` with its trainer plan and tokenizer).

``--load`` is what ``pretrain.evaluation.loading.load_for_eval`` reads (a converted HF checkpoint, a
training checkpoint at any TP size, a plain ``{"model", "model_config"}`` file); the tokenizer is
``--tokenizer-model`` (sentencepiece), ``--hf-tokenizer DIR``, or else the one that came with the weights.
"""

from __future__ import annotations

import os
import time

import torch

from pretrain.data.tokenizer import Tokenizer
from pretrain.evaluation import mc_task
from pretrain.evaluation.hf_tokenizer import HFTokenizer
from pretrain.evaluation.loading import LoadedModel, init_single_process, load_for_eval
from pretrain.evaluation.results import result_rows, sample_rows, write_results


def checkpoint_tokenizer(args, loaded: LoadedModel):
    """``(tokenizer, where it came from)`` by the flags' order of preference, else ``(None, None)``."""
    if args.tokenizer_model:
        return Tokenizer(args.tokenizer_model), f"--tokenizer-model {args.tokenizer_model}"
    if args.hf_tokenizer:
        return HFTokenizer(args.hf_tokenizer), f"--hf-tokenizer {args.hf_tokenizer}"
    if loaded.tokenizer_dir:
        return HFTokenizer(loaded.tokenizer_dir), f"the tokenizer of --load {args.load}"
    if loaded.tokenizer_model and os.path.isfile(loaded.tokenizer_model):
        return Tokenizer(loaded.tokenizer_model), f"the tokenizer of --load {args.load}"
    return None, None


def load_with_tokenizer(args) -> tuple[LoadedModel, object | None, str | None, str]:
    """``--load`` in one process at TP=1 under ``--precision`` / ``--precision-rule`` (default: its own
    plan) on ``--device`` (auto: CUDA when available); returns the loaded model, its tokenizer or None,
    where the tokenizer came from, and the device."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    init_single_process()
    vocab = Tokenizer(args.tokenizer_model).vocab_size if args.tokenizer_model else None
    loaded = load_for_eval(args.load, precision=args.precision, precision_rules=args.precision_rule,
                           vocab_size=vocab, device=device, seed=args.seed)
    tokenizer, source = checkpoint_tokenizer(args, loaded)
    return loaded, tokenizer, source, device


def evaluate(args) -> list[dict]:
    """Run ``args.tasks`` on ``args.load``; write and return the result rows."""
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    specs, needs_builtin = mc_task.resolve_tasks(names)
    if not needs_builtin:  # local data only: never touch the network
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # after the offline switches above, which HF datasets / hub read when they are first imported
    import lm_eval

    from pretrain.evaluation.lm_eval_adapter import MegatronLM

    t0 = time.perf_counter()
    loaded, tokenizer, _, device = load_with_tokenizer(args)
    if tokenizer is None:
        raise ValueError(f"--load {args.load}: no tokenizer came with it; pass --tokenizer-model or --hf-tokenizer")
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

"""Generate samples and log-probs from a checkpoint under a rollout precision plan.

    python launch/generate.py --load ckpt/run --rollout-precision mxfp4 --prompts prompts.jsonl \\
        --max-new-tokens 128 --out gen/mxfp4
    python launch/generate.py --load ckpt/run --rollout-precision nvfp4+had16 \\
        --rollout-precision-rule first:1=bf16 --prompts prompts.txt --temperature 0.8 --top-p 0.95 \\
        --seed 1 --out gen/nvfp4

``--load``: what ``launch/evaluate.py`` loads (a training checkpoint at any TP size, a converted HF
checkpoint, a plain ``{"model", "model_config"}`` file). ``--prompts``: ``.jsonl`` with one object
per line, ``{"prompt": TEXT}`` (needs a tokenizer: ``--tokenizer-model`` / ``--hf-tokenizer``, else the one
that came with ``--load``, e.g. the copy a training checkpoint carries of its run's, built-in or given) or
``{"prompt_ids": [ids]}``; any other file is plain text, one prompt per line. ``--precision`` (default: the checkpoint's plan, else bf16) is the
trainer's plan the model is built with -- what re-scoring the rollouts against the trainer uses.
Generation runs on ``model.generate.Engine`` (one process, TP=1, CUDA when available) with the
rollout plan's packed weights and KV-cache (``model.rollout``, ``model.rollout_plan``).

Writes ``OUT/samples.jsonl`` (per prompt: prompt ids and text, response ids and text, the log-prob
of each response token under the distribution it was sampled from, finish reason) and
``OUT/rollout.json`` (plan, weight bytes, KV bytes per token, sampling, tokens/s), and
``OUT/mismatch.md`` + plots: the trainer (``--precision``) re-scores the sampled tokens and the
mismatch is reported under verl's names, by response position, and with ``--attribution`` split
into weights / activations / KV-cache (``pretrain.rl.report``). ``--record-rounding SELECTOR``
(``--precision-rule`` selectors, repeatable) records the chosen linears' activation rounding while
the engine generates (``model.rollout_records``: block scales + one direction bit per element) and
writes to ``rollout.json`` each linear's record size in bits per element and the fraction of the
rollout's codes the trainer (``--precision``) reproduces, own rounding and replaying the records
(``pretrain.rl.alignment.engine_alignment``). Programmatic
use: :func:`load_session` then :func:`generate_rollouts`, which returns the padded rollout batch
(prompt ids, response ids, rollout log-probs, masks) a trainer re-scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

_PROG = "generate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--load", required=True, help="training checkpoint dir (any TP size), converted HF dir/file, or plain file")
    add("--prompts", required=True, metavar="FILE", help=".jsonl of {prompt: TEXT} / {prompt_ids: [...]}, or text lines")
    add("--out", required=True, help="output directory (samples.jsonl, rollout.json)")
    add("--rollout-precision", default="bf16", metavar="PRESET_OR_SPEC",
        help="rollout plan: bf16, fp8, mxfp4, nvfp4, mxfp4_w4a16 (+had16/+had32), or "
        "base=PRESET,linear=X@W[+had16],kv=FORMAT (model.rollout_plan)")
    add("--rollout-precision-rule", action="append", default=[], metavar="SELECTOR=VALUE",
        help="per-layer rollout recipe, --precision-rule selectors, e.g. first:1=bf16 (repeatable)")
    add("--precision", default=None, help="the trainer's plan (default: the checkpoint's, else bf16)")
    add("--precision-rule", action="append", default=[], help="per-layer trainer rule (repeatable)")
    add("--max-new-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.0, help="0: greedy")
    add("--top-k", type=int, default=0, help="0: off")
    add("--top-p", type=float, default=1.0)
    add("--stop-token", type=int, action="append", default=None,
        help="stop token id (repeatable; default: the tokenizer's end of document)")
    add("--seed", type=int, default=1234, help="sampling seed (and the model's quantization seed)")
    add("--batch-size", type=int, default=16, help="prompts per engine batch")
    add("--padding", choices=["left", "right"], default="left")
    add("--use-cache", action=argparse.BooleanOptionalAction, default=True,
        help="KV-cache decode; --no-use-cache recomputes every step (the oracle)")
    add("--tokenizer-model", default=None, help="sentencepiece model (pretrain.data.Tokenizer)")
    add("--hf-tokenizer", default=None, help="local Hugging Face tokenizer directory")
    add("--device", default="auto", help="cpu, cuda, or auto (default)")
    add("--record-rounding", action="append", default=[], metavar="SELECTOR",
        help="record these linears' activation rounding while generating (TRACE), e.g. kind:fc1 (repeatable); "
        "rollout.json gets bits/element and trainer agreement")
    add("--attribution", action="store_true",
        help="mismatch.md also attributes the mismatch to weights / activations / KV-cache (8+ re-scores)")
    return p


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2


# ================================================================================================
# Loading: model, tokenizer, rollout plan
# ================================================================================================


@dataclasses.dataclass
class Session:
    """What one generation run holds: the loaded model (trainer plan applied), its tokenizer (or
    None), the rollout and the engine."""

    loaded: object  # pretrain.evaluation.loading.LoadedModel
    tokenizer: object | None
    rollout: object  # model.rollout.RolloutModel
    engine: object  # model.generate.Engine
    device: str


def _tokenizer(args, loaded):
    from pretrain.data.tokenizer import Tokenizer
    from pretrain.evaluation.hf_tokenizer import HFTokenizer

    if args.tokenizer_model:
        return Tokenizer(args.tokenizer_model), f"--tokenizer-model {args.tokenizer_model}"
    if args.hf_tokenizer:
        return HFTokenizer(args.hf_tokenizer), f"--hf-tokenizer {args.hf_tokenizer}"
    if loaded.tokenizer_dir:
        return HFTokenizer(loaded.tokenizer_dir), f"the tokenizer of --load {args.load}"
    if loaded.tokenizer_model and os.path.isfile(loaded.tokenizer_model):
        return Tokenizer(loaded.tokenizer_model), f"the tokenizer of --load {args.load}"
    return None, None


def load_session(args) -> Session:
    """Load ``--load`` with the trainer plan, its tokenizer, and the rollout plan (weights packed)."""
    import torch

    from model.generate import Engine
    from model.rollout import packed_rollout
    from pretrain.evaluation.loading import init_single_process, load_for_eval

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    init_single_process()
    vocab = None
    if args.tokenizer_model:
        from pretrain.data.tokenizer import Tokenizer

        vocab = Tokenizer(args.tokenizer_model).vocab_size
    loaded = load_for_eval(args.load, precision=args.precision, precision_rules=args.precision_rule,
                           vocab_size=vocab, device=device, seed=args.seed)
    tokenizer, source = _tokenizer(args, loaded)
    if tokenizer is not None and tokenizer.vocab_size != loaded.cfg.vocab_size:
        raise ValueError(f"{source} has {tokenizer.vocab_size} tokens but --load {args.load} was built for a "
                         f"vocabulary of {loaded.cfg.vocab_size}; give the tokenizer the checkpoint was trained with")
    cfg = loaded.cfg
    rollout = packed_rollout(loaded.model, cfg, args.rollout_precision, args.rollout_precision_rule)
    try:
        engine = Engine(loaded.model, vocab_size=cfg.vocab_size, rollout=rollout, padding=args.padding,
                        use_cache=args.use_cache, record_layers=args.record_rounding,
                        record_codes=bool(args.record_rounding))
    except ValueError as e:
        raise ValueError(str(e).replace("record_layers", "--record-rounding", 1)) from None
    return Session(loaded, tokenizer, rollout, engine, device)


def read_prompts(path: str, tokenizer) -> list[dict]:
    """``[{"prompt": text or None, "prompt_ids": [...]}]`` from ``--prompts`` (see the module docstring);
    a one-line ValueError naming the file and line otherwise."""
    if not os.path.isfile(path):
        raise ValueError(f"--prompts {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {path} line {n}: not JSON ({e.msg}); expected "
                                 '{"prompt": TEXT} or {"prompt_ids": [ids]}') from None
            if not isinstance(obj, dict) or not ({"prompt", "prompt_ids"} & set(obj)):
                raise ValueError(f"--prompts {path} line {n}: expected an object with \"prompt\" (text) or "
                                 f"\"prompt_ids\" (a list of token ids)")
            text, ids = obj.get("prompt"), obj.get("prompt_ids")
            if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
                raise ValueError(f"--prompts {path} line {n}: \"prompt_ids\" must be a list of integers")
            if ids is None and not isinstance(text, str):
                raise ValueError(f"--prompts {path} line {n}: \"prompt\" must be a string")
        else:
            text, ids = line, None
        if ids is None:
            if tokenizer is None:
                raise ValueError(f"--prompts {path} line {n}: a text prompt needs a tokenizer; pass "
                                 "--tokenizer-model or --hf-tokenizer, or give \"prompt_ids\"")
            ids = list(tokenizer.tokenize(text))
        rows.append({"prompt": text, "prompt_ids": ids, "line": n})
    if not rows:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return rows


# ================================================================================================
# Generation
# ================================================================================================


def sampling_params(args, tokenizer):
    from model.generate import SamplingParams

    stop = args.stop_token if args.stop_token is not None else ([tokenizer.eod] if tokenizer is not None else [])
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, stop_tokens=tuple(stop), seed=args.seed)


def generate_rollouts(session: Session, prompt_ids: list[list[int]], params, batch_size: int):
    """Generate after every prompt, ``batch_size`` prompts per engine batch (batch ``k`` samples with
    seed ``params.seed + k``). Returns the ``model.generate.Generation`` of all prompts in order;
    ``.rollout_batch()`` gives the padded prompt ids, response ids, rollout log-probs and masks."""
    from model.generate import Generation

    parts = []
    for k, start in enumerate(range(0, len(prompt_ids), batch_size)):
        batch_params = dataclasses.replace(params, seed=params.seed + k)
        parts.append(session.engine.generate(prompt_ids[start : start + batch_size], batch_params))
    fields = ("prompts", "tokens", "logprobs", "finish_reasons", "last_logits")
    gen = Generation(*([x for p in parts for x in getattr(p, f)] for f in fields))
    if session.engine.recorded:  # rounding records (--record-rounding), per prompt
        gen.records = [r for p in parts for r in p.records]
        gen.record_codes = [c for p in parts for c in p.record_codes]
    return gen


def write_outputs(out_dir: str, session: Session, rows: list[dict], gen, params, seconds: float, args) -> dict:
    """``samples.jsonl`` and ``rollout.json``; returns the summary written to the latter."""
    os.makedirs(out_dir, exist_ok=True)
    tok = session.tokenizer
    with open(os.path.join(out_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
        for i, (row, ids, lps, reason) in enumerate(zip(rows, gen.tokens, gen.logprobs, gen.finish_reasons)):
            rec = {"index": i, "prompt": row["prompt"], "prompt_ids": row["prompt_ids"], "response_ids": ids,
                   "response": tok.detokenize(ids) if tok is not None else None, "logprobs": lps,
                   "finish_reason": reason}
            f.write(json.dumps(rec) + "\n")
    n_tokens = sum(len(t) for t in gen.tokens)
    summary = {
        "load": os.path.abspath(args.load), "rollout_plan": session.rollout.plan.to_dict(),
        "trainer_plan": session.loaded.plan.to_dict(), "weight_bytes": session.rollout.weight_bytes(),
        "kv_bytes_per_token": session.engine.kv_bytes_per_token(), "sampling": dataclasses.asdict(params),
        "prompts": len(rows), "generated_tokens": n_tokens, "seconds": seconds,
        "tokens_per_s": n_tokens / seconds if seconds > 0 else None, "device": session.device,
        "gemms": "emulated (quantize -> dequantize -> FP32 GEMM)", "use_cache": args.use_cache,
    }
    with open(os.path.join(out_dir, "rollout.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def run(args) -> dict:
    session = load_session(args)
    rows = read_prompts(args.prompts, session.tokenizer)
    session.engine.check_prompts([r["prompt_ids"] for r in rows], what=f"--prompts {args.prompts}: prompt")
    params = sampling_params(args, session.tokenizer)
    t0 = time.perf_counter()
    gen = generate_rollouts(session, [r["prompt_ids"] for r in rows], params, args.batch_size)
    summary = write_outputs(args.out, session, rows, gen, params, time.perf_counter() - t0, args)
    batch = gen.rollout_batch()
    label = f"--precision {args.precision}" if args.precision else "the checkpoint's plan (else bf16)"
    if batch.response_mask.any():  # mismatch.md: the trainer (session.loaded.plan) re-scores the rollouts
        from pretrain.rl.report import write_generation_mismatch

        mm = write_generation_mismatch(
            args.out, session.loaded.model, batch, vocab_size=session.loaded.cfg.vocab_size,
            rollout=args.rollout_precision, rollout_rules=args.rollout_precision_rule, trainer_precision=None,
            trainer_label=label, temperature=args.temperature if args.temperature > 0 else 1.0,
            truncated=args.temperature > 0 and (args.top_k > 0 or args.top_p < 1.0), attribution=args.attribution,
            top_k=args.top_k if args.temperature > 0 else 0, top_p=args.top_p if args.temperature > 0 else 1.0)
        summary["mismatch"] = {k: mm["overall"][k] for k in ("rollout_corr/kl", "rollout_corr/k3_kl",
                                                              "rollout_corr/log_ppl_abs_diff")}
    if batch.response_mask.any() and session.engine.recorded:  # the trainer against the rollout's codes
        from pretrain.rl.alignment import engine_alignment

        rows = engine_alignment(session.loaded.model, batch, gen.record_codes, session.engine.recorded,
                                vocab_size=session.loaded.cfg.vocab_size, trainer=None)
        summary["rounding_records"] = {
            "selectors": args.record_rounding, "trainer": label,
            "linears": {r["layer"]: {"format": r["format"], "elements": r["elements"],
                                     "bits_per_element": r["bits_per_element"], "agreement_own": r["own"],
                                     "agreement_replay": r["replay"]} for r in rows}}
    if "mismatch" in summary or "rounding_records" in summary:
        with open(os.path.join(args.out, "rollout.json"), "w") as f:  # now with the trainer's comparisons
            json.dump(summary, f, indent=1)
    return summary


def main(argv: list[str] | None = None) -> int:
    from pretrain.runtime import filter_expected_warnings

    filter_expected_warnings()  # megatron-core's notes on TransformerEngine / Apex being absent
    args = build_parser().parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value < (0 if flag == "--max-new-tokens" else 1):
            return _fail(f"{flag} {value}: must be {'>= 0' if flag == '--max-new-tokens' else '>= 1'}")
    try:
        summary = run(args)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0])
    plan = summary["rollout_plan"]
    print(f"{summary['prompts']} prompts, {summary['generated_tokens']} tokens in {summary['seconds']:.2f}s "
          f"({summary['tokens_per_s'] or 0:.1f} tokens/s, {summary['device']}, emulated GEMMs); rollout "
          f"{plan['rollout_precision']}, KV {plan['kv_cache']} {summary['kv_bytes_per_token']:g} B/token, packed "
          f"linear weights {summary['weight_bytes']['packed_linears']} B -> {args.out}/samples.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())

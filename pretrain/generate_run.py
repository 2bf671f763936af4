"""``launch/generate.py``'s work: samples and log-probs from a checkpoint under a rollout precision
plan, written with what the trainer's re-scoring finds (the launcher's docstring describes the files).

Programmatic use: :func:`load_session` then :func:`generate_rollouts`, which returns the padded
rollout batch (prompt ids, response ids, rollout log-probs, masks) a trainer re-scores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from model.generate import Engine, Generation, SamplingParams
from model.moe_replay import moe_routers
from model.rollout import RolloutModel, packed_rollout
from pretrain.evaluate_run import load_with_tokenizer
from pretrain.evaluation.loading import LoadedModel
from pretrain.rl.alignment import engine_alignment
from pretrain.rl.report import write_generation_mismatch

# ================================================================================================
# Loading: model, tokenizer, rollout plan
# ================================================================================================


@dataclasses.dataclass
class Session:
    """What one generation run holds: the loaded model (trainer plan applied), its tokenizer (or
    None), the rollout and the engine."""

    loaded: LoadedModel
    tokenizer: object | None  # pretrain.data.Tokenizer or HFTokenizer
    rollout: RolloutModel
    engine: Engine
    device: str


def load_session(args) -> Session:
    """Load ``--load`` with the trainer plan, its tokenizer, and the rollout plan (weights packed)."""
    loaded, tokenizer, source, device = load_with_tokenizer(args)
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
    """The engine's sampling settings from the flags; stop at the tokenizer's end of document by default."""
    stop = args.stop_token if args.stop_token is not None else ([tokenizer.eod] if tokenizer is not None else [])
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, stop_tokens=tuple(stop), seed=args.seed)


def generate_rollouts(session: Session, prompt_ids: list[list[int]], params, batch_size: int):
    """Generate after every prompt, ``batch_size`` prompts per engine batch (batch ``k`` samples with
    seed ``params.seed + k``). Returns the ``model.generate.Generation`` of all prompts in order;
    ``.rollout_batch()`` gives the padded prompt ids, response ids, rollout log-probs and masks."""
    parts = []
    for k, start in enumerate(range(0, len(prompt_ids), batch_size)):
        batch_params = dataclasses.replace(params, seed=params.seed + k)
        parts.append(session.engine.generate(prompt_ids[start : start + batch_size], batch_params))
    fields = ("prompts", "tokens", "logprobs", "finish_reasons", "last_logits")
    gen = Generation(*([x for p in parts for x in getattr(p, f)] for f in fields))
    if session.engine.recorded:  # rounding records (--record-rounding), per prompt
        gen.records = [r for p in parts for r in p.records]
        gen.record_codes = [c for p in parts for c in p.record_codes]
    if session.engine.moe:  # each position's chosen experts per MoE layer, per prompt
        gen.routes = [r for p in parts for r in p.routes]
    return gen


def sample_experts(route, prompt_len: int) -> dict:
    """A MoE sample's chosen experts (``samples.jsonl``): per MoE layer, per token run, the router's top-k
    expert ids -- ``prompt_experts [layers][P][k]`` for the prompt's tokens and ``response_experts
    [layers][R - 1][k]`` for the response's tokens the engine fed back (all but the last: never run)."""
    experts = route.experts.tolist()
    return {"prompt_experts": [layer[:prompt_len] for layer in experts],
            "response_experts": [layer[prompt_len:] for layer in experts]}


def write_outputs(out_dir: str, session: Session, rows: list[dict], gen, params, seconds: float, args) -> dict:
    """``samples.jsonl`` and ``rollout.json``; returns the summary written to the latter."""
    os.makedirs(out_dir, exist_ok=True)
    tok = session.tokenizer
    with open(os.path.join(out_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
        for i, (row, ids, lps, reason) in enumerate(zip(rows, gen.tokens, gen.logprobs, gen.finish_reasons)):
            rec = {"index": i, "prompt": row["prompt"], "prompt_ids": row["prompt_ids"], "response_ids": ids,
                   "response": tok.detokenize(ids) if tok is not None else None, "logprobs": lps,
                   "finish_reason": reason}
            if gen.routes is not None:
                rec.update(sample_experts(gen.routes[i], len(row["prompt_ids"])))
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
    if gen.routes is not None:  # which MoE layer each samples.jsonl experts list is
        summary["moe_layers"] = [name for name, _ in moe_routers(session.loaded.model)]
    with open(os.path.join(out_dir, "rollout.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def run(args) -> dict:
    """``launch/generate.py``'s whole run on its parsed ``args``: generate, write ``samples.jsonl`` and
    ``rollout.json``, then the trainer's re-scoring (``mismatch.md``) and rounding agreement."""
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
        mm = write_generation_mismatch(
            args.out, session.loaded.model, batch, vocab_size=session.loaded.cfg.vocab_size,
            rollout=args.rollout_precision, rollout_rules=args.rollout_precision_rule, trainer_precision=None,
            trainer_label=label, temperature=args.temperature if args.temperature > 0 else 1.0,
            truncated=args.temperature > 0 and (args.top_k > 0 or args.top_p < 1.0), attribution=args.attribution,
            top_k=args.top_k if args.temperature > 0 else 0, top_p=args.top_p if args.temperature > 0 else 1.0)
        summary["mismatch"] = {k: mm["overall"][k] for k in ("rollout_corr/kl", "rollout_corr/k3_kl",
                                                              "rollout_corr/log_ppl_abs_diff")}
    if batch.response_mask.any() and session.engine.recorded:  # the trainer against the rollout's codes
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

"""Rollout benchmark: each rollout preset against BF16, in one run.

    python launch/bench_rollout.py --out bench/rollout                      # a random tiny model
    python launch/bench_rollout.py --load ckpt/run --batch-size 8 --prompt-length 128 \\
        --max-new-tokens 128 --memory-budget-gib 80 --out bench/rollout
    python launch/bench_rollout.py --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 \\
        --moe-shared-expert-intermediate-size 128 --presets nvfp4,mxfp4 --out bench/rollout_moe   # a MoE policy

For every preset (default ``bf16,fp8,mxfp4,nvfp4,mxfp4_w4a16``) it generates the same batch of
random prompts (greedy, no stop token: every row runs ``--max-new-tokens`` steps) on
``model.generate.Engine`` and reports

  - tokens/s: generated tokens over the wall time of ``generate`` (prefill included);
  - weight bytes: the packed linear weights (``model.rollout.PackedWeight``: codes + scales) and
    every other parameter (embeddings, norms, biases) at its own dtype;
  - KV bytes per token: every layer's keys and values in the plan's KV format, block scales included;
  - a mixture-of-experts policy (``--num-experts``, or a MoE checkpoint): the packed bytes of its routed
    and shared experts' linears and of its routers (FP32 unless a rule says otherwise), and the share
    of the generated tokens' expert choices (per MoE layer) that differ from BF16's at the same
    position (greedy: rows diverge after the first differing token, so only positions before a row's
    first differing token are compared);
  - the largest batch at the memory budget: ``floor((budget - weight bytes) / ((prompt length +
    max new tokens) x KV bytes per token))``, activations not counted;

and each against BF16. **What is measured**: the GEMMs are the emulated backend (quantize ->
dequantize -> FP32 GEMM; packed weights dequantized at every call), so on CPU -- and for FP8/FP4
on any device, since the rollout path has no hardware GEMM yet -- tokens/s measures the
*emulation*, not FP8/FP4 tensor cores; bytes and the largest batch are what the packed formats
store and hold for any device. The table says which device ran.

Writes ``OUT/bench_rollout.json`` and ``OUT/bench_rollout.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

_PROG = "bench_rollout.py"
PRESETS = "bf16,fp8,mxfp4,nvfp4,mxfp4_w4a16"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--out", required=True)
    add("--load", default=None, help="a checkpoint (as launch/generate.py); default: a random model of the sizes below")
    add("--presets", default=PRESETS, help=f"comma-separated rollout presets or specs (default {PRESETS}); bf16 is "
        "always measured as the reference")
    add("--num-layers", type=int, default=2)
    add("--hidden-size", type=int, default=128)
    add("--ffn-hidden-size", type=int, default=256)
    add("--num-attention-heads", type=int, default=4)
    add("--num-query-groups", type=int, default=2)
    add("--vocab-size", type=int, default=256)
    add("--num-experts", type=int, default=None, help="a mixture-of-experts policy with this many routed experts")
    add("--moe-router-topk", type=int, default=2)
    add("--moe-ffn-hidden-size", type=int, default=None, help="each expert's width (default --ffn-hidden-size)")
    add("--moe-shared-expert-intermediate-size", type=int, default=None, help="shared experts' width (default none)")
    add("--batch-size", type=int, default=4)
    add("--prompt-length", type=int, default=16)
    add("--max-new-tokens", type=int, default=16)
    add("--memory-budget-gib", type=float, default=0.01, help="memory for weights + KV-cache (default 0.01 GiB)")
    add("--repeats", type=int, default=1, help="timed generations per preset (the best is reported)")
    add("--seed", type=int, default=1234)
    add("--device", default="auto", help="cpu, cuda, or auto (default)")
    return p


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2


def _model(args, device: str):
    # torch and megatron-core (through model and pretrain): not loaded for --help
    import torch

    from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
    from precision import PrecisionPolicy
    from pretrain.evaluation.loading import init_single_process, load_for_eval

    init_single_process()
    if args.load:
        loaded = load_for_eval(args.load, device=device, seed=args.seed)
        return loaded.model, loaded.cfg
    seq = args.prompt_length + args.max_new_tokens
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                      num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                      seq_length=seq + 1, vocab_size=args.vocab_size, num_experts=args.num_experts,
                      moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                      moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size)
    torch.manual_seed(args.seed)
    model = build_gpt(cfg, seed=args.seed).to(device).eval()
    apply_precision_plan(model, PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), cfg.num_layers))
    return model, cfg


def bench(args) -> list[dict]:
    # torch and megatron-core (through model): not loaded for --help
    import torch

    from model.generate import Engine, SamplingParams
    from model.gpt import policy_linear_names
    from model.rollout import RolloutModel
    from model.rollout_plan import resolve_rollout_plan

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, cfg = _model(args, device)
    names = policy_linear_names(model)
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    presets = ["bf16"] + [p.strip() for p in args.presets.split(",") if p.strip() and p.strip() != "bf16"]
    plans = {p: resolve_rollout_plan(p, [], names, cfg.num_layers, head_dim) for p in presets}  # refuse early
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch_size, args.prompt_length), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    budget = args.memory_budget_gib * 2**30
    seq = args.prompt_length + args.max_new_tokens
    rows, ref_routes, ref_tokens = [], None, None
    for preset, plan in plans.items():
        rollout = RolloutModel(model, plan)
        rollout.update()
        engine = Engine(model, vocab_size=cfg.vocab_size, rollout=rollout)
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=1))  # warm-up (and KV calibration)
        best = math.inf
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        n_tokens = sum(len(t) for t in out.tokens)
        wb = rollout.weight_bytes()
        kv = engine.kv_bytes_per_token()
        weights = wb["packed_linears"] + wb["other"]
        rows.append({"preset": preset, "rollout_plan": str(plan.label), "kv_cache": plan.kv.fmt,
                     "tokens_per_s": n_tokens / best, "weight_bytes": weights,
                     "packed_linear_bytes": wb["packed_linears"], "other_param_bytes": wb["other"],
                     "kv_bytes_per_token": kv,
                     "max_batch_at_budget": max(0, int((budget - weights) // (seq * kv))),
                     "device": device, "gemms": "emulated"})
        if out.routes is not None:
            rows[-1].update(_moe_columns(rollout, out, ref_routes, ref_tokens))
            if ref_routes is None:
                ref_routes, ref_tokens = out.routes, out.tokens
    ref = rows[0]
    for r in rows:
        r["speedup_vs_bf16"] = r["tokens_per_s"] / ref["tokens_per_s"]
        r["weight_bytes_vs_bf16"] = r["weight_bytes"] / ref["weight_bytes"]
        r["kv_bytes_vs_bf16"] = r["kv_bytes_per_token"] / ref["kv_bytes_per_token"]
        r["max_batch_vs_bf16"] = (r["max_batch_at_budget"] / ref["max_batch_at_budget"]
                                  if ref["max_batch_at_budget"] else None)
    return rows


def _moe_columns(rollout, out, ref_routes, ref_tokens) -> dict:
    """Expert / router packed bytes and the expert-choice difference from BF16 (module docstring)."""
    expert = sum(p.nbytes for n, p in rollout.packed.items() if ".mlp.experts." in n or ".mlp.shared_experts." in n)
    router = sum(p.nbytes for n, p in rollout.packed.items() if n.endswith(".mlp.router"))
    differ = total = 0
    for i, r in enumerate(out.routes if ref_routes is not None else ()):
        same = next((j for j, (a, b) in enumerate(zip(out.tokens[i], ref_tokens[i])) if a != b), len(out.tokens[i]))
        n = min(r.tokens, r.tokens - len(out.tokens[i]) + 1 + same)  # the prompt + generated tokens before it
        a, b = r.experts[:, :n].long().sort(-1).values, ref_routes[i].experts[:, :n].long().sort(-1).values
        differ, total = differ + int((a != b).any(-1).sum()), total + a.shape[0] * n
    return {"expert_linear_bytes": expert, "router_bytes": router,
            "expert_choice_differs_from_bf16": differ / total if total else 0.0}


def table(rows: list[dict], args) -> str:
    device = rows[0]["device"]
    title = (f"# Rollout presets vs BF16 (GEMMs emulated on {device.upper()}: tokens/s measures the emulation, "
             "not FP8/FP4 hardware)")
    setup = (f"batch {args.batch_size}, prompt {args.prompt_length} + {args.max_new_tokens} new tokens, memory "
             f"budget {args.memory_budget_gib:g} GiB (weights + KV-cache)")
    header = ("| preset | KV | tokens/s (emulated) | x BF16 | weight bytes | x BF16 | KV bytes/token | x BF16 "
              "| max batch at budget | x BF16 |")
    lines = [title, "", setup, "", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = f"{r['max_batch_vs_bf16']:.2f}" if r["max_batch_vs_bf16"] is not None else "-"
        lines.append(f"| {r['preset']} | {r['kv_cache']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_bf16']:.2f} "
                     f"| {r['weight_bytes']} | {r['weight_bytes_vs_bf16']:.3f} | {r['kv_bytes_per_token']:g} "
                     f"| {r['kv_bytes_vs_bf16']:.3f} | {r['max_batch_at_budget']} | {mb} |")
    if "expert_linear_bytes" in rows[0]:
        lines += ["", ("Mixture of experts: packed expert linears (routed + shared), routers, and the expert choices "
                       "(positions x MoE layers) that differ from BF16's before a row's first differing token:"), "",
                  "| preset | expert linear bytes | x BF16 | router bytes | expert choices differing from BF16 |",
                  "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['preset']} | {r['expert_linear_bytes']} | "
                         f"{r['expert_linear_bytes'] / rows[0]['expert_linear_bytes']:.3f} | {r['router_bytes']} | "
                         f"{r['expert_choice_differs_from_bf16']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("batch_size", "prompt_length", "max_new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            return _fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    try:
        rows = bench(args)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_rollout.json"), "w") as f:
        json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
    md = table(rows, args)
    with open(os.path.join(args.out, "bench_rollout.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
of each response token under the distribution it was sampled from, finish reason; for a
mixture-of-experts policy also the experts the rollout chose: ``prompt_experts`` and
``response_experts``, per MoE layer a list of each token's top-k expert ids -- the prompt's tokens,
then the response's but the last, which is never run through the model) and
``OUT/rollout.json`` (plan, weight bytes, KV bytes per token, sampling, tokens/s; ``moe_layers``:
the routers those lists follow, in order), and
``OUT/mismatch.md`` + plots: the trainer (``--precision``) re-scores the sampled tokens and the
mismatch is reported under verl's names, by response position, and with ``--attribution`` split
into weights / activations / KV-cache (``pretrain.rl.report``). ``--record-rounding SELECTOR``
(``--precision-rule`` selectors, repeatable) records the chosen linears' activation rounding while
the engine generates (``model.rollout_records``: block scales + one direction bit per element) and
writes to ``rollout.json`` each linear's record size in bits per element and the fraction of the
rollout's codes the trainer (``--precision``) reproduces, own rounding and replaying the records
(``pretrain.rl.alignment.engine_alignment``). Programmatic
use: ``pretrain.generate_run``'s :func:`load_session` then :func:`generate_rollouts`, which returns the
padded rollout batch (prompt ids, response ids, rollout log-probs, masks) a trainer re-scores.
"""

from __future__ import annotations

import argparse
import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain.runtime import filter_expected_warnings

_PROG = "generate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--load", required=True, help="training checkpoint dir (any TP size), converted HF dir/file, or plain file")
    add("--prompts", required=True, metavar="FILE", help=".jsonl of {prompt: TEXT} / {prompt_ids: [...]}, or text lines")
    add("--out", required=True, help="output directory (samples.jsonl, rollout.json); a MoE policy's samples "
        "also list each token's top-k experts per MoE layer (prompt_experts, response_experts)")
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


def main(argv: list[str] | None = None) -> int:
    filter_expected_warnings()  # megatron-core's notes on TransformerEngine / Apex being absent
    args = build_parser().parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value < (0 if flag == "--max-new-tokens" else 1):
            return _fail(f"{flag} {value}: must be {'>= 0' if flag == '--max-new-tokens' else '>= 1'}")
    from pretrain.generate_run import run  # torch and megatron-core: not loaded for --help

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

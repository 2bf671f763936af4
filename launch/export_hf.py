"""Export our model as a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral checkpoint: BF16, or FP4-packed for vLLM / SGLang.

    python launch/export_hf.py --load ckpt/ --out hf_out/                              # BF16
    python launch/export_hf.py --load ckpt/ --out hf_nvfp4/ --rollout-precision nvfp4  # nvfp4-pack-quantized
    python launch/export_hf.py --load ckpt/ --out hf_mxfp4/ --rollout-precision mxfp4  # mxfp4-pack-quantized

``--load``: a training checkpoint directory saved at any tensor-parallel size (shards are merged),
a ``launch/convert_hf.py`` output, or a plain ``{"model", "model_config"}`` file. The reverse of
``launch/convert_hf.py``; the architecture follows the model (``pretrain/hf_export.py``: MoE models
export as Qwen3-MoE with ``--qk-layernorm``, as Mixtral without). With ``--rollout-precision`` (and ``--rollout-precision-rule``, the
generation engine's syntax: ``model/rollout_plan.py``) the decoder linears' weights are quantized by
our quantizer exactly as the rollout engine's Fprop weights are (codes and scales bit for bit) and
packed by compressed-tensors into its format (every expert's fc1 / fc2 too; routers stay BF16); linears the plan keeps in BF16 go to the scheme's
``ignore`` list; ``mxfp4`` also declares dynamic MXFP4 activations, ``mxfp4_w4a16`` and ``nvfp4``
are weight-only (why: ``pretrain/hf_export.py``). The KV-cache format is not part of the export. Load the output with
``transformers`` (+ ``compressed-tensors``) or serve it with vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain.runtime import filter_expected_warnings

_PROG = "export_hf.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="training checkpoint dir (any TP), hf_converted.pt or plain file")
    p.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, tokenizer)")
    p.add_argument("--rollout-precision", default="bf16",
                   help="a rollout preset or spec (model/rollout_plan.py): bf16 (default); nvfp4, mxfp4, mxfp4_w4a16 "
                        "pack the FP4 weights in compressed-tensors' format")
    p.add_argument("--rollout-precision-rule", action="append", default=[], metavar="SELECTOR=VALUE",
                   help="per-layer rollout rule, e.g. first:1=bf16 (those layers stay BF16: the scheme's ignore list)")
    return p


def main(argv: list[str] | None = None) -> int:
    filter_expected_warnings()  # megatron-core's notes on TransformerEngine / Apex being absent
    args = build_parser().parse_args(argv)

    # torch and megatron-core: not loaded for --help
    from pretrain.evaluation.loading import init_single_process
    from pretrain.hf_export import HFExportError, export_hf, load_tp1_weights, weight_formats_from_rollout

    t0 = time.perf_counter()
    try:
        init_single_process()  # training checkpoints are read through megatron's parallel state
        state, cfg, tok = load_tp1_weights(args.load)
        formats, acts, note = weight_formats_from_rollout(args.rollout_precision, args.rollout_precision_rule, cfg)
        files = export_hf(state, cfg, args.out, weight_format=formats, activations=acts, tokenizer=tok,
                          info={"source": os.path.abspath(args.load), "rollout_precision": args.rollout_precision,
                                "rollout_precision_rules": args.rollout_precision_rule, "note": note})
    except (HFExportError, ValueError, FileNotFoundError) as e:  # SpecError is a ValueError
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    packed = [f.fmt for f in formats.values() if f is not None]
    weights = f"{packed[0]} weights ({len(packed)} linears packed, {len(formats) - len(packed)} BF16)" if packed else (
        "bf16 weights")
    print(f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, --rollout-precision "
          f"{args.rollout_precision}: {weights}, {size / 2**20:.2f} MiB; wrote {len(files)} files to {args.out} "
          f"({time.perf_counter() - t0:.1f}s)"
          + ("" if tok else "; no tokenizer came with --load"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

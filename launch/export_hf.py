"""Export our model as a Hugging Face Llama / Qwen2 checkpoint: BF16, or FP4-packed for vLLM / SGLang.

    python launch/export_hf.py --load ckpt/ --out hf_out/                              # BF16
    python launch/export_hf.py --load ckpt/ --out hf_nvfp4/ --rollout-precision nvfp4  # nvfp4-pack-quantized
    python launch/export_hf.py --load ckpt/ --out hf_mxfp4/ --rollout-precision mxfp4  # mxfp4-pack-quantized

``--load``: a training checkpoint directory saved at any tensor-parallel size (shards are merged),
a ``launch/convert_hf.py`` output, or a plain ``{"model", "model_config"}`` file. The reverse of
``launch/convert_hf.py``. With ``--rollout-precision`` the decoder linears' weights are quantized by
our quantizer exactly as the rollout engine's Fprop weights are (codes and scales bit for bit) and
stored in compressed-tensors' packed format; ``mxfp4`` also declares dynamic MXFP4 activations,
``mxfp4_w4a16`` and ``nvfp4`` are weight-only (why: ``pretrain/hf_export.py``). Load the output with
``transformers`` (+ ``compressed-tensors``) or serve it with vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROG = "export_hf.py"
# --rollout-precision -> (weight format, MXFP4 activations declared)
ROLLOUT_EXPORTS = {"bf16": (None, False), "nvfp4": ("nvfp4", False), "mxfp4": ("mxfp4", True),
                   "mxfp4_w4a16": ("mxfp4", False)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="training checkpoint dir (any TP), hf_converted.pt or plain file")
    p.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, tokenizer)")
    p.add_argument("--rollout-precision", default="bf16", choices=list(ROLLOUT_EXPORTS),
                   help="bf16 (default), or FP4 weights packed in compressed-tensors' format")
    args = p.parse_args(argv)

    from pretrain.evaluation.loading import init_single_process
    from pretrain.hf_export import HFExportError, export_hf, load_tp1_weights

    t0 = time.perf_counter()
    fmt, acts = ROLLOUT_EXPORTS[args.rollout_precision]
    try:
        init_single_process()  # training checkpoints are read through megatron's parallel state
        state, cfg, tok_dir = load_tp1_weights(args.load)
        files = export_hf(state, cfg, args.out, weight_format=fmt, activations=acts, tokenizer_dir=tok_dir,
                          info={"source": os.path.abspath(args.load), "rollout_precision": args.rollout_precision})
    except (HFExportError, ValueError, FileNotFoundError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    print(f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}: {args.rollout_precision} "
          f"weights, {size / 2**20:.2f} MiB; wrote {len(files)} files to {args.out} ({time.perf_counter() - t0:.1f}s)"
          + ("" if tok_dir else "; no tokenizer files came with --load"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

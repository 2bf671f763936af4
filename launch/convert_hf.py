"""Convert a Hugging Face Llama / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE checkpoint into our model's weights.

    python launch/convert_hf.py --hf-dir Llama-3.2-1B/ --save ckpt/llama1b
    # -> ckpt/llama1b/hf_converted.pt (+ ckpt/llama1b/hf_tokenizer/ when the HF dir has tokenizer files)

The directory needs ``config.json`` and ``*.safetensors``. The output holds the TP=1 weights under
our module names plus the ``ModelConfig`` (mixture-of-experts ones with their experts, router and
routing settings); any tensor-parallel size loads it
(``pretrain.hf_convert.load_converted_state_dict``). Train from it with
``launch/pretrain.py --pretrained-checkpoint ckpt/llama1b``; evaluate with
``launch/evaluate.py --load ckpt/llama1b``. File format: ``pretrain/hf_convert.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

_PROG = "convert_hf.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--save", required=True, help="output directory; writes SAVE/hf_converted.pt")
    p.add_argument("--seq-length", type=int, default=None,
                   help="model_config seq_length (default: max_position_embeddings)")
    args = p.parse_args(argv)

    # torch and megatron-core: not loaded for --help
    from pretrain.hf_convert import HFConvertError, convert_hf_checkpoint, save_converted

    t0 = time.perf_counter()
    try:
        payload = convert_hf_checkpoint(args.hf_dir, seq_length=args.seq_length)
    except HFConvertError as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    path = save_converted(payload, args.save)
    cfg, src = payload["model_config"], payload["source"]
    n_params = sum(t.numel() for t in payload["model"].values())
    print(f"{src['architecture']} ({src['dtype']}, {n_params / 1e6:.1f}M parameters): {cfg['num_layers']} layers, "
          f"hidden {cfg['hidden_size']}, ffn {cfg['ffn_hidden_size']}, heads {cfg['num_attention_heads']}/"
          f"{cfg['num_query_groups']}, vocab {cfg['vocab_size']}" + ("; q/k norms" if cfg["qk_layernorm"] else ""))
    if cfg["num_experts"]:
        routing = "softmax over all, top-k kept" if cfg["moe_router_pre_softmax"] else "top-k renormalized"
        freq = cfg["moe_layer_freq"]
        layers = "every layer" if freq == 1 else f"layers {[i for i, m in enumerate(freq) if m]}"
        print(f"mixture of experts ({layers}): {cfg['num_experts']} experts of width {cfg['moe_ffn_hidden_size']}, "
              f"top-{cfg['moe_router_topk']} ({routing}): --num-experts {cfg['num_experts']} --moe-router-topk "
              f"{cfg['moe_router_topk']}" + (" --moe-router-pre-softmax" if cfg["moe_router_pre_softmax"] else ""))
    tok_dir = os.path.join(args.save, "hf_tokenizer")
    tok = f"; tokenizer files in {tok_dir}" if os.path.isdir(tok_dir) else "; no tokenizer files in --hf-dir"
    print(f"wrote {path} ({time.perf_counter() - t0:.1f}s){tok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TP=2 vs TP=1 generation worker, run by test_generate_tp.py under ``torchrun --nproc-per-node 2`` (gloo).

Each rank generates at TP=1 (both ranks identically), then rebuilds the model at TP=2 from the same
seed (identical weights: ``use_cpu_initialization`` and a vocabulary padded alike for both sizes)
and generates again: greedy under the model's FP32 plan, greedy under the ``mxfp4`` and ``fp8``
rollout presets (packed weights, TP-reduced per-tensor amaxes, per-head KV scales of this rank's
heads), and sampled (temperature, top-k, top-p) under ``nvfp4``. Every rank writes its tokens and
log-probs to ``--out``/rank<r>.json.
"""

import argparse
import json
import os

import torch
from megatron.core import parallel_state

from model.generate import Engine, SamplingParams
from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from model.rollout import RolloutModel
from model.rollout_plan import resolve_rollout_plan
from precision import PrecisionPolicy

BASE = {"num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "num_query_groups": 2, "seq_length": 32, "vocab_size": 100, "init_method_std": 0.3,
        "make_vocab_size_divisible_by": 64}
STYLES = {"llama": {}, "gpt2": {"normalization": "LayerNorm", "activation": "gelu",
                                "position_embedding": "learned_absolute", "untie_embeddings": False,
                                "add_bias_linear": True},
          "moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64,
                  "moe_shared_expert_intermediate_size": 64}}
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [11, 12, 13]]
RUNS = {"model": (None, SamplingParams(max_new_tokens=5)),
        "mxfp4": ("mxfp4", SamplingParams(max_new_tokens=5)),
        "fp8": ("fp8", SamplingParams(max_new_tokens=5)),
        "nvfp4_sampled": ("nvfp4", SamplingParams(temperature=0.9, top_k=30, top_p=0.9, max_new_tokens=5, seed=3))}


def run(cfg, tp_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    torch.manual_seed(1234)
    model = build_gpt(cfg).eval()
    names = policy_linear_names(model)
    apply_precision_plan(model, PrecisionPolicy.from_args("fp32").resolve(names, cfg.num_layers))
    out = {}
    for key, (preset, params) in RUNS.items():
        rollout = None
        if preset is not None:
            rollout = RolloutModel(model, resolve_rollout_plan(preset, [], names, cfg.num_layers, 32))
        g = Engine(model, vocab_size=cfg.vocab_size, rollout=rollout).generate(PROMPTS, params)
        out[key] = {"tokens": g.tokens, "logprobs": g.logprobs}
        if g.routes is not None:  # a MoE policy: every position's experts per layer
            out[key]["experts"] = [r.experts.sort(-1).values.tolist() for r in g.routes]
    parallel_state.destroy_model_parallel()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    report = {style: {"tp1": run(ModelConfig(**{**BASE, **o}), 1), "tp2": run(ModelConfig(**{**BASE, **o}), 2)}
              for style, o in STYLES.items()}
    with open(os.path.join(args.out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

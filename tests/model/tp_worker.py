"""TP=2 vs TP=1 worker, run by test_tp_equality.py under ``torchrun --nproc-per-node 2`` (gloo).

Each rank first trains the model at TP=1 (both ranks identically, no data-parallel sync), then
rebuilds it at TP=2 from the same seed and trains it on the same batch. After the first backward
it reassembles every TP-sharded gradient from the two ranks (using megatron's ``partition_dim`` /
``partition_stride`` attributes) and compares it with the TP=1 gradient; replicated parameters
must hold identical gradients on both ranks. Rank 0 writes a JSON report to ``--out``: one entry
per ``--case PRESET:STEPS`` (``stand-in`` is the ``F.linear`` stand-in), all cases in one process
group, so the suite starts torchrun once instead of once per preset.
"""

import argparse
import json

import torch
from megatron.core import parallel_state

import model.layers
from model.gpt import (
    ModelConfig,
    allreduce_tp_partial_grads,
    apply_precision_plan,
    build_gpt,
    policy_linear_names,
)
from precision import presets
from tests.model._fakes import ReferenceLinear, plan_for

STYLES = {
    "llama": {},
    "gpt2": {
        "normalization": "LayerNorm",
        "activation": "gelu",
        "position_embedding": "learned_absolute",
        "untie_embeddings": False,
        "add_bias_linear": True,
        "num_query_groups": 4,
    },
}
BASE = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "seq_length": 32,
    "vocab_size": 256,
}


def full_tensor(param, t, group):
    """The TP=1 view of ``t`` (param's tensor or grad): all-gather shards and undo the strided split."""
    tp = group.size()
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(shards, t.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    chunks = [s.chunk(stride, dim=dim) for s in shards]  # rank r holds master chunks r, r+tp, ...
    return torch.cat([chunks[k % tp][k // tp] for k in range(tp * stride)], dim=dim)


def run(cfg, tp_size, steps, tokens, labels, preset):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(1234)
    model = build_gpt(cfg)
    if preset is None:
        apply_precision_plan(model, plan_for(model))
    else:
        recipe = presets.get(preset)
        apply_precision_plan(model, dict.fromkeys(policy_linear_names(model), recipe))
    # SGD, not AdamW: Adam would turn rounding noise in analytically-zero gradients (the key bias:
    # softmax ignores it) into full-size updates and make parameters incomparable.
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    position_ids = torch.arange(cfg.seq_length).expand_as(tokens)
    losses, grads, replica_diff = [], {}, 0.0
    for step in range(steps):
        opt.zero_grad()
        loss = model(tokens, position_ids, None, labels=labels).mean()
        loss.backward()
        allreduce_tp_partial_grads(model)  # a no-op without sequence parallelism / q-k norms
        losses.append(loss.item())
        if step == 0:
            for name, p in model.named_parameters():
                grads[name] = full_tensor(p, p.grad, group)
                if not getattr(p, "tensor_model_parallel", False) and tp_size > 1:
                    other = [torch.empty_like(p.grad) for _ in range(tp_size)]
                    torch.distributed.all_gather(other, p.grad, group=group)
                    replica_diff = max(replica_diff, max((o - p.grad).abs().max().item() for o in other))
        opt.step()
    params = {name: full_tensor(p, p.detach(), group) for name, p in model.named_parameters()}
    parallel_state.destroy_model_parallel()
    return losses, grads, params, replica_diff


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(preset, steps):
    """TP=1 vs TP=2 for both model styles under ``preset`` (``None``: the ``F.linear`` stand-in)."""
    real_linear = model.layers.policy_linear
    if preset is None:
        model.layers.policy_linear = ReferenceLinear()
    try:
        report = {}
        for style, overrides in STYLES.items():
            cfg = ModelConfig(**{**BASE, **overrides})
            gen = torch.Generator().manual_seed(7)
            tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
            labels = torch.roll(tokens, -1, dims=1)
            loss1, grads1, params1, _ = run(cfg, 1, steps, tokens, labels, preset)
            loss2, grads2, params2, replica_diff = run(cfg, 2, steps, tokens, labels, preset)
            assert grads1.keys() == grads2.keys(), grads1.keys() ^ grads2.keys()
            report[style] = {
                "loss_tp1": loss1,
                "loss_tp2": loss2,
                "grad_max_rel": {n: max_rel(grads2[n], grads1[n]) for n in grads1},
                "param_max_rel": {n: max_rel(params2[n], params1[n]) for n in params1},
                "replicated_grad_max_abs_diff_across_ranks": replica_diff,
            }
        return report
    finally:
        model.layers.policy_linear = real_linear


def parse_case(text):
    """``PRESET:STEPS`` -> (preset or None for ``stand-in``, steps)."""
    preset, _, steps = text.rpartition(":")
    if not preset or not steps.isdigit():
        raise argparse.ArgumentTypeError(f"--case {text!r}: expected PRESET:STEPS, e.g. mxfp4:5 or stand-in:5")
    return (None if preset == "stand-in" else preset), int(steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", type=parse_case, action="append", required=True,
                    help="PRESET:STEPS, repeatable; 'stand-in' is the F.linear stand-in for policy_linear")
    args = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    report = {"stand-in" if preset is None else preset: compare(preset, steps) for preset, steps in args.case}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Mixture of experts in parallel on CPU (gloo, the all-gather dispatcher): TP=2 equals TP=1 and EP=2
equals EP=1 -- losses, every linear's weight gradient (by its global plan name) and the weights after
three SGD steps.

This file is also the worker: ``torchrun --nproc-per-node 2 -m tests.model.test_moe_parallel --out F``.

TP=2 vs TP=1 (both ranks train the same batch): the dispatcher gives each TP rank half of the tokens,
the all-gather puts them back in TP=1's order, so every expert sees TP=1's rows; its fc1 / fc2 are split
over TP like a dense MLP's. Under MXFP4 every quantized operand equals TP=1's (shard widths are whole
32-blocks); only the row-parallel partial sums add in another order: agreement to 1e-5 relative, as
the dense TP test.

EP=2 vs EP=1 (world 2, data-parallel 2 in both, each rank its own batch): with EP=2 each rank holds two
of the four experts and runs them on both ranks' tokens at once, with EP=1 each rank runs all four on
its own tokens and the expert gradients are averaged over the two ranks. Fprop and Dgrad are row-wise,
so under MXFP4 they see the same operands; Wgrad contracts over tokens, and one GEMM over both ranks'
tokens is not two GEMMs summed -- an MX block along tokens would straddle the two ranks' rows. The EP
plan therefore keeps Wgrad in BF16 (elementwise rounding; only the FP32 summation order differs):
losses agree bit for bit, gradients and weights to 1e-5 relative.

Measured (2-core CPU, gloo): TP -- every weight gradient and weight bit-identical, losses equal but for
the last step's (1e-7 relative: the loss's own reductions); EP -- losses bit-identical, gradients
<= 2.6e-7 and weights <= 5.8e-8 relative (16 of 27 gradients differ in low bits: expert Wgrad and what
flows from it). Both need EP-independent initial weights (``model.moe.PaddedSequentialMLP``).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5
STEPS = 3


# ============================================================================================
# Worker (under torchrun)
# ============================================================================================


def _config():
    import dataclasses

    from tests.model._fakes import TINY_LLAMA

    return dataclasses.replace(TINY_LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                               moe_shared_expert_intermediate_size=64, moe_aux_loss_coeff=1e-2,
                               moe_z_loss_coeff=1e-3)


def _run(tp, ep, spec, tokens, labels):
    """Train STEPS SGD steps; returns (losses, {plan name: full weight grad at step 0}, {plan name: weight})."""
    import dataclasses

    from megatron.core import parallel_state

    from model.gpt import apply_precision_plan, build_gpt, policy_linears
    from precision.policy import parse_precision
    from tests.model.tp_worker import full_tensor

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    torch.manual_seed(1234)
    model = build_gpt(dataclasses.replace(_config(), expert_model_parallel_size=ep))
    linears = policy_linears(model)
    apply_precision_plan(model, {name: parse_precision(spec) for name, _ in linears})
    experts = {id(m.weight) for name, m in linears if ".experts." in name}
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(tokens, position_ids, None, labels=labels).mean()
        loss.backward()
        dp = dp_group.size()
        for p in model.parameters():  # data-parallel mean; an EP expert saw every rank's tokens already
            if id(p) in experts and ep > 1:
                p.grad /= dp
            elif dp > 1:
                torch.distributed.all_reduce(p.grad, group=dp_group)
                p.grad /= dp
        losses.append(loss.item())
        if step == 0:
            grads = {name: full_tensor(m.weight, m.weight.grad, tp_group) for name, m in linears}
        opt.step()
    weights = {name: full_tensor(m.weight, m.weight.detach(), tp_group) for name, m in linears}
    parallel_state.destroy_model_parallel()
    every = [None] * torch.distributed.get_world_size()  # EP: each rank has its own experts' names
    torch.distributed.all_gather_object(every, (grads, weights))
    merged_grads = {k: v for g, _ in every for k, v in g.items()}
    merged_weights = {k: v for _, w in every for k, v in w.items()}
    return losses, merged_grads, merged_weights


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _compare(one, two):
    (l1, g1, w1), (l2, g2, w2) = one, two
    assert g1.keys() == g2.keys(), g1.keys() ^ g2.keys()
    return {"loss_1": l1, "loss_2": l2, "grad_max_rel": {n: _max_rel(g2[n], g1[n]) for n in g1},
            "weight_max_rel": {n: _max_rel(w2[n], w1[n]) for n in w1}}


def worker_main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    cfg = _config()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_length), generator=gen)
    labels = torch.roll(tokens, -1, dims=2)
    report = {}
    tp_spec = "wgrad_hadamard"
    report["tp"] = _compare(_run(1, 1, tp_spec, tokens[0], labels[0]), _run(2, 1, tp_spec, tokens[0], labels[0]))
    ep_spec = "fprop=mxfp4,dgrad=mxfp4"  # Wgrad BF16: see the module docstring
    report["ep"] = _compare(_run(1, 1, ep_spec, tokens[rank], labels[rank]),
                            _run(1, 2, ep_spec, tokens[rank], labels[rank]))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    torch.distributed.destroy_process_group()


# ============================================================================================
# Test
# ============================================================================================


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests._dist import free_port, run_scaled

    out = tmp_path_factory.mktemp("moe_parallel") / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "tests.model.test_moe_parallel", "--out", str(out)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = run_scaled(cmd, 240, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_moe_parallel_matches_one_rank(report, layout):
    r = report[layout]
    if layout == "ep":
        assert r["loss_2"][0] == r["loss_1"][0]  # same operands in every Fprop
    assert r["loss_2"] == pytest.approx(r["loss_1"], rel=RTOL)
    assert r["loss_1"][-1] < r["loss_1"][0]  # it trains
    assert any(".experts.local_experts.3." in n for n in r["grad_max_rel"])  # every expert compared
    bad = {n: e for n, e in {**r["grad_max_rel"], **r["weight_max_rel"]}.items() if not e <= RTOL}
    assert not bad, bad


if __name__ == "__main__":
    worker_main(sys.argv[1:])

"""The training loop: schedule and optimizer pieces, the plan on the built model, a TP=2 run end to
end (progress lines, TensorBoard events, checkpoints) and TP=2 == TP=1 on the same global batch."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch

from pretrain.arguments import parse_run_config
from pretrain.optim import LRSchedule, build_optimizer, clip_grad_norm

from ._launch import TINY, load_rank_checkpoint, run_pretrain, scalars

# === schedule and optimizer ===


def test_lr_schedule_warmup_cosine_min():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    s = LRSchedule(opt, max_lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=14, decay_style="cosine")
    assert [s.lr_at(i) for i in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert s.lr_at(14) == s.lr_at(100) == 0.1
    lrs = [s.lr_at(i) for i in range(4, 15)]
    assert all(a > b for a, b in itertools.pairwise(lrs))
    linear = LRSchedule(opt, max_lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=10, decay_style="linear")
    assert linear.lr_at(5) == pytest.approx(0.5)
    assert s.step() == 0.25 and opt.param_groups[0]["lr"] == 0.25 and s.state_dict()["num_steps"] == 1


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    run = parse_run_config(["--train-iters", "4", *TINY, "--weight-decay", "0.05"], 1, False)
    decay, no_decay = build_optimizer(model, run.training).param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3  # linear bias, norm weight and bias


def test_clip_grad_norm(world_of_one):
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm([p], max_norm=1.0) == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.tensor([0.3, 0.4, 0.0, 0.0])
    assert clip_grad_norm([p], max_norm=1.0) == pytest.approx(0.5) and p.grad[0].item() == pytest.approx(0.3)


# === the precision plan on the built model ===


def test_plan_on_the_built_model(world_of_one):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from model.layers import PolicyColumnParallelLinear, PolicyRowParallelLinear
    from precision import presets
    from pretrain.train import build_model

    argv = ["--train-iters", "10", *TINY, "--precision", "mxfp4", "--gemm-backend", "reference"]
    run = parse_run_config([*argv, "--precision-rule", "first:1=bf16"], world_size=1, cuda=False)
    model, plan, whole = build_model(run, vocab_size=512, device=torch.device("cpu"))
    assert whole == plan  # one pipeline stage: the whole model
    linears = {
        n: m for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    }
    assert all(isinstance(m, (PolicyColumnParallelLinear, PolicyRowParallelLinear)) for m in linears.values())
    assert set(linears) == set(plan) and len(plan) == 2 * 4 + 1
    bf16, mxfp4 = presets.get("bf16"), presets.get("mxfp4")
    for name, m in linears.items():
        want = bf16 if name.startswith("decoder.layers.0.") or name == "output_layer" else mxfp4
        assert m.precision == plan[name] == want, name
        assert m.gemm_backend == "reference" and m.layer_name == name
    assert plan.rule_for("decoder.layers.0.mlp.linear_fc1") == "--precision-rule first:1=bf16"
    assert plan.rule_for("output_layer") == "preset mxfp4: kind:output=bf16"  # the preset's own rule
    assert plan.rule_for("decoder.layers.1.mlp.linear_fc2") == "--precision mxfp4"
    # a user rule comes before the preset's: the output layer can be lowered too
    run = parse_run_config([*argv, "--precision-rule", "kind:output=mxfp4"], world_size=1, cuda=False)
    model, plan, whole = build_model(run, vocab_size=512, device=torch.device("cpu"))
    assert whole == plan  # one pipeline stage: the whole model
    assert model.output_layer.precision == mxfp4


# === a TP=2 run end to end (default, compiled backend) ===

PROGRESS = re.compile(
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/6 \| loss (\d+\.\d{4}) \| lr (\S+) \| grad norm (\S+) \| "
    r"([\d,]+) tokens/s \| \S+ TFLOP/s/device \| [\d.]+ ms/iteration \| peak mem [\d.]+ GiB \(host RSS\) \| "
    r"elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$"
)


@pytest.mark.slow
def test_tp2_run_logs_tensorboard_and_checkpoints(tmp_path, data_cache):
    tb, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    proc = run_pretrain(
        [
            "--train-iters",
            "6",
            *TINY,
            "--precision",
            "wgrad_hadamard",
            "--tensor-model-parallel-size",
            "2",
            "--eval-interval",
            "3",
            "--save",
            str(ckpt),
            "--save-interval",
            "3",
            "--tensorboard-dir",
            str(tb),
            "--log-throughput",
            "--data-cache-dir",
            str(data_cache),
        ]
    )
    out = proc.stdout.splitlines()
    progress = [m for m in map(PROGRESS.match, out) if m]
    assert [int(m.group(1)) for m in progress] == [1, 2, 3, 4, 5, 6]  # once each: only rank 0 prints
    assert (
        sum(line.startswith("layer ") and line.rstrip().endswith("rule") for line in out) == 1
    )  # the plan table
    assert sum(line.startswith("parameters: ") for line in out) == 1
    assert "world size 2 = TP 2 x PP 1 x DP 1 | device cpu (gloo) | gemm backend auto" in proc.stdout
    # the start-up report says which GEMM of which layer runs on what (no hardware GEMMs on a CPU)
    assert "GEMM backends on cpu (hardware GEMMs here: none; requested: auto)" in proc.stdout
    assert "mxfp4+had16 -> emulated" in proc.stdout
    assert [line.split(" | ")[0].split("] ")[1] for line in out if " validation at " in line] == [
        "validation at iteration 3",
        "validation at iteration 6",
    ]
    assert f"tensorboard --logdir {tb}" in proc.stdout

    loss = scalars(tb, "lm loss")
    assert sorted(loss) == [1, 2, 3, 4, 5, 6] and loss[6] < loss[1] - 0.3
    assert scalars(tb, "learning-rate")[1] == pytest.approx(1.5e-3) and scalars(tb, "learning-rate")[
        2
    ] == pytest.approx(3e-3)
    assert all(v > 0 and math.isfinite(v) for v in scalars(tb, "grad-norm").values())
    assert all(v > 0 for v in scalars(tb, "tokens-per-sec").values())
    assert sorted(scalars(tb, "lm loss validation")) == [3, 6]
    for m in progress:  # the progress line shows what TensorBoard got
        assert float(m.group(2)) == pytest.approx(loss[int(m.group(1))], abs=6e-5)

    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000003",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
        "run_status.json",  # pretrain.status: every ending is recorded
    ]
    assert json.loads((ckpt / "run_status.json").read_text())["state"] == "done"
    shards = [load_rank_checkpoint(ckpt / "iter_0000006", r) for r in (0, 1)]
    for r, c in enumerate(shards):
        assert {
            "model",
            "optimizer",
            "opt_param_scheduler",
            "rng_state",
            "precision_plan",
            "args",
            "model_config",
            "tokenizer_model",
            "consumed_train_samples",
            "iteration",
        } <= set(c)
        assert c["model_config"]["hidden_size"] == 128 and c["model_config"]["vocab_size"] == 4096
        assert c["tokenizer_model"] == str(data_cache / "tokenizer.model")
        assert (
            c["iteration"] == 6
            and c["consumed_train_samples"] == 24
            and c["args"]["tensor_model_parallel_size"] == 2
        )
        assert c["precision_plan"]["decoder.layers.1.mlp.linear_fc2"]["rule"] == "--precision wgrad_hadamard"
        quant = c["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"]
        assert quant["name"] == "decoder.layers.0.mlp.linear_fc1" and quant["calls"]["wgrad"] == 6 * 2
    # TP shards differ, replicated parameters do not
    assert shards[0]["model"]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 128)
    assert not torch.equal(
        shards[0]["model"]["output_layer.weight"], shards[1]["model"]["output_layer.weight"]
    )
    assert torch.equal(
        shards[0]["model"]["decoder.final_layernorm.weight"],
        shards[1]["model"]["decoder.final_layernorm.weight"],
    )


# === TP=2 equals TP=1 on the same global batch ===
#
# Same seed, same data, DP=1 in both (so the same micro-batches and accumulation order); they differ
# only in TP's partial sums (row-parallel all-reduce, the vocab-parallel loss, the norm's shard sums).
# Measured over 6 AdamW iterations (reference backend, one thread per process):
#   bf16            loss <= 1.3e-5, val loss <= 1.4e-5, grad norm 4e-6 at iteration 1, <= 1.2e-3 later
#                   (fp32 sums differ in the last bits and flip bf16 roundings of the next GEMM's operands)
#   wgrad_hadamard  iterations 1-4 bit-identical (MXFP4 blocks lie along each GEMM's contraction axis
#                   and TP shards hold whole blocks, so each rank quantizes exactly what TP=1 does);
#                   then a 1-ulp difference of the clip coefficient flips a rounding: loss 1.6e-5,
#                   grad norm 1.2e-3 at iteration 6.
# Re-measured on a 2-core CPU machine (the same numbers at 22ca48a, before the change that
# prompted it): bf16 grad norm 1.7e-5 at iteration 1; wgrad_hadamard bit-identical for iterations
# 1-2, then the flipped roundings grow: grad norm 5e-4, 4.8e-3 and up to 2e-2 by iteration 6. The
# losses stay within LOSS_RTOL; a rank quantizing with its shard's own scales or blocks cut by a
# shard edge is off by percent from iteration 1 on.
LOSS_RTOL = 1e-4  # train and val loss, every iteration
GRAD_NORM_RTOL = 3e-2  # after the first update
FIRST_ITERATION_RTOL = {"bf16": 3e-5, "wgrad_hadamard": 0.0}  # identical weights: loss and grad norm


@pytest.fixture(scope="module", params=["bf16", "wgrad_hadamard"])
def tp_runs(request, tmp_path_factory, data_cache):
    prefix = data_cache / "default_train_text_document"
    runs = {}
    for tp in (1, 2):
        tb = tmp_path_factory.mktemp(f"tb_{request.param}_tp{tp}")
        run_pretrain(
            [
                "--train-iters",
                "6",
                *TINY,
                "--precision",
                request.param,
                "--gemm-backend",
                "reference",
                "--tensor-model-parallel-size",
                str(tp),
                "--eval-interval",
                "3",
                "--tensorboard-dir",
                str(tb),
                "--data-path",
                str(prefix),
                "--tokenizer-model",
                str(data_cache / "tokenizer.model"),
                "--split",
                "98,2,0",
                "--data-cache-dir",
                str(data_cache),
            ],
            nproc=tp,
        )
        runs[tp] = {tag: scalars(tb, tag) for tag in ("lm loss", "grad-norm", "lm loss validation")}
    return request.param, runs


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
def test_tp2_matches_tp1(tp_runs):
    preset, runs = tp_runs
    tp1, tp2 = runs[1], runs[2]
    for tag in tp1:
        assert tp1[tag].keys() == tp2[tag].keys()
    assert sorted(tp1["lm loss"]) == [1, 2, 3, 4, 5, 6] and sorted(tp1["lm loss validation"]) == [3, 6]
    for tag in ("lm loss", "grad-norm"):
        assert _rel(tp2[tag][1], tp1[tag][1]) <= FIRST_ITERATION_RTOL[preset], (tag, tp1[tag][1], tp2[tag][1])
    for tag, rtol in (
        ("lm loss", LOSS_RTOL),
        ("lm loss validation", LOSS_RTOL),
        ("grad-norm", GRAD_NORM_RTOL),
    ):
        worst = {k: _rel(tp2[tag][k], tp1[tag][k]) for k in tp1[tag]}
        assert max(worst.values()) <= rtol, (tag, worst)
    assert tp1["lm loss"][6] < tp1["lm loss"][1]

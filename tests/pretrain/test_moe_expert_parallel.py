"""Expert parallelism in ``launch/pretrain.py`` (``pretrain.expert_parallel``): TP=2 x EP=2 (world 4, DP 2,
each rank two of the four experts, each expert's fc1 / fc2 split over TP) trains like TP=1 x EP=1
(world 2, DP 2, every rank all experts, torch DDP), reports every expert, and its checkpoint resumes at
TP=1 x EP=1.

Tolerance: with EP=2 each expert's Wgrad contracts over both ranks' tokens in one GEMM where EP=1 sums
two per-rank GEMMs over DP, so FP32 summation orders differ (and an MX block along tokens would straddle
the ranks: the plan keeps the experts' Wgrad in BF16, elementwise); with TP=2 the row-parallel partial
sums (attention's projection, every fc2) add in another order. After step 1, gradients differing in
their last FP32 bits move AdamW's update (gradient / sqrt of its second moment: near-zero entries are
not damped) and, through the MXFP4 Fprop, can move an activation across a 4-bit rounding boundary; the
losses and gradient norms are compared to 1e-4 relative. No --moe-expert-capacity-factor here: dropping
is a discrete choice on the routing probabilities, and a last-bit difference can drop another token
(measured with capacity 1.5 at EP=2: losses within 1.3e-5, gradient norms 1.1 % apart at step 4).
Measured without it (2-core CPU, gloo): the four losses bit-identical, gradient norms <= 2.6e-7 relative
apart (the squares add over other groups in another order), the resumed steps 3-4 bit-identical to the
TP=2 x EP=2 run's -- closer than the tolerance, which the summation orders above do not guarantee.
"""

import re

import pytest

from pretrain.evaluation.numerics_report import load_unquantized
from pretrain.trainer.tags import read_scalars

from ._launch import TINY, run_pretrain, scalars
from .test_moe_resume import MOE

RTOL = 1e-4


def _printed_plan(stdout: str) -> list[str]:
    """The start-up GEMM-backend table and the precision plan a run prints (rank 0)."""
    table = stdout[stdout.index("GEMM backends on"):stdout.index("GEMMs per backend")]
    plan = stdout[stdout.index("layer (count): precision"):stdout.index("training iterations")]
    quantized = re.search(r"\d+ of \d+ linears quantized", stdout).group(0)
    return [table, plan, quantized]


@pytest.mark.slow
def test_tp2_x_ep2_matches_tp1_x_ep1_reports_every_expert_and_its_checkpoint_resumes_at_ep1(tmp_path, data_cache):
    """The TP=1 x EP=1 run is the oracle of what is reported: its rank holds every expert, so the plan it
    prints, its ``precision_plan`` text and its per-expert ``numerics/`` and ``moe/`` tags are the whole
    model's; the TP=2 x EP=2 run's rank 0 holds experts 0-1 and must print and write the same (experts
    2-3 by their global ids, gathered from EP rank 1).

    The checkpoint: the TP=2 x EP=2 run's ``torch_dist`` checkpoint at step 2 resumes at TP=1 x EP=1:
    the experts' weights and Adam moments are found by megatron's global expert keys whatever TP or EP
    rank held them, AdamW's step count (one per parameter) is given to every parameter of the new
    layout. The resumed steps 3-4 follow the TP=2 x EP=2 run's to the tolerance above (a TP=2 -> TP=1
    change adds the row-parallel summation order to step 3's operands)."""
    common = ["--train-iters", "4", *TINY, *MOE, "--precision", "fprop=mxfp4,dgrad=mxfp4", "--numerics-interval", "4",
              "--eval-interval", "100", "--data-cache-dir", str(data_cache)]
    one, four = tmp_path / "tp1_ep1", tmp_path / "tp2_ep2"
    proc1 = run_pretrain(common + ["--expert-model-parallel-size", "1", "--tensorboard-dir", str(one)])
    proc4 = run_pretrain(common + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                   "--ckpt-format", "torch_dist", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                                   "--tensorboard-dir", str(four)], nproc=4, timeout=600)  # fmt: skip
    assert "world size 4 = TP 2 x PP 1 x DP 2 (EP 2)" in proc4.stdout

    (loss1, norm1), (loss4, norm4) = [(scalars(tb, "lm loss"), scalars(tb, "grad-norm")) for tb in (one, four)]
    record = {"loss_tp1_ep1": loss1, "loss_tp2_ep2": loss4, "norm_tp1_ep1": norm1, "norm_tp2_ep2": norm4}
    assert sorted(loss1) == sorted(loss4) == [1, 2, 3, 4], record
    assert loss4 == pytest.approx(loss1, rel=RTOL), record
    assert norm4 == pytest.approx(norm1, rel=RTOL), record
    assert loss1[4] < loss1[1]

    # what rank 0 reports: every expert's GEMMs, by global id, as the run whose rank holds them all
    plan1, plan4 = _printed_plan(proc1.stdout), _printed_plan(proc4.stdout)
    assert plan4 == plan1
    assert "local_experts.3.linear_fc2" in plan4[1]
    assert load_unquantized(four, 4) == load_unquantized(one, 4)
    assert ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1", "wgrad/x") in load_unquantized(four, 4)
    tags1 = {t for t in read_scalars(one) if t.startswith(("numerics/", "moe/"))}
    tags4 = {t for t in read_scalars(four) if t.startswith(("numerics/", "moe/"))}
    assert tags4 == tags1
    for layer in (0, 1):
        for e in range(4):
            assert f"moe/layer_{layer}/expert_{e}/sqnr_db_min" in tags4
            assert f"numerics/decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2/fprop/x/sqnr_db" in tags4

    resumed = tmp_path / "resume_tp1_ep1"
    run_pretrain(common + ["--expert-model-parallel-size", "1", "--ckpt-format", "torch_dist", "--load",
                           str(tmp_path / "ckpt"), "--ckpt-step", "2", "--tensorboard-dir", str(resumed)])  # fmt: skip
    got = scalars(resumed, "lm loss")
    assert sorted(got) == [3, 4]
    assert [got[3], got[4]] == pytest.approx([loss4[3], loss4[4]], rel=RTOL), (got, record)


@pytest.mark.slow
def test_expert_parallel_refusals(tmp_path, data_cache):
    base = [*TINY, *MOE, "--train-iters", "2", "--data-cache-dir", str(data_cache)]
    proc = run_pretrain(base + ["--expert-model-parallel-size", "2", "--save", str(tmp_path / "c")], check=False)
    assert proc.returncode != 0  # the workers exit 2; torchrun reports a failed worker as 1
    line = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert line and "--ckpt-format torch_dist" in line[0] and "--save" in line[0], proc.stderr[-2000:]
    proc = run_pretrain(base + ["--expert-model-parallel-size", "2"], nproc=0, check=False)
    assert proc.returncode == 2
    assert "--expert-model-parallel-size 2 must divide the data-parallel size 1" in proc.stderr



def test_every_expert_lists_each_layers_experts_by_global_id():
    from pretrain.expert_parallel import every_expert

    layer = "decoder.layers.{}.mlp."
    rank1 = [layer.format(0) + "router", *(layer.format(0) + f"experts.local_experts.{e}.linear_fc{i}"
                                          for e in (2, 3) for i in (1, 2)),
             layer.format(0) + "shared_experts.linear_fc1", layer.format(1) + "linear_fc1", "output_layer"]  # fmt: skip
    got = every_expert(rank1, 4)
    assert got == [rank1[0], *(layer.format(0) + f"experts.local_experts.{e}.linear_fc{i}" for e in range(4)
                               for i in (1, 2)), *rank1[5:]]  # fmt: skip
    assert every_expert(got, 4) == got and every_expert(rank1, None) == rank1


def test_the_whole_plan_of_a_mixed_moe_model_names_its_layers_only(world_of_one):
    """``--moe-layer-freq [1,0]``: layer 0 MoE, layer 1 dense. The whole-model plan (printed, in
    TensorBoard and checkpoints) has exactly the model's linears -- no router or experts in layer 1, no
    dense MLP in layer 0 -- and a rule that selects a router in the dense layer is refused."""
    import torch

    from model.gpt import policy_linear_names
    from pretrain.arguments import ConfigError, parse_run_config
    from pretrain.trainer.plans import build_scheduled_model

    argv = ["--train-iters", "2", *TINY, *MOE, "--moe-layer-freq", "[1,0]", "--precision", "mxfp4"]
    model, plans = build_scheduled_model(parse_run_config(argv, 1, False), 512, torch.device("cpu"))
    assert list(plans.whole[0]) == policy_linear_names(model)
    assert "decoder.layers.1.mlp.linear_fc1" in plans.whole[0] and "decoder.layers.1.mlp.router" not in plans.whole[0]
    bad = parse_run_config(argv + ["--precision-rule", "kind:router,layers:1-1=bf16"], 1, False)
    with pytest.raises(ConfigError, match="matches no layer"):
        build_scheduled_model(bad, 512, torch.device("cpu"))

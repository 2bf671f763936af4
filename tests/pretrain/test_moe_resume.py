"""A mixture-of-experts run resumes exactly: 6 iterations straight vs 3, exit, resume, 3 more -- the same
losses, gradient norms and final checkpoint bit for bit, with stochastic rounding on every expert GEMM
(the experts' quantization streams travel in their ``_extra_state``) and the aux and z losses on. TP=2
runs the TP-sliced dispatcher too. The plan the checkpoint records lists every expert's GEMMs."""

import pytest

from pretrain.checkpointing import read_tracker

from ._launch import TINY, load_rank_checkpoint, run_pretrain, scalars
from .test_checkpoint import assert_same_state

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--moe-shared-expert-intermediate-size", "64", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_moe_resume_reproduces_the_uninterrupted_run(tmp_path, data_cache, tp):
    common = ["--train-iters", "6", *TINY, *MOE, "--precision", "bf16", "--precision-rule", "kind:expert=mxfp4_sr",
              "--tensor-model-parallel-size", str(tp), "--eval-interval", "3", "--data-cache-dir", str(data_cache)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_pretrain(common + ["--save", str(straight), "--tensorboard-dir", str(straight / "tb")], nproc=tp)
    run_pretrain(common + ["--save", str(split), "--load", str(split), "--exit-interval", "3",
                           "--tensorboard-dir", str(split / "tb1")], nproc=tp)
    assert read_tracker(str(split)) == 3
    run_pretrain(common + ["--save", str(split), "--load", str(split), "--tensorboard-dir", str(split / "tb2")],
                 nproc=tp)
    loss = scalars(straight / "tb", "lm loss")
    assert {**scalars(split / "tb1", "lm loss"), **scalars(split / "tb2", "lm loss")} == loss
    assert loss[6] < loss[1]
    assert scalars(split / "tb2", "grad-norm") == {
        k: v for k, v in scalars(straight / "tb", "grad-norm").items() if k > 3}
    for rank in range(tp):
        a = load_rank_checkpoint(straight / "iter_0000006", rank)
        b = load_rank_checkpoint(split / "iter_0000006", rank)
        for key in ("model", "optimizer", "rng_state", "precision_plan"):
            assert_same_state(a[key], b[key], key)
        quant = b["model"]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2._extra_state"]
        assert quant["calls"]["wgrad"] > 0
        plan = str(b["precision_plan"])
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1" in plan and "mlp.router" in plan

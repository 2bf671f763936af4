"""Expert parallelism in ``launch/pretrain.py`` (``pretrain.expert_parallel``): world 2, DP 2, the experts
split over 2 ranks (EP=2) trains like EP=1 (every rank all experts, torch DDP).

Tolerance: with EP=2 each expert's Wgrad contracts over both ranks' tokens in one GEMM where EP=1 sums
two per-rank GEMMs over DP, so FP32 summation orders differ (and an MX block along tokens would straddle
the ranks: the plan keeps the experts' Wgrad in BF16, elementwise). The first step's loss has identical
operands and is compared bit for bit. After it, gradients differing in their last FP32 bits move AdamW's
update (gradient / sqrt of its second moment: near-zero entries are not damped) and, through the MXFP4
Fprop, can move an activation across a 4-bit rounding boundary; the later losses and gradient norms are
compared to 1e-4 relative. No --moe-expert-capacity-factor here: dropping is a discrete choice on the
routing probabilities, and a last-bit difference can drop another token (measured with capacity 1.5:
losses within 1.3e-5, gradient norms 1.1 % apart at step 4). Measured without it (2-core CPU): step 1
bit-identical, losses and gradient norms equal to 4 significant digits over 4 steps."""

import pytest

from ._launch import TINY, run_pretrain, scalars
from .test_moe_resume import MOE

RTOL = 1e-4


@pytest.mark.slow
def test_expert_parallel_2_matches_expert_parallel_1_and_its_checkpoint_resumes_at_ep1(tmp_path, data_cache):
    """Also: the EP=2 run's ``torch_dist`` checkpoint (each rank two of the four experts, their Adam
    state sharded with them) resumes at EP=1 (every rank all experts): the experts' weights and Adam
    moments are found by megatron's global expert keys, AdamW's step count (one per parameter, rank
    0's order) is given to every parameter of the new layout. The resumed step 3 has the loaded
    weights (the same operands as the EP=2 run's step 3); step 4 follows one update from the loaded
    Adam state, to the tolerance above (without the step counts it was 3e-3 off)."""
    common = ["--train-iters", "4", *TINY, *MOE, "--precision", "fprop=mxfp4,dgrad=mxfp4",
              "--eval-interval", "100", "--data-cache-dir", str(data_cache)]
    runs = {}
    for ep in (1, 2):
        tb = tmp_path / f"ep{ep}"
        save = ["--ckpt-format", "torch_dist", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"] if ep == 2 else []
        proc = run_pretrain(common + ["--expert-model-parallel-size", str(ep), "--tensorboard-dir", str(tb), *save])
        runs[ep] = (scalars(tb, "lm loss"), scalars(tb, "grad-norm"))
        if ep == 2:
            assert "(EP 2)" in proc.stdout
    (loss1, norm1), (loss2, norm2) = runs[1], runs[2]
    assert sorted(loss1) == sorted(loss2) == [1, 2, 3, 4]
    assert loss2[1] == loss1[1]
    assert loss2 == pytest.approx(loss1, rel=RTOL)
    assert norm2 == pytest.approx(norm1, rel=RTOL)
    assert loss1[4] < loss1[1]

    resumed = tmp_path / "resume_ep1"
    run_pretrain(common + ["--expert-model-parallel-size", "1", "--ckpt-format", "torch_dist", "--load",
                           str(tmp_path / "ckpt"), "--ckpt-step", "2", "--tensorboard-dir", str(resumed)])  # fmt: skip
    got = scalars(resumed, "lm loss")
    assert sorted(got) == [3, 4]
    assert got[3] == loss2[3]
    assert got[4] == pytest.approx(loss2[4], rel=RTOL)


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


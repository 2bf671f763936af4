"""Evaluation reads the quantization state and never changes it: a run with ``--eval-interval 1``
trains bit-identically to one without evaluation, also for a recipe whose Fprop uses stochastic
rounding and delayed scaling (the two pieces of state an evaluation forward could disturb)."""

import pytest

from ._launch import TINY, run_pretrain, scalars

SR_DELAYED = ["--precision", "fprop=fp8+sr+delayed(max,4),dgrad=bf16,wgrad=bf16", "--gemm-backend", "reference"]


@pytest.mark.slow
def test_evaluation_leaves_training_bit_identical(tmp_path, data_cache):
    losses = {}
    for interval in (0, 1):
        tb = tmp_path / f"tb{interval}"
        out = run_pretrain(["--train-iters", "4", *TINY, *SR_DELAYED, "--eval-interval", str(interval),
                            "--tensorboard-dir", str(tb), "--data-cache-dir", str(data_cache)], nproc=0).stdout
        assert ("validation at iteration 2" in out) == (interval == 1)
        losses[interval] = scalars(tb, "lm loss")
    assert sorted(losses[1]) == [1, 2, 3, 4]
    assert losses[1] == losses[0]  # bit for bit (float32 TensorBoard scalars)

"""The megatron engine on CPU, through ``_megatron_on_cpu.py`` (megatron's CUDA allocations -> CPU).

megatron-core's DDP, optimizer and pipeline schedules run for real here (gloo, 2 processes); only
their hard-coded ``device="cuda"`` allocations are pointed at the CPU (see the harness). So these
tests check our side of the integration -- ``pretrain/engine.py``'s forward-step and loss
functions, per-token loss normalization through ``finalize_model_grads``, the loss broadcast from
the last pipeline stage, pipeline-stage model building and global layer numbering, checkpoints
per ``(TP, PP)`` rank, exact resume -- on every CI run. The distributed optimizer and gradient
clipping assert CUDA tensors inside megatron; their tests need GPUs (``test_megatron_engine.py``),
so runs here use ``--clip-grad 0``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pretrain._launch import TINY, run_pretrain
from tests.pretrain._launch import scalars as read_scalar

HARNESS = str(Path(__file__).with_name("_megatron_on_cpu.py"))
ITERS = ["--train-iters", "4", "--eval-interval", "2", "--clip-grad", "0"]

pytestmark = pytest.mark.slow


def _losses(tb: Path, tag: str = "lm loss") -> list[float]:
    return [v for _, v in sorted(read_scalar(tb, tag).items())]


def test_megatron_engine_matches_torch_engine_and_resumes_exactly(tmp_path, data_cache):
    """DP=2: megatron-core DDP + optimizer give the torch engine's losses (same init and batches;
    gradient reduction order and Adam kernels differ in the last bits, so bf16 rounding), and a
    resume under stochastic rounding (from the straight run's iteration-2 checkpoint) repeats the
    straight run's iterations 3 and 4 bit for bit."""
    common = [*TINY, *ITERS, "--data-cache-dir", str(data_cache)]
    tb_torch, tb_meg = tmp_path / "tb_torch", tmp_path / "tb_meg"
    run_pretrain([*common, "--precision", "bf16", "--ddp-impl", "torch", "--tensorboard-dir", str(tb_torch)],
                 nproc=2, script=HARNESS)
    out = run_pretrain([*common, "--precision", "bf16", "--ddp-impl", "megatron", "--tensorboard-dir",
                        str(tb_meg)], nproc=2, script=HARNESS).stdout
    assert "engine: megatron (--ddp-impl megatron): megatron-core DDP, no-pipelining schedule" in out
    torch_losses, megatron_losses = _losses(tb_torch), _losses(tb_meg)
    assert megatron_losses[0] == pytest.approx(torch_losses[0], abs=1e-5)
    assert megatron_losses == pytest.approx(torch_losses, abs=1e-3)
    assert _losses(tb_meg, "lm loss validation") == pytest.approx(_losses(tb_torch, "lm loss validation"), abs=1e-3)

    # the straight run saves at iteration 2 on its way; the resume starts from that checkpoint
    sr = [*common, "--precision", "mxfp4_sr", "--ddp-impl", "megatron"]
    tb_straight, tb_half, save = tmp_path / "tb_straight", tmp_path / "tb_half", tmp_path / "ckpt"
    run_pretrain([*sr, "--tensorboard-dir", str(tb_straight), "--save", str(save), "--save-interval", "2"], nproc=2,
                 script=HARNESS)
    resume = [*sr, "--tensorboard-dir", str(tb_half), "--save", str(tmp_path / "resumed"), "--load", str(save),
              "--ckpt-step", "2"]
    assert f"resumed from {save / 'iter_0000002'}: iteration 2" in run_pretrain(resume, nproc=2, script=HARNESS).stdout
    straight = read_scalar(tb_straight, "lm loss")
    assert read_scalar(tb_half, "lm loss") == {k: v for k, v in straight.items() if k > 2} and len(straight) == 4


def test_pipeline_parallel_matches_pp1_and_resumes_exactly(tmp_path, data_cache, converted):
    """PP=2 (megatron's 1F1B schedule over 2 processes) trains like PP=1 from the same weights (a
    converted HF model loaded by global layer number), under a per-layer quantized plan, gathers
    both stages' numerics telemetry, and writes and resumes Megatron's per-stage checkpoint files."""
    out_dir, _ = converted
    common = ["--pretrained-checkpoint", str(out_dir), "--seq-length", "64", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
              "--log-interval", "1", "--eval-iters", "1", *ITERS, "--data-cache-dir", str(data_cache),
              "--ddp-impl", "megatron", "--precision", "wgrad_hadamard", "--precision-rule", "first:1=bf16"]
    tb1 = tmp_path / "tb_pp1"
    run_pretrain([*common, "--tensorboard-dir", str(tb1)], nproc=0, script=HARNESS)

    save, tb2 = tmp_path / "pp2", tmp_path / "tb_pp2"
    pp2 = [*common, "--pipeline-model-parallel-size", "2", "--tensorboard-dir", str(tb2), "--save", str(save),
           "--load", str(save)]
    out = run_pretrain([*pp2, "--exit-interval", "2", "--numerics-interval", "2"], nproc=2, script=HARNESS).stdout
    assert "world size 2 = TP 1 x PP 2 x DP 1" in out and "1F1B pipeline schedule" in out
    # the whole model's plan is printed (rank 0 holds layer 0 only); the rule counts global layers
    # (the plan is printed grouped by rule: layer 0 by first:1=bf16, layer 1 -- on rank 1 -- by the preset)
    assert "decoder.layers.[0].{" in out and "decoder.layers.[1].{" in out and "mlp.linear_fc2}" in out
    assert sorted(p.name for p in (save / "iter_0000002").iterdir()) == ["checksums.json", "mp_rank_00_000",
                                                                         "mp_rank_00_001", "run_config.json",
                                                                         "tokenizer"]
    assert "resumed from" in run_pretrain(pp2, nproc=2, script=HARNESS).stdout

    # per-layer telemetry of both stages reaches rank 0's TensorBoard
    for layer in (0, 1):
        assert read_scalar(tb2, f"numerics/decoder.layers.{layer}.mlp.linear_fc1/wgrad/dy/sqnr_db")
    assert _losses(tb2) == pytest.approx(_losses(tb1), abs=1e-5)
    assert _losses(tb2, "lm loss validation") == pytest.approx(_losses(tb1, "lm loss validation"), abs=1e-5)

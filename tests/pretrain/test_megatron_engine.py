"""The megatron engine (``--ddp-impl megatron``): megatron-core DDP, optimizer and pipeline schedules.

These need CUDA (megatron-core 0.16.1's DDP buffers and schedules allocate on the GPU), so every
test here is ``@pytest.mark.gpu`` and is skipped, with its reason, on the CPU machines. What they
hold the engine to:
  - with one GPU, the megatron engine's losses equal the torch engine's (same init, same data; both
    normalize per token over the global batch; only the Adam kernels and reduction order differ);
  - with two GPUs, pipeline parallelism (PP=2, 1F1B) gives the PP=1 losses, under a quantized plan
    too, and writes Megatron's ``mp_rank_XX_YYY`` files;
  - with two GPUs and ``--use-distributed-optimizer`` (DP=2), a resume from iteration 2 repeats
    iterations 3-4 of an uninterrupted run, with ``distrib_optim.pt`` beside each rank file.
The CPU side (flag validation: PP and the distributed optimizer need CUDA and the megatron
engine) is in ``test_cli.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.pretrain._launch import TINY, run_pretrain
from tests.pretrain._launch import scalars as read_scalar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (megatron-core's DDP and pipeline schedules are CUDA-only)"
    ),
]


def _needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {torch.cuda.device_count()}")


def _losses(tb) -> list[float]:
    return [v for _, v in sorted(read_scalar(tb, "lm loss").items())]


def _run(tmp_path, name: str, extra: list[str], nproc: int, data_cache) -> list[float]:
    tb = tmp_path / f"tb_{name}"
    run_pretrain([*TINY, "--train-iters", "4", "--data-cache-dir", str(data_cache), "--tensorboard-dir", str(tb),
                  *extra], nproc=nproc)
    return _losses(tb)


def test_megatron_engine_matches_torch_engine(tmp_path, data_cache):
    _needs_gpus(1)
    torch_losses = _run(tmp_path, "torch", ["--ddp-impl", "torch", "--precision", "bf16"], 1, data_cache)
    megatron_losses = _run(tmp_path, "megatron", ["--ddp-impl", "megatron", "--precision", "bf16"], 1, data_cache)
    assert megatron_losses[0] == pytest.approx(torch_losses[0], abs=1e-5)  # same init, same batch
    assert megatron_losses == pytest.approx(torch_losses, abs=1e-3)


@pytest.mark.parametrize("precision", ["bf16", "wgrad_hadamard"])
def test_pipeline_parallel_matches_pp1(tmp_path, data_cache, precision):
    _needs_gpus(2)
    flags = ["--ddp-impl", "megatron", "--precision", precision]
    pp1 = _run(tmp_path, "pp1", flags, 1, data_cache)
    save = tmp_path / "pp2_ckpt"
    pp2 = _run(tmp_path, "pp2", [*flags, "--pipeline-model-parallel-size", "2", "--save", str(save)], 2, data_cache)
    assert pp2[0] == pytest.approx(pp1[0], abs=1e-5)
    assert pp2 == pytest.approx(pp1, abs=1e-3)
    assert sorted(p.name for p in (save / "iter_0000004").iterdir()) == ["checksums.json", "mp_rank_00_000",
                                                                         "mp_rank_00_001", "run_config.json",
                                                                         "tokenizer"]


def test_distributed_optimizer_resume_is_exact(tmp_path, data_cache):
    _needs_gpus(2)
    flags = ["--ddp-impl", "megatron", "--use-distributed-optimizer", "--precision", "mxfp4"]
    straight = _run(tmp_path, "straight", flags, 2, data_cache)
    save, tb = tmp_path / "half", tmp_path / "tb_half"
    common = [*TINY, *flags, "--train-iters", "4", "--data-cache-dir", str(data_cache), "--save", str(save),
              "--load", str(save), "--tensorboard-dir", str(tb)]
    run_pretrain([*common, "--exit-interval", "2"], nproc=2)
    assert (save / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    out = run_pretrain(common, nproc=2).stdout
    assert "resumed from" in out
    assert _losses(tb) == straight

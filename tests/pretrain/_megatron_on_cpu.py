"""``launch/pretrain.py`` with megatron-core's hard-coded CUDA allocations redirected to the CPU.

The megatron engine (``pretrain/engine.py``: megatron-core's ``DistributedDataParallel``, optimizer
and pipeline schedules) is CUDA-only in megatron-core 0.16.1 for one reason that matters here:
those modules allocate buffers with ``device="cuda"`` / ``torch.cuda.current_device()`` (token
counters, gradient buffers, pipeline receive buffers, norm accumulators) and synchronize CUDA
streams. This launcher -- a test harness, never used by the product, which refuses the megatron
engine on CPU -- points exactly those calls at the CPU: ``torch.cuda.current_device()`` returns
``"cpu"``, ``torch.cuda.synchronize`` does nothing, and in the megatron modules listed below the
tensor factories (``torch.zeros``, ``torch.tensor``, ...) map ``device="cuda"`` to the CPU. Every
line of megatron's schedules, DDP, optimizer and our engine then runs on CPU with gloo, so the
tests can hold the engine to the torch engine's losses, pipeline parallelism to PP=1, and resumes
to uninterrupted runs.

Two megatron checks cannot be redirected and keep their features GPU-only in tests: the
distributed optimizer and gradient clipping assert ``torch.cuda.FloatTensor`` parameters and
gradients (so harness runs use ``--clip-grad 0``; ``tests/pretrain/test_megatron_engine.py`` covers
both on GPUs).

    python -m torch.distributed.run --nproc-per-node 2 tests/pretrain/_megatron_on_cpu.py \\
        --ddp-impl megatron --pipeline-model-parallel-size 2 --clip-grad 0 ...
"""

import importlib
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MEGATRON_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.utils",
)
FACTORIES = ("zeros", "zeros_like", "empty", "ones", "full", "tensor")


def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return make


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a megatron module: the same, except that CUDA tensors are CPU tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)


def redirect_cuda_to_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    proxy = _TorchOnCpu("torch")
    for name in FACTORIES:
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    for module in MEGATRON_MODULES:
        importlib.import_module(module).torch = proxy


def main() -> int:
    redirect_cuda_to_cpu()
    from pretrain import arguments, train

    check_parallel = arguments._check_parallel
    # validate as on a GPU machine (the product refuses the megatron engine on CPU)
    arguments._check_parallel = lambda args, world_size, cuda: check_parallel(args, world_size, True)
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

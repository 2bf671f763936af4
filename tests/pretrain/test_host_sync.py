"""No host synchronisation in a training step: between ``--log-interval``s the training loop reads
nothing from its tensors to the host (stochastic rounding and delayed scaling included); the loss,
grad norm and telemetry are read when the loop settles its steps (log, evaluation, checkpoint).

Every device-to-host read of a tensor's data -- ``.item()``, ``float()``, ``bool()``, ``int()``
(all ``aten._local_scalar_dense``, counted by a ``TorchDispatchMode``) and ``.tolist()`` /
``.numpy()`` (patched) -- is counted, with the stack that made it, outside the places that read
by design: ``MetricsLogger.settle``, ``Validator.evaluate``, ``Checkpointer.save``, the telemetry loggers.
torch.compile does not run under a dispatch mode, so the fused quantizers run their eager code
here (the same operations).
"""

import os
import signal
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain import runtime
from pretrain import train as pretrain_train
from pretrain.arguments import parse_run_config
from pretrain.trainer.checkpointer import Checkpointer
from pretrain.trainer.metrics import MetricsLogger
from pretrain.trainer.phases import PrecisionPhases
from pretrain.trainer.validator import Validator
from tests.pretrain._launch import TINY

READS_ALLOWED_IN = (
    (MetricsLogger, "settle"),
    (Validator, "evaluate"),
    (Checkpointer, "save"),
    (PrecisionPhases, "log_delayed_scaling"),
    (PrecisionPhases, "log_numerics"),
)


class _Reads(TorchDispatchMode):
    """Counts reads of tensor data to the host once the first training step has begun.

    Exempt: the step counts ``torch.optim.AdamW`` keeps in *host* tensors (not capturable, by
    design, so that its bias correction reads no device memory on a GPU either)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.started = False  # set by the first Trainer.train_step
        self.allowed = 0  # > 0 inside a place that reads by design
        self.outside: list[str] = []  # where each read outside them came from
        self.inside = 0

    def count(self, tensor: torch.Tensor | None = None):
        if not self.started:
            return
        if tensor is not None and any(tensor is st.get("step") for st in self.optimizer.state.values()):
            assert tensor.device.type == "cpu"
            return
        if self.allowed:
            self.inside += 1
        else:
            ours = [f for f in traceback.format_stack()[:-2] if "site-packages" not in f]  # the repository's frames
            self.outside.append("".join(ours[-6:]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count(args[0])
        return func(*args, **(kwargs or {}))


@pytest.fixture
def trainer(tmp_path, data_cache):
    """A set-up Trainer (world of one, in this process), torn down after."""
    from megatron.core import parallel_state

    argv = [*TINY, "--train-iters", "6", "--log-interval", "3", "--eval-interval", "0", "--eval-iters", "1",
            "--precision", "mxfp4_sr", "--precision-rule", "kind:mlp=hif8_w8a8", "--num-workers", "0",
            "--data-cache-dir", str(data_cache), "--tensorboard-dir", str(tmp_path / "tb"),
            "--save", str(tmp_path / "ckpt")]  # fmt: skip
    run = parse_run_config(argv, 1, False)
    before = signal.getsignal(signal.SIGTERM)
    environ = dict(os.environ)  # setup() writes a world of one's RANK / MASTER_PORT into it
    t = pretrain_train.setup(run)
    yield t
    if t.tb is not None:
        t.tb.close()
    signal.signal(signal.SIGTERM, before)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    runtime.reset_groups()
    os.environ.clear()
    os.environ.update(environ)  # later tests' subprocesses must not join this (gone) world


def test_training_steps_read_nothing_to_the_host_between_log_intervals(trainer, monkeypatch):
    reads = _Reads(trainer.engine.optimizer)
    step = pretrain_train.Trainer.train_step

    def started(self, *a, **k):
        reads.started = True
        return step(self, *a, **k)

    monkeypatch.setattr(pretrain_train.Trainer, "train_step", started)
    for cls, name in READS_ALLOWED_IN:
        original = getattr(cls, name)

        def wrapped(*a, _original=original, **k):
            reads.allowed += 1
            try:
                return _original(*a, **k)
            finally:
                reads.allowed -= 1

        monkeypatch.setattr(cls, name, wrapped)
    for method in ("tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *a, _original=original, **k):
            reads.count(self)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    sigterm = runtime.Signals()
    with reads:
        status = pretrain_train.train(trainer, sigterm)
    assert status == 0 and trainer.iteration == 6
    assert not reads.outside, f"{len(reads.outside)} host read(s) in training steps, the first from:\n{reads.outside[0]}"
    assert reads.inside > 0  # the counter sees the reads where the loop settles its steps
    # the steps were all logged although read only twice (iterations 3 and 6)
    from tests.pretrain._launch import scalars

    assert sorted(scalars(trainer.run.logging.tensorboard_dir, "lm loss")) == [1, 2, 3, 4, 5, 6]
    assert sorted(scalars(trainer.run.logging.tensorboard_dir, "grad-norm")) == [1, 2, 3, 4, 5, 6]

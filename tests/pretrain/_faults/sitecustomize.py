"""Faults injected into ``launch/pretrain.py`` subprocesses by ``tests/pretrain/test_reliability.py``.

Python imports this file at start-up when its folder is first on ``PYTHONPATH``
(``_launch.env(faults=...)``). Each fault is switched on by a variable the test sets; without them
this module does nothing. Production code has no such switches.

``FAULT_SLOW_STDERR_RANK0=S``  rank 0 waits S seconds before anything it prints to stderr (a rank 0
                               that is slower than its peers to report bad input)
``FAULT_ENOSPC=TEXT``          ``torch.save`` into a file whose name contains TEXT writes a few bytes
                               and raises ``OSError(ENOSPC)`` (a full disk), on rank
                               ``FAULT_ENOSPC_RANK`` (default 0)
``FAULT_NAN_STEPS=3,5``        those (1-based) training steps of this process get a NaN loss, so
                               their gradients are non-finite (torch engine)
"""

import builtins
import errno
import os
import sys
import time

RANK = int(os.environ.get("RANK", "0"))

if os.environ.get("FAULT_SLOW_STDERR_RANK0") and RANK == 0:
    _delay = float(os.environ["FAULT_SLOW_STDERR_RANK0"])
    _print = builtins.print

    def _slow_print(*args, **kwargs):
        if kwargs.get("file") is sys.stderr:
            time.sleep(_delay)
        _print(*args, **kwargs)

    builtins.print = _slow_print

if os.environ.get("FAULT_ENOSPC") and RANK == int(os.environ.get("FAULT_ENOSPC_RANK", "0")):
    import torch

    _needle, _save = os.environ["FAULT_ENOSPC"], torch.save

    def _full_disk_save(obj, f, *args, **kwargs):
        name = str(getattr(f, "name", f))
        if _needle in name and name.endswith(".pt"):
            f.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return _save(obj, f, *args, **kwargs)

    torch.save = _full_disk_save

if os.environ.get("FAULT_NAN_STEPS"):
    import pretrain.engine as _engine

    _steps = {int(s) for s in os.environ["FAULT_NAN_STEPS"].split(",")}
    _train_step, _loss_sum = _engine.TorchEngine.train_step, _engine.TorchEngine._loss_sum
    _count = [0]

    def _counting_train_step(self, micro, schedule):
        _count[0] += 1
        return _train_step(self, micro, schedule)

    def _nan_loss_sum(self, module, mb):
        s, n = _loss_sum(self, module, mb)
        return (s * float("nan"), n) if _count[0] in _steps and module.training else (s, n)

    _engine.TorchEngine.train_step = _counting_train_step
    _engine.TorchEngine._loss_sum = _nan_loss_sum

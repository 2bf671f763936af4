"""What a training process does about its surroundings, before and beside the loop.

    from pretrain import runtime
    runtime.start("pretrain.py")      # first thing in an entry point, before megatron is imported

``start`` does two things, both for ``launch/pretrain.py`` and ``launch/rl.py`` (``filter_expected_warnings``
alone for the one-process tools: ``generate.py``, ``evaluate.py``, ``export_hf.py``):

- **Expected warnings stay quiet.** megatron-core warns, at import and when a config is built, about
  what this project chose not to use: TransformerEngine and Apex are absent (its Torch norm and
  optimizer fall-backs are the ones we use), and its own default ``cuda_graph_scope="full"`` is
  deprecated. Each is printed once per importing module, twice per process for the Apex one, in
  every rank. :data:`EXPECTED_WARNINGS` lists exactly these (category, the module that warns, the
  start of the message); any other warning, megatron's included, is shown as before.

- **Workers end with their launcher.** torchrun starts each worker in a session of its own, so a
  ``kill -9`` of torchrun (or of its process group) leaves the workers running, holding memory and
  devices, waiting in a collective that nobody will join. Under a launcher (torchrun's
  ``TORCHELASTIC_RUN_ID`` in the environment) :func:`exit_with_parent` asks Linux to send the
  worker ``SIGKILL`` when its parent exits (``prctl(PR_SET_PDEATHSIG)``), and a watcher thread
  compares ``os.getppid()`` with the launcher's pid once a second, on every platform, printing one
  line and exiting with status 1 when it has changed. A process started without a launcher (a
  world of one, ``nohup python launch/pretrain.py ...``) is not watched: its parent is a shell.

The loop refactor (``DESIGN.md``, the orchestration layer) grows this module into the runtime:
process groups, signals, refusals, rank-0 printing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
import warnings

__all__ = ["EXPECTED_WARNINGS", "exit_with_parent", "filter_expected_warnings", "start"]

# (category, module regex, message regex): warnings.filterwarnings matches both at the start
EXPECTED_WARNINGS = (
    (UserWarning, r"megatron\.core\.", r"Apex is not installed\. Falling back to Torch Norm"),
    (UserWarning, r"megatron\.core\.", r"Transformer Engine and Apex are not installed\. Falling back to "),
    (UserWarning, r"megatron\.core\.transformer\.transformer_config",
     r"full scope is deprecated\. Use empty cuda_graph_scope"),
)

LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every worker it starts
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_POLL_S = 1.0
_watching: dict[str, int] = {}


def filter_expected_warnings() -> None:
    """Hide exactly :data:`EXPECTED_WARNINGS` (see the module docstring); idempotent."""
    for category, module, message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _set_parent_death_signal(sig: int) -> bool:
    """Linux: the kernel sends ``sig`` to this process when its parent exits. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, prog: str, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent:
            print(f"{prog}: error: the launcher (pid {parent}) is gone; this worker (pid {os.getpid()}) exits",
                  file=sys.stderr, flush=True)
            os._exit(1)


def exit_with_parent(prog: str, *, poll_s: float = _POLL_S) -> bool:
    """Under a launcher, end this process when its parent (the launcher) is gone (module docstring).
    Returns whether the process is watched; idempotent."""
    if LAUNCHER_ENV not in os.environ:
        return False
    if _watching:
        return True
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the kernel was asked to watch it
        os._exit(1)
    _watching["parent"] = parent
    threading.Thread(target=_watch, args=(parent, prog, poll_s), name="parent-watch", daemon=True).start()
    return True


def start(prog: str) -> None:
    """An entry point's first call: quiet the expected warnings, end with the launcher."""
    filter_expected_warnings()
    exit_with_parent(prog)

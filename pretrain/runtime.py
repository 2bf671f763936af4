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

Beside the loop, for every entry point that trains (``pretrain.train.main``, ``launch/rl.py``):

- **Process groups**: :func:`init_process_group` starts ``torch.distributed`` from torchrun's
  environment (a world of one without it; gloo on CPU, NCCL on CUDA) and two gloo groups: the one on
  which failing ranks meet before they exit, and (on CUDA) one for host-side agreement.
- **Signals**: :class:`Signals` notes SIGTERM (during setup too); ``any_rank()`` is the ranks'
  agreement after an iteration (a host all-reduce, no device synchronisation).
- **Refusals -> exit codes**: :func:`run` parses on every rank, lets the ranks agree on bad input
  (:func:`agree_on_input`), then runs the program; a ``ConfigError`` or ``CheckpointError`` is one
  line and exit 2, a ``CheckpointSaveError`` one line and exit 4 (``pretrain.status``), printed once
  by rank 0 (:func:`refuse`) under the program's own name.
- **Rank-0 printing**: :func:`rank0_print`, :func:`is_rank0`.

    def main(argv=None):
        return runtime.run(lambda run, signals: train(setup(run), signals), prog="pretrain.py",
                           parse=lambda world, cuda: parse_run_config(argv, world, cuda))
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
import signal
import socket
import sys
import threading
import time
import warnings

__all__ = ["EXPECTED_WARNINGS", "Signals", "agree_on_input", "exit_with_parent", "filter_expected_warnings",
           "init_process_group", "is_rank0", "rank0_print", "refuse", "run", "start"]

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


# ================================================================================================
# Process groups, rank-0 printing
# ================================================================================================

ERROR_WAIT_S = 30  # how long a rank that failed waits for the others to fail alike (refuse)
_groups: dict[str, object] = {}  # "error": failing ranks meet here; "host": host-side agreement (CUDA)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group() -> None:
    """torch.distributed from torchrun's environment (a world of one without it), once, and the
    gloo group on which ranks that fail meet before they exit (:func:`refuse`)."""
    import torch

    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python launch/pretrain.py`: a world of one
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    _groups["error"] = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ERROR_WAIT_S))
    _groups["host"] = torch.distributed.new_group(backend="gloo") if cuda else None  # None: the (gloo) world


def reset_groups() -> None:
    """Forget the groups of :func:`init_process_group` (after the process group was destroyed)."""
    _groups.clear()


def is_rank0() -> bool:
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def rank0_print(*a) -> None:
    if is_rank0():
        print(*a, flush=True)


# ================================================================================================
# Signals, refusals, run()
# ================================================================================================


class Signals:
    """Set by SIGTERM (during setup too); ranks agree on it after every iteration (all-reduce MAX)."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def any_rank(self) -> bool:
        """Whether any rank got SIGTERM: a host-memory all-reduce on the gloo group of
        :func:`init_process_group` (no device synchronisation); no collective in a world of one."""
        import torch

        if torch.distributed.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=_groups.get("host"))
        return bool(flag.item())


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: a host-memory all-reduce (MAX) on the gloo group of
    :func:`init_process_group`, every rank calling it; no collective in a world of one."""
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=_groups.get("host"))
    return bool(t.item())


def agree_on_input(problem: str | None) -> str | None:
    """Under torchrun: every rank's validation result, gathered once (the process group is started
    for it), so that all ranks learn of a problem found by any and none exits before rank 0 prints."""
    import torch

    init_process_group()
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, problem)
    first = next((r for r, p in enumerate(found) if p), None)
    return None if first is None else found[first] + ("" if first == 0 else f" (found on rank {first})")


def refuse(message: str, status: int, prog: str):
    """Print ``PROG: error: message`` once (rank 0) and exit with ``status`` on every rank.

    With a process group the ranks then meet (a gloo ``monitored_barrier``) before exiting, so no
    rank's exit lets torchrun kill rank 0 before its line is out. A rank that waits
    ``ERROR_WAIT_S`` in vain (the error was not every rank's) prints the line itself."""
    import torch

    initialized = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    group = _groups.get("error")
    if initialized and torch.distributed.get_world_size() > 1 and group is not None:
        try:
            torch.distributed.monitored_barrier(group, timeout=datetime.timedelta(seconds=ERROR_WAIT_S))
        except RuntimeError:  # some rank never came: rank 0 may not have printed
            if rank != 0:
                print(f"{prog}: error: {message} (rank {rank})", file=sys.stderr, flush=True)
    sys.exit(status)


def run(main_fn, *, prog: str, parse) -> int:
    """An entry point's whole life: ``parse(world_size, cuda)`` on every rank (bad input: the ranks
    agree, one line, exit 2, before any model or data), then ``main_fn(config, signals)``, whose
    return is the exit status; refusals found later are one line with their exit status
    (``pretrain.status``); the process group is torn down at the end. ``main_fn`` closes what it
    opened (e.g. its TensorBoard writer) itself."""
    # this module is imported before megatron-core (start() filters its warnings first); these load it
    import torch

    from pretrain.arguments import ConfigError
    from pretrain.checkpointing import CheckpointError, CheckpointSaveError
    from pretrain.status import EXIT_BAD_INPUT, EXIT_SAVE_FAILED

    start(prog)  # (the launcher already did, before megatron was imported)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problem = config = None
    try:
        config = parse(world, torch.cuda.is_available())
    except ConfigError as e:
        problem = str(e)
    if world > 1 and "RANK" in os.environ:  # launched by torchrun (or srun): agree first
        problem = agree_on_input(problem)
    if problem:
        refuse(problem, EXIT_BAD_INPUT, prog)
    signals = Signals()  # from here on SIGTERM means: finish the iteration, save, exit 0
    try:
        status = main_fn(config, signals)
    except (ConfigError, CheckpointError) as e:  # found after setup started (e.g. a checkpoint mismatch)
        refuse(str(e), EXIT_BAD_INPUT, prog)
    except CheckpointSaveError as e:  # every rank raises it alike
        refuse(str(e), EXIT_SAVE_FAILED, prog)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return status

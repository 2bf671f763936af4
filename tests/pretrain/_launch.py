"""Helpers for the training-loop tests: run ``launch/pretrain.py``, read TensorBoard and checkpoints.

``run_pretrain(argv, nproc=2)`` runs the real entry point under ``python -m torch.distributed.run``
(free port, one thread per process, so runs on 2 cores are deterministic and comparable);
``nproc=0`` runs it as a plain ``python`` process (a world of one, no torchrun). ``TINY`` is a model
small enough for a few-second run. The ``data_cache`` and ``world_of_one`` fixtures live in
``tests/conftest.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests._dist import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH = str(REPO / "launch" / "pretrain.py")

# 2 layers, hidden 128 (64 per TP rank), GQA 4 heads / 2 groups, 64-token sequences, 2 micro-batches.
TINY = [
    "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "1",
]  # fmt: skip


# torchrun's variables: a child that inherited them would try to join the parent's world
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")


def env() -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    inherited = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return {**inherited, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def command(argv: list[str], nproc: int = 2, script: str = LAUNCH) -> list[str]:
    if nproc == 0:
        return [sys.executable, script, *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *argv]  # fmt: skip


def run_pretrain(argv: list[str], nproc: int = 2, timeout: float = 300, check: bool = True, script: str = LAUNCH):
    cmd = command(argv, nproc, script)
    proc = subprocess.run(
        cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def start_pretrain(argv: list[str], nproc: int = 2, log_path: Path | None = None) -> subprocess.Popen:
    """Start a run in the background; stdout and stderr go to ``log_path``."""
    with open(log_path, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command(argv, nproc), cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT
        )


def wait_for_line(log_path: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log_path.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended (exit {proc.returncode}) before {text!r}:\n{log_path.read_text()[-4000:]}"
            )
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"timed out waiting for {text!r}:\n{log_path.read_text()[-4000:]}")


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """``{RANK: pid}`` of the worker processes a torchrun process started (Linux ``/proc``)."""
    workers = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for var in environ:
            if var.startswith(b"RANK="):
                workers[int(var[5:])] = int(entry)
    return workers


def send_sigterm(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)


def scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """``{step: value}`` of a TensorBoard scalar, read with tensorboard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def load_rank_checkpoint(ckpt_dir: Path, tp_rank: int) -> dict:
    return torch.load(
        ckpt_dir / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt", map_location="cpu", weights_only=False
    )

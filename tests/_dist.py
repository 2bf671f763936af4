"""Small helpers shared by the tests that start process groups or torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import time

MAX_SCALE = 4.0  # a timeout grows at most 4x: a hung process still fails in bounded time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_factor() -> float:
    """How much slower than an idle machine a CPU-bound process runs now: runnable processes per
    core (1-minute load average), at least 1, at most ``MAX_SCALE``."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_SCALE, max(1.0, load / (os.cpu_count() or 1)))


def scaled_timeout(base_s: float) -> float:
    """``base_s`` (the budget on an idle machine of this kind) scaled by the machine's load now."""
    return base_s * load_factor()


def run_scaled(cmd, base_s: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=scaled_timeout(base_s), ...)``; a timeout fails with a message
    that says the budget, the load it was scaled by and the command (not a bare TimeoutExpired)."""
    timeout = scaled_timeout(base_s)
    start = time.monotonic()
    try:
        return subprocess.run(cmd, timeout=timeout, check=kwargs.pop("check", False), **kwargs)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-2000:]
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        raise AssertionError(
            f"timed out after {time.monotonic() - start:.0f} s (budget {base_s:.0f} s x load factor "
            f"{timeout / base_s:.2f}, capped at {MAX_SCALE:g}x): {' '.join(map(str, cmd))}\n{out}") from None

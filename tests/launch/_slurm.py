"""A local SLURM cluster for the tests: ``launch/slurm/local_cluster.sh`` started in a directory of
its own and always stopped, plus submitting, waiting for and killing jobs on it.

``with local_cluster(2) as c:`` gives two nodes, ``node0`` and ``node1``, each a network namespace
of its own (addresses 10.77.0.1 and 10.77.0.2); ``c.run([...])`` runs a SLURM client inside node0's
namespace (the only place the controller is reachable from). ``skip_reason(nodes)`` says why such a
cluster cannot run here (no root, no Debian packages, no namespaces), or ``None``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.pretrain._launch import REPO

SCRIPT = REPO / "launch" / "slurm" / "local_cluster.sh"
PACKAGES = "Debian's slurmd, slurmctld, slurm-client and munge (.ci/run installs them)"
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def skip_reason(nodes: int = 1) -> str | None:
    if os.geteuid() != 0:
        return f"needs root and {PACKAGES}"
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if not shutil.which(b)]
    if missing:
        return f"{', '.join(missing)} not found: needs {PACKAGES}"
    if nodes > 1:
        if not (shutil.which("ip") and shutil.which("nsenter") and shutil.which("unshare")):
            return "a cluster of network namespaces needs ip (iproute2), nsenter and unshare (util-linux)"
        probe = subprocess.run(["unshare", "--net", "--uts", "true"], check=False, capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return f"network namespaces are not permitted here: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Cluster:
    dir: Path
    nodes: int
    env: dict  # SLURM_CONF, and LOCAL_SLURM_NETNS with nodes > 1

    @property
    def netns(self) -> str | None:
        return self.env.get("LOCAL_SLURM_NETNS")

    def node_netns(self, node: int) -> str:
        assert self.netns, "a one-node cluster runs on this host, not in a namespace"
        return self.netns[:-1] + str(node)

    def run(self, argv: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol, ...) where the controller is reachable."""
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return subprocess.run([*prefix, *argv], check=False, env={**(env or os.environ), **self.env},
                              capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)

    def submit(self, nodes: int, script: Path, args: list[str], output: Path, env: dict, cwd: Path) -> int:
        r = self.run(["sbatch", "--parsable", "-N", str(nodes), "--output", str(output), str(script), *args],
                     env=env, cwd=cwd)
        assert r.returncode == 0, r.stdout + r.stderr
        return int(r.stdout.strip().split(";")[0])

    def job_state(self, job: int) -> tuple[str, str]:
        """(JobState, ExitCode) as scontrol reports them."""
        r = self.run(["scontrol", "show", "job", str(job), "-o"])
        assert r.returncode == 0, r.stdout + r.stderr
        state = re.search(r"JobState=(\S+)", r.stdout).group(1)
        return state, re.search(r"ExitCode=(\S+)", r.stdout).group(1)

    def wait(self, job: int, timeout: float = 600) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job))[0] in ACTIVE:
            if time.monotonic() > deadline:
                self.run(["scancel", str(job)])
                raise AssertionError(f"job {job} still {state[0]} after {timeout:.0f} s")
            time.sleep(0.5)
        return state

    def job_pids(self, node: int, job: int) -> list[int]:
        """The job's processes on one node (all of them but slurmstepd): what a lost node takes down."""
        r = subprocess.run(["ip", "netns", "pids", self.node_netns(node)], check=False, capture_output=True,
                           text=True, timeout=30)
        pids = []
        for pid in map(int, r.stdout.split()):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if comm != "slurmstepd" and f"SLURM_JOB_ID={job}".encode() in environ:
                pids.append(pid)
        return pids

    def kill_node(self, node: int, job: int) -> list[int]:
        pids = self.job_pids(node, job)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


@contextmanager
def local_cluster(nodes: int = 1) -> Iterator[Cluster]:
    """Start a cluster in a fresh directory; stop it (daemons, job processes, namespaces) and delete
    the directory however the body ends. munged wants its socket's directories searchable by all,
    hence a directory of its own rather than pytest's private tmp_path."""
    root = Path(tempfile.mkdtemp(prefix="lowprec-slurm-"))
    root.chmod(0o755)
    env = {**os.environ, "LOCAL_SLURM_DIR": str(root / "cluster")}
    try:
        r = subprocess.run(["bash", str(SCRIPT), "start", str(nodes)], check=False, env=env, capture_output=True,
                           text=True, timeout=120)
        logs = sorted((root / "cluster" / "log").glob("*"))
        assert r.returncode == 0, r.stderr + "".join(f"\n== {p.name}\n{p.read_text()[-2000:]}" for p in logs)
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", r.stdout, flags=re.MULTILINE))
        yield Cluster(root / "cluster", nodes, exports)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], check=False, env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)

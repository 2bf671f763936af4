"""End to end: a tiny sweep of 3 runs (and its resume), real SLURM jobs on a one-node localhost
cluster and on a two-node cluster of network namespaces (train, lose a node, resume exactly), two
torchrun "nodes" on loopback, and numerics telemetry through the report."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.checkpointing import read_tracker
from tests._dist import free_port
from tests.launch._slurm import ACTIVE, local_cluster, skip_reason
from tests.pretrain._launch import REPO, TINY, env, load_rank_checkpoint
from tests.pretrain.test_reliability import assert_equal, read_tracker_or_none

sys.path.insert(0, str(REPO / "launch"))
import sweep

pytestmark = pytest.mark.slow
FAST = [*TINY, "--eval-interval", "0", "--gemm-backend", "reference"]
SBATCH = REPO / "launch" / "slurm" / "pretrain.sbatch"


def tb_scalars(tb_dir: Path) -> dict:
    return sweep.read_scalars(tb_dir)


def test_tiny_sweep_end_to_end_and_resume(tmp_path, data_cache):
    f = tmp_path / "tiny.yaml"
    f.write_text("baseline: bf16\nnproc-per-node: 1\ngrid:\n  presets: [bf16, mxfp4, wgrad_hadamard]\n")
    out = tmp_path / "out"
    flags = ["--", *FAST, "--train-iters", "4", "--data-cache-dir", str(data_cache)]
    r = subprocess.run([sys.executable, str(REPO / "launch/sweep.py"), str(f), "--out", str(out), *flags],
                       check=False, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = (out / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 4 and rows[0].startswith("run,status,precision,seed,iterations")
    for name in ("bf16", "mxfp4", "wgrad_hadamard"):
        assert json.loads((out / "runs" / name / "status.json").read_text())["state"] == "done"
        assert len(tb_scalars(out / "runs" / name / "tensorboard")["lm loss"]) == 4
    assert (out / "loss_curves.png").stat().st_size > 5000 and (out / "gap.png").stat().st_size > 5000
    assert "| wgrad_hadamard | done | wgrad_hadamard |  | 4 |" in (out / "results.md").read_text()  # no seed

    # Half-finished sweep: one run failed, one never started. Re-running redoes exactly those two.
    (out / "runs" / "mxfp4" / "status.json").write_text(json.dumps({"state": "failed"}))
    shutil.rmtree(out / "runs" / "wgrad_hadamard")
    bf16_log = (out / "runs" / "bf16" / "train.log").read_text()
    r = subprocess.run([sys.executable, str(REPO / "launch/sweep.py"), str(f), "--out", str(out), *flags],
                       check=False, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "skipping 1 finished run" in r.stdout
    assert (out / "runs" / "bf16" / "train.log").read_text() == bf16_log
    assert "--load" in (out / "runs" / "mxfp4" / "train.log").read_text()  # resumed from its checkpoint
    assert json.loads((out / "runs" / "wgrad_hadamard" / "status.json").read_text())["state"] == "done"


def test_two_torchrun_nodes_on_loopback(tmp_path, data_cache):
    port = free_port()
    tb = tmp_path / "tb"
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-id", "loopback-test",
               "--rdzv-endpoint", f"127.0.0.1:{port}", str(REPO / "launch/pretrain.py"), *FAST,
               "--train-iters", "3", "--tensor-model-parallel-size", "2", "--precision", "wgrad_hadamard",
               "--tensorboard-dir", str(tb), "--data-cache-dir", str(data_cache)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert len(tb_scalars(tb)["lm loss"]) == 3


def slurm_env(**extra) -> dict:
    return {**env(), "PYTHON": sys.executable, "LOWPREC_ROOT": str(REPO), "NPROC_PER_NODE": "1", **extra}


@pytest.fixture(scope="module")
def slurm_cluster():
    if reason := skip_reason(1):
        pytest.skip(reason)
    with local_cluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def two_node_cluster():
    if reason := skip_reason(2):
        pytest.skip(reason)
    with local_cluster(2) as cluster:
        yield cluster


def test_sbatch_pretrain_on_a_local_cluster(tmp_path, data_cache, slurm_cluster):
    tb, log = tmp_path / "tb", tmp_path / "job.out"
    args = [*FAST, "--train-iters", "3", "--tensor-model-parallel-size", "2", "--precision", "wgrad_hadamard",
            "--tensorboard-dir", str(tb), "--data-cache-dir", str(data_cache)]
    job = slurm_cluster.submit(1, SBATCH, args, log, slurm_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port())),
                               tmp_path)
    state = slurm_cluster.wait(job)
    text = log.read_text() if log.exists() else ""
    assert state == ("COMPLETED", "0:0"), f"{state}\n{text[-4000:]}"
    assert "1 node(s) x 2 process(es)" in text
    assert "iteration" in text and "loss" in text
    assert len(tb_scalars(tb)["lm loss"]) == 3


def test_sbatch_on_two_nodes_trains_resumes_exactly_and_a_lost_node_ends_the_job(tmp_path, data_cache,
                                                                                 two_node_cluster):
    """``sbatch -N 2`` on two hosts (network namespaces, one slurmd each): c10d rendezvous at
    node0's address, TP=2 across the nodes over gloo. A straight run; the same run with node1's
    processes SIGKILLed after its second checkpoint, which must end the job in seconds with one
    error line naming the node and the checkpoint to resume; then the same sbatch command again,
    which resumes and ends with the straight run's losses, weights and optimizer state, bit for bit."""
    c, iters = two_node_cluster, 8
    argv = [*FAST, "--train-iters", str(iters), "--tensor-model-parallel-size", "2", "--precision",
            "wgrad_hadamard", "--save-interval", "2", "--data-cache-dir", str(data_cache)]
    straight, killed = tmp_path / "straight", tmp_path / "killed"

    log = tmp_path / "straight.out"
    job = c.submit(2, SBATCH, [*argv, "--save", str(straight), "--tensorboard-dir", str(tmp_path / "tb0")], log,
                   slurm_env(MASTER_PORT="29501"), tmp_path)
    state, text = c.wait(job), log.read_text()
    assert state == ("COMPLETED", "0:0"), f"{state}\n{text[-4000:]}"
    assert "2 node(s) x 1 process(es), rendezvous 10.77.0.1:29501 (node0)" in text
    assert "world size 2 = TP 2 x PP 1 x DP 1" in text

    # node1 lost after iteration 2 was saved
    same = [*argv, "--save", str(killed), "--load", str(killed)]
    log = tmp_path / "killed.out"
    job = c.submit(2, SBATCH, [*same, "--tensorboard-dir", str(tmp_path / "tb1")], log,
                   slurm_env(MASTER_PORT="29502"), tmp_path)
    deadline = time.monotonic() + 300
    while (read_tracker_or_none(killed) or 0) < 2:
        assert time.monotonic() < deadline and c.job_state(job)[0] in ACTIVE, log.read_text()[-4000:]
        time.sleep(0.1)
    assert c.kill_node(1, job), f"no process of job {job} on node1:\n{log.read_text()[-3000:]}"
    t0 = time.monotonic()
    state = c.wait(job, timeout=120)
    took, text = time.monotonic() - t0, log.read_text()
    assert state[0] == "FAILED" and took < 30, (state, took, text[-4000:])
    saved = read_tracker(str(killed))
    assert 2 <= saved < iters, f"the run ended before the kill:\n{text[-3000:]}"
    errors = [line for line in text.splitlines() if "error:" in line and line.startswith(("pretrain", "srun"))]
    (line,) = [e for e in errors if e.startswith(("pretrain.sbatch: error:", "pretrain.py: error:"))]
    assert line == (f"pretrain.sbatch: error: job {job}: node1: task 1: Killed (the other nodes were stopped); "
                    f"last complete checkpoint: iteration {saved} in --save {killed}; the same sbatch command "
                    f"with --load {killed} resumes it"), line

    # the same command resumes
    log = tmp_path / "resumed.out"
    job = c.submit(2, SBATCH, [*same, "--tensorboard-dir", str(tmp_path / "tb2")], log,
                   slurm_env(MASTER_PORT="29503"), tmp_path)
    state, text = c.wait(job), log.read_text()
    assert state == ("COMPLETED", "0:0"), f"{state}\n{text[-4000:]}"
    assert f"resumed from {killed / f'iter_{saved:07d}'}: iteration {saved}" in text
    loss_straight = {s: v for s, v in tb_scalars(tmp_path / "tb0")["lm loss"]}
    loss_resumed = {s: v for s, v in tb_scalars(tmp_path / "tb2")["lm loss"]}
    assert sorted(loss_resumed) == list(range(saved + 1, iters + 1))
    assert loss_resumed == {s: loss_straight[s] for s in loss_resumed}  # bit-identical (float32 events)
    for rank in (0, 1):
        a = load_rank_checkpoint(straight / f"iter_{iters:07d}", rank)
        b = load_rank_checkpoint(killed / f"iter_{iters:07d}", rank)
        assert_equal(a["model"], b["model"], "model")
        assert_equal(a["optimizer"], b["optimizer"], "optimizer")


def test_numerics_telemetry_tags_and_report(tmp_path, data_cache):
    from tests.pretrain._launch import run_pretrain

    tb = tmp_path / "run" / "tensorboard"
    run_pretrain([*FAST, "--train-iters", "2", "--precision", "wgrad_hadamard", "--numerics-interval", "1",
                  "--tensorboard-dir", str(tb), "--data-cache-dir", str(data_cache)], nproc=0)
    scalars = tb_scalars(tb)
    tags = [t for t in scalars if t.startswith("numerics/")]
    want = "numerics/decoder.layers.0.mlp.linear_fc1/wgrad/dy/sqnr_db"
    assert want in tags, tags[:10]
    for t in tags:
        assert all(math.isfinite(v) for _, v in scalars[t]), t
    assert any(t.startswith("numerics/output_layer/fprop/x/") for t in tags)
    r = subprocess.run([sys.executable, str(REPO / "launch/report.py"), str(tmp_path / "run")], check=False,
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "report" / "numerics_sqnr_db.png").exists()
    assert "## sqnr_db" in (tmp_path / "run" / "report" / "numerics.md").read_text()

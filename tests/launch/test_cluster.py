"""End to end: a tiny sweep of 3 runs (and its resume), a real SLURM job on a one-node localhost
cluster, two torchrun "nodes" on loopback, and numerics telemetry through the report."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.pretrain._launch import REPO, TINY, env

sys.path.insert(0, str(REPO / "launch"))
import sweep  # noqa: E402

pytestmark = pytest.mark.slow
FAST = [*TINY, "--eval-interval", "0", "--gemm-backend", "reference"]


def tb_scalars(tb_dir: Path) -> dict:
    return sweep.read_scalars(tb_dir)


def test_tiny_sweep_end_to_end_and_resume(tmp_path, data_cache):
    f = tmp_path / "tiny.yaml"
    f.write_text("baseline: bf16\nnproc-per-node: 1\ngrid:\n  presets: [bf16, mxfp4, wgrad_hadamard]\n")
    out = tmp_path / "out"
    flags = ["--", *FAST, "--train-iters", "4", "--data-cache-dir", str(data_cache)]
    r = subprocess.run([sys.executable, str(REPO / "launch/sweep.py"), str(f), "--out", str(out), *flags],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = (out / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 4 and rows[0].startswith("run,status,precision,seed,iterations")
    for name in ("bf16", "mxfp4", "wgrad_hadamard"):
        assert json.loads((out / "runs" / name / "status.json").read_text())["state"] == "done"
        assert len(tb_scalars(out / "runs" / name / "tensorboard")["train/loss"]) == 4
    assert (out / "loss_curves.png").stat().st_size > 5000 and (out / "gap.png").stat().st_size > 5000
    assert "| wgrad_hadamard | done | wgrad_hadamard |  | 4 |" in (out / "results.md").read_text()  # no seed

    # Half-finished sweep: one run failed, one never started. Re-running redoes exactly those two.
    (out / "runs" / "mxfp4" / "status.json").write_text(json.dumps({"state": "failed"}))
    shutil.rmtree(out / "runs" / "wgrad_hadamard")
    bf16_log = (out / "runs" / "bf16" / "train.log").read_text()
    r = subprocess.run([sys.executable, str(REPO / "launch/sweep.py"), str(f), "--out", str(out), *flags],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
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
    assert len(tb_scalars(tb)["train/loss"]) == 3


@pytest.fixture(scope="module")
def slurm_cluster():
    if os.geteuid() != 0 or not shutil.which("slurmctld") or not shutil.which("munged"):
        pytest.skip("needs root and Debian's slurmd, slurmctld, slurm-client and munge (.ci/run installs them)")
    r = subprocess.run(["bash", str(REPO / "launch/slurm/local_cluster.sh"), "start"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    conf = r.stdout.strip().split("=", 1)[1]
    yield {**os.environ, "SLURM_CONF": conf}
    subprocess.run(["bash", str(REPO / "launch/slurm/local_cluster.sh"), "stop"], timeout=60)


def test_sbatch_pretrain_on_a_local_cluster(tmp_path, data_cache, slurm_cluster):
    tb, log = tmp_path / "tb", tmp_path / "job.out"
    e = {**env(), **{k: v for k, v in slurm_cluster.items() if k.startswith("SLURM")},
         "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "LOWPREC_ROOT": str(REPO),
         "MASTER_PORT": str(free_port())}
    cmd = ["sbatch", "--wait", "-N", "1", "--output", str(log), str(REPO / "launch/slurm/pretrain.sbatch"),
           *FAST, "--train-iters", "3", "--tensor-model-parallel-size", "2", "--precision", "wgrad_hadamard",
           "--tensorboard-dir", str(tb), "--data-cache-dir", str(data_cache)]
    r = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=600)
    text = log.read_text() if log.exists() else ""
    assert r.returncode == 0, r.stdout + r.stderr + text[-4000:]
    assert "1 node(s) x 2 process(es)" in text
    assert "iteration" in text and "loss" in text
    assert len(tb_scalars(tb)["train/loss"]) == 3


def test_numerics_telemetry_tags_and_report(tmp_path, data_cache):
    from tests.pretrain._launch import run_pretrain

    tb = tmp_path / "run" / "tensorboard"
    run_pretrain([*FAST, "--train-iters", "2", "--precision", "wgrad_hadamard", "--numerics-interval", "1",
                  "--tensorboard-dir", str(tb), "--data-cache-dir", str(data_cache)], nproc=1)
    scalars = tb_scalars(tb)
    tags = [t for t in scalars if t.startswith("numerics/")]
    want = "numerics/decoder.layers.0.mlp.linear_fc1/wgrad/dy/sqnr_db"
    assert want in tags, tags[:10]
    for t in tags:
        assert all(v == v and abs(v) != float("inf") for _, v in scalars[t]), t
    assert any(t.startswith("numerics/output_layer/fprop/x/") for t in tags)
    r = subprocess.run([sys.executable, str(REPO / "launch/report.py"), str(tmp_path / "run")], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "report" / "numerics_sqnr_db.png").exists()
    assert "## sqnr_db" in (tmp_path / "run" / "report" / "numerics.md").read_text()

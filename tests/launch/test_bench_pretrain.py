"""``launch/bench_pretrain.py`` on CPU: one pretrain run per recipe, a table against the baseline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_pretrain_smoke(tmp_path, data_cache):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "tiny", "--precisions",
           "bf16,mxfp4", "--train-iters", "2", "--skip", "0", "--out", str(out), "--", "--num-layers", "2",
           "--global-batch-size", "4", "--micro-batch-size", "4", "--lr-warmup-iters", "0",
           "--data-cache-dir", str(data_cache)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_pretrain.json").read_text())
    assert result["device"] == "cpu" and [r["precision"] for r in result["runs"]] == ["bf16", "mxfp4"]
    for run in result["runs"]:
        assert run["iterations"] == 2 and run["tokens_per_sec"] > 0 and run["tflops_per_device"] > 0
        assert 5.0 < run["final_loss"] < 10.0
    md = (out / "bench_pretrain.md").read_text()
    assert "| bf16 |" in md and "| 1.00x |" in md and "| mxfp4 |" in md


def test_bench_pretrain_reports_a_refused_run(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "tiny", "--precisions",
           "nope", "--train-iters", "40", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1
    assert "pretrain.py: error: --precision: unknown precision 'nope'" in (out / "bench_pretrain.md").read_text()

"""``launch/bench_pretrain.py`` on CPU: one pretrain run per recipe, a table against the baseline."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_pretrain_smoke(tmp_path, data_cache):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "tiny", "--precisions",
           "bf16,mxfp4", "--bf16-modes", "on", "--train-iters", "2", "--skip", "0", "--goals", "--out", str(out),
           "--", "--num-layers", "2", "--global-batch-size", "4", "--micro-batch-size", "4", "--lr-warmup-iters", "0",
           "--data-cache-dir", str(data_cache)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_pretrain.json").read_text())
    assert result["device"] == "cpu" and [r["precision"] for r in result["runs"]] == ["bf16", "mxfp4"]
    for run in result["runs"]:
        assert run["mode"] == "on" and "--bf16" in (out / f"{run['precision']}-bf16on" / "log").read_text()
        assert run["iterations"] == 2 and run["tokens_per_sec"] > 0 and run["tflops_per_device"] > 0
        assert 5.0 < run["final_loss"] < 10.0
        assert run["peak_memory_gib"] > 0 and run["memory_kind"] == "cpu_rss"
        assert 0 < run["quant_fraction"] < 1
        assert run["gemm_paths"] == {"emulated": 27}  # CPU: (2 layers x 4 linears + output layer) x 3 GEMMs
    md = (out / "bench_pretrain.md").read_text()
    assert "| bf16 (emulated) | on |" in md and "| 1.00x |" in md and "| mxfp4 (emulated) | on |" in md
    assert "- the goals are for a GPU run (no known BF16 peak on this device): not checked" in md


def test_bench_pretrain_dry_run_passes_the_bf16_flag(tmp_path):
    cmd = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "tiny", "--precisions",
           "bf16,fp8", "--bf16-modes", "off,on,default", "--train-iters", "3", "--out", str(tmp_path), "--dry-run",
           "--", "--num-layers", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 and not any(tmp_path.iterdir())
    flags = [("--bf16" in ln.split(), "--no-bf16" in ln.split()) for ln in lines]
    assert flags == [(False, True)] * 2 + [(True, False)] * 2 + [(False, False)] * 2
    assert all("--precision bf16 " in ln for ln in lines[::2]) and all(ln.endswith("--num-layers 2") for ln in lines)
    bad = subprocess.run(cmd[:-4] + ["--bf16-modes", "yes"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode == 2 and "--bf16-modes: unknown yes; valid: default, on, off" in bad.stderr


def test_quant_fraction_table_and_goals():
    sys.path.insert(0, str(REPO / "launch"))
    import bench_pretrain as bp

    # 2 iterations x 3 quantizer calls; 100 tokens per iteration at 50 and 100 tokens/s (2 s, 1 s)
    stats = {"quant_seconds": [0.1, 0.2, 0.3, 0.1, 0.1, 0.05], "iterations": 2}
    assert bp.quant_fraction(stats, [(1, 50.0), (2, 100.0)], 100, skip=0) == pytest.approx((0.3 + 0.25) / 2)
    assert bp.quant_fraction(stats, [(1, 50.0), (2, 100.0)], 100, skip=1) == pytest.approx(0.25)
    assert math.isnan(bp.quant_fraction(stats, [(1, 50.0)], None, skip=0))  # tokens per iteration unknown
    assert bp._log_fields("x 4 micro-batches, 8,192 tokens\nGEMMs per backend: bf16_mm 12, fp8_scaled_mm 6\n") == \
        {"tokens_per_iter": 8192, "gemm_paths": {"bf16_mm": 12, "fp8_scaled_mm": 6}, "emulated_gemms": None}
    assert not bp.is_emulated("bf16", {"bf16_mm": 12}) and bp.is_emulated("bf16", {"emulated": 12})
    assert not bp.is_emulated("fp8", {"fp8_scaled_mm": 3}) and bp.is_emulated("mxfp4", {"bf16_mm": 3})
    row = {"tflops_per_device": 400.0, "memory_kind": "cuda_allocated", "peak_memory_gib": 30.0,
           "quant_fraction": 0.1, "final_loss": 3.0, "mode": "on"}
    rows = [{**row, "precision": "bf16", "tokens_per_sec": 1000.0, "gemm_paths": {"bf16_mm": 9}, "emulated": False},
            {**row, "precision": "fp8", "tokens_per_sec": 1200.0, "gemm_paths": {"fp8_scaled_mm": 9}, "emulated": False},
            {**row, "precision": "mxfp4", "tokens_per_sec": 800.0, "gemm_paths": {"bf16_mm": 9}, "emulated": True}]
    md = bp.table(rows, 989.0, 790.0)  # MFU against the datasheet peak and the measured BF16 GEMM ceiling
    assert "| fp8 | on | 1,200 | 1.20x | 0.83x | 400 | 40.4% | 50.6% | 30.00 GiB | 10% | fp8_scaled_mm 9 | 3.0000 |" in md
    assert "| mxfp4 (emulated) | on | 800 | 0.80x | 1.25x |" in md
    assert bp.goal_lines(rows, 989.0) == [
        "- bf16 MFU (--bf16 on): 40.4% (goal >= 40%): met",
        "- fp8 tokens/s vs bf16 (--bf16 on): 1.20x (goal >= 1.3x): NOT met",
        "- mxfp4 (emulated) step time vs bf16 (--bf16 on): 1.25x (goal <= 1.3x): met"]
    assert bp.goal_lines(rows, None) == ["- the goals are for a GPU run (no known BF16 peak on this device): not checked"]


def test_bench_pretrain_reports_a_refused_run(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "tiny", "--precisions",
           "nope", "--train-iters", "40", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1
    assert "pretrain.py: error: --precision: unknown precision 'nope'" in (out / "bench_pretrain.md").read_text()


def test_moe_against_dense_table_and_expert_quant_fraction(tmp_path):
    sys.path.insert(0, str(REPO / "launch"))
    import bench_pretrain as bp

    # 1 iteration, 4 quantizer calls of which the 2nd and 4th are the routed experts'; 100 tokens at 50 tokens/s
    stats = {"quant_seconds": [0.1, 0.2, 0.3, 0.4], "quant_expert": [False, True, False, True], "iterations": 1}
    assert bp.quant_fraction(stats, [(1, 50.0)], 100, skip=0) == pytest.approx(1.0 / 2)
    assert bp.quant_fraction(stats, [(1, 50.0)], 100, skip=0, experts_only=True) == pytest.approx(0.6 / 2)
    assert math.isnan(bp.quant_fraction({**stats, "quant_expert": []}, [(1, 50.0)], 100, skip=0, experts_only=True))
    row = {"tflops_per_device": 1.0, "memory_kind": "cpu_rss", "peak_memory_gib": 1.0, "quant_fraction": 0.5,
           "final_loss": 7.0, "mode": "default", "gemm_paths": {"emulated": 9}, "emulated": True}
    rows = [{**row, "model": "moe_tiny", "precision": "bf16", "tokens_per_sec": 600.0, "expert_quant_fraction": 0.0},
            {**row, "model": "tiny", "precision": "bf16", "tokens_per_sec": 1000.0, "expert_quant_fraction": float("nan")},
            {**row, "model": "moe_tiny", "precision": "mxfp4", "tokens_per_sec": 300.0, "expert_quant_fraction": 0.25},
            {**row, "model": "tiny", "precision": "mxfp4", "tokens_per_sec": 400.0, "expert_quant_fraction": float("nan")}]
    md = bp.table(rows, None)
    assert "| model | recipe |" in md and "vs dense | experts quant |" in md
    assert "| moe_tiny | bf16 (emulated) | default | 600 | 1.00x | 1.00x |" in md and "| 0.60x | 0% |" in md
    assert "| moe_tiny | mxfp4 (emulated) | default | 300 | 0.50x | 2.00x |" in md and "| 0.75x | 25% |" in md
    assert "| tiny | mxfp4 (emulated) | default | 400 | 0.40x | 2.50x |" in md  # against the dense bf16 run
    cmd = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "moe_tiny", "--dense-model-size",
           "tiny", "--precisions", "bf16,mxfp4", "--train-iters", "3", "--out", str(tmp_path), "--dry-run"]
    lines = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert [ln.split("--model-size ")[1].split()[0] for ln in lines] == ["moe_tiny", "tiny"] * 2
    assert "tiny-mxfp4/child_stats.json" in lines[3]
    bad = subprocess.run(cmd[:5] + ["nope"] + cmd[6:], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dense-model-size nope: no configs/models/nope.yaml (a model-size name" in bad.stderr

"""``launch/gpu_check.sh`` kept from rotting on CPU: its dry run, its wheel refusal, its limits."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "gpu_check.sh"
BUDGET_S = 9 * 60  # what the device check gets on the node


def run(tmp_path, **env):
    e = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "SITE": str(tmp_path / "site"),
         "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=300, env=e,
                          check=False)


def test_dry_run_prints_every_bounded_step_within_the_budget(tmp_path):
    proc = run(tmp_path, DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any((tmp_path / "out").iterdir()), "a dry run wrote results"
    out = proc.stdout
    budgets = [int(s) for s in re.findall(r"^timeout (\d+) ", out, re.MULTILINE)]
    assert len(budgets) == 6 and sum(budgets) < BUDGET_S, budgets  # steps 0-5, each under its own timeout
    # the device checks: GEMM backends, then Triton quantizers and cast-transpose, then the engine
    for name in ("test_scaled_mm.py", "test_bf16_path.py", "test_triton_quant.py", "test_triton_bf16.py",
                 "test_cast_transpose.py", "test_megatron_engine.py"):
        assert re.search(rf"-m pytest -q -m gpu .*{name}", out), name
    assert out.index("test_scaled_mm.py") < out.index("test_triton_quant.py") < out.index("bench_kernels.py") \
        < out.index("bench_pretrain.py --model-size 1.3b")
    assert "--formats mxfp4,nvfp4,fp8_e4m3 " in out  # a bounded kernel benchmark
    runs = [ln for ln in out.splitlines() if "--child-stats" in ln]
    assert len(runs) == 4 and all("--bf16 " in ln and "--tensor-model-parallel-size 1" in ln
                                  and "--micro-batch-size 8" in ln for ln in runs)
    assert all(str(tmp_path / "work") in ln for ln in runs)  # run logs stay out of $OUT


def test_refuses_before_any_step_naming_each_missing_wheel(tmp_path):
    # a Python without site-packages stands for the bare node: no megatron-core, no numpy, ...
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    proc = run(tmp_path, PYTHON=str(python))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "== 1." not in proc.stdout  # nothing ran
    err = proc.stderr
    assert "gpu_check.sh: missing on this machine: megatron.core (wheel: megatron-core==0.16.1)" in err
    assert "numpy (wheel: numpy)" in err and "FETCH_WHEELS=1 bash launch/gpu_check.sh" in err
    assert "optional: torchao missing (torchao==0.18.0)" in proc.stdout


def test_writes_at_most_8_files_and_names_no_machine_paths():
    text = SCRIPT.read_text()
    files = set(re.findall(r"\$OUT/([\w.]+)", text)) - {"*.txt", "*.json", "*.md"}
    files |= {"bench_pretrain.md", "bench_pretrain.json"}  # copied from $WORK
    assert len(files) <= 8, files
    # paths live in variables ($OUT, $WORK, .whl/): no absolute path of any one machine is written in
    assert not re.search(r"(?<![\w$}])/(?:work|root|home|tmp|opt|mnt)/", text)


def test_gpu_marker_selects_the_triton_and_cast_transpose_tests():
    for name in ("test_triton_quant.py", "test_triton_bf16.py", "test_cast_transpose.py"):
        assert re.search(r"^pytestmark = .*pytest\.mark\.gpu", (REPO / "tests/kernels" / name).read_text(),
                         re.MULTILINE), name


@pytest.mark.slow
def test_environment_step_runs_on_cpu(tmp_path):
    proc = run(tmp_path, STEPS="0", BUDGET_SCALE="4")  # a shared CPU machine imports megatron slowly
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = (tmp_path / "out" / "environment.txt").read_text()
    assert "| torch " in env and "torch.mm(out_dtype=): yes" in env and "SDPA enable_gqa" in env
    assert "fp8: GEMMs per backend: emulated 3" in env
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["environment.txt"]


def test_bench_pretrain_gives_every_run_its_micro_batch(tmp_path):
    """bench_pretrain --micro-batch-size N reaches every run (8 by default on CUDA: at 1 or 2 a
    quantized step measures host overhead); one given after -- wins; a bad value is one line."""
    base = [sys.executable, str(REPO / "launch" / "bench_pretrain.py"), "--model-size", "tiny", "--precisions",
            "bf16,fp8", "--train-iters", "3", "--out", str(tmp_path), "--dry-run", "--micro-batch-size", "8"]
    out = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    runs = [ln for ln in out.splitlines() if "--child-stats" in ln]
    assert len(runs) == 2 and all(ln.count("--micro-batch-size 8") == 1 for ln in runs), out
    out = subprocess.run(base + ["--", "--micro-batch-size", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    runs = [ln for ln in out.splitlines() if "--child-stats" in ln]
    assert all("--micro-batch-size 2" in ln and "--micro-batch-size 8" not in ln for ln in runs), out
    bad = subprocess.run(base[:-1] + ["0"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--micro-batch-size: must be >= 1, got 0" in bad.stderr

"""``launch/gpu_check.sh`` kept from rotting on CPU: its dry run, its wheel refusal, its limits."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "gpu_check.sh"
BUDGET_S = 8 * 60  # what the device check gets on the node, installation included
INSTALL_S = 30  # the carried wheels' installation before the first step


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
    budgets = [int(s) for s in re.findall(r"^timeout -k 10 (\d+) ", out, re.MULTILINE)]
    assert len(budgets) == 6 and sum(budgets) + INSTALL_S <= BUDGET_S, budgets  # steps 0-5, each bounded
    # the device checks: GEMM backends, then Triton quantizers and cast-transpose, then the engine
    for name in ("test_scaled_mm.py", "test_bf16_path.py", "test_triton_quant.py", "test_triton_bf16.py",
                 "test_cast_transpose.py", "test_megatron_engine.py", "test_operand_compile.py"):
        assert re.search(rf"-m pytest -q -m gpu .*{name}", out), name
    # ordered by value: versions and paths, Triton bit-exactness, the 1.3B tokens/s, then the rest
    assert out.index("api_report, the probe") < out.index("test_triton_quant.py") \
        < out.index("bench_pretrain.py --model-size 1.3b") < out.index("test_scaled_mm.py") \
        < out.index("test_operand_compile.py") \
        < out.index("bench_kernels.py") < out.index("test_megatron_engine.py")
    assert "--formats mxfp4,nvfp4,fp8_e4m3 " in out and "--hidden 2048 --ffn 11264" in out  # the 1.3B's fc1
    bench = next(ln for ln in out.splitlines() if "bench_pretrain.py --model-size 1.3b" in ln)
    iters, skip = (int(re.search(rf"--{k} (\d+)", bench).group(1)) for k in ("train-iters", "skip"))
    assert iters - skip >= 10, bench  # at least 10 timed iterations after the warm-up
    runs = [ln for ln in out.splitlines() if "--child-stats" in ln]
    assert [re.search(r"--precision (\S+)", ln).group(1) for ln in runs] == ["bf16", "fp8", "wgrad_hadamard"]
    for ln in runs:  # gradient accumulation: 2 micro-batches per optimizer step
        assert "--bf16 " in ln and "--tensor-model-parallel-size 1" in ln
        assert "--micro-batch-size 8" in ln and "--global-batch-size 16" in ln, ln
    assert all(str(tmp_path / "work") in ln for ln in runs)  # run logs stay out of $OUT


def test_a_global_batch_without_accumulation_is_refused_in_one_line(tmp_path):
    proc = run(tmp_path, DRY_RUN="1", MICRO_BATCH="8", GLOBAL_BATCH="8")
    assert proc.returncode == 2 and "== 0." not in proc.stdout
    assert proc.stderr.strip() == ("gpu_check.sh: GLOBAL_BATCH=8 must be a multiple of MICRO_BATCH=8 larger than it "
                                   "(gradient accumulation keeps the optimizer step out of most timed iterations)")


def test_a_step_leaves_no_process_behind(tmp_path):
    """A step cut at its budget is killed with every process it started (its session), and the
    script goes on to the next step."""
    text = SCRIPT.read_text()
    body = text[text.index("step() {"):text.index("\n}\n", text.index("step() {")) + 3]
    marker = tmp_path / "alive"
    script = tmp_path / "one_step.sh"
    script.write_text("set -uo pipefail\nSTEPS=' 7 '\nDRY=0\nBUDGET_SCALE=1\nSESSION=$(command -v setsid || true)\n"
                      + body[body.index("step() {"):] + "\n"
                      + f"step 7 2 {tmp_path}/log.txt sh -c 'sleep 47.3 & echo started; sleep 47.3'\n"
                      + f"echo rc=$?\nsleep 1\npgrep -f 'sleep 47.3' > {marker} || true\n")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert "started" in proc.stdout and "rc=124" in proc.stdout and "(step cut at its 2 s budget)" in proc.stdout
    assert marker.read_text().strip() == "", "a process of the cut step survived"


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
    # step 3's compile check: its CUDA case carries the marker (the CPU case runs in every CI run)
    text = (REPO / "tests/kernels/test_operand_compile.py").read_text()
    assert "@pytest.mark.gpu\n" in text and "fullgraph=True" in text


@pytest.mark.slow
def test_environment_step_runs_on_cpu(tmp_path):
    proc = run(tmp_path, STEPS="0", BUDGET_SCALE="4")  # a shared CPU machine imports megatron slowly
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = (tmp_path / "out" / "environment.txt").read_text()
    assert "| torch " in env and "torch.mm(out_dtype=): yes" in env and "SDPA enable_gqa" in env
    assert "fp8: GEMMs per backend: emulated 3" in env and "  fprop: fp8_e4m3 -> emulated" in env
    assert "device: cpu: no known dense peak" in env
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

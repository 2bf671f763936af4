"""The device check's labels: "(emulated)" only for a quantized GEMM off its own tensor cores."""

import sys
from pathlib import Path

import pytest

from kernels.backends import describe_backends
from precision import presets

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
import bench_pretrain as bp

SM90 = (9, 0)


def _log(plan) -> str:  # what a run's log holds: the start-up report on a simulated H200
    return "x 1 micro-batches, 16,384 tokens\n" + describe_backends(plan, SM90) + "\n"


@pytest.mark.parametrize(("recipe", "emulated"), [("fp8", 0), ("bf16", 0), ("mxfp4", 6), ("wgrad_hadamard", 6)])
def test_the_bf16_output_layer_does_not_make_a_recipe_emulated(recipe, emulated):
    plan = {"decoder.layers.0.mlp.linear_fc1": presets.get(recipe), "decoder.layers.0.mlp.linear_fc2":
            presets.get(recipe), "output_layer": presets.get("bf16")}
    fields = bp._log_fields(_log(plan))
    assert fields["emulated_gemms"] == emulated
    # fp8 on an H200: 6 FP8 tensor-core GEMMs and the BF16 output layer's 3 plain BF16 GEMMs
    if recipe == "fp8":
        assert fields["gemm_paths"] == {"bf16_mm": 3, "fp8_scaled_mm": 6}
        assert bp.is_emulated("fp8", fields["gemm_paths"])  # what the counts alone said (the old label)


def test_cpu_gemms_are_emulated():
    text = "x\n" + describe_backends({"output_layer": presets.get("bf16")}, "cpu")
    assert bp._log_fields(text)["emulated_gemms"] == 3


def test_table_gives_mfu_against_both_peaks():
    row = {"precision": "bf16", "mode": "on", "tokens_per_sec": 1.0, "tflops_per_device": 395.0,
           "memory_kind": "cuda_allocated", "peak_memory_gib": 1.0, "quant_fraction": 0.0, "final_loss": 1.0,
           "gemm_paths": {"bf16_mm": 3}, "emulated": False}
    md = bp.table([row], 989.0, 790.0)
    assert "| MFU (datasheet) | MFU (measured BF16 GEMM) |" in md
    assert "| 395 | 39.9% | 50.0% |" in md
    assert "| 395 | 39.9% | n/a |" in bp.table([row], 989.0)  # no ceiling measured (a CPU run)
    assert bp.bf16_gemm_ceiling() is None or bp.bf16_gemm_ceiling() > 0


def test_bench_kernels_prints_an_empty_table(capsys):
    """On a CPU the device check's kernel set (Triton only) has no quantizer rows: a line, not a crash."""
    import bench_kernels as bk

    bk._print_table("quantizers", [], [("format", "format", "{}"), ("ms", "ms", "{:.2f}")])
    assert "(no rows: none of the asked implementations runs on this device)" in capsys.readouterr().out

"""A QAT plan says how much it quantizes: ``N of M linears quantized`` at start-up, a plan that
quantizes nothing refused in one line, and a warm-up shorter than the amax window warned about."""

from __future__ import annotations

from tests.pretrain.test_schedule import FAST, run_main


def test_hif8_w8a8_on_a_small_model_quantizes_nothing_and_is_refused(data_cache, capsys):
    # TINY has 2 layers: hif8_w8a8's first:3 / last:2 rules keep every linear in BF16
    status, out = run_main([*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "3",
                            "--precision", "hif8_w8a8", "--qat-warmup-iters", "1"], capsys)
    assert status == 2
    line = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(line) == 1 and ("--precision hif8_w8a8: the plan quantizes none of the 9 linears of this 2-layer "
                               "model") in line[0], out
    assert "--precision-rule 'kind:mlp=hif8_w8a8'" in line[0]
    assert "QAT warm-up done" not in out


def test_start_up_reports_quantized_linears_and_a_short_warmup(data_cache, capsys):
    status, out = run_main([*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "3", "--precision",
                            "hif8_w8a8", "--precision-rule", "kind:mlp=hif8_w8a8", "--qat-warmup-iters", "2"], capsys)
    assert status == 0, out
    assert "precision phase 1 (hif8_w8a8): 4 of 9 linears quantized" in out  # fc1 + fc2 of 2 layers
    assert ("warning: --qat-warmup-iters 2 is shorter than the amax window (64 steps of max): QAT starts with "
            "histories of 2 steps, not 64") in out
    status, out = run_main([*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "2",
                            "--precision", "bf16"], capsys)
    assert status == 0 and "--precision bf16: 0 of 9 linears quantized" in out and "warning" not in out

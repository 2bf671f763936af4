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
                            "hif8_w8a8", "--precision-rule", "kind:mlp=hif8_w8a8", "--qat-warmup-iters", "2",
                            "--qat-backward", "ste"], capsys)
    assert status == 0, out
    assert ("precision phase 1 (hif8_w8a8): 4 of 9 linears quantized; --qat-backward ste: Dgrad / Wgrad consume "
            "Fprop's Q(w), Q(x)") in out  # fc1 + fc2 of 2 layers
    assert ("warning: --qat-warmup-iters 2 is shorter than the amax window (64 steps of max): QAT starts with "
            "histories of 2 steps, not 64") in out
    status, out = run_main([*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "2",
                            "--precision", "bf16"], capsys)
    assert status == 0 and "--precision bf16: 0 of 9 linears quantized" in out and "warning" not in out


def test_fp8_margin_sets_every_per_tensor_operand_and_is_checked_per_format():
    import pytest

    from precision import PrecisionPolicy
    from pretrain.arguments import ConfigError
    from pretrain.train import override_margin

    names = [f"decoder.layers.{i}.mlp.linear_fc1" for i in range(2)] + ["output_layer"]
    plan = PrecisionPolicy.from_args("base=fp8,fprop=hif8+delayed(max,64)").resolve(names, 2)
    got = override_margin(plan, 2)
    lp = got["decoder.layers.0.mlp.linear_fc1"]
    assert lp.fprop.a.margin == lp.fprop.b.margin == lp.dgrad.a.margin == lp.wgrad.b.margin == 2
    assert lp.fprop.a.scale_target == 2.0 and lp.dgrad.a.scale_target == 57344 / 4  # E5M2 dy
    assert got["output_layer"] == plan["output_layer"]  # bf16: untouched
    assert got.rule_for("decoder.layers.0.mlp.linear_fc1").endswith("+ --fp8-margin 2")
    hif8_only = PrecisionPolicy.from_args("fprop=hif8,dgrad=bf16,wgrad=bf16").resolve(names, 2)
    assert override_margin(hif8_only, -12)["decoder.layers.1.mlp.linear_fc1"].fprop.a.scale_target == 2.0**15
    # ... HiF8 takes -12 (amax -> 2^15), FP8 does not
    with pytest.raises(ConfigError, match=r"--fp8-margin -1: fp8_e5m2: margin -1 must be an integer in \[0, 64\]"):
        override_margin(plan, -1)

"""The cost model against hand-computed single GEMMs on each target.

Shape 4096 x 4096 x 4096 (T = K = N): every GEMM is 2 * 4096^3 = 137,438,953,472 FLOPs; every
operand and the y / dx outputs hold 4096^2 = 16,777,216 elements (BF16: 33,554,432 bytes).
MXFP4 stores 4 + 8/32 = 4.25 bits = 0.53125 bytes per element (codes + E8M0 scales per 32).
"""

import pytest

from precision.cost_model import TARGETS, LinearShape, gemm_cost, get_target, linear_shapes, plan_cost
from precision.recipe import Gemm, LinearPrecision, parse_gemm

S = LinearShape("l", 4096, 4096, 4096)
E = 4096 * 4096  # elements of one operand
US = 1e-6


def cost(spec, gemm="fprop", target="b200", shape=S, fused=False):
    g = Gemm(gemm)
    return gemm_cost(shape, g, parse_gemm(spec, g), TARGETS[target], fused)


def test_b200_bf16_fprop_is_compute_bound():
    c = cost("bf16")
    assert c.compute_s == pytest.approx(137_438_953_472 / 2250e12)  # 61.08 us
    assert c.gemm_bytes == 3 * 2 * E  # x, w, y in BF16
    assert c.quant_bytes == 0
    assert c.bound == "compute" and c.time_s / US == pytest.approx(61.084, rel=1e-4)


def test_b200_mxfp4_fprop():
    c = cost("mxfp4")
    assert c.rate_class == "fp4"
    assert c.compute_s / US == pytest.approx(15.271, rel=1e-4)  # 9 PFLOP/s
    assert c.gemm_bytes == 2 * 0.53125 * E + 2 * E  # codes + scales of x and w, BF16 y
    assert c.quant_bytes == 2 * (2 + 0.53125) * E  # read BF16, write codes + scales, per operand
    assert c.time_s / US == pytest.approx(15.271 + 84_934_656 / 8e12 / US, rel=1e-4)  # 25.888 us


def test_b200_wgrad_hadamard_pays_an_extra_pass():
    c = cost("mxfp4+had16", "wgrad")
    rotation = 2 * 2 * (2 * E)  # read + write both BF16 operands once more
    assert c.quant_bytes == 2 * (2 + 0.53125) * E + rotation
    assert c.gemm_bytes == 2 * 0.53125 * E + 4 * E  # dw accumulates in FP32
    assert c.time_s / US == pytest.approx(15.271 + 219_152_384 / 8e12 / US, rel=1e-4)  # 42.665 us


def test_b200_fused_quantization_writes_only_codes():
    c = cost("mxfp4", fused=True)
    assert c.quant_bytes == 2 * 0.53125 * E
    assert c.time_s / US == pytest.approx(15.271 + 2.228, rel=1e-3)
    assert cost("mxfp4+had16", "wgrad", fused=True).quant_bytes == 2 * 0.53125 * E  # rotation fused too


def test_mi355x_fp8_current_scaling_reads_the_operand_twice():
    c = cost("fp8", target="mi355x")
    assert c.rate_class == "fp8"
    assert c.compute_s / US == pytest.approx(137_438_953_472 / 5033.2e12 / US)  # 27.306 us
    assert c.quant_bytes == 2 * (2 + 1 + 2) * E  # amax pass + cast pass (read 2, write 1)
    assert c.time_s / US == pytest.approx(27.306 + 20.972, rel=1e-4)


def test_mi355x_mxfp6_runs_at_the_fp4_rate():
    c6, c4 = cost("mxfp6_e2m3", target="mi355x"), cost("mxfp4", target="mi355x")
    assert c6.rate_class == "fp6" and c6.compute_s == c4.compute_s  # MXFP6 = MXFP4 = 2x FP8 = 4x BF16
    assert c6.compute_s / US == pytest.approx(13.654, rel=1e-4)
    assert cost("bf16", target="mi355x").compute_s == pytest.approx(4 * c6.compute_s, rel=1e-3)
    assert c6.quant_bytes == 2 * (2 + 0.78125) * E  # 6 + 8/32 bits
    assert cost("nvfp4", target="mi355x").rate_class == "bf16"  # OCP MX only: NVFP4 emulated


def test_b200_mxfp6_runs_at_the_fp8_rate():
    assert cost("mxfp6_e2m3").compute_s == cost("fp8").compute_s


def test_h200_emulates_fp4_at_the_bf16_rate():
    c = cost("mxfp4", target="h200")
    assert c.rate_class == "bf16"
    assert c.compute_s / US == pytest.approx(138.897, rel=1e-4)  # 989.5 TFLOP/s
    assert c.gemm_bytes == 3 * 2 * E  # dequantized to BF16 for a BF16 GEMM
    assert c.quant_bytes == 2 * (2 + 2) * E
    assert c.time_s / US == pytest.approx(138.897 + 27.962, rel=1e-4)  # slower than BF16 itself
    assert c.time_s > cost("bf16", target="h200").time_s
    fp8 = cost("fp8", "wgrad", target="h200")
    assert fp8.rate_class == "fp8" and fp8.time_s / US == pytest.approx(69.449 + 34.953, rel=1e-4)


def test_mixed_operands_run_at_the_slower_rate():
    assert cost("mxfp4@fp8").rate_class == "fp8"
    assert cost("mxfp4@fp8").compute_s == cost("fp8").compute_s


def test_small_gemm_is_memory_bound():
    c = cost("bf16", shape=LinearShape("s", 256, 256, 256))
    assert c.bound == "memory"
    assert c.time_s == pytest.approx(3 * 2 * 256 * 256 / 8e12)  # 49.2 ns: the bytes, not the FLOPs


def test_tiny_model_shapes_and_plan_ratio():
    from model.gpt import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8,
                      num_query_groups=4, seq_length=128, vocab_size=4000)
    shapes = {s.name: s for s in linear_shapes(cfg, micro_batch_size=4, tp_size=2)}
    assert len(shapes) == 2 * 4 + 1
    assert shapes["decoder.layers.0.self_attention.linear_qkv"] == LinearShape(
        "decoder.layers.0.self_attention.linear_qkv", 512, 256, 256)  # (8 + 2*4) * 32 / TP
    assert shapes["decoder.layers.1.mlp.linear_fc1"].out_features == 768  # SwiGLU 2*768 / TP
    assert shapes["decoder.layers.1.mlp.linear_fc2"].in_features == 384  # row parallel
    assert shapes["output_layer"].out_features == 2048  # 4000 padded to 4096, / TP
    bf16 = {n: LinearPrecision() for n in shapes}
    cost_bf16 = plan_cost(shapes.values(), bf16, TARGETS["b200"])
    assert cost_bf16.ratio(cost_bf16) == 1.0
    assert len(cost_bf16.per) == 3 * len(shapes)


def test_unknown_target_is_one_line():
    with pytest.raises(ValueError, match=r"--target 'a100': unknown; valid: b200, mi355x, h200"):
        get_target("a100")


def test_module_docstring_example():
    import doctest

    import precision.cost_model as cost_model

    assert doctest.testmod(cost_model).failed == 0

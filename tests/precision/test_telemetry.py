"""Per-operand numerics telemetry: the numbers are right, and collecting them changes nothing."""

import torch

from model.linear import policy_linear
from precision import LayerQuantState, presets, quantize
from precision.telemetry import operand_stats


def test_mx_clipped_and_flushed_fractions():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([7.9, 1.0, 1e-3, -2.0])  # floor scale 2^0: 7.9 clips; 1e-3 flushes
    deq = quantize(x, "mxfp4").dequantize()
    s = operand_stats(x, deq, "mxfp4", axis=1)
    assert s["clipped"] == 1 / 32 and s["flushed"] == 1 / 32 and s["amax"] == torch.tensor(7.9).item()
    assert 10 < s["sqnr_db"] < 30


def test_per_tensor_clipping_under_delayed_scale():
    x = torch.tensor([1.0, 2.0, 4.0, 100.0])
    deq = quantize(x, "hif8", amax=4.0).dequantize()
    s = operand_stats(x, deq, "hif8", scale_amax=4.0)
    assert s["clipped"] == 0.25 and s["amax_ratio"] == 25.0


def test_exact_operand_reports_max_sqnr():
    x = torch.tensor([[1.0, 2.0, -4.0, 0.5] * 8])
    s = operand_stats(x, quantize(x, "mxfp4").dequantize(), "mxfp4", axis=1)
    assert s["sqnr_db"] == 200.0 and s["clipped"] == 0 and s["flushed"] == 0


def test_collecting_stats_is_bit_neutral_and_covers_every_operand():
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)
    outs = []
    for collect in (False, True):
        st = LayerQuantState(1, "l")
        st.collect_stats = collect
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        policy_linear(xr, wr, presets.get("wgrad_hadamard"), state=st).backward(dy)
        outs.append((xr.grad, wr.grad, st))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    stats = outs[1][2].stats
    assert set(stats) == {"fprop/x", "fprop/w", "dgrad/dy", "dgrad/w", "wgrad/dy", "wgrad/x"}
    for v in stats.values():
        assert all(k in v for k in ("sqnr_db", "clipped", "flushed", "amax"))
        assert 5 < v["sqnr_db"] < 40


def test_block_figures_follow_each_gemms_contraction_axis():
    """Wgrad's operands are blocked along tokens, Fprop's along features: the recorded per-block
    figures are precision.block_stats' on the quantizer's input along that axis; a GEMM that rotates
    its operands reports no had16_* (its input already is the rotated one)."""
    from precision.block_stats import block_figures, hadamard_figures

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g)
    x[0] *= 300.0  # a first-token row: one outlier in each 32-token column block
    w, dy = torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)
    stats = {}
    for preset in ("mxfp4", "wgrad_hadamard"):
        st = LayerQuantState(1, "l")
        st.collect_stats = True
        policy_linear(x.clone().requires_grad_(True), w.clone().requires_grad_(True), presets.get(preset),
                      state=st).backward(dy)
        stats[preset] = st.stats
    plain = stats["mxfp4"]
    for key, axis in (("wgrad/x", 0), ("fprop/x", 1)):
        want = block_figures(x, quantize(x, "mxfp4", axis=axis).dequantize(), axis=axis)
        want.update(hadamard_figures(x, "mxfp4", axis=axis))
        for k, v in want.items():
            assert plain[key][k] == v, (key, k)
    assert plain["wgrad/x"]["flushed_nonzero"] > 3 * plain["fprop/x"]["flushed_nonzero"]
    assert plain["wgrad/x"]["had16_flushed_nonzero"] < plain["wgrad/x"]["flushed_nonzero"]
    assert not any(k.startswith("had16_") for k in stats["wgrad_hadamard"]["wgrad/x"])
    assert "had16_block_top_share" in stats["wgrad_hadamard"]["fprop/x"]

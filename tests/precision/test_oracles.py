"""Our MX and NVFP4 quantizers against torchao's independent references (to_mx, nvfp4_quantize).

Scale rule for each comparison is in the test id (floor = OCP, rceil = NVIDIA hardware).
torchao differs from our rule on non-finite input (NUMERICS.md: a block with Inf is NaN for us),
so the oracle comparisons use finite data; the non-finite rule is tested in test_formats.py.
"""

import pytest
import torch

pytest.importorskip("torchao")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize  # noqa: E402

from precision import quantize  # noqa: E402

ELEM = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}
MODE = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


def adversarial(rows: int = 64, seed: int = 0) -> torch.Tensor:
    """Random normals, wide exponent ranges, E2M1/E4M3 ties, saturating maxima, zero blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 256, generator=g)
    x[: rows // 4] *= torch.exp2(torch.randint(-60, 60, (rows // 4, 1), generator=g).float())
    x[rows // 4: rows // 2] = torch.exp2(torch.randint(-20, 20, (rows // 4, 256), generator=g).float()) * \
        torch.randn(rows // 4, 256, generator=g).sign()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.5, 7.0, 7.75])
    x[rows // 2, :11] = ties
    x[rows // 2, 11] = 6.0  # block amax exactly 6 -> scale 2^0 with floor for E2M1
    x[rows // 2 + 1, :32] = 0.0  # zero block
    x[rows // 2 + 2] *= 1e30
    x[rows // 2 + 3] *= 1e-30
    x[rows // 2 + 4, :32] = torch.linspace(-7.99, 7.99, 32)  # mantissa > 1.5 -> floor clips
    return x


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mx_matches_torchao_to_mx(fmt, rule, seed):
    x = adversarial(seed=seed)
    scale_ref, data_ref = to_mx(x, ELEM[fmt], 32, MODE[rule])
    q = quantize(x, fmt, scale_rule=rule)
    assert torch.equal(q.scales, scale_ref.view(torch.uint8).reshape(q.scales.shape))
    if fmt == "mxfp4":
        assert torch.equal(q.packed(), data_ref.view(torch.uint8))
    else:
        # Compare values (sign of zero included through the bits).
        assert torch.equal(q.codes, data_ref.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_matches_torchao(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g).float())
    x[0, :16] = torch.linspace(-6, 6, 16)
    q = quantize(x, "nvfp4")
    amax = x.abs().amax()
    scale_ref, data_ref = nvfp4_quantize(x, 16, per_tensor_scale=amax / (448.0 * 6.0))
    # Two documented differences: torchao clamps the block scale to E4M3's smallest *normal*
    # (2^-6) where NUMERICS.md keeps E4M3 subnormal scales, and computes the block scale as
    # (amax_b / 6) / (amax_t / 2688) where TransformerEngine's order (ours) is
    # amax_b * (2688 / amax_t) / 6. Compare the blocks whose scale is normal in both.
    normal = scale_ref.float() > 2.0**-6
    assert normal.float().mean() > 0.8
    assert torch.equal(q.scales.view(torch.uint8)[normal], scale_ref.view(torch.uint8)[normal])
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes_ref = torch.stack([data_ref & 0xF, data_ref >> 4], dim=-1).reshape(64, 128)
    mask = normal.repeat_interleave(16, dim=1)
    same = (q.codes[mask] == codes_ref[mask]).float().mean().item()
    assert same > 0.999  # the two FP32 orders may land a value on opposite sides of a tie
    s = scale_ref.float().repeat_interleave(16, dim=1) * (amax / 2688.0)
    deq_ref = vals[codes_ref.long()] * s
    torch.testing.assert_close(q.dequantize()[mask], deq_ref[mask], rtol=2e-6, atol=0)

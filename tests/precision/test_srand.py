"""Counter-based stochastic-rounding uniforms (``precision.srand``) and their use by the quantizers."""

import pytest
import torch

from precision import quantize
from precision.srand import SRKey, mix32

_M32 = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32, written out on Python ints (the oracle for the tensor version)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def py_uniform(seed: int, index: int) -> float:
    lo, hi = seed & _M32, seed >> 32
    ka = lowbias32(lo ^ lowbias32(hi ^ 0x9E3779B9))
    kb = lowbias32(ka ^ hi ^ 0x85EBCA6B)
    h = lowbias32(lowbias32((index & _M32) ^ ka) ^ (index >> 32) ^ kb)
    return (h >> 8) / 2**24


def test_mix32_equals_the_integer_definition():
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    xs[:3] = torch.tensor([0, 1, _M32])
    assert mix32(xs).tolist() == [lowbias32(v) for v in xs.tolist()]


def test_uniforms_are_the_hash_of_the_global_index():
    key = SRKey(2**63 - 12345, row_offset=3, col_offset=5, global_cols=2**33)  # index above 2^32
    u = key.uniforms((2, 3))
    want = [[py_uniform(key.seed, (3 + r) * 2**33 + 5 + c) for c in range(3)] for r in range(2)]
    assert u.dtype == torch.float32 and u.tolist() == want


def test_a_shard_draws_the_whole_tensors_numbers():
    full = SRKey(7).uniforms((6, 64))
    rows = SRKey(7, row_offset=3, global_cols=64).uniforms((3, 64))  # row-parallel shard
    cols = SRKey(7, col_offset=32, global_cols=64).uniforms((6, 32))  # column-parallel shard
    assert torch.equal(rows, full[3:]) and torch.equal(cols, full[:, 32:])
    assert not torch.equal(SRKey(7).uniforms((6, 32)), cols)  # offsets matter
    assert not torch.equal(SRKey(8).uniforms((6, 64)), full)  # seeds matter


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("axis", [0, 1])
def test_sr_quantize_of_a_shard_is_the_slice_of_the_whole(fmt, axis):
    """A column shard whose edge falls on a block boundary along the quantized axis quantizes as
    the matching slice of the whole tensor does (NVFP4 and FP8 given the whole tensor's amax)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g)
    amax = x.abs().amax()
    kw = dict(axis=axis, rounding="stochastic", amax=amax if fmt in ("nvfp4", "fp8_e5m2") else None)
    whole = quantize(x, fmt, sr=SRKey(11), **kw).dequantize()
    shard = quantize(x[:, 32:], fmt, sr=SRKey(11, col_offset=32, global_cols=64), **kw).dequantize()
    assert torch.equal(shard, whole[:, 32:])


def test_sr_with_a_key_is_unbiased_and_reproducible():
    x = torch.full((256, 256), 1.2)  # MXFP4 with scale 1: between the grid points 1 and 1.5
    q = quantize(x, "mxfp4", rounding="stochastic", sr=SRKey(3)).dequantize()
    assert set(q.unique().tolist()) == {1.0, 1.5}
    assert abs(q.mean().item() - 1.2) < 4 * 0.5 * (0.4 * 0.6 / x.numel()) ** 0.5  # 4 sigma
    assert torch.equal(q, quantize(x, "mxfp4", rounding="stochastic", sr=SRKey(3)).dequantize())
    assert not torch.equal(q, quantize(x, "mxfp4", rounding="stochastic", sr=SRKey(4)).dequantize())


def test_key_validation_errors_name_the_field():
    with pytest.raises(ValueError, match="seed"):
        SRKey(-1)
    with pytest.raises(ValueError, match="offsets"):
        SRKey(1, row_offset=-2)
    with pytest.raises(ValueError, match="global_cols"):
        SRKey(1, global_cols=0)


def test_nvfp4_takes_an_external_tensor_amax():
    x = torch.randn(4, 32)
    local = quantize(x, "nvfp4")
    bigger = quantize(x, "nvfp4", amax=torch.tensor(40.0))
    assert torch.equal(bigger.tensor_scale, torch.tensor(448 * 6 / 40.0))
    assert torch.equal(quantize(x, "nvfp4", amax=40.0).codes, bigger.codes)
    assert torch.equal(quantize(x, "nvfp4", amax=x.abs().amax()).codes, local.codes)
    assert not torch.equal(bigger.scales, local.scales)

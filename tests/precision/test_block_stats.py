"""Per-block operand figures (precision.block_stats) against numpy on tensors whose answer is known."""

import math

import numpy as np
import torch

from precision import quantize
from precision.block_stats import block_figures, hadamard_figures


def _np_figures(x: np.ndarray, axis: int, block: int, flushed: np.ndarray) -> dict[str, float]:
    """The oracle: numpy's median (mean of the two middle values), energies in float64."""
    m = np.moveaxis(np.abs(x.astype(np.float64)), axis, -1)
    n = (m.shape[-1] // block) * block
    b = m[..., :n].reshape(-1, block)
    med, top = np.median(b, axis=1), b.max(axis=1)
    ratio = float(np.mean(top[med > 0] / med[med > 0]))
    e = (b**2).sum(1)
    share = float(np.mean((b**2).max(1)[e > 0] / e[e > 0]))
    nz = x != 0
    return {"flushed_nonzero": float((nz & flushed).sum() / nz.sum()), "block_max_median": ratio,
            "block_top_share": share}


def _np_mxfp4_flushes(x: np.ndarray, axis: int) -> np.ndarray:
    """Where OCP MXFP4 (floor scale 2^(floor(log2 amax) - 2), E2M1, nearest-even) gives zero:
    |x| / scale <= 0.25, half the smallest subnormal (0.5), the tie going to even zero."""
    m = np.moveaxis(np.abs(x.astype(np.float64)), axis, -1)
    b = m.reshape(*m.shape[:-1], -1, 32)
    amax = b.max(-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** (np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2), 1.0)
    return np.moveaxis(((b / scale) <= 0.25).reshape(m.shape), -1, axis)


def _first_token_tensor() -> torch.Tensor:
    """[64 tokens, 64 features]: token 0 of each 32-token block at 1000, every other element 1."""
    x = torch.ones(64, 64)
    x[0], x[32] = 1000.0, 1000.0
    return x


def test_one_outlier_per_token_block_flushes_the_rest_only_along_tokens():
    x = _first_token_tensor()
    tok = block_figures(x, quantize(x, "mxfp4", axis=0).dequantize(), axis=0)
    feat = block_figures(x, quantize(x, "mxfp4", axis=1).dequantize(), axis=1)
    # along tokens: each 32-block is one 1000 and 31 ones -> the ones fall below 0.25 * 2^7 and flush
    assert tok["flushed_nonzero"] == 31 / 32
    assert tok["block_max_median"] == 1000.0
    assert math.isclose(tok["block_top_share"], 1e6 / (1e6 + 31), rel_tol=1e-12)
    # along features every block is flat
    assert feat == {"flushed_nonzero": 0.0, "block_max_median": 1.0, "block_top_share": 1 / 32}


def test_hadamard_spreads_the_outlier():
    x = _first_token_tensor()
    had = hadamard_figures(x, "mxfp4", axis=0)
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    h /= 4.0
    xn = x.numpy().astype(np.float64)
    rot = np.einsum("ij,gjf->gif", h, xn.reshape(4, 16, 64)).reshape(64, 64)  # groups of 16 tokens
    want = _np_figures(rot, 0, 32, _np_mxfp4_flushes(rot, 0) & (rot != 0))
    for k, v in want.items():
        assert math.isclose(had[f"had16_{k}"], v, rel_tol=1e-5), k
    assert had["had16_flushed_nonzero"] < 0.6 and had["had16_block_max_median"] < 5  # far from 31/32 and 1000


def test_random_tensors_match_numpy_on_both_axes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, generator=g) * torch.exp(2 * torch.randn(96, 1, generator=g))  # heavy token scales
    x[5, :7] = 0.0
    x[40:45, 3] = 0.0
    for axis in (0, 1):
        deq = quantize(x, "mxfp4", axis=axis).dequantize()
        got = block_figures(x, deq, axis=axis)
        want = _np_figures(x.numpy(), axis, 32, _np_mxfp4_flushes(x.numpy(), axis))
        assert got["flushed_nonzero"] == want["flushed_nonzero"]
        for k in ("block_max_median", "block_top_share"):
            assert math.isclose(got[k], want[k], rel_tol=1e-5), (axis, k)


def test_partial_blocks_zeros_and_nonfinite():
    x = torch.tensor([[0.0] * 32 + [2.0] * 31 + [8.0] + [1.0, float("inf"), 3.0]])  # 67: two full blocks
    f = block_figures(x, x.clone(), axis=1)
    assert f["block_max_median"] == 4.0  # the all-zero block has no median; the tail block is dropped
    assert math.isclose(f["block_top_share"], 64 / (31 * 4 + 64))
    assert f["flushed_nonzero"] == 0.0
    assert hadamard_figures(x, "mxfp4", axis=1) == {}  # 67 is not a multiple of 16


def test_all_zero_tensor_gives_zero_figures_never_nan():
    z = torch.zeros(4, 64)
    assert block_figures(z, z, axis=1) == {"flushed_nonzero": 0.0, "block_max_median": 0.0, "block_top_share": 0.0}
    assert block_figures(torch.ones(2, 8), torch.ones(2, 8), axis=1)["block_max_median"] == 0.0  # no full block

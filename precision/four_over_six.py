"""Four over six (4/6): NVFP4 with a per-block choice between two block scales (arXiv 2512.02010).

E2M1's grid is coarsest near its maximum (4 -> 6 is one step of 2), so plain NVFP4, which maps
every block's amax to 6, makes its largest relative errors on the values near each block's
maximum. 4/6 quantizes every block twice -- once with its amax mapped to 6, once mapped to 4
(the scale 1.5x larger, so the block's top values fall where the grid is ...3, 4) -- and keeps, per
block, the candidate whose dequantized block is closer to the input.

The order of operations is the authors' reference quantizer (``fouroversix``'s PyTorch backend,
every step one FP32 operation)::

    S     = 6 * 256                       # E2M1 max x the largest block scale 4/6 allows
    g_enc = S / amax_tensor               # (1 for an all-zero tensor: every scale is then 0)
    s6    = e4m3((amax_block / 6) * g_enc)
    s4    = e4m3(((amax_block / 6) * g_enc) * 1.5)      # <= 384: still inside E4M3
    q_k   = e2m1_rne(x * (1 / ((1 / g_enc) * s_k)))    # 0 where s_k == 0
    d_k   = ((q_k * s_k) * amax_tensor) / S            # the block as the authors dequantize it
    err_k = sum((d_k - x)^2)   (mse, default) | sum |d_k - x| (mae) | max |d_k - x| (abs_max)
                                          # sums in precision.blocks.pairwise_sum's fixed order
    keep 4 where err_4 < err_6 (a tie keeps 6)

The per-tensor scale changes: the largest block scale is 256 instead of 448, so that a block
whose amax is the tensor's can still be scaled to 4 (256 x 1.5 = 384 <= 448). Codes and scale
bytes are stored as NVFP4's (``QuantizedTensor.tensor_scale`` = ``g_enc`` above), so any NVFP4
consumer -- the dequantizer, the BF16 form, the FP4 tensor-core GEMM -- reads them unchanged.

2-D weight tiles (``/2d``): the authors treat each 16x16 square as one 256-element block -- its
amax sets both candidate scales and the error is summed over the square -- so the square's codes
serve Fprop and Dgrad alike. Stochastic rounding: both candidates round with the same uniform
per element (the authors draw independent ones); the choice then looks at the rounded values, so
4/6 with SR is not unbiased (use ``ms_eden`` for an unbiased NVFP4 rounding).
"""

from __future__ import annotations

import torch

from precision.blocks import FP32_MAX, from_blocks, pairwise_sum, to_blocks
from precision.elements import E2M1, E4M3, e2m1_decode, e2m1_encode, fdiv
from precision.enums import FourOverSix, Rounding

__all__ = ["SCALE_MAX_4OVER6", "fouroversix_quantize", "fouroversix_quantize_blocks", "fouroversix_tensor_scale"]

SCALE_MAX_4OVER6 = 256.0  # the largest block scale under 4/6 (1.5 x 256 = 384 fits E4M3's 448)
EXPANSION = 1.5  # 6 / 4: the "map to 4" candidate's scale relative to the "map to 6" one
TILE = 16  # NVFP4's block and 2-D tile edge


def fouroversix_tensor_scale(amax_tensor: torch.Tensor) -> torch.Tensor:
    """``g_enc = (6 * 256) / amax`` as one FP32 division (1 for an all-zero tensor)."""
    amax_tensor = amax_tensor.float()
    g = torch.clamp(fdiv(E2M1.max_normal * SCALE_MAX_4OVER6, amax_tensor), max=FP32_MAX)
    return torch.where(amax_tensor == 0, torch.ones_like(g), g)


def _block_error(d: torch.Tensor, x: torch.Tensor, rule: FourOverSix) -> torch.Tensor:
    diff = d - x
    if rule == FourOverSix.MSE:
        return pairwise_sum(diff * diff)
    if rule == FourOverSix.MAE:
        return pairwise_sum(diff.abs())
    if rule == FourOverSix.ABS_MAX:
        return diff.abs().amax(dim=-1)
    raise ValueError(f"4over6: unknown error measure {rule!r}; valid: {', '.join(FourOverSix.values()[1:])}")


def fouroversix_quantize_blocks(
    xb: torch.Tensor,
    amax_tensor: torch.Tensor,
    rule: FourOverSix | str = FourOverSix.MSE,
    rounding: Rounding | str = Rounding.NEAREST,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """4/6 of float32 blocks ``[..., nblocks, B]`` (B = 16, or 256 for a flattened 16x16 tile)
    under the tensor-level ``amax_tensor`` (0-d). Returns ``(codes uint8, E4M3 scale bytes,
    g_enc, chose_4 bool [..., nblocks])``. A block holding NaN/Inf gets the NaN scale byte 0x7F
    and zero codes (NVFP4's rule); a block whose chosen scale is 0 stores zeros with their sign."""
    rule = FourOverSix.parse(rule, "4over6 error measure")
    rounding = Rounding.parse(rounding, "4over6 rounding")
    xb = xb.float()
    amax_t = amax_tensor.float().reshape(())
    g_enc = fouroversix_tensor_scale(amax_t)
    g_dec = 1.0 / g_enc
    amax_b = xb.abs().amax(dim=-1)
    finite = torch.isfinite(amax_b)
    amax_b = torch.where(finite, amax_b, torch.zeros_like(amax_b))
    x = torch.where(finite.unsqueeze(-1), xb, torch.zeros_like(xb))
    s6_hp = fdiv(amax_b, E2M1.max_normal) * g_enc
    if stochastic := rounding.stochastic:
        if u is None:  # one draw shared by both candidates
            u = torch.rand(xb.shape, generator=generator, device=xb.device, dtype=torch.float32)
    sign = torch.signbit(xb).to(torch.uint8) << E2M1.sign_shift
    cands = []
    for s_hp in (s6_hp, s6_hp * EXPANSION):
        s = torch.clamp(s_hp, max=E4M3.max_normal).to(torch.float8_e4m3fn).float()
        s_enc = torch.clamp(1.0 / (g_dec * s), max=FP32_MAX)
        v = torch.clamp(x * s_enc.unsqueeze(-1), -E2M1.max_normal, E2M1.max_normal)
        codes = e2m1_encode(v, rounding, None, u if stochastic else None)
        codes = torch.where((s == 0).unsqueeze(-1), sign, codes)
        d = fdiv(e2m1_decode(codes) * s.unsqueeze(-1) * amax_t, E2M1.max_normal * SCALE_MAX_4OVER6)
        cands.append((codes, s, _block_error(d, x, rule)))
    (c6, s6, e6), (c4, s4, e4) = cands
    chose_4 = (e4 < e6) & finite
    codes = torch.where(chose_4.unsqueeze(-1), c4, c6)
    scales = torch.where(chose_4, s4, s6).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.where(finite, scales, torch.full_like(scales, 0x7F))
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return codes, scales, g_enc, chose_4


def _tiles(x2: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A 2-D ``[R, C]`` tensor (zero-padded to whole 16x16 squares) as ``[R/16, C/16, 256]``, each
    square's elements in row-major order."""
    r, c = x2.shape
    x2 = torch.nn.functional.pad(x2, (0, (-c) % TILE, 0, (-r) % TILE))
    rt, ct = x2.shape[0] // TILE, x2.shape[1] // TILE
    return x2.reshape(rt, TILE, ct, TILE).permute(0, 2, 1, 3).reshape(rt, ct, TILE * TILE), rt, ct


def _untile(t: torch.Tensor, rt: int, ct: int, r: int, c: int) -> torch.Tensor:
    return t.reshape(rt, ct, TILE, TILE).permute(0, 2, 1, 3).reshape(rt * TILE, ct * TILE)[:r, :c]


def fouroversix_quantize(
    xf: torch.Tensor,
    axis: int,
    amax_tensor: torch.Tensor,
    rule: FourOverSix | str = FourOverSix.MSE,
    rounding: Rounding | str = Rounding.NEAREST,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
    block2d: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4/6 of a float32 tensor with 16-element blocks along ``axis`` (or 16x16 squares of a 2-D
    tensor, ``block2d``). Returns ``(codes shaped like xf, scale bytes laid out as NVFP4's -- the
    block axis ``axis`` shrunk to ceil(n / 16) -- and g_enc)``: the fields of an NVFP4
    ``QuantizedTensor``."""
    n = xf.shape[axis]
    if not block2d:
        xb = to_blocks(xf, axis, TILE)
        ub = to_blocks(u, axis, TILE) if u is not None else None
        codes, sbytes, g_enc, _ = fouroversix_quantize_blocks(xb, amax_tensor, rule, rounding, generator, ub)
        return from_blocks(codes, axis, n), sbytes.movedim(-1, axis), g_enc
    if xf.dim() != 2:
        raise ValueError(f"4over6 with 2-D tiles: expected a 2-D tensor (a weight [out, in]), got {tuple(xf.shape)}")
    if Rounding.parse(rounding, "4over6 rounding").stochastic:
        raise ValueError("4over6 with 2-D tiles rounds to nearest (one quantized weight serves Fprop and Dgrad)")
    r, c = xf.shape
    tiles, rt, ct = _tiles(xf)  # squares of the natural [out, in] layout, whatever the axis
    codes_t, grid, g_enc, _ = fouroversix_quantize_blocks(tiles, amax_tensor, rule)
    codes = _untile(codes_t, rt, ct, r, c)
    axis = axis % 2
    g = grid if axis == 1 else grid.t()  # [squares across the other axis, squares along axis]
    sbytes = g.repeat_interleave(TILE, dim=0)[: xf.shape[1 - axis]]
    return codes, sbytes.movedim(-1, axis).contiguous() if axis == 0 else sbytes, g_enc

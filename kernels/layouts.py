"""Operand and block-scale layouts that hardware scaled-GEMMs expect.

``torch._scaled_mm(A, B, ...)`` computes ``A [M, K] @ B [K, N]`` with ``A`` row-major and ``B``
column-major: both operands **contraction-major** (K contiguous). A GEMM's operands arrive in
their natural layouts (``kernels.gemm.CONTRACTION_AXES``); quantizing each one with
``layout="contraction_last"`` gives ``A_k [M, K]`` and ``B_k [N, K]``, and ``B = B_k.t()``::

    FPROP  y  = x ·wᵀ   A_k = x  [T, in]   B_k = w  [out, in]    (w blocks along axis 1)
    DGRAD  dx = dy·w    A_k = dy [T, out]  B_k = wᵀ [in, out]    (w blocks along axis 0)
    WGRAD  dw = dyᵀ·x   A_k = dyᵀ[out, T]  B_k = xᵀ [in, T]      (dy, x blocks along tokens)

Block scales come as ``[rows, K / block]`` (one byte per block). cuBLAS on sm_100 wants them in its
"blocked" layout: the matrix zero-padded to multiples of 128 rows x 4 columns and cut into
128x4 tiles stored one after another (row-tile major); inside a tile, element ``(r, c)`` sits at
``(r % 32) * 16 + (r // 32) * 4 + c`` -- 32 row-groups of 4x4. ``to_blocked`` / ``from_blocked``
compute that placement by index arithmetic (torchao's ``to_blocked`` reshapes instead: the tests
hold the two equal). On gfx950 (MI355X) the scales stay plain row-major ``[rows, K / block]``.

A weight in 2-D tiles (``/2d``: NVFP4 16x16, MX 32x32) is quantized once and feeds both GEMMs that
consume it: every square carries one scale, so Dgrad's ``B_k = wᵀ`` is Fprop's ``B_k = w`` with its
codes transposed and its square scales re-laid, no second quantization (:func:`transpose_tiled`)::

    FPROP  B_k = w  [out, in]  codes, scales [out, in/t]  (square (i, j)'s scale on rows 16i..)
    DGRAD  B_k = wᵀ [in, out]  codes.t(), scales [in, out/t] = squares.t() repeated on t rows
"""

from __future__ import annotations

import torch

from precision.formats import pack_codes, unpack_codes

__all__ = [
    "SCALE_LAYOUTS",
    "blocked_offsets",
    "from_blocked",
    "pack_fp4",
    "pad_rows",
    "to_blocked",
    "transpose_tiled",
    "unpack_fp4",
]

SCALE_LAYOUTS = ("blocked", "row_major")


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def blocked_offsets(rows: int, cols: int, device=None) -> torch.Tensor:
    """Flat position in the blocked layout of each element of the padded ``[rows', cols']`` matrix."""
    pr, pc = _ceil_to(rows, 128), _ceil_to(cols, 4)
    r = torch.arange(pr, device=device).unsqueeze(1)
    c = torch.arange(pc, device=device).unsqueeze(0)
    tile = (r // 128) * (pc // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` block scales -> the flat cuBLAS blocked layout (zero padding included).

    Length ``ceil(rows/128)*128 * ceil(cols/4)*4``; the dtype is kept (uint8, e8m0 or e4m3 bytes).
    """
    if scales.dim() != 2:
        raise ValueError(f"to_blocked: expected a 2-D [rows, K/block] scale matrix, "
                         f"got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.zeros(_ceil_to(rows, 128), _ceil_to(cols, 4), dtype=raw.dtype, device=scales.device)
    padded[:rows, :cols] = raw
    out = torch.empty(padded.numel(), dtype=raw.dtype, device=scales.device)
    out[blocked_offsets(rows, cols, scales.device).reshape(-1)] = padded.reshape(-1)
    return out.view(scales.dtype) if raw.dtype != scales.dtype else out


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: the ``[rows, cols]`` scale matrix (padding dropped)."""
    raw = blocked.view(torch.uint8) if blocked.element_size() == 1 else blocked
    flat = raw.reshape(-1)
    expected = _ceil_to(rows, 128) * _ceil_to(cols, 4)
    if flat.numel() != expected:
        raise ValueError(f"from_blocked: {flat.numel()} bytes cannot hold a blocked [{rows}, {cols}] "
                         f"scale matrix ({expected} expected)")
    out = flat[blocked_offsets(rows, cols, flat.device)][:rows, :cols].contiguous()
    return out.view(blocked.dtype) if raw.dtype != blocked.dtype else out


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) -> two per byte along the last axis, low nibble = even index
    (``precision.formats.pack_codes``, the registry's packing)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dimension must be even, got {codes.shape[-1]}")
    return pack_codes(codes, 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`."""
    return unpack_codes(packed, 4)


def pad_rows(t: torch.Tensor, multiple: int, dim: int = 0) -> torch.Tensor:
    """Zero-pad ``dim`` to a multiple (zero codes are +0.0 in every format here)."""
    pad = (-t.shape[dim]) % multiple
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=dim)


def transpose_tiled(codes: torch.Tensor, scales: torch.Tensor, tile: int, *, packed: bool):
    """A 2-D-tiled operand's hardware form for the GEMM that contracts its other axis.

    ``codes`` ``[rows, K]`` (``[rows, K/2]`` FP4 two per byte when ``packed``) and ``scales``
    ``[rows, K/tile]`` (each square's scale on each of its rows) -> ``(codes [K, rows]`` (packed
    likewise), ``scales [K, rows/tile])``: Fprop's weight ``w`` as Dgrad's ``wᵀ`` from the same
    quantization. ``rows`` must be even when ``packed``."""
    c = unpack_fp4(codes) if packed else codes
    rows = c.shape[0]
    if packed and rows % 2:
        raise ValueError(f"transpose_tiled: {rows} rows cannot pack two FP4 codes per byte once transposed")
    ct = c.t().contiguous()
    squares = scales[::tile]  # [ceil(rows / tile), K / tile]
    st = squares.t().repeat_interleave(tile, dim=0)[: ct.shape[0]].contiguous()
    return (pack_fp4(ct) if packed else ct), st

"""Fused Triton quantizers: one pass from a BF16/FP32 tensor to codes + scales (+ dequantized values).

Formats: every registry entry with a sign-exponent-mantissa element (``Format.triton``; ``TRITON_FORMATS``):
MX ``mxfp8_*``, ``mxfp6_*``, ``mxfp4`` (32-blocks, E8M0 scales, FLOOR or RCEIL), ``nvfp4`` (16-blocks,
E4M3 scales, FP32 tensor scale) and per-tensor ``fp8_e4m3`` / ``fp8_e5m2``; the element's constants
(bias, mantissa bits, sign position, which non-finite codes exist) come from its ``ElementSpec``.
Formats with a tensor-wide number (NVFP4's tensor scale, FP8's scale) computed from this tensor's
own amax take two launches: an amax kernel (atomic max of the finite ``|x|``, rotated first if
asked), then the quantize kernel, which computes the scale (and its reciprocal) from that amax with
``precision``'s expressions -- no torch ops between the two, no host sync. With a given amax
(delayed scaling, a TP-reduced amax) the quantize kernel is the only launch; for FP8 it also finds
this tensor's amax as it goes (telemetry, the delayed-scaling history).

Layout -- blocks run along ``axis`` (a GEMM operand's contraction axis), for any axis, without a
transposed copy. The input is addressed as ``[outer, n, inner]`` (``n`` the block axis) with its own
strides; the kernel's tile is ``TILE_R`` rows x ``TK`` elements of the block axis, where a "row" is
one ``(outer, inner)`` pair. For ``axis=-1`` rows are contiguous runs; for ``axis=0`` of a row-major
``[T, H]`` tensor (Wgrad: blocks over tokens) the loads are strided along the block axis and
contiguous across rows, which is what coalesces on a GPU. Row ``r = o*inner + i`` is also the row
order of ``x.movedim(axis, -1)``, so per-element random offsets (``r * n_pad + k``) and the
reference's stochastic-rounding draws line up with the reference's block layout.

Outputs are written either in the input's layout (``layout="input"``: what ``precision.quantize``
returns) or contraction-last (``layout="contraction_last"``: ``x.movedim(axis, -1)`` order, the
K-major operand ``torch._scaled_mm`` wants; with ``pack=True`` two FP4 codes per byte along K, low
nibble = even index).

Numerics are those of ``precision`` (see ``shared/NUMERICS.md``) and equal the reference bit for bit
for nearest rounding (tested under ``TRITON_INTERPRET=1``): scale exponents from float32 bits,
rounding onto the element grid by exact power-of-two rescaling and the ``(s + 2^23) - 2^23``
round-half-even identity, codes from the grid value's bits, divisions with ``div_rn``. FMA
contraction is disabled on launch so that ``a*b + c`` is never fused where the reference rounds
twice.

Stochastic rounding: ``u`` from ``tl.rand(seed, r * n_pad + k)`` inside the kernel (reproducible from
the seed on this backend; a different stream from the reference's ``torch.rand``), or -- for hardware
GEMM backends that must reproduce the emulated operands bit for bit -- uniforms drawn by the caller
in the reference's order (``sr=`` a tensor of them).

Rotation (``rotation``: a ``GemmRecipe``'s rotation name, ``had16``, ``had32`` or ``rht16*``):
``diag(signs)·H_n`` applied to consecutive groups of ``n`` along the block axis before quantization,
fused into the same pass, in the order of the
specification ``precision.rotation.rotate``: the signs (exact), the top-bit-first Walsh-Hadamard
butterflies ``(a, b) -> (a + b, a - b)`` (pairs ``(i, i + n/2)`` first), then one multiplication by
``fl(1/sqrt(n))``. Every step is one IEEE float32 operation in the same order on CPU, in the
interpreter and on a GPU (no FMA: see above), so fused quantization equals
``quantize(rotate(x))`` bit for bit for ``had16``, ``had32``, ``rht16`` and ``rht128`` alike, and the
hardware GEMM backends take their rotated operands from this kernel (``kernels.operand``).

The FP4 error controls (``OperandFormat.control``; docs/controls.md) run in the same pass, after the
rotation, each the reference's expression on the tile's blocks (``_four_over_six``, ``_ms_eden``,
``_quest``): NVFP4 four-over-six (two candidate block scales, the smaller block error kept, a tie
keeping 6; nearest or SR with one uniform for both), MS-EDEN over 16- or 128-element groups (a group
lies inside one tile: the tile is at least the group wide; the scale rounded stochastically with
the block's first element's uniform) and QuEST MXFP4 scales (nearest or SR). Block sums run in
``precision.blocks.pairwise_sum``'s order (``_pairwise``: halves added element-wise), E4M3 casts
saturate as torch's does, square roots are ``sqrt_rn``: bit-exact to the reference
(``tests/kernels/test_triton_controls.py``).

2-D weight tiles (``/2d``, a 2-D ``x``): the tile's rows hold whole ``tile x tile`` squares (NVFP4
16, MX 32); each square's amax -- NaN/Inf making the whole square non-finite -- scales all its
blocks, and 4/6 sums its error over the square (``_square_sum``), whichever axis the blocks run along.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

from precision.eden import EDEN_SCALE_MAX, VAL_MAX
from precision.enums import FourOverSix
from precision.formats import FORMATS, Rounding, ScaleRule, Scaling, format_names
from precision.quantize import operand_format
from precision.quest import EPS as QUEST_EPS
from precision.quest import QUEST_SCALE
from precision.recipe import OperandFormat
from precision.rotation import hadamard_matrix, rotation_size
from precision.srand import SRKey

__all__ = [
    "TRITON_FORMATS",
    "TritonQuantResult",
    "cast_transpose_triton",
    "interpreter_problem",
    "interpreting",
    "quantize_triton",
]

TRITON_FORMATS = format_names(lambda f: f.triton)  # the registry's formats with a kernel here

MODE_MX, MODE_NVFP4, MODE_TENSOR = 0, 1, 2
_MODE = {Scaling.BLOCK: MODE_MX, Scaling.TWO_LEVEL: MODE_NVFP4, Scaling.TENSOR: MODE_TENSOR}
# ELEM constexpr: how the element codes non-finite values (finite-only; E4M3 NaN; E5M2 Inf and NaN)
_NONFINITE = {"none": 0, "nan": 1, "inf_nan": 2}
FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)  # a constexpr: visible inside @jit
# the controls' float32 constants, exactly as the reference's FP32 arithmetic sees them
EDEN_VAL_MAX = tl.constexpr(float(np.float32(VAL_MAX)))  # a block amax maps here (6 / ((17/16) * 0.93))
EDEN_SCALE_MAX_F32 = tl.constexpr(float(np.float32(EDEN_SCALE_MAX)))  # 255.99
QUEST_SCALE_F32 = tl.constexpr(float(np.float32(QUEST_SCALE)))  # 2.92247856 / 6
QUEST_EPS_F32 = tl.constexpr(float(np.float32(QUEST_EPS)))  # 1e-8


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1`` before import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreter_problem() -> str | None:
    """Why the interpreter cannot run our kernels, or None: TRITON_INTERPRET=1 set only after triton
    itself was imported (torch.compile, torchao and megatron import it) leaves ``tl.max`` & co.
    compiled-only."""
    from triton.runtime.interpreter import InterpretedFunction

    if interpreting() and not isinstance(_quant_kernel, InterpretedFunction):
        return "TRITON_INTERPRET=1 was set after kernels.triton_quant was imported"
    if interpreting() and not isinstance(tl.standard.max, InterpretedFunction):
        return ("TRITON_INTERPRET=1 was set after triton was imported (torch.compile, torchao and megatron "
                "import it); set it in the environment before starting Python")
    return None


# ====================================================================== device helpers
@triton.jit
def _expfloor(a):
    """floor(log2(a)) of float32 a >= 0 from its exponent bits (-127 for 0 and subnormals)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _pow2(e):
    """Exact float32 2**e for int32 e in [-149, 127]."""
    normal = (tl.maximum(e + 127, 1) << 23).to(tl.float32, bitcast=True)
    one = tl.full(e.shape, 1, tl.int32)
    sub = (one << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _signbit(v):
    return (v.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def _round_grid(v, u, EMIN: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr,
                SR: tl.constexpr):
    """|v| rounded onto the element grid (ties to even, or stochastic with ``u``), saturating.

    Returns the magnitude (>= 0); the caller keeps the sign separately. Mirrors
    ``precision.elements.round_to_grid`` operation for operation.
    """
    mag = tl.abs(v)
    e = tl.minimum(tl.maximum(_expfloor(mag), EMIN), EMAX)
    steps = mag * _pow2(MBITS - e)  # exact: scaling by a power of two
    if SR:
        lo = tl.floor(steps)
        q = lo + (u < (steps - lo)).to(tl.float32)
    else:
        q = (steps + 8388608.0) - 8388608.0  # round half to even (steps < 2^23 whenever it matters)
    return tl.minimum(q * _pow2(e - MBITS), MAXN)


@triton.jit
def _grid_code(qm, EMIN: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr):
    """Code magnitude of a (non-negative, on-grid) element value."""
    bits = qm.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    normal = ((e + BIAS) << MBITS) | ((bits & 0x7FFFFF) >> (23 - MBITS))
    sub = (qm * SUBSCALE).to(tl.int32)  # subnormal element: the mantissa is an exact integer
    return tl.where(e >= EMIN, normal, sub)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (``precision.srand.mix32``)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _key_uniforms(sr_ka, sr_kb, sr_row, sr_col, sr_gcols, o2, i2, k2, N, INNER, C, NAT: tl.constexpr):
    """``precision.srand`` uniforms of the tile's elements from the SRKey params
    ``k_a, k_b, row_offset, col_offset, global_cols``, each passed as a kernel argument plus 2^32
    (``_sr_args``: Triton then types every one int64 whatever its value, so one compiled kernel
    serves every key, and no tensor is copied to the device per call). The element's natural 2-D position
    ``(row, col)`` of ``x.reshape(-1, C)``: NAT 0 -- blocks along the last axis (row o, col k);
    1 -- along the second-to-last (row o*N + k, col i); 2 -- any other axis (from the flat index)."""
    ka = (sr_ka - 4294967296).to(tl.uint32)
    kb = (sr_kb - 4294967296).to(tl.uint32)
    row_off = sr_row - 4294967296
    col_off = sr_col - 4294967296
    gcols = sr_gcols - 4294967296
    if NAT == 0:
        row = o2 + k2 * 0
        col = k2 + o2 * 0
    elif NAT == 1:
        row = o2 * N + k2 + i2 * 0
        col = i2 + k2 * 0
    else:
        flat = (o2 * N + k2) * INNER + i2
        row = flat // C
        col = flat % C
    idx = (row_off + row) * gcols + (col_off + col)
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    h = _mix32(_mix32(lo ^ ka) ^ hi ^ kb)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24: 24 bits, exact


@triton.jit
def _hadamard(a, TILE_R: tl.constexpr, TK: tl.constexpr, ROT: tl.constexpr, LOG_ROT: tl.constexpr):
    """Unnormalized Walsh-Hadamard butterflies on consecutive groups of ROT along axis 1, top bit
    first (pairs (i, i + ROT/2) first): the pairwise-halves order of the reference's fp32 matmul."""
    for s in tl.static_range(LOG_ROT):  # half-width ROT >> (s + 1): a constexpr per unrolled stage
        t = tl.reshape(a, [TILE_R, TK // (ROT >> s), 2, ROT >> (s + 1)])
        t = tl.permute(t, (0, 1, 3, 2))
        lo, hi = tl.split(t)
        t = tl.join(lo + hi, lo - hi)
        t = tl.permute(t, (0, 1, 3, 2))
        a = tl.reshape(t, [TILE_R, TK])
    return a


@triton.jit
def _pairwise(t, TILE_R: tl.constexpr, G: tl.constexpr, N: tl.constexpr):
    """``[TILE_R, G, N]`` (N a power of two <= 256) summed over its last axis in
    ``precision.blocks.pairwise_sum``'s order: the halves ``t[..., :N/2] + t[..., N/2:]`` added
    element-wise until one is left -> ``[TILE_R, G]``."""
    for s in tl.static_range(8):  # half-width N >> (s + 1): a constexpr per unrolled stage
        if (N >> s) > 1:
            t = tl.reshape(t, [TILE_R, G, 2, N >> (s + 1)])
            lo, hi = tl.split(tl.permute(t, (0, 1, 3, 2)))
            t = lo + hi
    return tl.reshape(t, [TILE_R, G])


@triton.jit
def _square_max(t, TILE_R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr):
    """2-D tiles: ``[TILE_R, NB]`` per-row block values -> each ``T x T`` square's maximum, for
    each of its T rows (the tile's rows are whole squares)."""
    m = tl.max(tl.reshape(t, [TILE_R // T, T, NB]), axis=1)
    return tl.reshape(tl.broadcast_to(m[:, None, :], [TILE_R // T, T, NB]), [TILE_R, NB])


@triton.jit
def _square_sum(t, TILE_R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr, TWO_D: tl.constexpr):
    """2-D tiles: ``[TILE_R, NB, T]`` -> each square's sum over its T*T elements in
    ``_pairwise``'s order of the square read row-major in the tensor's own ``[rows, cols]`` layout
    (``precision.four_over_six._tiles``), for each of its T rows. TWO_D 1: the tile's rows are the
    tensor's rows (blocks along axis 1); 2: its columns (blocks along axis 0)."""
    t4 = tl.reshape(t, [TILE_R // T, T, NB, T])
    if TWO_D == 1:
        t4 = tl.permute(t4, (0, 2, 1, 3))  # [square, block, row, col]
    else:
        t4 = tl.permute(t4, (0, 2, 3, 1))  # the tile's k runs along the tensor's rows
    m = _pairwise(tl.reshape(t4, [TILE_R // T, NB, T * T]), TILE_R // T, NB, T * T)
    return tl.reshape(tl.broadcast_to(m[:, None, :], [TILE_R // T, T, NB]), [TILE_R, NB])


@triton.jit
def _e4m3_rne(s):
    """float32 s >= 0 (or NaN) cast to E4M3 as torch's cast does: nearest-even, saturating at 448
    (+Inf too), NaN kept."""
    r = _round_grid(s, s, -6, 8, 3, 448.0, False)
    return tl.where(s == s, r, s)


@triton.jit
def _e4m3_value(b):
    """The value of E4M3 byte ``b`` in [0, 0x7E] (positive, finite)."""
    e = b >> 3
    m = (b & 7).to(tl.float32)
    return tl.where(e == 0, m * 0.001953125, (m + 8.0) * _pow2(e - 10))  # subnormal: m * 2^-9


@triton.jit
def _sr_e4m3(c, u):
    """``precision.eden._sr_e4m3``: positive float32 ``c`` rounded stochastically onto E4M3 between
    the neighbours of its (saturating) nearest-even cast -- up with probability
    ``(c - down) / (up - down)`` against ``u`` -- with the reference's edges: the neighbour past
    448 (byte 0x7F) and below 0 (0xFF) are NaN, so ``c`` above 448 stays 448; NaN stays NaN."""
    cur = _e4m3_rne(c)
    b = _grid_code(cur, -6, 3, 7, 512.0)
    nan = float("nan")
    nxt = tl.where(b >= 0x7E, nan, _e4m3_value(tl.minimum(b + 1, 0x7E)))
    prev = tl.where(b <= 0, nan, _e4m3_value(tl.maximum(b - 1, 0)))
    above = cur > c
    up = tl.where(above, cur, nxt)
    down = tl.where(above, prev, cur)
    p_up = tl.math.div_rn(c - down, up - down)
    out = tl.where(u < p_up, up, down)
    return tl.where(c == c, out, c)


@triton.jit
def _e2m1_away(v):
    """|v| rounded to the nearest E2M1 value, midpoints away from zero, saturating at 6 (NaN -> 6):
    ``precision.eden.rtn_e2m1_away``'s magnitude (``bucketize(right=True)`` over the midpoints)."""
    a = tl.abs(v)
    m = tl.where(a >= 5.0, 6.0, tl.where(a >= 3.5, 4.0, tl.where(a >= 2.5, 3.0, tl.where(a >= 1.75, 2.0,
        tl.where(a >= 1.25, 1.5, tl.where(a >= 0.75, 1.0, tl.where(a >= 0.25, 0.5, 0.0)))))))
    return tl.where(a == a, m, 6.0)


@triton.jit
def _e2m1_toward_zero(a):
    """|v| = ``a`` rounded to the nearest E2M1 value, midpoints towards zero, beyond 5 -> 6:
    ``precision.quest.rtn_e2m1_toward_zero``'s magnitude (``bucketize(right=False)``)."""
    return tl.where(a > 5.0, 6.0, tl.where(a > 3.5, 4.0, tl.where(a > 2.5, 3.0, tl.where(a > 1.75, 2.0,
        tl.where(a > 1.25, 1.5, tl.where(a > 0.75, 1.0, tl.where(a > 0.25, 0.5, 0.0)))))))


# ====================================================================== the FP4 error controls
# Each takes one tile's blocks ``xb [TILE_R, NB, BLOCK]`` (non-finite elements already zeroed),
# ``bad [TILE_R, NB]`` (the block held NaN/Inf: zeroed whole here, as the reference zeroes it,
# before any sum that spans blocks; the caller overwrites its outputs), the input's sign bits
# ``sb`` and the SR uniforms ``ub`` (block layout), and returns ``(scale [TILE_R, NB], E2M1 codes,
# signed element values)``; the dequantized element is the element value times the scale.
@triton.jit
def _signed(qm, neg):
    """E2M1 code and signed value of the grid magnitude ``qm`` with sign bit ``neg``."""
    return _grid_code(qm, 0, 1, 1, 2.0) | (neg << 3), tl.where(neg == 1, -qm, qm)


@triton.jit
def _fos_candidate(x, ub, s_hp, a_t, g_dec, ERR: tl.constexpr, SR: tl.constexpr, TILE_R: tl.constexpr,
                   NB: tl.constexpr, BLOCK: tl.constexpr, TWO_D: tl.constexpr):
    """One 4/6 candidate (``precision.four_over_six``): the E4M3 scale of ``s_hp``, the rounded
    magnitudes and the block error of the authors' dequantization ``((q * s) * amax) / (6 * 256)``."""
    s = _e4m3_rne(tl.minimum(s_hp, 448.0))
    s_enc = tl.minimum(tl.math.div_rn(tl.zeros_like(s) + 1.0, g_dec * s), FP32_MAX)
    v = tl.minimum(tl.maximum(x * s_enc[:, :, None], -6.0), 6.0)
    qm = _round_grid(v, ub, 0, 2, 1, 6.0, SR)
    qm = tl.where((s == 0.0)[:, :, None], 0.0, qm)  # a zero scale stores zeros
    qv = tl.where(_signbit(x) == 1, -qm, qm)
    d = tl.math.div_rn((qv * s[:, :, None]) * a_t, tl.zeros_like(qv) + 1536.0)
    diff = d - x
    if ERR == 2:
        err = tl.max(tl.abs(diff), axis=2)
        if TWO_D > 0:
            err = _square_max(err, TILE_R, NB, BLOCK)
    else:
        if ERR == 0:
            e = diff * diff
        else:
            e = tl.abs(diff)
        if TWO_D > 0:
            err = _square_sum(e, TILE_R, NB, BLOCK, TWO_D)
        else:
            err = _pairwise(e, TILE_R, NB, BLOCK)
    return s, qm, err


@triton.jit
def _four_over_six(xb, bad, sb, ub, a_t, g_enc, g_dec, ERR: tl.constexpr, SR: tl.constexpr,
                   TILE_R: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, TWO_D: tl.constexpr):
    """NVFP4 4/6: per block (2-D: per 16x16 square, its amax and its summed error) the candidate
    mapping the amax to 4 (scale x 1.5) where its error is smaller than the one mapping it to 6 (a
    tie keeps 6); both round with the same uniforms."""
    x = tl.where(bad[:, :, None], 0.0, xb)
    amax = tl.max(tl.abs(x), axis=2)
    if TWO_D > 0:
        amax = _square_max(amax, TILE_R, NB, BLOCK)
    s6_hp = tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0) * g_enc
    s6, q6, e6 = _fos_candidate(x, ub, s6_hp, a_t, g_dec, ERR, SR, TILE_R, NB, BLOCK, TWO_D)
    s4, q4, e4 = _fos_candidate(x, ub, s6_hp * 1.5, a_t, g_dec, ERR, SR, TILE_R, NB, BLOCK, TWO_D)
    four = e4 < e6
    code, qv = _signed(tl.where(four[:, :, None], q4, q6), sb)
    return tl.where(four, s4, s6), code, qv


@triton.jit
def _ms_eden(xb, bad, sb, ub, s_dec, TILE_R: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
             GROUP: tl.constexpr):
    """MS-EDEN (``precision.eden``): the E4M3 block scale mapping the block amax to VAL_MAX, elements
    to nearest (midpoints away from zero), EDEN's factor ``sum(v*v) / sum(v*q)`` over each GROUP of
    elements (16: the block; 128: eight blocks) and the corrected scale rounded stochastically with
    the block's first element's uniform."""
    x = tl.where(bad[:, :, None], 0.0, xb)
    amax = tl.max(tl.abs(x), axis=2)
    s_b = _e4m3_rne(tl.math.div_rn(tl.math.div_rn(amax, tl.zeros_like(amax) + EDEN_VAL_MAX),
                                   tl.zeros_like(amax) + s_dec))
    s_b = tl.where(s_b == 0.0, 1.0, s_b)
    v = tl.math.div_rn(x, tl.zeros_like(x) + (s_b * s_dec)[:, :, None])
    qm = _e2m1_away(v)
    q = tl.where(_signbit(v) == 1, -qm, qm)
    NG: tl.constexpr = NB * BLOCK // GROUP
    num = _pairwise(tl.reshape(v * v, [TILE_R, NG, GROUP]), TILE_R, NG, GROUP)
    den = _pairwise(tl.reshape(v * q, [TILE_R, NG, GROUP]), TILE_R, NG, GROUP)
    corr = tl.where(den == 0.0, 1.0, tl.math.div_rn(num, tl.where(den == 0.0, 1.0, den)))
    corr = tl.reshape(tl.broadcast_to(corr[:, :, None], [TILE_R, NG, GROUP // BLOCK]), [TILE_R, NB])
    lane = tl.arange(0, BLOCK)[None, None, :]
    u0 = tl.max(tl.where(lane == 0, ub, -1.0), axis=2)  # the block's first element's uniform
    # the code's sign: the input's (a zero keeps it, any other value has it) -- except where v is
    # NaN (a zero block under a tensor amax so small that s_dec underflows to 0: s_b = e4m3(0/0)),
    # whose +6 takes torch's positive NaN scale's sign; its scale is NaN, so it decodes to NaN anyway
    code, qv = _signed(qm, tl.where(v == v, sb, 0))
    return _sr_e4m3(s_b * corr, u0), code, qv


@triton.jit
def _quest(xb, bad, sb, ub, SR: tl.constexpr, TILE_R: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    """QuEST (``precision.quest``): the E8M0 exponent ``floor(log2(QUEST_SCALE * std + EPS))`` of
    the block's standard deviation (moments in the pairwise order, the variance clamped at 0),
    elements to nearest (midpoints towards zero, beyond 5 -> 6) or stochastically. Returns the
    scale byte (int32) in place of the scale."""
    x = tl.where(bad[:, :, None], 0.0, xb)
    n = tl.zeros([TILE_R, NB], dtype=tl.float32) + BLOCK
    mean_sq = tl.math.div_rn(_pairwise(x * x, TILE_R, NB, BLOCK), n)
    mean = tl.math.div_rn(_pairwise(x, TILE_R, NB, BLOCK), n)
    var = mean_sq - mean * mean
    var = tl.where(var < 0.0, 0.0, var)  # torch.clamp(min=0): NaN stays NaN
    e = _expfloor(tl.sqrt_rn(var) * QUEST_SCALE_F32 + QUEST_EPS_F32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    v = x * _pow2(-e)[:, :, None]  # exact: a power of two
    if SR:
        qm = _round_grid(v, ub, 0, 2, 1, 6.0, True)
    else:
        qm = _e2m1_toward_zero(tl.abs(v))
    code, qv = _signed(qm, sb)
    return e + 127, code, qv


# ====================================================================== the kernels
@triton.jit
def _load_tile(x_ptr, signs_ptr, R, N, INNER, sx_o, sx_i, sx_k, TILE_R: tl.constexpr, TK: tl.constexpr,
               ROT: tl.constexpr, LOG_ROT: tl.constexpr, ROT_C: tl.constexpr, HAS_SIGNS: tl.constexpr):
    """This program's [TILE_R, TK] float32 tile (zero outside the tensor), rotated if asked, and its
    addressing: rows r = (o, i), block-axis index k."""
    r1 = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)      # [TILE_R]
    k1 = tl.program_id(1).to(tl.int64) * TK + tl.arange(0, TK)              # [TK]
    r2 = r1[:, None]
    o2 = (r1 // INNER)[:, None]
    i2 = (r1 % INNER)[:, None]
    k2 = k1[None, :]
    row_ok = r2 < R
    valid = row_ok & (k2 < N)
    x = tl.load(x_ptr + o2 * sx_o + i2 * sx_i + k2 * sx_k, mask=valid, other=0.0).to(tl.float32)
    if ROT > 0:  # diag(signs)·H_ROT along the block axis, in precision.rotation.rotate's order:
        if HAS_SIGNS:  # signs (exact), butterflies, then one multiplication by 1/sqrt(ROT)
            sg = tl.load(signs_ptr + (k1 % ROT)).to(tl.float32)
            x = x * sg[None, :]
        x = _hadamard(x, TILE_R, TK, ROT, LOG_ROT) * ROT_C
    return x, r2, o2, i2, k2, row_ok, valid


@triton.jit
def _amax_kernel(x_ptr, signs_ptr, amax_ptr, R, N, INNER, sx_o, sx_i, sx_k,
                 TILE_R: tl.constexpr, TK: tl.constexpr, ROT: tl.constexpr, LOG_ROT: tl.constexpr,
                 ROT_C: tl.constexpr, HAS_SIGNS: tl.constexpr):
    """Atomic max of the finite |x| (rotated if asked) into an integer cell (int32 or int64, its
    low 32 bits): non-negative float32 values order like their bit patterns."""
    x, r2, o2, i2, k2, row_ok, valid = _load_tile(x_ptr, signs_ptr, R, N, INNER, sx_o, sx_i, sx_k, TILE_R, TK,
                                                  ROT, LOG_ROT, ROT_C, HAS_SIGNS)
    finite = (x == x) & (tl.abs(x) < float("inf"))
    m = tl.max(tl.max(tl.where(finite & valid, tl.abs(x), 0.0), axis=1), axis=0)
    tl.atomic_max(amax_ptr, m.to(tl.int32, bitcast=True).to(amax_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["sr_ka", "sr_kb", "sr_row", "sr_col", "sr_gcols"])
def _quant_kernel(
    x_ptr, signs_ptr, u_ptr, seed_ptr, sr_ka, sr_kb, sr_row, sr_col, sr_gcols, gs_ptr,
    codes_ptr, scales_ptr, dq_ptr, aux_ptr, ts_ptr,
    R, N, INNER, NPAD, NBLK, C,
    sx_o, sx_i, sx_k, sc_o, sc_i, sc_k, ss_o, ss_i, ss_k, sd_o, sd_i, sd_k, su_o, su_i, su_k,
    prescale,
    MODE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, TILE_R: tl.constexpr,
    ROT: tl.constexpr, LOG_ROT: tl.constexpr, ROT_C: tl.constexpr, HAS_SIGNS: tl.constexpr,
    ELEM: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    MAXN: tl.constexpr, SUBSCALE: tl.constexpr, SIGN_SHIFT: tl.constexpr,
    RCEIL: tl.constexpr, SR: tl.constexpr, U_GIVEN: tl.constexpr, KEYED: tl.constexpr, NAT: tl.constexpr,
    PRESCALE: tl.constexpr, TARGET: tl.constexpr, MARGIN: tl.constexpr, AMAX_OUT: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_DQ: tl.constexpr, PACK: tl.constexpr, BF16_FORM: tl.constexpr,
    CTRL: tl.constexpr, ERR: tl.constexpr, GROUP: tl.constexpr, TWO_D: tl.constexpr,
):
    """MODE 0: MX, 1: NVFP4, 2: per-tensor FP8. CTRL: the FP4 error control (``_CTRL``: 0 none,
    1 4over6 with error measure ERR, 2 MS-EDEN over GROUP-element groups, 3 QuEST). TWO_D: 2-D
    weight tiles of BLOCK x BLOCK (0: 1-D blocks; see :func:`_square_sum`).

    Tensor-level numbers (MODE 1, 2) are computed here from the amax at ``gs_ptr`` (float32: the
    amax pass's result, or a given delayed / TP-reduced amax), with the reference's expressions, and
    program (0, 0) writes them to ``ts_ptr`` (float32 ``[scale, 1/scale]``; NVFP4 ``[g_enc, 1/g_enc]``).
    MODE 2 also adds its clip count to ``aux_ptr[1]`` (int64) and, with AMAX_OUT (the amax was
    given, so no amax pass ran), max-reduces the tile's finite amax into ``aux_ptr[0]``.

    BF16_FORM: ``dq_ptr`` (bfloat16) receives the BF16 form (``kernels.bf16_operand``) instead of
    the FP32 dequantization: the element value (per-tensor), element x 2^(byte-127) without the
    pre-scale (MX), element x E4M3 block scale (NVFP4) -- exact in BF16."""
    TK: tl.constexpr = NB * BLOCK
    x, r2, o2, i2, k2, row_ok, valid = _load_tile(x_ptr, signs_ptr, R, N, INNER, sx_o, sx_i, sx_k, TILE_R, TK,
                                                  ROT, LOG_ROT, ROT_C, HAS_SIGNS)
    _quant_store(x, r2, o2, i2, k2, row_ok, valid, tl.program_id(0), tl.program_id(1), tl.num_programs(1),
                 u_ptr, seed_ptr, sr_ka, sr_kb, sr_row, sr_col, sr_gcols, gs_ptr, codes_ptr, scales_ptr, dq_ptr,
                 aux_ptr, ts_ptr, N, INNER, NPAD, NBLK, C, sc_o, sc_i, sc_k, ss_o, ss_i, ss_k, sd_o, sd_i, sd_k, su_o, su_i, su_k,
                 prescale, MODE, BLOCK, NB, TILE_R, ELEM, EMIN, EMAX, MBITS, BIAS, MAXN, SUBSCALE, SIGN_SHIFT,
                 RCEIL, SR, U_GIVEN, KEYED, NAT, PRESCALE, TARGET, MARGIN, AMAX_OUT, WRITE_CODES, WRITE_DQ, PACK,
                 BF16_FORM, CTRL, ERR, GROUP, TWO_D)


@triton.jit
def _quant_store(
    x, r2, o2, i2, k2, row_ok, valid, pid_r, pid_k, nprog_k,
    u_ptr, seed_ptr, sr_ka, sr_kb, sr_row, sr_col, sr_gcols, gs_ptr, codes_ptr, scales_ptr, dq_ptr, aux_ptr, ts_ptr,
    N, INNER, NPAD, NBLK, C, sc_o, sc_i, sc_k, ss_o, ss_i, ss_k, sd_o, sd_i, sd_k, su_o, su_i, su_k,
    prescale,
    MODE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, TILE_R: tl.constexpr,
    ELEM: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    MAXN: tl.constexpr, SUBSCALE: tl.constexpr, SIGN_SHIFT: tl.constexpr,
    RCEIL: tl.constexpr, SR: tl.constexpr, U_GIVEN: tl.constexpr, KEYED: tl.constexpr, NAT: tl.constexpr,
    PRESCALE: tl.constexpr, TARGET: tl.constexpr, MARGIN: tl.constexpr, AMAX_OUT: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_DQ: tl.constexpr, PACK: tl.constexpr, BF16_FORM: tl.constexpr,
    CTRL: tl.constexpr, ERR: tl.constexpr, GROUP: tl.constexpr, TWO_D: tl.constexpr,
):
    """Quantize one loaded ``[TILE_R, NB*BLOCK]`` tile (blocks along axis 1) and store its codes,
    scales and dequantized / BF16 values: the body of :func:`_quant_kernel`, shared with the
    cast-transpose kernel, which calls it once per layout on the same registers."""
    TK: tl.constexpr = NB * BLOCK
    finite = (x == x) & (tl.abs(x) < float("inf"))

    # ---- random numbers for stochastic rounding -----------------------------------------
    u = x  # placeholder, unused for nearest rounding
    if SR:
        if U_GIVEN:
            u = tl.load(u_ptr + o2 * su_o + i2 * su_i + k2 * su_k, mask=valid, other=0.0)
        elif KEYED:
            u = _key_uniforms(sr_ka, sr_kb, sr_row, sr_col, sr_gcols, o2, i2, k2, N, INNER, C, NAT)
        else:
            seed = tl.load(seed_ptr)
            u = tl.rand(seed, r2 * NPAD + k2)

    sign = _signbit(x)

    if MODE == 2:
        # ================= per-tensor FP8: v = x * scale ============================
        # scale = scale_target / (amax * 2^margin), 1 for amax 0, at most FP32_MAX
        # (precision.tensorwise.scale_from_amax: one division); 1/scale: one division
        a = tl.load(gs_ptr) * MARGIN
        scale = tl.minimum(tl.where(a > 0, tl.math.div_rn(tl.zeros_like(a) + TARGET, a), 1.0), FP32_MAX)
        inv_scale = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        first = (pid_r == 0) & (pid_k == 0)
        tl.store(ts_ptr, scale, mask=first)
        tl.store(ts_ptr + 1, inv_scale, mask=first)
        if AMAX_OUT:  # this tensor's own amax, for telemetry and the delayed-scaling history
            m = tl.max(tl.max(tl.where(finite & valid, tl.abs(x), 0.0), axis=1), axis=0)
            tl.atomic_max(aux_ptr, m.to(tl.int32, bitcast=True).to(tl.int64))
        v = x * scale
        fin = (v == v) & (tl.abs(v) < float("inf"))
        nclip = tl.sum(tl.sum(((tl.abs(v) > MAXN) & fin & valid).to(tl.int64), axis=1), axis=0)
        tl.atomic_add(aux_ptr + 1, nclip)
        sign = _signbit(v)
        qm = _round_grid(tl.where(fin, v, 0.0), u, EMIN, EMAX, MBITS, MAXN, SR)
        code = _grid_code(qm, EMIN, MBITS, BIAS, SUBSCALE) | (sign << SIGN_SHIFT)
        qv = tl.where(sign == 1, -qm, qm)
        if ELEM == 1:  # E4M3 has no Inf: every non-finite value is the NaN code
            code = tl.where(fin, code, 0x7F)
            qv = tl.where(fin, qv, float("nan"))
        else:  # E5M2 keeps +-Inf; NaN keeps its sign bit, as torch's cast does
            code = tl.where(fin, code, tl.where(v == v, 0x7C, 0x7F) | (sign << 7))
            qv = tl.where(fin, qv, v)
        dq = qv * inv_scale
        c2 = code
        d2 = qv if BF16_FORM else dq
    else:
        # ================= block formats ===========================================
        xb = tl.reshape(x, [TILE_R, NB, BLOCK])
        fb = tl.reshape(finite, [TILE_R, NB, BLOCK])
        ub = tl.reshape(u, [TILE_R, NB, BLOCK])
        sb = tl.reshape(sign, [TILE_R, NB, BLOCK])
        bad = tl.max((fb == 0).to(tl.int32), axis=2) > 0             # [TILE_R, NB]
        xb = tl.where(fb, xb, 0.0)  # non-finite blocks are dropped whole; keep the arithmetic finite
        amax = tl.max(tl.abs(xb), axis=2)
        if TWO_D > 0:  # 2-D weight tiles: each square's amax and non-finiteness, for each of its rows
            bad = _square_max(bad.to(tl.int32), TILE_R, NB, BLOCK) > 0
            amax = _square_max(tl.where(bad, 0.0, amax), TILE_R, NB, BLOCK)
        ef = _expfloor(amax)
        if MODE == 0 and CTRL == 3:
            # ---- QuEST MXFP4: the E8M0 scale from the block's standard deviation ------
            sbyte, code, qv = _quest(xb, bad, sb, ub, SR, TILE_R, NB, BLOCK)
            code = tl.where(bad[:, :, None], 0, code)
            dq = qv * _pow2(sbyte - 127)[:, :, None]
            dq = tl.where(bad[:, :, None], float("nan"), dq)
            sbyte = tl.where(bad, 255, sbyte)
        elif MODE == 1 and CTRL > 0:
            # ---- NVFP4 4/6 or MS-EDEN: their own tensor scale, block scales and elements -----
            a = tl.load(gs_ptr)
            if CTRL == 1:  # g_enc = min(6*256 / amax, FP32_MAX), 1 for amax 0 (fouroversix_tensor_scale)
                g_enc = tl.minimum(tl.math.div_rn(tl.zeros_like(a) + 1536.0, a), FP32_MAX)
                g_enc = tl.where(a == 0.0, 1.0, g_enc)
                g_dec = tl.math.div_rn(tl.zeros_like(g_enc) + 1.0, g_enc)
                s, code, qv = _four_over_six(xb, bad, sb, ub, a, g_enc, g_dec, ERR, SR, TILE_R, NB, BLOCK, TWO_D)
            else:  # s_dec = amax / 255.99 / VAL_MAX (1 for amax 0); tensor scale min(1 / s_dec, FP32_MAX)
                s_dec = tl.math.div_rn(tl.math.div_rn(a, tl.zeros_like(a) + EDEN_SCALE_MAX_F32),
                                       tl.zeros_like(a) + EDEN_VAL_MAX)
                s_dec = tl.where(a == 0.0, 1.0, s_dec)
                g_enc = tl.minimum(tl.math.div_rn(tl.zeros_like(s_dec) + 1.0, s_dec), FP32_MAX)
                g_dec = tl.math.div_rn(tl.zeros_like(g_enc) + 1.0, g_enc)
                s, code, qv = _ms_eden(xb, bad, sb, ub, s_dec, TILE_R, NB, BLOCK, GROUP)
            first = (pid_r == 0) & (pid_k == 0)
            tl.store(ts_ptr, g_enc, mask=first)
            tl.store(ts_ptr + 1, g_dec, mask=first)
            code = tl.where(bad[:, :, None], 0, code)
            if BF16_FORM:  # g_dec goes to the GEMM output
                dq = qv * s[:, :, None]
            else:
                dq = qv * (s * g_dec)[:, :, None]
            dq = tl.where(bad[:, :, None], float("nan"), dq)
            sbyte = tl.where(bad | (s != s), 0x7F, _grid_code(s, -6, 3, 7, 512.0))
        elif MODE == 0:
            # ---- MX: E8M0 scale byte (FLOOR or RCEIL), elements x / 2^(s-127) -------
            if RCEIL:
                r = tl.math.div_rn(amax, tl.zeros_like(amax) + MAXN)
                tiny = r < 1.1754943508222875e-38
                r = tl.where(tiny, r * 18446744073709551616.0, r)  # * 2^64, exact
                up = ((r.to(tl.int32, bitcast=True) & 0x7FFFFF) != 0).to(tl.int32)
                e = _expfloor(r) + up - tl.where(tiny, 64, 0)
            else:
                e = ef - EMAX
            e = tl.minimum(tl.maximum(e, -127), 127)
            zero = ef == -127
            sbyte = tl.where(zero, 0, e + 127)
            v = xb * _pow2(127 - sbyte)[:, :, None]
            if PRESCALE:
                v = v * prescale
            qm = _round_grid(v, ub, EMIN, EMAX, MBITS, MAXN, SR)
            code = _grid_code(qm, EMIN, MBITS, BIAS, SUBSCALE) | (sb << SIGN_SHIFT)
            # zero / FP32-subnormal blocks: zeros with their sign (-0 stays -0); bad blocks: NaN
            code = tl.where(zero[:, :, None], sb << SIGN_SHIFT, code)
            code = tl.where(bad[:, :, None], 0, code)
            qv = tl.where(sb == 1, -qm, qm)
            dq = qv * _pow2(sbyte - 127)[:, :, None]
            if PRESCALE and not BF16_FORM:  # the BF16 form leaves the pre-scale to the GEMM output
                dq = tl.math.div_rn(dq, tl.zeros_like(dq) + prescale)
            dq = tl.where(zero[:, :, None], (sb << 31).to(tl.float32, bitcast=True), dq)
            dq = tl.where(bad[:, :, None], float("nan"), dq)
            sbyte = tl.where(bad, 255, sbyte)
        else:
            # ---- NVFP4: E4M3 block scale under the FP32 tensor scale ----------------
            # g_enc = min(448*6 / amax, FP32_MAX), 1 for amax 0 (precision.blocks.nvfp4_tensor_scale)
            a = tl.load(gs_ptr)
            g_enc = tl.minimum(tl.math.div_rn(tl.zeros_like(a) + 2688.0, a), FP32_MAX)
            g_enc = tl.where(a == 0.0, 1.0, g_enc)
            g6 = tl.math.div_rn(g_enc, tl.zeros_like(g_enc) + 6.0)   # g_enc / 6
            g_dec = tl.math.div_rn(tl.zeros_like(g_enc) + 1.0, g_enc)  # 1 / g_enc
            first = (pid_r == 0) & (pid_k == 0)
            tl.store(ts_ptr, g_enc, mask=first)
            tl.store(ts_ptr + 1, g_dec, mask=first)
            s_dec = tl.minimum(tl.where(bad, 0.0, amax) * g6, 448.0)
            s_dec = _round_grid(s_dec, s_dec, -6, 8, 3, 448.0, False)   # E4M3, nearest
            sbyte = _grid_code(s_dec, -6, 3, 7, 512.0)
            s_enc = tl.minimum(tl.math.div_rn(tl.zeros_like(s_dec) + 1.0, s_dec * g_dec), FP32_MAX)
            v = tl.minimum(tl.maximum(xb * s_enc[:, :, None], -6.0), 6.0)
            v = tl.where(v == v, v, 0.0)
            qm = _round_grid(v, ub, 0, 2, 1, 6.0, SR)
            code = _grid_code(qm, 0, 1, 1, 2.0) | (_signbit(v) << 3)
            code = tl.where((s_dec == 0.0)[:, :, None], sb << 3, code)  # zero scale: signed zeros
            code = tl.where(bad[:, :, None], 0, code)
            qv = tl.where(_signbit(v) == 1, -qm, qm)
            if BF16_FORM:  # g_dec goes to the GEMM output
                dq = qv * s_dec[:, :, None]
            else:
                dq = qv * (s_dec * g_dec)[:, :, None]
            dq = tl.where(bad[:, :, None], float("nan"), dq)
            sbyte = tl.where(bad, 0x7F, sbyte)

        # ---- scales: one byte per block ---------------------------------------------
        kb1 = pid_k.to(tl.int64) * NB + tl.arange(0, NB)
        kb2 = kb1[None, :]
        tl.store(scales_ptr + o2 * ss_o + i2 * ss_i + kb2 * ss_k, sbyte.to(tl.uint8),
                 mask=row_ok & (kb2 < NBLK))
        c2 = tl.reshape(code, [TILE_R, TK])
        d2 = tl.reshape(dq, [TILE_R, TK])

    # ---- codes (optionally two FP4 per byte) and dequantized values -----------------------
    if WRITE_CODES:
        if PACK:
            pr = tl.reshape(c2, [TILE_R, TK // 2, 2])
            lo, hi = tl.split(pr)
            packed = (lo | (hi << 4)).to(tl.uint8)
            kp = (pid_k.to(tl.int64) * (TK // 2) + tl.arange(0, TK // 2))[None, :]
            tl.store(codes_ptr + o2 * sc_o + i2 * sc_i + kp * sc_k, packed, mask=row_ok & (kp * 2 < N))
        else:
            tl.store(codes_ptr + o2 * sc_o + i2 * sc_i + k2 * sc_k, c2.to(tl.uint8), mask=valid)
    if WRITE_DQ:
        tl.store(dq_ptr + o2 * sd_o + i2 * sd_i + k2 * sd_k, d2.to(dq_ptr.dtype.element_ty), mask=valid)


# ====================================================================== host side
@dataclass
class TritonQuantResult:
    """What one :func:`quantize_triton` call produced (``None`` for what was not asked for).

    ``codes`` / ``scales``: uint8, in the layout asked for (see the module docstring);
    per-tensor formats: ``scales`` is the float32 encode scale (0-d). ``dequantized``: float32,
    shaped like the input. ``bf16`` / ``out_scale``: the BF16 form and its output factor
    (``kernels.bf16_operand``). ``tensor_scale``: NVFP4's ``g_enc``. ``amax`` / ``num_clipped``:
    per-tensor formats (current amax of the finite values; saturated count).
    """

    fmt: str
    axis: int
    codes: torch.Tensor | None
    scales: torch.Tensor | None
    dequantized: torch.Tensor | None
    tensor_scale: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    num_clipped: torch.Tensor | None = None
    prescale: float = 1.0
    bf16: torch.Tensor | None = None  # the BF16 form (``bf16_form=True``), in the layout asked for
    out_scale: torch.Tensor | None = None  # its FP32 factor for the GEMM output (None: none)
    decode_scale: torch.Tensor | None = None  # codes: 1 / scale (NVFP4: 1 / g_enc), shape (1,) as GEMMs take it
    workspace: torch.Tensor | None = None  # per-tensor: the kernel's [scale, 1/scale] (shared by a second layout)


def _collapse(shape, strides):
    """One (size, stride) for a run of dims, or None when they cannot be addressed by one stride."""
    size, stride = 1, 0
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if size == 1:
            size, stride = n, s
        elif s == stride * size:
            size *= n
        else:
            return None
    return size, stride


def _ois_of(shape, strides, axis: int):
    """(outer, inner, s_outer, s_inner, s_axis) addressing of a tensor of ``shape`` / ``strides``
    around ``axis``, or None."""
    sh, st = list(shape), list(strides)
    a = _collapse(sh[:axis], st[:axis])
    b = _collapse(sh[axis + 1:], st[axis + 1:])
    if a is None or b is None:
        return None
    return a[0], b[0], a[1], b[1], st[axis]


def _ois(t: torch.Tensor, axis: int):
    return _ois_of(t.shape, t.stride(), axis)


class _Out:
    """An output buffer: ``tensor`` in the layout handed back and the kernel's (s_outer, s_inner,
    s_axis) strides of it seen in the input's layout -- no view is made for the kernel."""

    def __init__(self, shape, axis, n_axis, dtype, device, layout):
        if layout == "input":
            s = list(shape)
            s[axis] = n_axis
            self.tensor = torch.empty(s, dtype=dtype, device=device)
            self.strides = _ois(self.tensor, axis)[2:]
        else:  # contraction-last: x.movedim(axis, -1) order, contiguous
            moved = [v for d, v in enumerate(shape) if d != axis] + [n_axis]
            self.tensor = torch.empty(moved, dtype=dtype, device=device)
            st = list(self.tensor.stride())
            natural = st[:axis] + [st[-1]] + st[axis:-1]
            s = list(shape)
            s[axis] = n_axis
            self.strides = _ois_of(s, natural, axis)[2:]


def _strides(t: torch.Tensor | None, axis: int):
    if t is None:
        return 0, 0, 0
    _, _, so, si, sk = _ois(t, axis)
    return so, si, sk


_DUMMIES: dict = {}


def _dummies(dev: torch.device):
    """Placeholder pointers for arguments a launch does not read (made once per device); the int64
    one has two cells, so a launch may also add a clip count nobody reads into it (a cast-transpose's
    second layout, whose count is the first's)."""
    key = (dev.type, dev.index)
    if key not in _DUMMIES:
        _DUMMIES[key] = (torch.zeros(1, device=dev), torch.zeros(2, dtype=torch.int64, device=dev))
    return _DUMMIES[key]


@functools.cache
def _rotation_constant(n: int) -> float:
    """``fl32(1/sqrt(n))``, the entry of ``precision.rotation.hadamard_matrix(n)``."""
    return float(hadamard_matrix(n)[0, 0])


_TILE_R_GPU = 64


def quantize_triton(
    x: torch.Tensor,
    fmt: OperandFormat | str,
    *,
    axis: int = -1,
    amax: torch.Tensor | float | None = None,
    sr: SRKey | torch.Generator | torch.Tensor | None = None,
    rotation: str = "none",
    signs: torch.Tensor | None = None,
    codes: bool = True,
    dequantize: bool = False,
    layout: str = "input",
    pack: bool = False,
    tile_rows: int | None = None,
    bf16_form: bool = False,
    _capture: list | None = None,
    _own_amax: torch.Tensor | None = None,
    _shared: TritonQuantResult | None = None,
) -> TritonQuantResult:
    """Quantize ``x`` to ``fmt`` in one fused pass (two for per-tensor formats and NVFP4).

    ``fmt``: an ``OperandFormat`` (its rounding, scale rule, pre-scale and margin), or a format name
    for its defaults (``OperandFormat(name)``). ``amax`` (a float or a 0-d float32 tensor): the amax
    of the tensor-level scale (per-tensor formats; NVFP4's FP32 tensor scale) instead of this
    tensor's own. ``sr``, stochastic rounding's uniforms: a ``precision.srand.SRKey`` (the
    counter-based uniforms, generated in-kernel, bit-identical to the reference's
    ``quantize(..., sr=)``); a float32 tensor of uniforms drawn in the reference's ``generator``
    order (bit-identical to it; block formats: one per element of ``x.movedim(axis, -1)`` padded to
    whole blocks -- MS-EDEN's scale takes each block's first, as ``precision.eden.ms_eden_quantize``
    does with ``u=``, not the per-block draws of its ``generator``); a ``torch.Generator``, or None
    for torch's default one (one seed drawn from it for ``tl.rand``: reproducible, its own stream).
    MS-EDEN (``ms_eden`` / ``ms_eden128``) draws from ``sr`` as stochastic rounding does.

    ``rotation``: a ``precision.rotation.ROTATIONS`` name, as a ``GemmRecipe`` holds it (``signs``:
    the +-1 vector, required for ``rht*``). ``codes``/``dequantize``: which outputs to write.
    ``layout``: ``input`` or ``contraction_last``; ``pack``: FP4 codes two per byte along the block
    axis (``contraction_last`` only). ``bf16_form``: write the BF16 operand of ``kernels.bf16_mm``
    directly (in ``layout``), in place of ``dequantize`` -- element x power-of-two block scale (MX),
    x E4M3 block scale (NVFP4), the element itself (per-tensor), with ``out_scale`` the factor the
    GEMM output takes; formats with a ``Format.bf16_shift`` (MXFP8) need the whole tensor's largest
    scale first and go through ``kernels.bf16_operand.bf16_form`` on the codes instead.
    """
    if getattr(fmt, "fmt", getattr(fmt, "name", fmt)) not in TRITON_FORMATS:  # OperandFormat, Format or name
        raise ValueError(f"triton quantizer: no kernel for format {fmt!r}; "
                         f"valid: {', '.join(TRITON_FORMATS)}")
    op = operand_format(fmt)  # a name: its defaults
    spec, rounding, scale_rule, prescale = op.format, op.rounding, op.scale_rule, op.prescale_factor
    margin = op.margin  # scale = scale_target / amax / 2^margin
    fmt = spec.name
    if layout not in ("input", "contraction_last"):
        raise ValueError(f"layout: unknown {layout!r}; valid: input, contraction_last")
    if x.dim() == 0:
        raise ValueError("quantize: x must have at least one dimension")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"triton quantizer: input dtype {x.dtype} not supported; "
                         "valid: float32, bfloat16, float16")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"triton quantizer: needs a CUDA device (x is on {x.device.type}), or "
                           "TRITON_INTERPRET=1 set before importing triton for the CPU interpreter")
    if x.device.type != "cuda" and (why := interpreter_problem()):
        raise RuntimeError(f"triton quantizer: {why}")
    axis = axis % x.dim()
    n = x.shape[axis]
    if op.triton_missing:
        raise ValueError(f"triton quantizer: {op.triton_missing}")
    if not rounding.triton:
        raise ValueError(f"triton quantizer: no kernel for {rounding} rounding; valid: "
                         f"{', '.join(r for r in Rounding if r.triton)} (the reference quantizer has every mode)")
    stochastic = rounding.stochastic
    rot = 0 if rotation == "none" else rotation_size(rotation)
    if rot and n % rot:
        raise ValueError(f"rotation {rotation}: axis {axis} has length {n}, not a multiple of {rot}; "
                         "zero-pad both GEMM operands first")
    if rotation.startswith("rht") and signs is None:
        raise ValueError(f"rotation {rotation}: needs signs= (the +-1 vector of length {rot})")
    if pack and (spec.bits != 4 or layout != "contraction_last" or n % 2):
        raise ValueError("pack=True: 4-bit formats "
                         f"({', '.join(n for n in TRITON_FORMATS if FORMATS[n].bits == 4)}), "
                         "layout='contraction_last' and an even axis length only")
    if bf16_form and (dequantize or not spec.bf16_exact or spec.bf16_shift):
        raise ValueError(f"bf16_form: {spec.name} needs " + ("dequantize=False" if dequantize else
                         "a format with Format.bf16_exact and no bf16_shift") + " (see kernels.bf16_operand)")
    key = uniforms = seed = None  # stochastic rounding: exactly one of them
    if stochastic and isinstance(sr, SRKey):
        key = sr
    elif stochastic and isinstance(sr, torch.Tensor):
        uniforms = sr
    elif stochastic:  # a torch.Generator, or None: torch's default generator of x's device
        dev_g = sr.device if sr is not None else x.device
        seed = torch.randint(0, 2**62, (1,), generator=sr, device=dev_g, dtype=torch.int64)

    dev = x.device
    ois = _ois(x, axis)
    if ois is None:  # dims that no single stride addresses: one copy
        x = x.contiguous()
        ois = _ois(x, axis)
    outer, inner, sx_o, sx_i, sx_k = ois
    R = outer * inner

    block = spec.block if spec.blocked else 64
    ctrl, err, group = _control(op)
    tk = max(block, rot, group, 2)  # an EDEN group lies inside one tile (GROUP is 16 but for eden128)
    nb = tk // block
    npad = -(-n // block) * block if spec.blocked else n
    nblk = -(-n // block) if spec.blocked else 0
    # GPU: a fixed tile; interpreter: few, large programs (each is a numpy pass)
    cpu_tile = max(16, min(256, triton.next_power_of_2(R)))
    gpu_tile = _TILE_R_GPU
    if ctrl and tk > 32:  # eden128's 128-wide tile: 16 rows (its sm_90 PTX is a third of 64 rows' size)
        gpu_tile = max(16, _TILE_R_GPU * 32 // tk)
    tile_r = tile_rows or (gpu_tile if dev.type == "cuda" else cpu_tile)
    two_d = 0
    if op.block2d:  # 2-D weight tiles: the tile's rows hold whole squares
        if x.dim() != 2:
            raise ValueError(f"{op}: 2-D block scaling takes a 2-D tensor (a weight [out, in]), "
                             f"got shape {tuple(x.shape)}")
        if op.four_over_six != FourOverSix.NONE and stochastic:
            raise ValueError(f"{op}: 4over6 with 2-D tiles rounds to nearest (one quantized weight serves "
                             "Fprop and Dgrad)")
        tile_r = max(tile_r, spec.tile)
        if tile_r % spec.tile:
            raise ValueError(f"tile_rows: {tile_r} is not a multiple of {op}'s {spec.tile}x{spec.tile} tile")
        two_d = 1 if axis == 1 else 2
    grid = (triton.cdiv(R, tile_r), triton.cdiv(n, tk))

    elem = spec.element
    ekw = dict(ELEM=_NONFINITE[elem.nonfinite], EMIN=elem.emin, EMAX=elem.emax, MBITS=elem.mbits,
               BIAS=elem.bias, MAXN=float(elem.max_normal),
               SUBSCALE=float(2.0 ** (elem.mbits - elem.emin)), SIGN_SHIFT=elem.sign_shift)
    rot_c = _rotation_constant(rot) if rot else 1.0
    dummy_f, dummy_i = _dummies(dev)
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if signs is not None else dummy_f
    ncols = x.shape[-1]
    nat = 0 if axis == x.dim() - 1 else 1 if axis == x.dim() - 2 else 2
    launch = dict(BLOCK=block, NB=nb, TILE_R=tile_r, ROT=rot, LOG_ROT=int(math.log2(rot)) if rot else 0,
                  ROT_C=rot_c, HAS_SIGNS=signs is not None and rot > 0, **ekw)
    per_tensor = spec.kind == Scaling.TENSOR

    def run(mode, gs, codes_o, scales_o, dq_o, aux, ts, u_t, seed_t, amax_out=False):
        none = (0, 0, 0)
        args = (x, signs_t, u_t if u_t is not None else dummy_f, seed_t if seed_t is not None else dummy_f,
                *sr_args, gs if gs is not None else dummy_f,
                codes_o.tensor if codes_o is not None else dummy_f,
                scales_o.tensor if scales_o is not None else dummy_f,
                dq_o.tensor if dq_o is not None else dummy_f, aux if aux is not None else dummy_f,
                ts if ts is not None else dummy_f,
                R, n, inner, npad, nblk, ncols, sx_o, sx_i, sx_k,
                *(codes_o.strides if codes_o is not None else none),
                *(scales_o.strides if scales_o is not None else none),
                *(dq_o.strides if dq_o is not None else none), *_strides(u_t, axis), float(prescale))
        meta = dict(MODE=mode, RCEIL=scale_rule == ScaleRule.RCEIL, SR=stochastic, U_GIVEN=uniforms is not None,
                    KEYED=uniforms is None and key is not None, NAT=nat, PRESCALE=prescale != 1.0,
                    TARGET=float(spec.scale_target) if per_tensor else 1.0,
                    MARGIN=2.0**margin if per_tensor else 1.0, AMAX_OUT=amax_out,
                    WRITE_CODES=codes, WRITE_DQ=dequantize or bf16_form, PACK=pack, BF16_FORM=bf16_form,
                    CTRL=ctrl, ERR=err, GROUP=group, TWO_D=two_d, **launch)
        if _capture is not None:  # cast_transpose_triton launches both layouts' arguments in one kernel
            _capture.append((args, meta))
        else:
            _launch(_quant_kernel, grid, args, meta)

    def amax_pass(cell: torch.Tensor) -> None:  # atomic max of the finite |x| (rotated) into cell[0]
        _launch(_amax_kernel, grid, (x, signs_t, cell, R, n, inner, sx_o, sx_i, sx_k),
                dict(TILE_R=tile_r, TK=tk, ROT=rot, LOG_ROT=launch["LOG_ROT"], ROT_C=rot_c,
                     HAS_SIGNS=launch["HAS_SIGNS"]))

    # ---- SR random numbers ---------------------------------------------------------------------
    u_t = seed_t = None
    sr_args = _sr_args(key, x.shape)  # a key: kernel arguments, no tensor
    if uniforms is not None:
        u_t = _uniforms_view(uniforms.to(dev, torch.float32), x.shape, axis, npad, spec.blocked)
    elif seed is not None:
        seed_t = seed.reshape(1).to(device=dev, dtype=torch.int64)

    # ---- outputs, allocated in the layout handed back (the kernel gets their strides) -----------
    shape = list(x.shape)
    codes_o = _Out(shape, axis, n // 2 if pack else n, torch.uint8, dev, layout) if codes else None
    dq_o = _Out(shape, axis, n, torch.float32, dev, "input") if dequantize else None
    if bf16_form:
        dq_o = _Out(shape, axis, n, torch.bfloat16, dev, layout)
    given = None if amax is None else _amax_tensor(amax, dev)

    # ---- tensor-level numbers: computed in the kernel from the amax (no host-side arithmetic); the
    #      amax pass runs only for a current scale: a given amax leaves one launch -------------------
    if per_tensor and _shared is not None:  # a cast-transpose's second layout, same format and amax:
        # its scale, 1/scale, amax and clip count are the first layout's (the same elements against
        # the same scale), so it writes the same ts and adds its clip count where nobody reads it
        ts = _shared.workspace
        run(MODE_TENSOR, _own_amax, codes_o, None, dq_o, dummy_i, ts, u_t, seed_t)
        res = replace(_shared, axis=axis, codes=codes_o.tensor if codes_o is not None else None,
                                  dequantized=dq_o.tensor if dq_o is not None and not bf16_form else None, bf16=None)
        out_scale = _shared.out_scale
    elif per_tensor:
        ws = torch.zeros(2, dtype=torch.int64, device=dev)  # [own amax (float32 bits), clipped count]
        ts = torch.empty(2, device=dev)  # [scale, 1/scale], written by the kernel
        amax_out = given is not None and _own_amax is None  # the quantize pass finds the amax itself
        if given is None and _own_amax is None:
            amax_pass(ws)
        own = _own_amax if _own_amax is not None else ws.view(torch.float32)[0]
        run(MODE_TENSOR, given if given is not None else own, codes_o, None, dq_o, ws, ts, u_t, seed_t,
            amax_out=amax_out)
        res = TritonQuantResult(fmt, axis, codes_o.tensor if codes_o is not None else None, ts[0],
                                dq_o.tensor if dq_o is not None and not bf16_form else None, amax=own,
                                num_clipped=ws[1], workspace=ts)
        # the spec's dequantization, element * (1 / scale): a 0-d factor of the BF16 form's GEMM
        # output; with codes, the 1-element scale torch._scaled_mm takes as it is (no reshape per GEMM)
        out_scale = ts[1] if bf16_form else None
        res.decode_scale = None if bf16_form else ts[1:2]
    else:
        scales_o = _Out(shape, axis, nblk, torch.uint8, dev, layout)
        gs = ts = g_enc = out_scale = None
        if spec.kind == Scaling.TWO_LEVEL:
            gs = given if given is not None else _own_amax
            if gs is None:
                cell = torch.zeros(1, dtype=torch.int64, device=dev)
                amax_pass(cell)
                gs = cell.view(torch.float32)
            ts = torch.empty(2, device=dev)  # [g_enc, 1/g_enc], written by the kernel
            g_enc, out_scale = ts[0], ts[1]
        run(_MODE[spec.kind], gs, codes_o, scales_o, dq_o, None, ts, u_t, seed_t)
        decode = ts[1:2] if ts is not None and codes_o is not None else None  # NVFP4's 1/g_enc for the GEMM
        res = TritonQuantResult(fmt, axis, codes_o.tensor if codes_o is not None else None, scales_o.tensor,
                                dq_o.tensor if dq_o is not None and not bf16_form else None, tensor_scale=g_enc,
                                prescale=prescale if spec.has_scale_rules else 1.0, decode_scale=decode)
    res.out_scale = out_scale
    if bf16_form:
        res.bf16 = dq_o.tensor
    return res


_CTRL = {None: 0, "4over6": 1, "eden": 2, "eden128": 2, "quest": 3}  # OperandFormat.control -> CTRL
_ERR = {FourOverSix.MSE: 0, FourOverSix.MAE: 1, FourOverSix.ABS_MAX: 2}


def _control(op: OperandFormat) -> tuple[int, int, int]:
    """The kernel's ``(CTRL, ERR, GROUP)`` for an operand format (see :func:`_quant_kernel`)."""
    ctrl = _CTRL[op.control]
    return ctrl, _ERR.get(op.four_over_six, 0), op.rounding.eden_group or 16


def _amax_tensor(amax, dev) -> torch.Tensor:
    """A given amax as a float32 tensor on ``dev`` whose first element the kernel reads."""
    if isinstance(amax, torch.Tensor):
        return amax.to(device=dev, dtype=torch.float32)
    return torch.tensor([float(amax)], dtype=torch.float32, device=dev)


# ====================================================================== cast-transpose
# Per-layout kernel arguments of _quant_store, in _quant_kernel's order (see _split_args).
_LAYOUT_ARGS = slice(2, 15), slice(18, 21), slice(24, 37)
_LAYOUT_META = ("MODE", "BLOCK", "NB", "TILE_R", "ELEM", "EMIN", "EMAX", "MBITS", "BIAS", "MAXN", "SUBSCALE",
                "SIGN_SHIFT", "RCEIL", "SR", "U_GIVEN", "KEYED", "NAT", "PRESCALE", "TARGET", "MARGIN", "AMAX_OUT",
                "WRITE_CODES", "WRITE_DQ", "PACK", "BF16_FORM", "CTRL", "ERR", "GROUP", "TWO_D")


@triton.jit(do_not_specialize=[f"{p}_{k}" for p in "ab" for k in ("ka", "kb", "row", "col", "gcols")])
def _cast_transpose_kernel(
    x_ptr, T, H, sx_t, sx_h,
    a_u, a_seed, a_ka, a_kb, a_row, a_col, a_gcols, a_gs, a_codes, a_scales, a_dq, a_aux, a_ts, a_NPAD, a_NBLK, a_C, a_sc_o, a_sc_i, a_sc_k,
    a_ss_o, a_ss_i, a_ss_k, a_sd_o, a_sd_i, a_sd_k, a_su_o, a_su_i, a_su_k, a_prescale,
    b_u, b_seed, b_ka, b_kb, b_row, b_col, b_gcols, b_gs, b_codes, b_scales, b_dq, b_aux, b_ts, b_NPAD, b_NBLK, b_C, b_sc_o, b_sc_i, b_sc_k,
    b_ss_o, b_ss_i, b_ss_k, b_sd_o, b_sd_i, b_sd_k, b_su_o, b_su_i, b_su_k, b_prescale,
    BT: tl.constexpr, BH: tl.constexpr,
    A_MODE: tl.constexpr, A_BLOCK: tl.constexpr, A_NB: tl.constexpr, A_TILE_R: tl.constexpr,
    A_ELEM: tl.constexpr, A_EMIN: tl.constexpr, A_EMAX: tl.constexpr, A_MBITS: tl.constexpr,
    A_BIAS: tl.constexpr, A_MAXN: tl.constexpr, A_SUBSCALE: tl.constexpr, A_SIGN_SHIFT: tl.constexpr,
    A_RCEIL: tl.constexpr, A_SR: tl.constexpr, A_U_GIVEN: tl.constexpr, A_KEYED: tl.constexpr,
    A_NAT: tl.constexpr, A_PRESCALE: tl.constexpr, A_TARGET: tl.constexpr, A_MARGIN: tl.constexpr,
    A_AMAX_OUT: tl.constexpr, A_WRITE_CODES: tl.constexpr, A_WRITE_DQ: tl.constexpr,
    A_PACK: tl.constexpr, A_BF16_FORM: tl.constexpr,
    B_MODE: tl.constexpr, B_BLOCK: tl.constexpr, B_NB: tl.constexpr, B_TILE_R: tl.constexpr,
    B_ELEM: tl.constexpr, B_EMIN: tl.constexpr, B_EMAX: tl.constexpr, B_MBITS: tl.constexpr,
    B_BIAS: tl.constexpr, B_MAXN: tl.constexpr, B_SUBSCALE: tl.constexpr, B_SIGN_SHIFT: tl.constexpr,
    B_RCEIL: tl.constexpr, B_SR: tl.constexpr, B_U_GIVEN: tl.constexpr, B_KEYED: tl.constexpr,
    B_NAT: tl.constexpr, B_PRESCALE: tl.constexpr, B_TARGET: tl.constexpr, B_MARGIN: tl.constexpr,
    B_AMAX_OUT: tl.constexpr, B_WRITE_CODES: tl.constexpr, B_WRITE_DQ: tl.constexpr,
    B_PACK: tl.constexpr, B_BF16_FORM: tl.constexpr,
    A_CTRL: tl.constexpr, A_ERR: tl.constexpr, A_GROUP: tl.constexpr, A_TWO_D: tl.constexpr,
    B_CTRL: tl.constexpr, B_ERR: tl.constexpr, B_GROUP: tl.constexpr, B_TWO_D: tl.constexpr,
):
    """One read of a ``[BT, BH]`` tile of the 2-D ``x [T, H]``, quantized twice from the same
    registers: layout A with blocks along axis 1 (rows t, block axis h), layout B with blocks along
    axis 0 (the transposed tile: rows h, block axis t) -- TransformerEngine's fused cast-transpose."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    t1 = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
    h1 = pid_h.to(tl.int64) * BH + tl.arange(0, BH)
    t_ok = t1[:, None] < T
    h_ok = h1[:, None] < H
    valid = t_ok & (h1[None, :] < H)
    x = tl.load(x_ptr + t1[:, None] * sx_t + h1[None, :] * sx_h, mask=valid, other=0.0).to(tl.float32)
    # === A: blocks along h -- rows r = t (o = t, i = 0), k = h
    _quant_store(x, t1[:, None], t1[:, None], tl.zeros([BT, 1], dtype=tl.int64), h1[None, :], t_ok, valid,
                 pid_t, pid_h, tl.num_programs(1),
                 a_u, a_seed, a_ka, a_kb, a_row, a_col, a_gcols, a_gs, a_codes, a_scales, a_dq, a_aux, a_ts, H, 1, a_NPAD, a_NBLK, a_C, a_sc_o, a_sc_i,
                 a_sc_k, a_ss_o, a_ss_i, a_ss_k, a_sd_o, a_sd_i, a_sd_k, a_su_o, a_su_i, a_su_k, a_prescale,
                 A_MODE, A_BLOCK, A_NB, A_TILE_R, A_ELEM, A_EMIN, A_EMAX, A_MBITS, A_BIAS, A_MAXN, A_SUBSCALE,
                 A_SIGN_SHIFT, A_RCEIL, A_SR, A_U_GIVEN, A_KEYED, A_NAT, A_PRESCALE, A_TARGET, A_MARGIN,
                 A_AMAX_OUT, A_WRITE_CODES, A_WRITE_DQ,
                 A_PACK, A_BF16_FORM, A_CTRL, A_ERR, A_GROUP, A_TWO_D)
    # === B: blocks along t (the transposed tile) -- rows r = h (o = 0, i = h), k = t
    _quant_store(tl.trans(x), h1[:, None], tl.zeros([BH, 1], dtype=tl.int64), h1[:, None], t1[None, :], h_ok,
                 tl.trans(valid), pid_h, pid_t, tl.num_programs(0),
                 b_u, b_seed, b_ka, b_kb, b_row, b_col, b_gcols, b_gs, b_codes, b_scales, b_dq, b_aux, b_ts, T, H, b_NPAD, b_NBLK, b_C, b_sc_o, b_sc_i,
                 b_sc_k, b_ss_o, b_ss_i, b_ss_k, b_sd_o, b_sd_i, b_sd_k, b_su_o, b_su_i, b_su_k, b_prescale,
                 B_MODE, B_BLOCK, B_NB, B_TILE_R, B_ELEM, B_EMIN, B_EMAX, B_MBITS, B_BIAS, B_MAXN, B_SUBSCALE,
                 B_SIGN_SHIFT, B_RCEIL, B_SR, B_U_GIVEN, B_KEYED, B_NAT, B_PRESCALE, B_TARGET, B_MARGIN,
                 B_AMAX_OUT, B_WRITE_CODES, B_WRITE_DQ,
                 B_PACK, B_BF16_FORM, B_CTRL, B_ERR, B_GROUP, B_TWO_D)


_CT_TILE = 64  # cast-transpose tile: [64 tokens, 64 features], whole MX (32) and NVFP4 (16) blocks both ways


def cast_transpose_triton(
    x: torch.Tensor,
    fmt_row: OperandFormat | str,
    fmt_col: OperandFormat | str,
    *,
    sr_row: SRKey | None = None,
    sr_col: SRKey | None = None,
    amax_row: torch.Tensor | float | None = None,
    amax_col: torch.Tensor | float | None = None,
    codes: bool = True,
    bf16_form: bool = False,
) -> tuple[TritonQuantResult, TritonQuantResult]:
    """Both quantized layouts of a 2-D ``x [T, H]`` from one read of it (a fused cast-transpose).

    ``fmt_row``: blocks along axis 1 (``x`` as Dgrad's ``dy`` or Fprop's ``x`` consume it);
    ``fmt_col``: blocks along axis 0, the token axis (``x`` or ``dy`` for Wgrad). Each is an
    ``OperandFormat`` (or a format name for its defaults), as :func:`quantize_triton` takes it, with
    its own SR key (``sr_row`` / ``sr_col``) and scale amax (``amax_*``: delayed or TP-reduced;
    None: this tensor's own, found by one amax pass shared by both). Results are those of
    ``quantize_triton(x, fmt, axis=1 / 0, layout="contraction_last", ...)`` bit for bit -- ``[T, H]``
    and ``[H, T]`` -- so they equal the reference quantizer's for each layout. No rotation (a rotated
    operand is another tensor) and no FP4 packing; ``bf16_form`` as in :func:`quantize_triton`.
    """
    if x.dim() != 2:
        raise ValueError(f"cast_transpose: x must be 2-D [T, H], got shape {tuple(x.shape)}")
    for op in (operand_format(f) for f in (fmt_row, fmt_col)):
        if op.rounding.eden_group > _CT_TILE:
            raise ValueError(f"cast_transpose: {op}: the EDEN group ({op.rounding.eden_group} elements) is wider than "
                             f"the {_CT_TILE}-element tile; quantize each layout with quantize_triton")
    specs = [operand_format(f).format for f in (fmt_row, fmt_col)]
    blocks_ = [sp.block if sp.blocked else _CT_TILE for sp in specs]
    tile = _CT_TILE  # = the per-tensor kernels' tile width: their clip-count grids match this one's
    t_len, h_len = x.shape
    own = None
    needs_amax = [sp.kind == Scaling.TENSOR or (sp.tensor_scaled and a is None)
                  for sp, a in zip(specs, (amax_row, amax_col))]
    if any(needs_amax):  # one amax pass for both layouts
        sx_t, sx_h = x.stride()
        bits = torch.zeros(1, dtype=torch.int32, device=x.device)
        grid = (triton.cdiv(t_len, tile), triton.cdiv(h_len, tile))
        _launch(_amax_kernel, grid, (x, bits, bits, t_len, h_len, 1, sx_t, 0, sx_h),
                {"TILE_R": tile, "TK": tile, "ROT": 0, "LOG_ROT": 0, "ROT_C": 1.0, "HAS_SIGNS": False})
        own = bits.view(torch.float32)[0]
    captured: list = []
    common = {"layout": "contraction_last", "codes": codes, "bf16_form": bf16_form, "tile_rows": tile,
              "_capture": captured, "_own_amax": own}
    row = quantize_triton(x, fmt_row, axis=1, sr=sr_row, amax=amax_row, **common)
    same = (specs[0].kind == Scaling.TENSOR and amax_row is None and amax_col is None
            and operand_format(fmt_row) == operand_format(fmt_col)  # one scale: one set of tensor numbers
            and not operand_format(fmt_row).rounding.stochastic)  # (SR: each layout counts its own clips)
    col = quantize_triton(x, fmt_col, axis=0, sr=sr_col, amax=amax_col, _shared=row if same else None, **common)
    (a_args, a_meta), (b_args, b_meta) = captured
    per = [[v for sl in _LAYOUT_ARGS for v in args[sl]] for args in (a_args, b_args)]
    meta = {}
    for tag, m, nb in (("A_", a_meta, tile // blocks_[0]), ("B_", b_meta, tile // blocks_[1])):
        m = {**m, "TILE_R": tile, "NB": nb}  # per-tensor formats: BLOCK (64) is only a tile width, NB 1
        meta.update({tag + k: m[k] for k in _LAYOUT_META})
    grid = (triton.cdiv(t_len, tile), triton.cdiv(h_len, tile))
    _launch(_cast_transpose_kernel, grid, (x, t_len, h_len, *x.stride(), *per[0], *per[1]),
            dict(BT=tile, BH=tile, **meta))
    return row, col


_I32 = 1 << 32  # added to each SR key argument (see _key_uniforms)


def _sr_args(key: SRKey | None, shape) -> tuple[int, int, int, int, int]:
    """The SR key's ``(k_a, k_b, row_offset, col_offset, global_cols)``, each plus 2^32, as kernel
    arguments (zeros plus 2^32 without a key)."""
    if key is None:
        return (_I32,) * 5
    ka, kb = key.key_words()
    return ka + _I32, kb + _I32, key.row_offset + _I32, key.col_offset + _I32, key.cols(shape) + _I32


def _launch(kernel, grid, args, meta) -> None:
    if interpreting():
        import numpy as np  # the interpreter runs on numpy: NaN/Inf lanes that get masked warn

        with np.errstate(all="ignore"):
            kernel[grid](*args, **meta)
    else:  # no FMA contraction: the reference rounds every product and sum separately
        kernel[grid](*args, **meta, enable_fp_fusion=False)


def _uniforms_view(u: torch.Tensor, shape, axis: int, npad: int, block: bool) -> torch.Tensor:
    """The reference's SR draws viewed like ``x`` (block formats: ``axis`` padded to ``npad``)."""
    if not block:
        return u.reshape(shape)
    moved = [s for d, s in enumerate(shape) if d != axis] + [npad]
    return u.reshape(moved).movedim(-1, axis)


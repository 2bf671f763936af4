"""HiFloat8 (arXiv 2409.16626): a tapered 8-bit float, decoded from its bit layout.

Byte = ``S | Dot | E | M``. The dot prefix after the sign says how many exponent bits D follow
and how many mantissa bits remain:

========  ==  ========  ==============
dot       D   mantissa  |exponent|
========  ==  ========  ==============
``11``    4   1         8 .. 15
``10``    3   2         4 .. 7
``01``    2   3         2 .. 3
``001``   1   3         1
``0001``  0   3         0
``0000``  --  denormal: value 2^(M-23), M = 1..7
========  ==  ========  ==============

The exponent field is sign-magnitude with an implicit leading 1 (first stored bit = exponent
sign, 1 = negative). 0x00 = 0 (no -0), 0x80 = NaN, 0x6F / 0xEF = +-Inf, max finite 2^15 (0x6E),
min positive 2^-22. Rounding: to the nearest value, ties away from zero. A raw cast overflows to
Inf at >= 40960 (the midpoint to the missing 1.5*2^15); ``hif8_encode(saturate=True)`` clamps to
+-2^15 instead, as the training quantizer does.

Encoding uses the decoded table itself: the positive finite values sorted, and the midpoints
between neighbours as decision boundaries -- so encoder and decoder cannot disagree.
"""

from __future__ import annotations

import torch

__all__ = ["hif8_decode_byte", "hif8_decode", "hif8_encode", "HIF8_MAX", "HIF8_MIN", "HIF8_SCALE_TARGET"]

HIF8_MAX = 2.0**15
HIF8_MIN = 2.0**-22
# The value a per-tensor scale maps a tensor's amax to (``precision.formats``: scale = target / amax).
# 2^3 is the top binade with 3 mantissa bits (|E| <= 3): the bulk of a tensor below its amax keeps
# HiF8's full precision, and the 12 binades 2^4 .. 2^15 above it are headroom for an amax jump
# under delayed scaling. Chosen by measurement (README, "HiF8 QAT and evaluation"): on Gaussian
# values and a trained checkpoint's weights / activations / gradients, 2^3 is within 0.05 dB of the
# best target (2^4) and of per-tensor E4M3, where TE's FP8 rule (amax -> 2^15) loses ~12 dB; unlike
# 2^4 it loses nothing when the amax doubles after the scale was set.
HIF8_SCALE_TARGET = 2.0**3
_NAN, _POS_INF, _NEG_INF = 0x80, 0x6F, 0xEF


def hif8_decode_byte(byte: int) -> float:
    """Value of one HiF8 byte, straight from the bit layout."""
    if byte == _NAN:
        return float("nan")
    if byte in (_POS_INF, _NEG_INF):
        return float("inf") if byte == _POS_INF else float("-inf")
    sign = -1.0 if byte & 0x80 else 1.0
    bits = byte & 0x7F  # 7 bits after the sign
    if bits >> 5 == 0b11:
        d, rest = 4, bits & 0x1F
    elif bits >> 5 == 0b10:
        d, rest = 3, bits & 0x1F
    elif bits >> 5 == 0b01:
        d, rest = 2, bits & 0x1F
    elif bits >> 4 == 0b001:
        d, rest = 1, bits & 0xF
    elif bits >> 3 == 0b0001:
        d, rest = 0, bits & 0x7
    else:  # 0000 MMM: denormal (MMM = 0 is zero)
        m = bits & 0x7
        return 0.0 if m == 0 else sign * 2.0 ** (m - 23)
    mbits = {4: 1, 3: 2, 2: 3, 1: 3, 0: 3}[d]
    m = rest & ((1 << mbits) - 1)
    efield = rest >> mbits
    if d == 0:
        exp = 0
    else:
        esign = -1 if efield >> (d - 1) else 1
        mag = (1 << (d - 1)) | (efield & ((1 << (d - 1)) - 1))  # implicit leading 1
        exp = esign * mag
    return sign * 2.0**exp * (1.0 + m / (1 << mbits))


_TABLE = torch.tensor([hif8_decode_byte(b) for b in range(256)], dtype=torch.float64)
_POS = sorted((float(v), b) for b, v in enumerate(_TABLE.tolist()) if v > 0 and v != float("inf"))
_POS_VALUES = torch.tensor([0.0] + [v for v, _ in _POS], dtype=torch.float64)  # 0, 2^-22, ..., 2^15
_POS_CODES = torch.tensor([0] + [b for _, b in _POS], dtype=torch.uint8)
# Midpoints between neighbours; a value equal to a midpoint rounds away from zero (upper bucket).
_MIDS = ((_POS_VALUES[1:] + _POS_VALUES[:-1]) / 2).float()
_OVERFLOW = float(HIF8_MAX * 1.25)  # midpoint between 2^15 and the missing 1.5 * 2^15


def hif8_decode(codes: torch.Tensor) -> torch.Tensor:
    """HiF8 bytes (uint8) -> float32 values."""
    return _TABLE.float().to(codes.device)[codes.long()]


def hif8_encode(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """float32 -> HiF8 bytes, nearest with ties away from zero.

    ``saturate=False`` is the raw cast (>= 40960 becomes Inf); ``saturate=True`` clamps finite
    values to +-2^15. NaN -> 0x80, +-Inf -> 0x6F/0xEF either way.
    """
    x = x.float()
    mag = x.abs()
    idx = torch.bucketize(mag, _MIDS.to(x.device), right=True)  # == midpoint -> upper
    codes = _POS_CODES.to(x.device)[idx.clamp(max=len(_POS_CODES) - 1)]
    neg = torch.signbit(x) & (codes != 0)
    codes = codes | (neg.to(torch.uint8) << 7)
    if not saturate:
        over = mag >= _OVERFLOW
        codes = torch.where(over, torch.where(torch.signbit(x), _NEG_INF, _POS_INF).to(torch.uint8), codes)
    inf = torch.isinf(x)
    codes = torch.where(inf, torch.where(x > 0, _POS_INF, _NEG_INF).to(torch.uint8), codes)
    return torch.where(torch.isnan(x), torch.full_like(codes, _NAN), codes)

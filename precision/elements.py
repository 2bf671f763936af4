"""Element formats: rounding a float32 tensor onto a low-precision grid, and element codes.

Every function here works on *already scaled* values: block and tensor scaling live in
``precision.blocks`` and ``precision.tensorwise``. Bit layouts and rounding rules are those of
``shared/NUMERICS.md``:

=========  ====  ====  ===========  =============  =============
element    bias  emax  max normal   min subnormal  Inf / NaN
=========  ====  ====  ===========  =============  =============
E2M1 (FP4)  1     2     6            0.5            none
E2M3 (FP6)  1     2     7.5          0.125          none
E3M2 (FP6)  3     4     28           0.0625         none
E4M3        7     8     448          2^-9           NaN only (0x7F / 0xFF)
E5M2       15    15     57344        2^-16          Inf and NaN
=========  ====  ====  ===========  =============  =============

Rounding is ``nearest`` (ties to even, saturating to the max normal) or ``stochastic``
(round up with probability equal to the distance from the lower neighbour over the gap; unbiased
for in-range values; uniforms from ``precision.srand`` or a ``torch.Generator``). Codes: E2M1 by
bucketize, FP8 through the torch dtypes, any finite-only element (FP6) from the grid value's float32
bits (``grid_encode`` / ``grid_decode``; ``encode_element`` / ``decode_element`` pick the path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precision.enums import Rounding

__all__ = [
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "ELEMENTS",
    "ElementSpec",
    "decode_element",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_values",
    "element_values",
    "encode_element",
    "exponent_floor",
    "fdiv",
    "fp8_decode",
    "fp8_encode",
    "grid_decode",
    "grid_encode",
    "pow2",
    "round_to_grid",
]


@dataclass(frozen=True)
class ElementSpec:
    """A sign-exponent-mantissa element format (no scale)."""

    name: str
    ebits: int  # exponent bits
    mbits: int  # stored mantissa bits
    emin: int  # exponent of the smallest normal
    emax: int  # exponent of the largest power of two
    max_normal: float
    torch_dtype: torch.dtype | None  # torch storage dtype, where one exists
    nonfinite: str = "none"  # codes for non-finite values: "none" (finite-only), "nan", "inf_nan"

    @property
    def bits(self) -> int:
        """Bits per code: sign, exponent, mantissa."""
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return 1 - self.emin

    @property
    def sign_shift(self) -> int:
        """Position of the sign bit in the code."""
        return self.ebits + self.mbits

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)


E2M1 = ElementSpec("e2m1", ebits=2, mbits=1, emin=0, emax=2, max_normal=6.0, torch_dtype=None)
E2M3 = ElementSpec("e2m3", ebits=2, mbits=3, emin=0, emax=2, max_normal=7.5, torch_dtype=None)
E3M2 = ElementSpec("e3m2", ebits=3, mbits=2, emin=-2, emax=4, max_normal=28.0, torch_dtype=None)
E4M3 = ElementSpec("e4m3", ebits=4, mbits=3, emin=-6, emax=8, max_normal=448.0, torch_dtype=torch.float8_e4m3fn,
                   nonfinite="nan")
E5M2 = ElementSpec("e5m2", ebits=5, mbits=2, emin=-14, emax=15, max_normal=57344.0, torch_dtype=torch.float8_e5m2,
                   nonfinite="inf_nan")
ELEMENTS = {e.name: e for e in (E2M1, E2M3, E3M2, E4M3, E5M2)}


def _rounding(rounding) -> Rounding:
    """``rounding`` (a member or its name) as a :class:`Rounding`; a one-line error otherwise."""
    return Rounding.parse(rounding, "rounding")


def fdiv(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` as one IEEE float32 division on every device.

    PyTorch evaluates ``number / tensor`` as ``reciprocal(tensor) * number`` and, on CUDA,
    ``tensor / number`` as ``tensor * (1 / number)``: two roundings, which flip scales that sit on
    a rounding tie (NUMERICS.md's NVFP4 tie vector). Both operands become tensors on one device.
    """
    t = a if isinstance(a, torch.Tensor) else b
    a = a if isinstance(a, torch.Tensor) else torch.full_like(t, a, dtype=torch.float32)
    b = b if isinstance(b, torch.Tensor) else torch.full_like(t, b, dtype=torch.float32)
    return torch.div(a.float(), b.float())


def exponent_floor(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(|a|)) of float32 values from the exponent bits (int32; -127 for 0 and subnormals)."""
    bits = a.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-149, 127], built from bits (no transcendental calls)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    # 2^-127 .. 2^-149 are FP32 subnormals: a single mantissa bit.
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, sub)


def round_to_grid(
    a: torch.Tensor,
    spec: ElementSpec,
    rounding: Rounding | str = Rounding.NEAREST,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round float32 ``a`` onto ``spec``'s value grid, saturating to +-max normal.

    Works for any finite input; NaN stays NaN. ``nearest`` is round-half-to-even;
    ``stochastic`` rounds up with probability (distance to the lower neighbour) / gap, using
    ``u`` (uniform [0, 1) numbers shaped like ``a``) or, if not given, one
    ``torch.rand(a.shape, generator=generator)`` draw.
    """
    a = a.float()
    mag = a.abs()
    # Spacing of the grid around |a|: 2^(max(floor(log2|a|), emin) - mbits).
    e = exponent_floor(mag).clamp(min=spec.emin, max=spec.emax)
    ulp = pow2(e - spec.mbits)
    steps = mag / ulp  # exact: division by a power of two
    q = _rounding(rounding).round_steps(steps, u, generator)
    q = torch.clamp(q * ulp, max=spec.max_normal)
    return torch.copysign(q, a)


def e2m1_round(v: torch.Tensor, rounding: Rounding | str = Rounding.NEAREST, u: torch.Tensor | None = None) -> torch.Tensor:
    """``round_to_grid(v, E2M1, ...)`` written with float operations only (the grid step is 0.5
    below 2, 1 below 4, 2 above; saturate at 6), so a compiler can vectorize it; same values."""
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    steps = a / step  # exact: division by a power of two
    q = _rounding(rounding).round_steps(steps, u)
    return torch.copysign(torch.clamp(q * step, max=E2M1.max_normal), v)


# ---------------------------------------------------------------- E2M1 codes
_E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Decision boundaries between neighbouring magnitudes. At a tie the even code wins: ties at 0.25,
# 1.25, 2.5 and 5 go down (boundary included in the lower bucket), ties at 0.75, 1.75 and 3.5 go up
# (boundary nudged one float32 ulp down so the tie lands in the upper bucket).
_E2M1_TIE_DOWN = [0.25, 1.25, 2.5, 5.0]
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_BOUNDS_RNE = torch.where(
    torch.isin(_E2M1_BOUNDS, torch.tensor(_E2M1_TIE_DOWN)),
    _E2M1_BOUNDS,
    torch.nextafter(_E2M1_BOUNDS, torch.tensor(-1.0)),
)


def e2m1_values() -> torch.Tensor:
    """The 16 E2M1 code values (index = code)."""
    return _E2M1_VALUES.clone()


def e2m1_encode(a: torch.Tensor, rounding: Rounding | str = Rounding.NEAREST, generator=None,
                u: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled float32 values -> E2M1 codes (uint8, 0..15), saturating at 6.

    Nearest rounding is one bucketize over the decision boundaries; stochastic rounding goes
    through ``round_to_grid`` and maps the (exact) result to its code.
    """
    a = a.float()
    if _rounding(rounding).nearest_even:
        mag = torch.bucketize(a.abs(), _E2M1_BOUNDS_RNE.to(a.device), right=False)
    else:
        q = round_to_grid(a, E2M1, rounding, generator, u).abs()
        mag = torch.bucketize(q, _E2M1_BOUNDS.to(a.device), right=False)  # exact grid values
    sign = torch.signbit(a).to(torch.uint8) << 3
    return mag.to(torch.uint8) | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8) -> float32 values."""
    return _E2M1_VALUES.to(codes.device)[codes.long() & 0xF]


# ---------------------------------------------------------------- FP8 codes
def fp8_encode(a: torch.Tensor, spec: ElementSpec, rounding: Rounding | str = Rounding.NEAREST, generator=None,
               u: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled float32 values -> FP8 codes (uint8), saturating to +-max normal; NaN/Inf -> NaN code
    for E4M3 (it has no Inf), kept as +-Inf for E5M2."""
    a = a.float()
    finite = torch.isfinite(a)
    if _rounding(rounding).nearest_even:
        q = a.clamp(-spec.max_normal, spec.max_normal)  # torch RNE-casts; E5M2 does not saturate itself
    else:
        q = round_to_grid(a, spec, rounding, generator, u)
    q = torch.where(finite, q, a if spec is E5M2 else torch.full_like(a, float("nan")))
    return q.to(spec.torch_dtype).view(torch.uint8)


def fp8_decode(codes: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    return codes.view(spec.torch_dtype).float()


# ---------------------------------------------------------------- any element: codes from bits
def element_values(spec: ElementSpec) -> torch.Tensor:
    """The value of every code of ``spec`` (index = code), decoded from the bit layout
    ``sign | exponent (bias 1 - emin) | mantissa``: exponent field 0 is subnormal. Finite-only
    formats (E2M1, E2M3, E3M2) use every code; for FP8 use the torch dtypes."""
    vals = []
    for code in range(1 << spec.bits):
        m = code & ((1 << spec.mbits) - 1)
        ef = (code >> spec.mbits) & ((1 << spec.ebits) - 1)
        mag = (m * 2.0 ** (spec.emin - spec.mbits) if ef == 0
               else (1 + m / 2**spec.mbits) * 2.0 ** (ef - spec.bias))
        vals.append(-mag if code >> spec.sign_shift else mag)
    return torch.tensor(vals, dtype=torch.float32)


_VALUE_TABLES: dict[str, torch.Tensor] = {}


def grid_encode(a: torch.Tensor, spec: ElementSpec, rounding: Rounding | str = Rounding.NEAREST, generator=None,
                u: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled float32 values -> codes of a finite-only element format (uint8), saturating.

    Rounds with :func:`round_to_grid` (RNE or stochastic), then reads the code off the exact grid
    value's float32 bits: normal -- exponent field ``e + bias`` and the top ``mbits`` mantissa
    bits; subnormal -- the integer ``|q| / min_subnormal``. NaN encodes as +0 (callers mark
    non-finite blocks through their scale).
    """
    a = a.float()
    q = round_to_grid(torch.where(torch.isnan(a), torch.zeros_like(a), a), spec, rounding, generator, u).abs()
    e = exponent_floor(q)
    bits = q.view(torch.int32)
    normal = ((e + spec.bias) << spec.mbits) | ((bits & 0x7FFFFF) >> (23 - spec.mbits))
    sub = (q * 2.0 ** (spec.mbits - spec.emin)).to(torch.int32)  # exact: a small integer
    mag = torch.where(e >= spec.emin, normal, sub)
    return (mag | (torch.signbit(a).to(torch.int32) << spec.sign_shift)).to(torch.uint8)


def grid_decode(codes: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    """Codes of a finite-only element format -> float32 values (table lookup)."""
    table = _VALUE_TABLES.get(spec.name)
    if table is None:
        table = _VALUE_TABLES[spec.name] = element_values(spec)
    return table.to(codes.device)[codes.long() & ((1 << spec.bits) - 1)]


def encode_element(a: torch.Tensor, spec: ElementSpec, rounding: Rounding | str = Rounding.NEAREST, generator=None,
                   u: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled float32 values -> ``spec`` codes (uint8): the fastest exact path for each element."""
    if spec is E2M1:
        return e2m1_encode(a, rounding, generator, u)
    if spec.torch_dtype is not None:
        return fp8_encode(a, spec, rounding, generator, u)
    return grid_encode(a, spec, rounding, generator, u)


def decode_element(codes: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    """``spec`` codes -> float32 values."""
    if spec.torch_dtype is not None:
        return fp8_decode(codes, spec)
    return grid_decode(codes, spec)

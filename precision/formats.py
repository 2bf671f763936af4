"""The format registry: every number format is one object that carries its behaviour.

A format knows its scaling kind, block size, element, bits per element (scale overhead included),
which roundings and scale rules apply, whether delayed scaling applies, and how to quantize,
dequantize and pack -- TransformerEngine's "one quantizer interface, one ``quantize_impl`` per
format". Adding a format is one entry in :data:`FORMATS` (plus its element in
``precision.elements`` if the element is new); every list of valid values -- errors, CLI choices,
the spec grammar, README tables -- is read from here.

>>> FORMATS["mxfp6_e2m3"].bits_per_element, FORMATS["nvfp4"].kind
(6.25, 'two_level')

Roundings, scale rules, amax algorithms and scaling kinds are the ``str`` enums of
``precision.enums`` (re-exported here); a rounding carries its behaviour (``Rounding.round_steps``).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass

import torch

from precision import blocks
from precision.elements import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    ElementSpec,
    decode_element,
    encode_element,
)
from precision.enums import AmaxAlgo, FourOverSix, Rounding, ScaleRule, Scaling
from precision.eden import ms_eden_quantize
from precision.four_over_six import fouroversix_quantize
from precision.quest import quest_quantize
from precision.hif8 import HIF8_MAX, HIF8_SCALE_TARGET, hif8_decode, hif8_encode
from precision.srand import SRKey
from precision.tensorwise import scale_from_amax, tensor_amax

__all__ = [
    "FORMATS",
    "AmaxAlgo",
    "Format",
    "QuantizedTensor",
    "Rounding",
    "ScaleRule",
    "Scaling",
    "format_names",
    "get_format",
    "pack_codes",
    "unpack_codes",
]


# BF16 (``Format.bf16_exact``): 7 stored mantissa bits, FP32's exponent range, subnormals to 2^-133
BF16_MANTISSA_BITS = 7
BF16_MIN_SUBNORMAL_EXP = -133  # 2^-126 (smallest normal) x 2^-7


# ====================================================================== quantized tensors
@dataclass
class QuantizedTensor:
    """The result of ``precision.quantize``.

    ``codes``: one code per element, shaped like the input (uint8; fp32 / bf16: the int32 / int16
    bit patterns). ``scales``: block formats -- uint8 scale bytes (E8M0 for MX, E4M3 for NVFP4)
    shaped like the input with the block axis shrunk to ceil(n / block); per-tensor formats --
    the float32 encode scale (0-d). ``tensor_scale``: NVFP4's FP32 encode scale ``g_enc``.
    ``num_clipped``: per-tensor formats, how many finite values saturated (0-d int64 tensor).
    ``block2d``: 2-D tiles (``Format.tile`` squares, weights): ``scales`` keep the 1-D layout along
    ``axis``, each square's scale repeated on its rows; :meth:`along` serves the other axis.
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor | None
    axis: int
    tensor_scale: torch.Tensor | None = None
    prescale: float = 1.0
    num_clipped: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    block2d: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def format(self) -> Format:
        return FORMATS[self.fmt]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.format.dequantize(self).to(dtype)

    def packed(self) -> torch.Tensor:
        """The codes in packed storage along the last axis (``Format.pack``)."""
        return self.format.pack(self.codes)

    def tile_scales(self) -> torch.Tensor:
        """A 2-D-tiled tensor's scale bytes, one per square: ``[ceil(rows / t), ceil(n / t)]``
        with ``axis`` last (what packed storage keeps; ``t`` = ``Format.tile``)."""
        if not self.block2d:
            raise ValueError(f"tile_scales: {self.fmt} was quantized in 1-D blocks (give block2d=True)")
        return self.scales.movedim(self.axis, -1)[:: self.format.tile]

    def along(self, axis: int) -> QuantizedTensor:
        """The same quantized tensor with its block scales laid out along ``axis``: for 2-D tiles the
        same codes and square scales (no second quantization: Fprop's weight serves Dgrad)."""
        axis = axis % self.codes.dim()
        if axis == self.axis:
            return self
        if not self.block2d:
            raise ValueError(f"along: a {self.fmt} tensor in 1-D blocks along axis {self.axis} cannot serve "
                             f"axis {axis} without a second quantization (2-D tiles can: block2d=True)")
        t = self.format.tile
        grid = self.tile_scales()  # [other-axis squares, this-axis squares]
        scales = grid.t().repeat_interleave(t, dim=0)[: self.codes.shape[self.axis]]  # [n_this, other squares]
        return dataclasses.replace(self, scales=scales.movedim(-1, axis).contiguous(), axis=axis)


# ====================================================================== packing
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Sub-byte codes packed along the last axis, lowest index in the lowest bits:
    4-bit -- two per byte (low nibble = even index); 6-bit -- four in three bytes."""
    per, nbytes = {4: (2, 1), 6: (4, 3)}[bits]
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"pack: last dimension must be a multiple of {per} for {bits}-bit codes, got {n}")
    if bits == 4:  # byte arithmetic only (the hardware GEMM path packs every FP4 operand)
        c = codes.view(torch.uint8).reshape(*codes.shape[:-1], n // 2, 2)
        return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], n // per, per) & ((1 << bits) - 1)
    word = sum(c[..., i] << (bits * i) for i in range(per))
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], dim=-1)
    return out.reshape(*codes.shape[:-1], n // per * nbytes).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    per, nbytes = {4: (2, 1), 6: (4, 3)}[bits]
    if bits == 4:
        p = packed.view(torch.uint8)
        return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], -1)
    p = packed.view(torch.uint8).to(torch.int32)
    if p.shape[-1] % nbytes:
        raise ValueError(f"unpack: last dimension must be a multiple of {nbytes} for {bits}-bit codes")
    b = p.reshape(*p.shape[:-1], -1, nbytes)
    word = sum(b[..., j] << (8 * j) for j in range(nbytes))
    out = torch.stack([(word >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], dim=-1)
    return out.reshape(*p.shape[:-1], -1).to(torch.uint8)


# ====================================================================== the formats
@dataclass(frozen=True)
class Format(abc.ABC):
    """One number format. Subclasses implement ``_quantize`` and ``dequantize``."""

    name: str
    kind: Scaling
    description: str  # one phrase for tables and --help
    element: ElementSpec | None = None
    block: int = 0
    code_bits: int = 8  # bits of one element code
    scale_bits: int = 0  # bits of one block scale (block formats)
    tile: int = 0  # 2-D block scaling (weights): the edge of the square sharing one scale; 0: 1-D only
    roundings: tuple[Rounding, ...] = (Rounding.NEAREST, Rounding.STOCHASTIC)  # NVFP4 adds MS_EDEN
    scale_rules: tuple[ScaleRule, ...] = (ScaleRule.FLOOR,)  # more than FLOOR: MX
    delayed: bool = False  # delayed scaling (an amax history) applies
    four_over_six: bool = False  # NVFP4: the per-block 4-or-6 scale choice (``/4over6``) applies
    max_normal: float = 0.0
    scale_target: float = 0.0
    """Per-tensor formats: the value a tensor's amax maps to, ``scale = scale_target / amax``
    (FP8: its max normal, as TransformerEngine; HiF8: 2^3, inside its 3-mantissa-bit binades).
    An operand's ``margin`` divides it by 2^margin (``OperandFormat.scale_target``)."""
    rate_class: str | None = None
    """The tensor-core rate class a GEMM of this format runs at on a device whose tensor cores take
    its scaling kind (``precision.cost_model``: ``fp32``, ``bf16``, ``fp8``, ``fp6``, ``fp4``); None:
    no device has tensor cores for it (HiF8), so it is emulated everywhere."""

    # ---------------------------------------------------------------- properties
    @property
    def scaling(self) -> Scaling:
        """Where the element scales live: ``none``, ``tensor`` or ``block`` (NVFP4's block scales
        included; ``kind`` tells two-level apart). Prefer ``blocked`` / ``tensor_scaled`` / ``kind``."""
        return Scaling.BLOCK if self.kind == Scaling.TWO_LEVEL else self.kind

    @property
    def bits(self) -> int:
        """Bits of one element code (4 for FP4 formats)."""
        return self.code_bits

    @property
    def bits_per_element(self) -> float:
        """Storage per element including the block-scale overhead (tensor scales are amortized)."""
        return self.code_bits + (self.scale_bits / self.block if self.block else 0)

    @property
    def supports_sr(self) -> bool:
        return any(r.stochastic for r in self.roundings)

    @property
    def has_scale_rules(self) -> bool:
        """Whether the MX scale rules (floor / rceil) apply."""
        return len(self.scale_rules) > 1

    is_mx = has_scale_rules

    @property
    def blocked(self) -> bool:
        """Per-block scales (MX, NVFP4)."""
        return self.kind in (Scaling.BLOCK, Scaling.TWO_LEVEL)

    @property
    def tensor_scaled(self) -> bool:
        """A tensor-level scale from the tensor's amax (per-tensor formats, NVFP4's FP32 scale):
        under tensor parallelism its amax is the whole tensor's."""
        return self.kind in (Scaling.TENSOR, Scaling.TWO_LEVEL)

    @property
    def rounds(self) -> bool:
        """False only for the identity (fp32)."""
        return True

    @property
    def packable(self) -> bool:
        return self.code_bits in (4, 6)

    @property
    def triton(self) -> bool:
        """Whether the fused Triton quantizer (``kernels.triton_quant``) has a kernel for this format:
        every sign-exponent-mantissa element under per-tensor, block or two-level scaling (not
        fp32/bf16, which do not round through a grid, nor HiF8's tapered code)."""
        return self.element is not None and self.kind != Scaling.NONE

    @property
    def bf16_exact(self) -> bool:
        """Whether BF16 holds every dequantized value exactly once the FP32 tensor-level factors --
        a per-tensor decode scale, NVFP4's ``g_dec``, the 3/4 SR pre-scale -- are applied to the GEMM
        output instead: then an emulated GEMM of this format can run on BF16 tensor cores with FP32
        accumulation (``kernels.bf16_mm``). Element formats qualify when their mantissa fits BF16's 7
        bits (block scales are powers of two, and NVFP4's E4M3 x E2M1 products have at most 6
        significant bits); MX elements whose smallest value under the smallest scale 2^-127 lies
        below BF16's smallest subnormal need a power-of-two shift (:attr:`bf16_shift`)."""
        return self.element is not None and self.element.mbits <= BF16_MANTISSA_BITS

    @property
    def bf16_shift(self) -> int:
        """Binades by which an MX element's least significant bit under the smallest scale (2^-127)
        falls below BF16's smallest subnormal 2^-133: the power-of-two shift ``kernels.bf16_mm``
        moves from the operand to the GEMM output (MXFP8 E4M3: 3, E5M2: 10; 0 for every other
        format, whose values BF16 always spans)."""
        if self.kind != Scaling.BLOCK or self.element is None:
            return 0
        lsb = self.element.emin - self.element.mbits - 127
        return max(0, BF16_MIN_SUBNORMAL_EXP - lsb)

    # ---------------------------------------------------------------- behaviour
    def check(self, rounding, scale_rule) -> tuple[Rounding, ScaleRule]:
        """Validated rounding and scale rule for this format (one-line errors naming the format)."""
        r = Rounding.parse(rounding, f"{self.name}: rounding")
        s = ScaleRule.parse(scale_rule, f"{self.name}: scale rule")
        if r not in self.roundings:
            raise ValueError(f"{self.name}: {r} rounding is not supported; valid: {', '.join(self.roundings)}")
        if s not in self.scale_rules:
            raise ValueError(f"{self.name}: scale rule {s} does not apply; valid: {', '.join(self.scale_rules)}"
                             + ("" if self.has_scale_rules else f" (scale rules {', '.join(ScaleRule.values())}"
                                " apply to MX formats only)"))
        return r, s

    def quantize(self, x: torch.Tensor, op=None, *, axis: int = -1, amax: torch.Tensor | float | None = None,
                 sr: SRKey | torch.Generator | None = None) -> QuantizedTensor:
        """Quantize ``x`` (blocks along ``axis``) as ``op`` says: a ``precision.recipe.OperandFormat``
        of this format (rounding, scale rule, pre-scale, 2-D ``tile`` squares; validated when it was
        made), or None for this format's defaults (nearest, floor, none, 1-D). ``sr``: an ``SRKey``
        or a ``torch.Generator``; ``amax``: a tensor-level scale's. See ``precision.quantize`` (which
        also applies an operand's ``margin``)."""
        if op is not None and op.fmt != self.name:
            raise ValueError(f"{self.name}.quantize: the operand format is {op.fmt}, not {self.name}")
        r, s = (Rounding.NEAREST, ScaleRule.FLOOR) if op is None else (op.rounding, op.scale_rule)
        prescale, block2d = (1.0, False) if op is None else (op.prescale_factor, op.block2d)
        extra = {} if op is None or op.four_over_six == FourOverSix.NONE else {"four_over_six": op.four_over_six}
        if block2d and x.dim() != 2:
            raise ValueError(f"{self.name}: 2-D block scaling takes a 2-D tensor (a weight [out, in]), "
                             f"got shape {tuple(x.shape)}")
        if x.dim() == 0:
            raise ValueError("quantize: x must have at least one dimension")
        axis = axis % x.dim()
        generator = sr if isinstance(sr, torch.Generator) else None
        u = None
        if r.stochastic and sr is not None and generator is None:  # natural layout, blocked like x below
            u = sr.uniforms(x.shape, x.device)
        if block2d:
            return self._quantize(x.float(), axis, r, s, generator, prescale, amax, u, block2d=True, **extra)
        return self._quantize(x.float(), axis, r, s, generator, prescale, amax, u, **extra)

    @abc.abstractmethod
    def _quantize(self, xf, axis, rounding, scale_rule, generator, prescale, amax, u) -> QuantizedTensor:
        """Quantize float32 ``xf`` (blocks along ``axis``; ``u``: SR uniforms shaped like ``xf``)."""

    @abc.abstractmethod
    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """float32 values of ``q``."""

    def fake_quantize(self, x: torch.Tensor, op=None, **kw) -> torch.Tensor:
        """quantize -> dequantize to float32 (the emulated operand)."""
        return self.dequantize(self.quantize(x, op, **kw)).float()

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed storage along the last axis (4-bit: 2 per byte; 6-bit: 4 in 3 bytes)."""
        if not self.packable:
            raise ValueError(f"packed(): {self.name} has {self.code_bits}-bit codes, stored one per element; "
                             f"packed formats: {', '.join(n for n, f in FORMATS.items() if f.packable)}")
        return pack_codes(codes, self.code_bits)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if not self.packable:
            raise ValueError(f"unpack: {self.name} codes are not packed")
        return unpack_codes(packed, self.code_bits)


@dataclass(frozen=True)
class IdentityFormat(Format):
    """FP32: not rounded at all; codes are the float32 bit patterns."""

    @property
    def rounds(self) -> bool:
        return False

    def _quantize(self, xf, axis, rounding, scale_rule, generator, prescale, amax, u):
        return QuantizedTensor(self.name, xf.clone().view(torch.int32), None, axis)

    def dequantize(self, q):
        return q.codes.view(torch.float32)


@dataclass(frozen=True)
class CastFormat(Format):
    """A plain RNE cast to a torch dtype (bf16); codes are its bit patterns."""

    dtype: torch.dtype = torch.bfloat16
    code_dtype: torch.dtype = torch.int16

    @property
    def bf16_exact(self) -> bool:
        return self.dtype == torch.bfloat16

    def _quantize(self, xf, axis, rounding, scale_rule, generator, prescale, amax, u):
        return QuantizedTensor(self.name, xf.to(self.dtype).view(self.code_dtype), None, axis)

    def dequantize(self, q):
        return q.codes.view(self.dtype).float()


@dataclass(frozen=True)
class TensorFormat(Format):
    """Per-tensor scaling: ``scale = scale_target / amax`` (current, or a given/delayed amax), values
    beyond ``max_normal`` saturate and are counted."""

    def encode(self, v, rounding, generator, u):
        return encode_element(v, self.element, rounding, generator, u)

    def decode(self, codes):
        return decode_element(codes, self.element)

    def _quantize(self, xf, axis, rounding, scale_rule, generator, prescale, amax, u):
        cur = tensor_amax(xf)
        used = cur if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=xf.device).reshape(())
        scale = scale_from_amax(used, self.scale_target)
        v = xf * scale
        clipped = (v.abs() > self.max_normal) & torch.isfinite(v)
        codes = self.encode(v, rounding, generator, u)
        return QuantizedTensor(self.name, codes, scale, axis, num_clipped=clipped.sum(), amax=cur)

    def dequantize(self, q):
        return self.decode(q.codes) * (1.0 / q.scales)


@dataclass(frozen=True)
class HiF8Format(TensorFormat):
    """HiFloat8 under a per-tensor scale (tapered precision, ties away, saturating at 2^15)."""

    @property
    def bf16_exact(self) -> bool:
        return True  # at most 3 mantissa bits, values 2^-22 .. 2^15 (and +-Inf, NaN)

    def encode(self, v, rounding, generator, u):
        return hif8_encode(v, saturate=True)

    def decode(self, codes):
        return hif8_decode(codes)


@dataclass(frozen=True)
class MXFormat(Format):
    """OCP MX: ``block`` consecutive elements along the contraction axis share an E8M0 scale."""

    def _quantize(self, xf, axis, rounding, scale_rule, generator, prescale, amax, u, block2d=False):
        n = xf.shape[axis]
        if scale_rule == ScaleRule.QUEST:  # precision.quest: the block scale from its std, clipping
            if block2d or prescale != 1.0:
                raise ValueError(f"{self.name}/quest: 1-D blocks and no pre-scale only")
            codes, sbytes = quest_quantize(xf, axis, rounding, generator, u)
            return QuantizedTensor(self.name, codes, sbytes, axis)
        xb = blocks.to_blocks(xf, axis, self.block)
        ub = blocks.to_blocks(u, axis, self.block) if u is not None else None
        tiles = blocks.tile_amax(xf, axis, self.tile) if block2d else None
        codes, sbytes = blocks.mx_quantize_blocks(xb, self.element, scale_rule, rounding, generator, prescale, ub,
                                                  amax=tiles)
        return QuantizedTensor(self.name, blocks.from_blocks(codes, axis, n), sbytes.movedim(-1, axis), axis,
                               prescale=prescale, block2d=block2d)

    def dequantize(self, q):
        n = q.codes.shape[q.axis]
        cb = blocks.to_blocks(q.codes, q.axis, self.block)
        out = blocks.mx_dequantize_blocks(cb, q.scales.movedim(q.axis, -1), self.element, q.prescale)
        return blocks.from_blocks(out, q.axis, n)


@dataclass(frozen=True)
class NVFP4Format(Format):
    """NVFP4: 16-element blocks with E4M3 scales under an FP32 tensor scale from the tensor amax
    (or a given one: the TP-reduced whole-tensor amax)."""

    def _quantize(self, xf, axis, rounding, scale_rule, generator, prescale, amax, u, block2d=False,
                  four_over_six=FourOverSix.NONE):
        n = xf.shape[axis]
        used = tensor_amax(xf) if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=xf.device)
        if rounding.eden_group:  # precision.eden: EDEN-corrected, stochastically rounded scales
            if block2d:
                raise ValueError(f"{self.name}: {rounding} rounds 1-D blocks (2-D weight tiles round to nearest)")
            codes, sbytes, g_enc = ms_eden_quantize(xf, axis, used.reshape(()), u, generator, rounding.eden_group)
            return QuantizedTensor(self.name, codes, sbytes, axis, tensor_scale=g_enc)
        if four_over_six != FourOverSix.NONE:  # precision.four_over_six: per block, amax -> 4 or 6
            codes, sbytes, g_enc = fouroversix_quantize(xf, axis, used.reshape(()), four_over_six, rounding,
                                                        generator, u, block2d)
            return QuantizedTensor(self.name, codes, sbytes, axis, tensor_scale=g_enc, block2d=block2d)
        xb = blocks.to_blocks(xf, axis, self.block)
        ub = blocks.to_blocks(u, axis, self.block) if u is not None else None
        g_enc = blocks.nvfp4_tensor_scale(used.reshape(()))
        tiles = blocks.tile_amax(xf, axis, self.tile) if block2d else None
        codes, sbytes = blocks.nvfp4_quantize_blocks(xb, g_enc, rounding, generator, ub, amax=tiles)
        return QuantizedTensor(self.name, blocks.from_blocks(codes, axis, n), sbytes.movedim(-1, axis), axis,
                               tensor_scale=g_enc, block2d=block2d)

    def dequantize(self, q):
        n = q.codes.shape[q.axis]
        cb = blocks.to_blocks(q.codes, q.axis, self.block)
        out = blocks.nvfp4_dequantize_blocks(cb, q.scales.movedim(q.axis, -1), q.tensor_scale)
        return blocks.from_blocks(out, q.axis, n)


_NEAREST = (Rounding.NEAREST,)
_MX_RULES = (ScaleRule.FLOOR, ScaleRule.RCEIL)


def _mx(name: str, element: ElementSpec, what: str) -> MXFormat:
    return MXFormat(name, Scaling.BLOCK, f"{what} + E8M0 scale per 32", element, block=32,
                    code_bits=element.bits, scale_bits=8, tile=32, scale_rules=_MX_RULES, max_normal=element.max_normal,
                    rate_class=f"fp{element.bits}")


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        IdentityFormat("fp32", Scaling.NONE, "float32, not rounded (exact FP32 GEMM)", code_bits=32,
                       roundings=_NEAREST, rate_class="fp32"),
        CastFormat("bf16", Scaling.NONE, "bfloat16 (RNE cast)", code_bits=16, roundings=_NEAREST, rate_class="bf16"),
        TensorFormat("fp8_e4m3", Scaling.TENSOR, "E4M3, saturating", E4M3, delayed=True,
                     max_normal=E4M3.max_normal, scale_target=E4M3.max_normal, rate_class="fp8"),
        TensorFormat("fp8_e5m2", Scaling.TENSOR, "E5M2, saturating", E5M2, delayed=True,
                     max_normal=E5M2.max_normal, scale_target=E5M2.max_normal, rate_class="fp8"),
        HiF8Format("hif8", Scaling.TENSOR, "HiFloat8, ties away, saturating at 2^15", roundings=_NEAREST,
                   delayed=True, max_normal=HIF8_MAX, scale_target=HIF8_SCALE_TARGET),
        _mx("mxfp8_e4m3", E4M3, "E4M3"),
        _mx("mxfp8_e5m2", E5M2, "E5M2"),
        _mx("mxfp6_e2m3", E2M3, "E2M3 (FP6)"),
        _mx("mxfp6_e3m2", E3M2, "E3M2 (FP6)"),
        dataclasses.replace(_mx("mxfp4", E2M1, "E2M1 (FP4)"), scale_rules=(*_MX_RULES, ScaleRule.QUEST)),
        NVFP4Format("nvfp4", Scaling.TWO_LEVEL, "E2M1 + E4M3 scale per 16 + FP32 tensor scale", E2M1, block=16,
                    code_bits=4, scale_bits=8, tile=16, max_normal=E2M1.max_normal, rate_class="fp4",
                    roundings=tuple(Rounding), four_over_six=True),
    )
}


def format_names(predicate=None) -> tuple[str, ...]:
    """Registered format names, optionally those whose ``Format`` satisfies ``predicate``."""
    return tuple(n for n, f in FORMATS.items() if predicate is None or predicate(f))


def get_format(fmt) -> Format:
    """The ``Format`` for a name (or a ``Format``); a one-line error listing the valid names."""
    if isinstance(fmt, Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}") from None


def format_table() -> str:
    """The README's format table, from the registry."""
    rows = ["| format | scaling | block | bits/element | elements | SR | scale rules | delayed |",
            "|---|---|---|---|---|---|---|---|"]
    for f in FORMATS.values():
        rows.append(f"| `{f.name}` | {f.kind} | {f.block or '-'} | {f.bits_per_element:g} | {f.description} "
                    f"| {'yes' if f.supports_sr else 'no'} | {', '.join(f.scale_rules) if f.has_scale_rules else '-'} "
                    f"| {'yes' if f.delayed else 'no'} |")
    return "\n".join(rows)


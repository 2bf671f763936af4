"""Rounding-alignment records (TRACE): replay the rollout's FP4 rounding in the trainer.

A rollout engine and a trainer that quantize "the same" activation see slightly different inputs
(another kernel's summation order, a KV-cache, BF16 vs FP32 somewhere upstream). A block's scale
can then differ, and an element that sits near a rounding decision boundary can round to the other
neighbour: the trainer computes its loss on numbers the rollout never used. The record carries what
is needed to make the trainer's rounding the rollout's, cheaply:

    q_roll, rec = record_rounding(x_roll, "nvfp4")       # rollout: quantize and record
    q_train = replay_quantize(x_train, rec)                # trainer: quantize with the record
    x_fq = replay_fake_quantize(x_train, rec)              # ... as a fake-quantized operand (STE)
    code_agreement(q_train, q_roll)                        # fraction of element codes that agree
    rec.bits_per_element                                   # 1 + 8/16 (+ 32/numel) for NVFP4

What the record holds, per quantized activation:
  - the block scales as the rollout computed them (E8M0 bytes for MX, E4M3 bytes and the FP32
    tensor scale ``g_enc`` for NVFP4: ``QuantizedTensor.scales`` / ``tensor_scale``);
  - one **direction bit** per element: with ``v`` the element in units of its block scale
    (``v = x / scale``, saturated to +-max normal) and ``lo <= v <= hi`` its two neighbouring grid
    points of the element format (``precision.elements.element_values``: E2M1, E2M3, E3M2), the
    bit is 1 when the rollout's value is ``hi`` ("up", towards +inf) and ``hi != lo``, else 0
    ("down", or ``v`` on the grid). Bits are packed eight to a byte.
  Size: ``1 + scale_bits / block`` bits per element (+ 32 / numel for NVFP4's tensor scale):
  1.25 for MXFP4, 1.5 for NVFP4 -- against 4.25 / 4.5 for the codes themselves.

Replay (the trainer's fake-quant mode, :func:`replay_quantize`): the trainer's own ``x'`` is
divided by the **recorded** scale (its own amax is not used), giving ``v'`` in grid interval
``[lo', hi']``. Where ``v'`` lies in the rollout's interval the recorded neighbour is taken
(``lo'`` for "down", ``hi'`` for "up"); elsewhere the trainer's own round-to-nearest-even.
One bit cannot name the rollout's interval, so "lies in the rollout's interval" is decided from
``v'`` itself: ``v'`` is taken to be in it when it is at least ``window`` grid steps (default
1/4 of its interval) away from both ends -- a value that near the middle cannot have crossed a
grid point unless the two inputs differ by more than that, and a value near a grid point rounds
to that grid point under nearest rounding on either side of it. Hence, for ``|v - v'| < window``
times the smaller adjacent grid step (in scaled units), replay reproduces every rollout code
(tested); identical inputs agree 100 % with or without replay. ``window = 0`` applies the
recorded direction everywhere (pure direction replay).

Measured (64x128 N(0,1) activations, trainer inputs perturbed by a relative 2e-3 / 1e-2 / 5e-2):
the trainer's own rounding agrees with the rollout on 99.3 / 96.6 / 86.5 % of MXFP4 codes, replay
on 100 / 100 / 99.2 % (``window = 0``: 100 / 98.3 / 92.0 %); NVFP4 within half a point of that.

Codes are compared by their grid value (``code_agreement``), so ``+0`` and ``-0`` count as one.
Only nearest-rounded block formats with a finite element grid are recorded (``mxfp4``, ``nvfp4``,
``mxfp6_*``); stochastic rounding has no nearest to replay against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precision import blocks
from precision.elements import E2M1, decode_element, element_values, encode_element, exponent_floor, fdiv
from precision.formats import FORMATS, QuantizedTensor, ScaleRule
from precision.recipe import OperandFormat

__all__ = ["RoundingRecord", "code_agreement", "record_rounding", "recordable_formats", "replay_fake_quantize",
           "replay_quantize"]

DEFAULT_WINDOW = 0.25


def recordable_formats() -> tuple[str, ...]:
    """Block formats whose element grid is finite (their codes have neighbours to record)."""
    return tuple(n for n, f in FORMATS.items() if f.blocked and f.element is not None and f.element.torch_dtype is None)


def _check_format(fmt) -> str:
    name = getattr(fmt, "fmt", fmt)
    if name not in recordable_formats():
        raise ValueError(f"rounding record: format {name!r} cannot be recorded; valid: {', '.join(recordable_formats())}")
    return name


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    flat = bits.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).reshape(-1, 8)
    return (flat << torch.arange(8, dtype=torch.uint8, device=flat.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()


@dataclass
class RoundingRecord:
    """The rollout's block scales and one packed direction bit per element (module docstring)."""

    fmt: str
    axis: int
    shape: tuple[int, ...]
    scales: torch.Tensor  # QuantizedTensor.scales layout: block axis shrunk, at ``axis``
    tensor_scale: torch.Tensor | None  # NVFP4's g_enc
    direction: torch.Tensor  # uint8, bits packed eight per byte (element order of ``shape``)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @classmethod
    def from_directions(cls, fmt: str, axis: int, scales: torch.Tensor, up: torch.Tensor,
                        tensor_scale: torch.Tensor | None = None) -> RoundingRecord:
        """A record from its scales and its direction bits as a bool tensor (True = up), packed here."""
        return cls(fmt, axis % up.dim(), tuple(up.shape), scales, tensor_scale, _pack_bits(up))

    def directions(self) -> torch.Tensor:
        """The direction bits (bool, ``shape``; True = rounded up)."""
        return _unpack_bits(self.direction, self.numel).reshape(self.shape)

    @property
    def bits_per_element(self) -> float:
        """Record size: direction bits + scale bytes (+ the FP32 tensor scale) per element."""
        bits = self.direction.numel() * 8 + self.scales.numel() * FORMATS[self.fmt].scale_bits
        return (bits + (32 if self.tensor_scale is not None else 0)) / self.numel


def _scaled(xb: torch.Tensor, sbytes: torch.Tensor, fmt: str, g_enc) -> torch.Tensor:
    """Blocks ``[..., nblocks, block]`` in units of their (recorded) scale, saturated: exactly the
    value ``precision.blocks`` rounds (same FP32 operations)."""
    spec = FORMATS[fmt].element
    if fmt == "nvfp4":
        s_dec = sbytes.view(torch.float8_e4m3fn).float()
        s_enc = torch.clamp(1.0 / (s_dec * (1.0 / g_enc)), max=blocks.FP32_MAX)
        v = torch.clamp(xb * s_enc.unsqueeze(-1), -E2M1.max_normal, E2M1.max_normal)
        zero = torch.isnan(v) | (s_dec == 0).unsqueeze(-1)  # a zero scale stores signed zeros
        return torch.where(zero, torch.copysign(torch.zeros_like(v), xb), v)
    v = xb * blocks.pow2(127 - sbytes.to(torch.int32)).unsqueeze(-1)
    return torch.clamp(v, -spec.max_normal, spec.max_normal)


def _neighbours(v: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``: the grid points with ``lo <= v <= hi`` (``grid`` sorted, signed; ``v`` in range)."""
    i = torch.bucketize(v, grid, right=True).clamp(1, grid.numel() - 1)  # grid[i-1] <= v < grid[i]
    lo, hi = grid[i - 1], grid[i]
    on = v == hi  # only at the top of the grid (v = +max)
    return torch.where(on, hi, lo), hi


def _grid(fmt: str, device) -> torch.Tensor:
    vals = element_values(FORMATS[fmt].element)
    return torch.unique(vals[torch.isfinite(vals)]).to(device)  # sorted, -0 folded into 0


def record_rounding(x: torch.Tensor, fmt, *, axis: int = -1, scale_rule=ScaleRule.FLOOR,
                    amax: torch.Tensor | float | None = None) -> tuple[QuantizedTensor, RoundingRecord]:
    """The rollout side: quantize ``x`` (nearest rounding, blocks along ``axis``) and record its
    block scales and rounding directions. ``fmt``: a recordable format name or OperandFormat
    (``scale_rule`` / ``amax``: as ``precision.quantize``). Returns ``(quantized, record)``."""
    name = _check_format(fmt)
    rule = getattr(fmt, "scale_rule", scale_rule)
    if getattr(fmt, "rounding", None) is not None and fmt.rounding.stochastic:
        raise ValueError(f"rounding record: {fmt} rounds stochastically; only nearest rounding can be replayed")
    axis = axis % x.dim()
    f = FORMATS[name]
    q = f.quantize(x, OperandFormat(name, scale_rule=rule), axis=axis, amax=amax)
    xb = blocks.to_blocks(x.float(), axis, f.block)
    v = _scaled(xb, q.scales.movedim(axis, -1), name, q.tensor_scale)
    qv = _grid_values(q, axis)
    up = blocks.from_blocks(qv > v, axis, x.shape[axis])
    return q, RoundingRecord.from_directions(name, axis, q.scales.clone(), up, q.tensor_scale)


def _grid_values(q: QuantizedTensor, axis: int) -> torch.Tensor:
    """Element grid values of ``q``'s codes as ``[..., nblocks, block]`` blocks (unscaled)."""
    f = FORMATS[q.fmt]
    return blocks.to_blocks(decode_element(q.codes, f.element), axis, f.block)


def replay_quantize(x: torch.Tensor, record: RoundingRecord, *, window: float = DEFAULT_WINDOW) -> QuantizedTensor:
    """The trainer side: quantize ``x`` (the trainer's own values, ``record.shape``) with the
    rollout's recorded scales and, where ``x`` lies in the rollout's grid interval, the recorded
    rounding direction; its own round-to-nearest elsewhere (module docstring). Dequantize the
    result for the fake-quantized operand."""
    if tuple(x.shape) != record.shape:
        raise ValueError(f"replay: x is {tuple(x.shape)}, the record {record.shape}")
    if not 0.0 <= window < 0.5:
        raise ValueError(f"replay: window must be in [0, 0.5), got {window}")
    name, axis = record.fmt, record.axis
    f = FORMATS[name]
    xb = blocks.to_blocks(x.float(), axis, f.block)
    sbytes = record.scales.movedim(axis, -1)
    v = _scaled(xb, sbytes, name, record.tensor_scale)
    lo, hi = _neighbours(v, _grid(name, x.device))
    up = blocks.to_blocks(record.directions().to(x.device), axis, f.block)
    step = hi - lo
    frac = torch.where(step > 0, fdiv(v - lo, torch.where(step > 0, step, torch.ones_like(step))), torch.zeros_like(v))
    inside = (step > 0) & (frac >= window) & (frac <= 1.0 - window)
    rne = encode_element(v, f.element)  # the trainer's own nearest rounding
    replayed = torch.copysign(torch.where(up, hi, lo), v)  # keeps -0 for negative values rounded to 0
    codes = torch.where(inside, encode_element(replayed, f.element), rne)
    codes = _zero_blocks(codes, xb, sbytes, name)
    return QuantizedTensor(name, blocks.from_blocks(codes, axis, x.shape[axis]), record.scales, axis,
                           tensor_scale=record.tensor_scale)


def replay_fake_quantize(x: torch.Tensor, record: RoundingRecord, *, window: float = DEFAULT_WINDOW) -> torch.Tensor:
    """The trainer's fake-quant mode: :func:`replay_quantize`'s values in ``x``'s dtype, with a
    straight-through gradient (d out / d x = 1), as the training Fprop's fake-quantized operand."""
    values = replay_quantize(x.detach(), record, window=window).dequantize(torch.float32).to(x.dtype)
    return x + (values - x).detach()


def _zero_blocks(codes: torch.Tensor, xb: torch.Tensor, sbytes: torch.Tensor, fmt: str) -> torch.Tensor:
    """As the quantizer: MX blocks of zeros / FP32 subnormals hold signed zeros, NaN-scale blocks
    zero codes (NVFP4's zero-scale blocks are signed zeros already, see ``_scaled``)."""
    if fmt != "nvfp4":
        spec = FORMATS[fmt].element
        tiny = exponent_floor(xb.abs().amax(dim=-1)) == -127
        codes = torch.where(tiny.unsqueeze(-1), torch.signbit(xb).to(torch.uint8) << spec.sign_shift, codes)
    bad = sbytes == (0x7F if fmt == "nvfp4" else 0xFF)
    return torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)


def code_agreement(a: QuantizedTensor, b: QuantizedTensor) -> float:
    """Fraction of elements whose codes have the same grid value (``+0`` = ``-0``)."""
    if a.fmt != b.fmt or a.shape != b.shape:
        raise ValueError(f"code agreement: {a.fmt} {tuple(a.shape)} vs {b.fmt} {tuple(b.shape)}")
    spec = FORMATS[a.fmt].element
    return float((decode_element(a.codes, spec) == decode_element(b.codes, spec)).double().mean())


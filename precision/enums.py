"""The typed vocabularies of the precision core: roundings, scale rules, amax algorithms, scaling kinds.

A leaf module (it imports only torch): the element, block and per-tensor numerics, the format
registry and the recipes all read these names from here, so none of them imports another to learn
a valid value.

Every vocabulary is a ``str`` enum: a member equals, hashes, prints (``str`` and ``repr``),
JSON-encodes and pickles as its plain string value (``"nearest"``), so specs, logs and checkpoints
read as they did when these were strings.

A rounding is a behaviour, not only a name: each :class:`Rounding` member carries how it rounds
(:meth:`Rounding.round_steps`), whether it draws random numbers, whether it is round-half-to-even
(which the code-table fast paths implement), which fused kernels implement it, and its spec
modifier. Code asks the member (``fmt.rounding.stochastic``), never compares names.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["AmaxAlgo", "FourOverSix", "Rounding", "ScaleRule", "Scaling"]


class _StrEnum(str, enum.Enum):
    """A ``str`` enum that behaves as its value: ``==``/hash/``str``/f-strings/JSON, and pickles as
    a plain ``str`` (checkpoints stay loadable with ``weights_only=True`` and by older code)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # dataclass reprs (OperandFormat(...)) read as they did with strings
        return repr(self.value)

    def __hash__(self) -> int:
        return str.__hash__(self)

    def __reduce_ex__(self, protocol):
        return str, (self.value,)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value, what: str):
        """``value`` as a member; a one-line error naming ``what`` and the valid values otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what}: unknown {value!r}; valid: {', '.join(cls.values())}") from None


# ---------------------------------------------------------------- roundings
def _round_half_even(steps: torch.Tensor, u, generator) -> torch.Tensor:
    return torch.round(steps)  # torch.round rounds half to even


def _round_half_away(steps: torch.Tensor, u, generator) -> torch.Tensor:
    return torch.floor(steps + 0.5)  # steps >= 0: a midpoint goes up


def _round_stochastic(steps: torch.Tensor, u, generator) -> torch.Tensor:
    lo = torch.floor(steps)
    if u is None:
        u = torch.rand(steps.shape, generator=generator, device=steps.device, dtype=torch.float32)
    return lo + (u < (steps - lo)).float()


class Rounding(_StrEnum):
    """How a scaled value lands on an element grid.

    Each member is ``(name, spec modifier, stochastic, nearest_even, triton, step rounding)``:

    * ``modifier``: the compact spec's operand modifier (``mxfp4/sr``); None for the default;
    * ``stochastic``: draws one uniform per element (``precision.srand.SRKey`` or a generator);
    * ``nearest_even``: round half to even -- what the code-table fast paths (E2M1 bucketize, the
      torch FP8 casts) compute; any other mode goes through the generic grid rounding;
    * ``triton``: the fused Triton quantizer implements it (else ``auto`` runs the reference);
    * the step rounding: ``f(steps, u, generator)`` -> whole grid steps (``steps`` = |v| / ulp >= 0).

    Adding a mode is one member here (the reference quantizers, the compiled fused ones, the spec
    grammar, validation and the valid-value lists follow); HiF8 rounds ties away from zero under
    ``NEAREST`` (its own code table).
    """

    NEAREST = ("nearest", None, False, True, True, _round_half_even)
    STOCHASTIC = ("stochastic", "sr", True, False, True, _round_stochastic)
    # MS-EDEN (Quartet II; NVFP4 only, ``precision.eden``): elements round to nearest (midpoints
    # away from zero), the block scale takes EDEN's correction and is rounded stochastically --
    # one uniform per block; unbiased over the GEMM's random rotation (rht16*)
    MS_EDEN = ("ms_eden", "eden", True, False, True, _round_half_away)
    # the same with EDEN's correction over 128-element groups under a 128-point random rotation
    # (rht128*): Quartet II's setting
    MS_EDEN128 = ("ms_eden128", "eden128", True, False, True, _round_half_away)

    def __new__(cls, value, modifier, stochastic, nearest_even, triton, step_fn):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.modifier = modifier
        obj.stochastic = stochastic
        obj.nearest_even = nearest_even
        obj.triton = triton
        obj._step_fn = step_fn
        return obj

    @property
    def eden_group(self) -> int:
        """MS-EDEN's group (the elements sharing one correction factor, = its rotation's size): 16
        or 128; 0 for every other mode."""
        return {"ms_eden": 16, "ms_eden128": 128}.get(self.value, 0)

    def round_steps(self, steps: torch.Tensor, u: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
        """Whole grid steps for ``steps`` (non-negative float32, an exact multiple count of the grid
        spacing): stochastic modes use ``u`` (uniforms shaped like ``steps``) or one draw from
        ``generator``."""
        return self._step_fn(steps, u, generator)

    @classmethod
    def from_modifier(cls, mod: str) -> Rounding | None:
        """The member whose spec modifier is ``mod`` (``sr``), or None."""
        return next((m for m in cls if m.modifier == mod), None)

    @classmethod
    def modifiers(cls) -> tuple[str, ...]:
        return tuple(m.modifier for m in cls if m.modifier)


# ---------------------------------------------------------------- scale rules, amax, scaling kinds
class ScaleRule(_StrEnum):
    FLOOR = "floor"  # OCP MX: exponent = floor(log2 amax) - emax_elem (the block maximum may clip)
    RCEIL = "rceil"  # NVIDIA hardware: 2^ceil(log2(amax / max_normal)) (never clips)
    QUEST = "quest"  # MXFP4 (precision.quest): 2^floor(log2(2.92 / 6 * block std)); clips at ~2.9 sigma


class FourOverSix(_StrEnum):
    """NVFP4 four-over-six (``precision.four_over_six``): per block, map the amax to 4 or to 6,
    whichever block error is smaller under this measure; ``none``: always 6 (plain NVFP4)."""

    NONE = "none"
    MSE = "mse"  # sum of squared errors (the authors' default; spec modifier ``4over6``)
    MAE = "mae"  # sum of absolute errors (``4over6(mae)``)
    ABS_MAX = "abs_max"  # largest absolute error (``4over6(abs_max)``)


class AmaxAlgo(_StrEnum):
    CURRENT = "current"  # this tensor's own amax
    MOST_RECENT = "most_recent"
    MAX = "max"
    EMA = "ema"


class Scaling(_StrEnum):
    NONE = "none"
    TENSOR = "tensor"  # one FP32 scale per tensor
    BLOCK = "block"  # one scale per block along the contraction axis
    TWO_LEVEL = "two_level"  # block scales under an FP32 tensor scale (NVFP4)

"""Per-GEMM numeric recipes: ``OperandFormat`` -> ``GemmRecipe`` -> ``LinearPrecision``.

Every linear layer runs three GEMMs; each quantizes its two operands along its contraction axis::

    FPROP  y  = x  · wᵀ    operands (x, w)    contraction over in-features
    DGRAD  dx = dy · w     operands (dy, w)   contraction over out-features
    WGRAD  dw = dyᵀ· x     operands (dy, x)   contraction over tokens

All three classes are frozen dataclasses validated on construction; variants come from
``dataclasses.replace``.

Compact spec (``LinearPrecision.parse`` / ``str``)::

    fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4+had16
    base=fp8,wgrad=mxfp4+sr+prescale          # base: a preset for the GEMMs not named
    dgrad=fp8_e5m2@fp8_e4m3                    # two operands (in the GEMM's order) joined by '@'
    wgrad=mxfp4/sr@mxfp4                       # '/mod' applies to one operand, '+mod' to both
    fprop=nvfp4@nvfp4/2d,dgrad=nvfp4/sr@nvfp4/2d   # weights in 16x16 tiles (TransformerEngine's NVFP4)
    fprop=hif8+delayed(max,64)                 # per-tensor delayed scaling, amax algo and window

A spec may name only some GEMMs (a *partial* spec, ``LinearPrecision.parse_partial``). The GEMMs it
does not name are ``base``'s when it gives one; otherwise, as ``--precision`` (or a spec file, or a
plan file's ``default``), BF16 -- the default precision -- and, as a per-layer rule
(``--precision-rule 'kind:mlp=wgrad=mxfp4+had16'``), whatever the layer would get without the rule
(``precision.policy``).

GEMM spec grammar: ``operand ['@' operand] ('+' modifier)*`` with ``operand = format ('/' mod)*``.
Operand modifiers: ``sr`` (stochastic rounding), ``prescale`` (3/4 before SR), ``2d`` (weights:
2-D square tiles, NVFP4 16x16 / MX 32x32), ``rceil`` (MX scale rule; ``floor`` is the default;
``quest``: MXFP4's Gaussian-fitted scale under a rotation), ``eden`` / ``eden128`` (NVFP4 MS-EDEN
rounding under an ``rht16*`` / ``rht128*`` rotation), ``delayed(ALGO[,N])`` (per-tensor formats: ALGO one of
most_recent, max, ema), ``margin(N)`` (per-tensor formats: scale = target / amax / 2^N),
``4over6[(mse|mae|abs_max)]`` (NVFP4: each block's amax mapped to 4 or 6, whichever block error
is smaller -- ``precision.four_over_six``).
GEMM modifiers: a rotation (had16, had32, rht16, rht16_resample, rht16_te, rht128, rht128_resample) or any
operand modifier, applied to both operands. ``fp8`` alone means TransformerEngine's hybrid: E4M3
for ``x`` and ``w``, E5M2 for ``dy``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from precision.enums import AmaxAlgo, FourOverSix, Rounding, ScaleRule, Scaling
from precision.formats import FORMATS, format_names
from precision.rotation import ROTATIONS, rotation_size

__all__ = ["PRESETS", "Gemm", "GemmRecipe", "LinearPrecision", "OperandFormat", "PartialPrecision", "SpecError",
           "preset", "register_preset"]


class SpecError(ValueError):
    """An invalid precision spec; the message names the GEMM, the bad value and the valid ones."""


# The named presets (``--precision NAME``, ``base=NAME`` in a compact spec): name -> constructor.
# ``precision.presets`` defines them with :func:`register_preset`; they build on the classes below,
# so the registry lives here and the spec grammar reads it without importing the presets module.
PRESETS: dict[str, Callable[[], LinearPrecision]] = {}


def register_preset(fn: Callable[[], LinearPrecision]) -> Callable[[], LinearPrecision]:
    """Register ``fn`` (its name is the preset's name, its docstring the preset's table)."""
    PRESETS[fn.__name__] = fn
    return fn


def preset(name: str) -> LinearPrecision:
    """The ``LinearPrecision`` of a registered preset; a one-line error listing the valid names."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown precision preset {name!r}; valid: {', '.join(PRESETS)}") from None


class Gemm(str, enum.Enum):
    """The three GEMMs of a linear layer: the only names code, logs and metrics use."""

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"

    @property
    def operands(self) -> tuple[str, str]:
        return {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}[self.value]

    @property
    def result(self) -> str:
        return {"fprop": "y", "dgrad": "dx", "wgrad": "dw"}[self.value]

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class OperandFormat:
    """How one GEMM operand is quantized. String values are accepted for the enum fields (and
    stored as the enum member, which equals and prints as the same string).

    Resolved once, when it is made, and read as plain attributes: ``format``, the registry entry of
    ``fmt`` (``precision.formats.Format``), and ``prescale_factor``, the factor before rounding
    (0.75 with ``prescale``, else 1.0). Neither is a field: they pickle as the fields alone."""

    fmt: str = "bf16"
    """A registered format name (``precision.formats.FORMATS``)."""
    rounding: Rounding = Rounding.NEAREST
    """``nearest``, ``stochastic`` (formats whose ``supports_sr``), ``ms_eden`` / ``ms_eden128`` (NVFP4,
    under a random rotation ``rht16*`` / ``rht128*`` of the GEMM: ``precision.eden``)."""
    scale_rule: ScaleRule = ScaleRule.FLOOR
    """MX formats only: ``floor`` (OCP), ``rceil``, or ``quest`` (MXFP4 under a rotation: the scale
    from the block's standard deviation, Quartet's forward -- ``precision.quest``)."""
    prescale: bool = False
    """MX, stochastic: multiply by 3/4 before rounding (arXiv 2502.20586)."""
    block2d: bool = False
    """Weights only (``/2d``): one scale per 2-D square tile (NVFP4 16x16 E4M3 under the FP32 tensor
    scale, MX 32x32 E8M0), so Fprop and Dgrad consume the same codes from one quantization."""
    amax_algo: AmaxAlgo = AmaxAlgo.CURRENT
    """Formats with delayed scaling (per-tensor): ``current`` or a history algorithm."""
    amax_history_len: int = 1
    margin: int = 0
    """Per-tensor formats: TransformerEngine's margin -- ``scale = scale_target / amax / 2^margin``
    with the format's own ``scale_target`` (FP8: its max normal; HiF8: 2^3). Positive leaves more
    headroom above the amax; negative moves the amax up towards ``max_normal`` (HiF8 ``-12`` is
    the FP8 rule, amax -> 2^15)."""
    four_over_six: FourOverSix = FourOverSix.NONE
    """NVFP4 only (``/4over6``, arXiv 2512.02010): per block, the scale mapping its amax to 4 or to
    6, whichever gives the smaller block error under this measure (``mse``, ``mae``, ``abs_max``);
    the largest block scale becomes 256 (``precision.four_over_six``). ``none``: plain NVFP4."""

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise SpecError(f"unknown format {self.fmt!r}; valid: {', '.join(FORMATS)}")
        self._derive()
        spec = self.format
        for field, enum_type, what in (("rounding", Rounding, "rounding"), ("scale_rule", ScaleRule, "scale rule"),
                                       ("amax_algo", AmaxAlgo, "amax algorithm"),
                                       ("four_over_six", FourOverSix, "4over6 error measure")):
            value = getattr(self, field)
            if value not in enum_type.values():
                raise SpecError(f"{self.fmt}: unknown {what} {value!r}; valid: {', '.join(enum_type.values())}")
            object.__setattr__(self, field, enum_type(value))  # the same value, typed
        if self.rounding not in spec.roundings:
            raise SpecError(f"{self.fmt}: {self.rounding} rounding is not supported; valid with: "
                            f"{', '.join(format_names(lambda f: self.rounding in f.roundings))}")
        if self.scale_rule == ScaleRule.QUEST and self.scale_rule not in spec.scale_rules:
            raise SpecError(f"{self.fmt}: the quest scale rule (a Gaussian fit to E2M1's grid) applies to "
                            f"{', '.join(format_names(lambda f: ScaleRule.QUEST in f.scale_rules))} only")
        if self.scale_rule == ScaleRule.QUEST and (self.block2d or self.prescale):
            raise SpecError(f"{self.fmt}: quest scales 1-D blocks from their own statistics; "
                            f"drop {'2d' if self.block2d else 'prescale'}")
        if self.scale_rule not in spec.scale_rules:
            raise SpecError(f"{self.fmt}: scale rule {str(self.scale_rule)!r} applies to MX formats only "
                            f"({', '.join(format_names(lambda f: f.has_scale_rules))})")
        if self.prescale and not (spec.has_scale_rules and self.rounding.stochastic):
            raise SpecError(f"{self.fmt}: prescale (3/4) needs an MX format with stochastic rounding")
        if self.block2d and not spec.tile:
            raise SpecError(f"{self.fmt}: 2-D block scaling (2d) does not apply; valid with: "
                            f"{', '.join(format_names(lambda f: f.tile))}")
        if self.four_over_six != FourOverSix.NONE and self.rounding.eden_group:
            raise SpecError(f"{self.fmt}: 4over6 and eden both set the block scale; give one of them")
        if self.four_over_six != FourOverSix.NONE and not spec.four_over_six:
            raise SpecError(f"{self.fmt}: 4over6 (a choice between block scales mapping the amax to 4 or 6) "
                            f"applies to NVFP4 only; valid with: {', '.join(format_names(lambda f: f.four_over_six))}")
        if self.amax_algo != AmaxAlgo.CURRENT and not spec.delayed:
            raise SpecError(f"{self.fmt}: delayed scaling applies to per-tensor formats only "
                            f"({', '.join(format_names(lambda f: f.delayed))})")
        if self.amax_history_len < 1:
            raise SpecError(f"{self.fmt}: amax history length must be >= 1, got {self.amax_history_len}")
        if self.margin:
            if spec.kind != Scaling.TENSOR:
                raise SpecError(f"{self.fmt}: margin applies to per-tensor formats only "
                                f"({', '.join(format_names(lambda f: f.kind == Scaling.TENSOR))})")
            lo = -round(math.log2(spec.max_normal / spec.scale_target))
            if not isinstance(self.margin, int) or not lo <= self.margin <= 64:
                raise SpecError(f"{self.fmt}: margin {self.margin!r} must be an integer in [{lo}, 64] (scale target "
                                f"{spec.scale_target:g} / 2^margin must not exceed the max normal {spec.max_normal:g})")

    def _derive(self) -> None:
        """Set the attributes derived from the fields (``format``, ``prescale_factor``), once."""
        object.__setattr__(self, "format", FORMATS[self.fmt])
        object.__setattr__(self, "prescale_factor", 0.75 if self.prescale else 1.0)

    def __getstate__(self) -> dict:  # pickles as its fields alone (the registry entry is looked up again)
        return {k: v for k, v in self.__dict__.items() if k not in ("format", "prescale_factor")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self._derive()

    @property
    def is_high_precision(self) -> bool:
        return self.format.kind == Scaling.NONE

    @property
    def control(self) -> str | None:
        """The FP4 error control this operand uses (``4over6``, ``eden``, ``eden128``, ``quest``), or None."""
        if self.four_over_six != FourOverSix.NONE:
            return "4over6"
        if self.rounding.eden_group:
            return self.rounding.modifier
        return "quest" if self.scale_rule == ScaleRule.QUEST else None

    @property
    def triton_missing(self) -> str | None:
        """Why the Triton quantizer (``kernels.triton_quant``) has no kernel for this operand's
        settings -- one line its dispatchers hand on (``auto`` then runs the reference) -- or None.
        It has every rounding, scale rule, FP4 error control and 2-D weight tiling (bit for bit:
        tests/kernels/test_triton_quant.py, test_triton_controls.py), so none is refused today; a
        setting added without a kernel answers here."""
        return None

    @property
    def scale_target(self) -> float:
        """Per-tensor formats: the value this operand's amax maps to, the format's ``scale_target``
        divided by 2^``margin``."""
        return self.format.scale_target * 2.0 ** -self.margin

    def modifiers(self) -> list[str]:
        mods = []
        if self.rounding.modifier:
            mods.append(self.rounding.modifier)
        if self.prescale:
            mods.append("prescale")
        if self.block2d:
            mods.append("2d")
        if self.scale_rule != ScaleRule.FLOOR:
            mods.append(self.scale_rule)
        if self.amax_algo != AmaxAlgo.CURRENT:
            mods.append(f"delayed({self.amax_algo},{self.amax_history_len})")
        if self.margin:
            mods.append(f"margin({self.margin})")
        if self.four_over_six != FourOverSix.NONE:
            mods.append("4over6" if self.four_over_six == FourOverSix.MSE else f"4over6({self.four_over_six})")
        return mods

    def __str__(self) -> str:
        return "/".join([self.fmt, *self.modifiers()])


BF16 = OperandFormat("bf16")


@dataclass(frozen=True)
class GemmRecipe:
    """Two operand formats (in the GEMM's operand order) and a rotation along the contraction axis."""

    a: OperandFormat = BF16
    b: OperandFormat = BF16
    rotation: str = "none"

    def __post_init__(self):
        for op in (self.a, self.b):  # a recipe rule: the quantizer itself tiles with SR too
            if op.block2d and op.rounding.stochastic:
                raise SpecError(f"{op.fmt}/2d: 2-D weight tiles round to nearest (one quantized weight serves "
                                f"Fprop and Dgrad); drop {op.rounding.modifier}")
        if self.rotation not in ROTATIONS:
            raise SpecError(f"unknown rotation {self.rotation!r}; valid: {', '.join(ROTATIONS)}")
        if any(op.scale_rule == ScaleRule.QUEST for op in (self.a, self.b)) and self.rotation == "none":
            raise SpecError(f"quest fits a Gaussian to Hadamard-rotated blocks: add a rotation to the GEMM "
                            f"({', '.join(ROTATIONS[1:])}; Quartet uses had32)")
        for op in (self.a, self.b):
            group = op.rounding.eden_group
            if group and not (self.rotation.startswith("rht") and rotation_size(self.rotation) == group):
                valid = [r for r in ROTATIONS if r.startswith("rht") and rotation_size(r) == group]
                raise SpecError(f"{op.rounding.modifier} (MS-EDEN over {group}-element groups) is unbiased over a "
                                f"random {group}-point rotation of both operands: add one of {', '.join(valid)} "
                                f"to the GEMM (got {self.rotation})")

    def operand(self, name: str, gemm: Gemm) -> OperandFormat:
        """The format of operand ``name`` ('x', 'w' or 'dy') in ``gemm``."""
        i = gemm.operands.index(name)
        return self.a if i == 0 else self.b

    @property
    def is_high_precision(self) -> bool:
        return self.a.is_high_precision and self.b.is_high_precision and self.rotation == "none"

    def spec(self) -> str:
        rot = [] if self.rotation == "none" else [self.rotation]
        if self.a == self.b:
            return "+".join([self.a.fmt, *self.a.modifiers(), *rot])
        return "+".join([f"{self.a}@{self.b}", *rot])

    __str__ = spec


_MOD_RE = re.compile(r"^delayed\((\w+)(?:,(\d+))?\)$")
_MARGIN_RE = re.compile(r"^margin\((-?\d+)\)$")
_FOUR_OVER_SIX_RE = re.compile(r"^4over6(?:\((\w+)\))?$")


def _apply_modifier(fields: dict, mod: str) -> None:
    """Record one modifier in ``fields`` (OperandFormat keyword arguments)."""
    if rounding := Rounding.from_modifier(mod):
        fields["rounding"] = rounding
    elif mod == "prescale":
        fields["prescale"] = True
    elif mod == "2d":
        fields["block2d"] = True
    elif mod in ScaleRule.values():
        fields["scale_rule"] = mod
    elif mod == AmaxAlgo.CURRENT:
        fields.update(amax_algo=AmaxAlgo.CURRENT, amax_history_len=1)
    elif m := _MOD_RE.match(mod):
        algo, n = m.group(1), int(m.group(2) or (64 if m.group(1) == "max" else 1))
        fields.update(amax_algo=algo, amax_history_len=n)
    elif m := _MARGIN_RE.match(mod):
        fields["margin"] = int(m.group(1))
    elif m := _FOUR_OVER_SIX_RE.match(mod):
        rule = m.group(1) or FourOverSix.MSE.value
        if rule not in FourOverSix.values()[1:]:
            raise SpecError(f"4over6({rule}): unknown error measure; valid: "
                            f"{', '.join(f'4over6({v})' for v in FourOverSix.values()[1:])} (4over6 alone: mse)")
        fields["four_over_six"] = rule
    else:
        raise SpecError(f"unknown modifier {mod!r}; valid: {', '.join(Rounding.modifiers())}, prescale, 2d, {', '.join(ScaleRule.values())}, "
                        f"current, margin(N), 4over6[(mse|mae|abs_max)], delayed(ALGO[,N]) with ALGO in {', '.join(AmaxAlgo.values()[1:])}, or a rotation "
                        f"({', '.join(ROTATIONS[1:])})")


def _parse_operand(text: str, role: str) -> OperandFormat:
    """``format('/'mod)*`` for operand ``role`` ('x', 'w' or 'dy')."""
    fmt, *mods = text.split("/")
    if fmt == "fp8":
        fmt = "fp8_e5m2" if role == "dy" else "fp8_e4m3"
    if fmt not in FORMATS:
        raise SpecError(f"unknown format {fmt!r}; valid: fp8 (hybrid), {', '.join(FORMATS)}")
    fields: dict = {}
    for mod in mods:
        _apply_modifier(fields, mod)
    return OperandFormat(fmt, **fields)


def parse_gemm(text: str, gemm: Gemm) -> GemmRecipe:
    """Parse one GEMM's compact spec (see the module docstring)."""
    try:
        text = text.strip()
        if not text:
            raise SpecError("empty recipe")
        # '+' separates GEMM modifiers; parentheses never contain '+'.
        head, *gmods = text.split("+")
        parts = head.split("@")
        if len(parts) > 2:
            raise SpecError(f"{head!r} has {len(parts)} operands; a GEMM has two (a@b)")
        roles = gemm.operands
        texts = parts if len(parts) == 2 else [parts[0], parts[0]]
        rotation = "none"
        shared_mods = []
        for mod in gmods:
            if mod in ROTATIONS[1:]:
                if rotation != "none":
                    raise SpecError(f"two rotations ({rotation}, {mod}); give at most one")
                rotation = mod
            else:
                shared_mods.append(mod)
        ops = [_parse_operand("/".join([t, *shared_mods]), role) for t, role in zip(texts, roles)]
        return check_block2d(GemmRecipe(ops[0], ops[1], rotation), gemm)
    except SpecError as e:
        raise SpecError(f"{gemm.value}: {e}") from None


def check_block2d(recipe: GemmRecipe, gemm: Gemm) -> GemmRecipe:
    """``recipe`` unchanged if 2-D block scaling sits on weights only (operand ``w`` of Fprop and
    Dgrad); a one-line error naming the operand otherwise."""
    for role, op in zip(gemm.operands, (recipe.a, recipe.b)):
        if op.block2d and role != "w":
            raise SpecError(f"operand {role} ({op}): 2-D block scaling (2d) applies to weights only "
                            f"(operand w of fprop and dgrad); {role} keeps 1-D blocks along the contraction axis")
    return recipe


@dataclass(frozen=True)
class LinearPrecision:
    """The three GEMM recipes of one linear layer."""

    fprop: GemmRecipe = GemmRecipe()
    dgrad: GemmRecipe = GemmRecipe()
    wgrad: GemmRecipe = GemmRecipe()

    def __post_init__(self):
        for g in Gemm:
            r = getattr(self, g.value)
            if not isinstance(r, GemmRecipe):
                raise SpecError(f"{g.value}: expected a GemmRecipe, got {type(r).__name__}")
            try:
                check_block2d(r, g)
            except SpecError as e:
                raise SpecError(f"{g.value}: {e}") from None

    def recipe(self, gemm: Gemm) -> GemmRecipe:
        return getattr(self, Gemm(gemm).value)

    def __str__(self) -> str:
        return ",".join(f"{g.value}={self.recipe(g).spec()}" for g in Gemm)

    @classmethod
    def parse(cls, text: str) -> LinearPrecision:
        """Parse ``fprop=...,dgrad=...,wgrad=...``; the GEMMs not named are ``base=PRESET``'s when it
        is given, else BF16 (the default precision)."""
        got = cls.parse_partial(text)
        return got.over(cls()) if isinstance(got, PartialPrecision) else got

    @classmethod
    def parse_partial(cls, text: str) -> LinearPrecision | PartialPrecision:
        """Parse a compact spec: a ``LinearPrecision`` when it names all three GEMMs or a ``base``, else a
        :class:`PartialPrecision` of the GEMMs it names."""
        items = {}
        for part in _split_top(text):
            if "=" not in part:
                raise SpecError(f"{part!r}: expected GEMM=RECIPE with GEMM one of fprop, dgrad, wgrad "
                                "(or base=PRESET)")
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in ("base", "fprop", "dgrad", "wgrad"):
                raise SpecError(f"unknown key {key!r}; valid: base, fprop, dgrad, wgrad")
            if key in items:
                raise SpecError(f"{key}: given twice")
            items[key] = value
        if not items:
            raise SpecError(f"{text!r}: empty spec; give GEMM=RECIPE for one or more of fprop, dgrad, wgrad")
        base = preset(items.pop("base")) if "base" in items else None
        named = PartialPrecision(tuple((g, parse_gemm(items[g.value], g)) for g in Gemm if g.value in items))
        if base is not None or len(named.recipes) == len(Gemm):
            return named.over(base or cls())
        return named

    def table(self) -> str:
        """A small table of what each GEMM consumes."""
        rows = ["| GEMM | operands | formats | rotation |", "|---|---|---|---|"]
        for g in Gemm:
            r = self.recipe(g)
            rows.append(f"| {g.value} `{g.result} = {'·'.join(g.operands)}` | {g.operands[0]}, {g.operands[1]} "
                        f"| {r.a}, {r.b} | {r.rotation} |")
        return "\n".join(rows)


@dataclass(frozen=True)
class PartialPrecision:
    """Recipes for some of a linear's GEMMs; the others come from elsewhere (:meth:`over`)."""

    recipes: tuple[tuple[Gemm, GemmRecipe], ...]
    """``(GEMM, recipe)`` pairs, in Fprop, Dgrad, Wgrad order, each GEMM at most once."""

    def over(self, rest: LinearPrecision) -> LinearPrecision:
        """``rest`` with the named GEMMs replaced by this spec's recipes."""
        return dataclasses.replace(rest, **{g.value: r for g, r in self.recipes})

    def __str__(self) -> str:
        return ",".join(f"{g.value}={r.spec()}" for g, r in self.recipes)


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside parentheses (``delayed(max,64)``)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]

"""Rollout precision: what the generation engine's GEMMs and KV-cache consume.

A rollout runs only Fprop, ``y = x · wᵀ``. So a rollout plan gives each linear layer one GEMM
recipe -- the activation format (operand ``x``), the weight format (operand ``w``), an optional
rotation along the in-features -- and the model one KV-cache format (``model.kv_cache``)::

    preset        weights w         activations x     KV-cache            bits/weight
    bf16          bf16              bf16              bf16 (reference)    16
    fp8           fp8_e4m3 tensor   fp8_e4m3 tensor   fp8_e4m3 per head   8
    mxfp4         mxfp4             mxfp4             mxfp4               4.25
    nvfp4         nvfp4             nvfp4             nvfp4               4.5
    mxfp4_w4a16   mxfp4             bf16              bf16                4.25
    nvfp4_4over6  nvfp4 4/6         nvfp4 4/6         nvfp4               4.5

The FP4 error controls that are deterministic forward quantizers work in a rollout GEMM like any
format: four-over-six on NVFP4 weights and activations (``nvfp4_4over6``, or ``x@w`` specs with
``/4over6``, ``/4over6(mae)``, ``/2d/4over6``), and QuEST's MXFP4 scale under a Hadamard
(``linear=mxfp4/quest+had32``). MS-EDEN (``eden``, ``eden128``) is refused: it rounds its scales
stochastically under resampled random rotations -- a backward control, unbiased only in expectation.

``PRESET+had16`` / ``PRESET+had32`` adds a deterministic Hadamard on the activations along the
in-features -- and on the weights, so that the exact product is unchanged (``H·Hᵀ = I``), exactly
as a training Fprop recipe with that rotation does. Like every training preset, a rollout preset
keeps the output layer in BF16 (rule ``kind:output=bf16``) and a mixture-of-experts router's GEMM in
FP32 (``kind:router=fp32``, the trainer's router); a user rule comes first and wins
(``--rollout-precision-rule kind:router=nvfp4`` quantizes the router too).

Mixture-of-experts policies: every routed expert's ``linear_fc1`` / ``linear_fc2`` and the shared
experts' are linears like any other, selected by ``kind:expert``, ``kind:expert_fc1``,
``kind:expert_fc2``, ``kind:shared_expert``, ``experts:A-B`` (global expert numbers), ``kind:router``,
combined with ``layers:A-B``: ``--rollout-precision-rule 'kind:shared_expert=bf16'``.

Compact spec (``--rollout-precision``)::

    mxfp4                                 a preset
    nvfp4+had16                           a preset with a Hadamard
    base=mxfp4,kv=bf16                    a preset with another KV-cache format
    linear=bf16@mxfp4+had16,kv=fp8        Fprop GEMM spec x@w (``precision.recipe`` grammar), KV format

Per-layer rules (``--rollout-precision-rule SELECTOR=VALUE``) use ``--precision-rule``'s selectors
(``first:N``, ``last:N``, ``layers:A-B``, ``kind:K``, globs; ``precision.policy``) with VALUE a
rollout preset (its linear part) or a Fprop spec ``x@w[+rot]``: ``--rollout-precision-rule
first:1=bf16``, ``--rollout-precision-rule 'kind:mlp=bf16@nvfp4'``.

Per-layer KV-cache formats: VALUE may instead (or also) name the KV-cache format of the selected
transformer layers, ``kv=FORMAT`` (``linear=SPEC`` names the linear part when both are given)::

    --rollout-precision-rule 'last:1=kv=fp8'               the last layer's cache in FP8, the rest the plan's
    --rollout-precision-rule 'layers:0-1=kv=bf16'          layers 0 and 1 cached in BF16
    --rollout-precision-rule 'first:1=linear=bf16,kv=bf16' layer 0 entirely in BF16

A KV rule selects transformer layers -- ``first:N``, ``last:N``, ``layers:A-B`` or a glob over the
cache's name ``decoder.layers.I.self_attention.core_attention`` -- never a ``kind:`` (a kind names
linears). Like linear rules, KV rules are first-match and one that selects nothing is refused.
The plan's ``kv`` stays the plan-wide default; ``kv_for(layer)`` is what layer ``layer`` caches in.

A rollout GEMM rounds to nearest, with current scaling and at most a deterministic Hadamard: it
holds no state that changes between calls (no stochastic rounding, no amax history, no resampled
signs), so a token's numbers never depend on when it was generated.

Per-tensor activation scales (``fp8``, and NVFP4's FP32 global scale) come from the amax of the
tokens in one call -- a decode step's, or a whole prefix's when recomputed -- so there cached and
uncached generation legitimately differ (``model.generate``); weights (quantized once) and MX
activations (blocked within one token) do not depend on the call.

The plan resolves to a ``PrecisionPlan`` whose entries are ``LinearPrecision`` values with the
rollout recipe as Fprop (Dgrad/Wgrad BF16, unused): the trainer's forward under that plan
(``model.gpt.apply_precision_plan``) runs exactly the rollout's Fprop -- the recompute oracle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from model.kv_cache import KVFormat
from precision.formats import AmaxAlgo, Rounding, format_names
from precision.policy import PrecisionPlan, PrecisionPolicy, Rule
from precision.recipe import Gemm, GemmRecipe, LinearPrecision, SpecError, parse_gemm

__all__ = [
    "ROLLOUT_PRESETS",
    "ROLLOUT_ROTATIONS",
    "RolloutPlan",
    "RolloutPrecision",
    "kv_cache_name",
    "parse_rollout",
    "resolve_rollout_plan",
]

# preset -> (Fprop spec x@w, KV-cache format)
ROLLOUT_PRESETS: dict[str, tuple[str, str]] = {
    "bf16": ("bf16@bf16", "bf16"),
    "fp8": ("fp8_e4m3@fp8_e4m3", "fp8_e4m3"),
    "mxfp4": ("mxfp4@mxfp4", "mxfp4"),
    "nvfp4": ("nvfp4@nvfp4", "nvfp4"),
    "mxfp4_w4a16": ("bf16@mxfp4", "bf16"),
    "nvfp4_4over6": ("nvfp4/4over6@nvfp4/4over6", "nvfp4"),
}
ROLLOUT_ROTATIONS = ("none", "had16", "had32")
_KEYS = ("base", "linear", "kv")


def _valid() -> str:
    return (f"a preset ({', '.join(ROLLOUT_PRESETS)}, optionally +had16 / +had32) or "
            f"base=PRESET,linear=X@W[+had16],kv=FORMAT")


def _check_recipe(recipe: GemmRecipe, where: str) -> GemmRecipe:
    for role, op in zip(Gemm.FPROP.operands, (recipe.a, recipe.b)):
        if op.rounding.eden_group:
            raise SpecError(f"{where}: operand {role} {op}: MS-EDEN ({op.rounding.modifier}) is a backward control "
                            "(stochastic scales under random rotations); a rollout rounds to nearest -- "
                            "forward controls: 4over6 (NVFP4), quest (MXFP4 under had16/had32)")
    if recipe.rotation not in ROLLOUT_ROTATIONS:
        raise SpecError(f"{where}: rotation {recipe.rotation} is not deterministic; valid: "
                        f"{', '.join(ROLLOUT_ROTATIONS)}")
    for role, op in zip(Gemm.FPROP.operands, (recipe.a, recipe.b)):
        if op.rounding != Rounding.NEAREST or op.amax_algo != AmaxAlgo.CURRENT or op.prescale:
            raise SpecError(f"{where}: operand {role} {op}: a rollout rounds to nearest with current "
                            "scaling (no sr, prescale or delayed scaling)")
    return recipe


def _linear(value: str, where: str) -> GemmRecipe:
    """A preset name (``mxfp4``, ``mxfp4+had16``) or a Fprop spec ``x@w[+rot]`` as a Fprop recipe."""
    head, _, rot = value.partition("+")
    if head in ROLLOUT_PRESETS:
        value = ROLLOUT_PRESETS[head][0] + (f"+{rot}" if rot else "")
    elif "@" not in head and head.split("/")[0] not in (*format_names(), "fp8"):
        raise SpecError(f"{where} {value!r}: unknown rollout preset; valid: {_valid()}")
    try:
        return _check_recipe(parse_gemm(value, Gemm.FPROP), f"{where} {value!r}")
    except SpecError as e:
        msg = str(e)
        raise SpecError(msg if msg.startswith(where) else f"{where} {value!r}: {msg}") from None


@dataclass(frozen=True)
class RolloutPrecision:
    """A parsed ``--rollout-precision``: the default Fprop recipe of every linear and the KV format."""

    linear: GemmRecipe
    kv: KVFormat
    label: str

    def __str__(self) -> str:
        return f"linear={self.linear.spec()},kv={self.kv.fmt}"


def parse_rollout(value: str, flag: str = "--rollout-precision") -> RolloutPrecision:
    """``--rollout-precision``'s value (see the module docstring); one-line errors naming ``flag``."""
    text = value.strip()
    if "=" not in text:
        head = text.partition("+")[0]
        if head not in ROLLOUT_PRESETS:
            raise SpecError(f"{flag} {value!r}: unknown rollout preset; valid: {_valid()}")
        return RolloutPrecision(_linear(text, flag), KVFormat(ROLLOUT_PRESETS[head][1]), text)
    items: dict[str, str] = {}
    for part in text.split(","):
        key, eq, val = (s.strip() for s in part.partition("="))
        if not eq or key not in _KEYS:
            raise SpecError(f"{flag} {value!r}: unknown key {key!r}; valid keys: {', '.join(_KEYS)} ({_valid()})")
        if key in items:
            raise SpecError(f"{flag} {value!r}: {key} given twice")
        items[key] = val
    base = parse_rollout(items["base"], f"{flag} base=") if "base" in items else None
    if base is None and not {"linear", "kv"} <= set(items):
        raise SpecError(f"{flag} {value!r}: give base=PRESET or both linear= and kv=")
    linear = _linear(items["linear"], f"{flag} linear=") if "linear" in items else base.linear
    try:
        kv = KVFormat(items["kv"]) if "kv" in items else base.kv
    except ValueError as e:
        raise SpecError(f"{flag} {value!r}: {e}") from None
    return RolloutPrecision(linear, kv, text)


def kv_cache_name(layer: int) -> str:
    """The name a KV rule's glob matches for transformer layer ``layer``'s cache."""
    return f"decoder.layers.{layer}.self_attention.core_attention"


@dataclass(frozen=True)
class RolloutPlan:
    """The resolved rollout plan: a Fprop recipe per linear (as ``LinearPrecision.fprop`` entries of
    ``linears``), the plan-wide KV-cache format ``kv`` and, per transformer layer, the format its
    cache stores (``kv_layers``; empty: every layer ``kv``) with the rule that chose it."""

    linears: PrecisionPlan
    kv: KVFormat
    label: str
    kv_layers: tuple[KVFormat, ...] = ()
    kv_rules: tuple[str, ...] = ()

    def fprop(self, name: str) -> GemmRecipe:
        return self.linears[name].fprop

    def kv_for(self, layer: int) -> KVFormat:
        """The KV-cache format of transformer layer ``layer`` (0-based)."""
        return self.kv_layers[layer] if self.kv_layers else self.kv

    def kv_formats(self, num_layers: int) -> list[KVFormat]:
        """One KV-cache format per transformer layer."""
        if self.kv_layers and len(self.kv_layers) != num_layers:
            raise ValueError(f"rollout plan has KV formats for {len(self.kv_layers)} layers, the model {num_layers}")
        return list(self.kv_layers) if self.kv_layers else [self.kv] * num_layers

    @property
    def per_head_scale(self) -> bool:
        """Whether any layer's KV format needs calibrated per-head scales."""
        return any(f.per_head_scale for f in (self.kv_layers or (self.kv,)))

    def table(self) -> str:
        width = max((len(n) for n in self.linears), default=5)
        lines = [f"{'layer':<{width}}  {'fprop x@w':<28} rule"]
        for name in self.linears:
            lines.append(f"{name:<{width}}  {self.fprop(name).spec():<28} {self.linears.rule_for(name)}")
        if self.kv_layers:
            for i, (fmt, rule) in enumerate(zip(self.kv_layers, self.kv_rules)):
                lines.append(f"{'kv-cache layer ' + str(i):<{width}}  {fmt.fmt:<28} {rule}")
        else:
            lines.append(f"{'kv-cache':<{width}}  {self.kv.fmt}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = {"rollout_precision": self.label, "kv_cache": self.kv.fmt,  # label: --rollout-precision as given
               "linears": {n: self.fprop(n).spec() for n in self.linears}}
        if self.kv_layers:
            out["kv_cache_layers"] = [f.fmt for f in self.kv_layers]
        return out


def _rule_value(text: str) -> tuple[str, GemmRecipe | None, KVFormat | None]:
    """A ``--rollout-precision-rule``'s selector, linear recipe (None: not set) and KV format (None: not set)."""
    where = f"--rollout-precision-rule {text!r}:"
    if "=" not in text:
        raise SpecError(f"--rollout-precision-rule {text!r}: expected SELECTOR=PRESET_OR_SPEC, e.g. first:1=bf16, "
                        "or SELECTOR=kv=FORMAT, e.g. last:1=kv=fp8")
    selector, value = (s.strip() for s in text.split("=", 1))
    linear = kv = None
    for part in (p.strip() for p in value.split(",")):
        key, eq, val = (s.strip() for s in part.partition("="))
        if not eq:  # a bare preset or spec: the linear part
            key, val = "linear", part
        if key not in ("linear", "kv"):
            raise SpecError(f"{where} unknown key {key!r}; valid: a preset or X@W spec, linear=SPEC, kv=FORMAT")
        if (key == "linear" and linear is not None) or (key == "kv" and kv is not None):
            raise SpecError(f"{where} {key} given twice")
        if key == "linear":
            linear = _linear(val, where)
        else:
            try:
                kv = KVFormat.parse(val, f"{where} kv=")
            except ValueError as e:
                raise SpecError(str(e)) from None
    if kv is not None and selector.startswith("kind:"):
        raise SpecError(f"{where} kv= needs a selector of transformer layers (first:N, last:N, layers:A-B or a glob "
                        f"over {kv_cache_name(0).replace('0', 'I', 1)}); {selector} names linears")
    return selector, linear, kv


def _resolve_kv(base: KVFormat, kv_rules: list[tuple[str, Rule, KVFormat]], num_layers: int, head_dim: int,
                value: str) -> tuple[tuple[KVFormat, ...], tuple[str, ...]]:
    """Per-layer KV formats (first matching KV rule, else ``base``); refuses a KV rule that selects nothing."""
    names = [kv_cache_name(i) for i in range(num_layers)]
    for i, (text, rule, fmt) in enumerate(kv_rules):
        where = f"--rollout-precision-rule {text!r}"
        if problem := rule.range_problem(num_layers):
            raise SpecError(f"{where}: {problem}")
        matched = [n for n in names if rule.matches(n, num_layers)]
        if not matched:
            raise SpecError(f"{where}: matches no layer's KV-cache; caches: {kv_cache_name(0)} .. "
                            f"{kv_cache_name(num_layers - 1)}")
        if all(any(r.matches(n, num_layers) for _, r, _ in kv_rules[:i]) for n in matched):
            raise SpecError(f"{where}: selects no layer's KV-cache: every layer it matches is taken by an earlier rule")
        fmt.check_head_dim(head_dim, where)
    formats, labels = [], []
    for n in names:
        hit = next(((t, f) for t, r, f in kv_rules if r.matches(n, num_layers)), None)
        formats.append(hit[1] if hit else base)
        labels.append(f"--rollout-precision-rule {hit[0]}" if hit else f"--rollout-precision {value}")
    return tuple(formats), tuple(labels)


def resolve_rollout_plan(value: str, rules: Iterable[str], names: Iterable[str], num_layers: int,
                         head_dim: int) -> RolloutPlan:
    """Resolve ``--rollout-precision value`` and ``--rollout-precision-rule`` ``rules`` over the
    model's linear ``names`` and its ``num_layers`` KV-caches; refuses a rule that selects nothing and
    a KV format whose block does not divide ``head_dim`` (one line each, naming the flag)."""
    rules = list(rules)
    base = parse_rollout(value)
    base.kv.check_head_dim(head_dim, "--rollout-precision kv")
    user, checked, kv_rules = [], [], []
    for text in rules:
        selector, recipe, kv = _rule_value(text)
        if recipe is not None:
            rule = Rule(selector, LinearPrecision(fprop=recipe), f"--rollout-precision-rule {text}")
            user.append(rule)
            checked.append((text, rule))
        if kv is not None:
            kv_rules.append((text, Rule(selector, LinearPrecision(), f"--rollout-precision-rule {text}"), kv))
    builtin = [Rule("kind:output", LinearPrecision(fprop=parse_gemm("bf16", Gemm.FPROP)), "rollout preset: kind:output=bf16"),
               Rule("kind:router", LinearPrecision(fprop=parse_gemm("fp32", Gemm.FPROP)), "rollout preset: kind:router=fp32")]
    policy = PrecisionPolicy(LinearPrecision(fprop=base.linear), user + builtin,
                             default_label=f"--rollout-precision {value}")
    policy.checked = checked
    names = list(names)
    try:
        policy.check_rules(num_layers, names)
    except SpecError as e:
        raise SpecError(str(e).replace("--precision-rule", "--rollout-precision-rule")) from None
    kv_layers, kv_labels = _resolve_kv(base.kv, kv_rules, num_layers, head_dim, value) if kv_rules else ((), ())
    return RolloutPlan(policy.resolve(names, num_layers), base.kv, value, kv_layers, kv_labels)

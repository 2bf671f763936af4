"""Precision policy: ordered first-match rules from layer names to ``LinearPrecision``.

A policy resolves once, before the model is built, into a :class:`PrecisionPlan` (a read-only
mapping ``layer name -> LinearPrecision``) that is logged, printed with ``.table()`` and saved in
checkpoints. Layer names are megatron-core module paths, e.g.
``decoder.layers.3.mlp.linear_fc1``, ``decoder.layers.0.self_attention.linear_qkv``,
``output_layer``.

Selectors (all anchored -- ``decoder.layers.1.*`` never matches layer 10):

=================  ==============================================================
``GLOB``           fnmatch over the whole name, e.g. ``decoder.layers.*.mlp.*``
``first:N``        the linears of transformer layers 0 .. N-1
``last:N``         the linears of the last N transformer layers
``layers:A-B``     the linears of transformer layers A .. B (inclusive)
``kind:K``         by module kind: qkv, proj, fc1, fc2, output, attention (qkv+proj), mlp (fc1+fc2);
                   in mixture-of-experts layers: expert (every routed expert's fc1+fc2),
                   expert_fc1, expert_fc2, shared_expert (fc1+fc2), router
``experts:A-B``    the linears of routed experts A .. B (global expert numbers)
``S1,S2``          both: ``kind:expert_fc2,layers:0-1``, ``experts:0-3,layers:2-3``
=================  ==============================================================

``kind:fc1`` / ``fc2`` / ``mlp`` take any linear of that name, routed and shared experts' included.

On the command line a rule is ``SELECTOR=VALUE`` where VALUE is a preset name or a per-GEMM spec
(``--precision-rule first:2=bf16``, ``--precision-rule 'kind:mlp=base=fp8,wgrad=mxfp4+had16'``).
A spec that names only some GEMMs and no ``base`` overrides just those GEMMs, on top of what the layer
would get without the rule (the next matching rule, or the default): with ``--precision fp8``,
``--precision-rule 'kind:mlp=wgrad=mxfp4+had16'`` gives the MLP linears FP8 Fprop and Dgrad and an
MXFP4 + Hadamard Wgrad. As ``--precision`` (or a spec file, or a plan's ``default``) the GEMMs a spec
does not name are BF16, the default precision.
A command-line rule that selects nothing is refused (``PrecisionPolicy.check_rules``): a reversed
range, layer numbers beyond the model, no matching layer, or every match taken by an earlier rule.

``--precision FILE`` takes three things: a preset name, a per-GEMM spec, or a file. A file is either
a *spec file* (one ``LinearPrecision``: keys ``base``, ``fprop``, ``dgrad``, ``wgrad``) or a whole
**plan file** (YAML or JSON; what ``launch/search_plan.py`` writes)::

    default: fp8                       # every linear no entry below matches (preset or spec)
    linears:                           # optional: exact layer names, checked first
      output_layer: bf16
    rules:                             # optional: ordered --precision-rule values, first match wins
      - layers:0-0=bf16
      - kind:mlp=base=fp8,wgrad=mxfp4+had16
    metadata: {cost_ratio: 0.61}       # optional, free: the search's evidence; ignored by training

A plan file's entries come after the user's ``--precision-rule`` values and before the built-in
output-layer rule (``kind:output=bf16``), so the file resolves to the same per-linear plan wherever
``PrecisionPolicy.from_args`` reads ``--precision`` (pretrain, sweeps, evaluation). Every error in a
plan file is one line naming ``--precision`` and the file.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from precision import presets
from precision.recipe import LinearPrecision, PartialPrecision, SpecError

__all__ = ["KINDS", "PlanFile", "PrecisionPlan", "PrecisionPolicy", "Rule", "is_plan_file", "load_plan_file",
           "parse_precision", "parse_rule_value", "write_plan_file"]

KINDS = {
    "qkv": ("linear_qkv",),
    "proj": ("linear_proj",),
    "fc1": ("linear_fc1",),
    "fc2": ("linear_fc2",),
    "output": ("output_layer",),
    "attention": ("linear_qkv", "linear_proj"),
    "mlp": ("linear_fc1", "linear_fc2"),
}
_EXPERT_KINDS = {  # kind -> (module path fragment, last name or None for any)
    "expert": (".mlp.experts.", None),
    "expert_fc1": (".mlp.experts.", "linear_fc1"),
    "expert_fc2": (".mlp.experts.", "linear_fc2"),
    "shared_expert": (".mlp.shared_experts.", None),
    "router": (".mlp.", "router"),
}
KINDS.update({k: () for k in _EXPERT_KINDS})
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_SPEC_FILE_KEYS = ("base", "fprop", "dgrad", "wgrad")
_PLAN_FILE_KEYS = ("default", "linears", "rules", "metadata")


def _by_suffix(names: Iterable[str]) -> tuple[dict[str, list[int]], list[str]]:
    """``({suffix after decoder.layers.N.: [N, ...]}, other names)``."""
    layers: dict[str, list[int]] = {}
    others = []
    for name in names:
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
            layers.setdefault(parts[3], []).append(int(parts[2]))
        else:
            others.append(name)
    return layers, others


def describe_names(names: Iterable[str]) -> str:
    """Layer names compactly: ``decoder.layers.{0..11}.mlp.linear_fc1, ..., output_layer``."""
    layers, others = _by_suffix(names)
    described = [f"decoder.layers.{{{min(ix)}..{max(ix)}}}.{suffix}" for suffix, ix in layers.items()]
    return ", ".join(described + others)


def compact_names(names: list[str]) -> str:
    """Layer names exactly and compactly: transformer layers as ``decoder.layers.[0-3,5].SUFFIX`` (the
    suffixes of one layer set in braces), other names as they are."""
    layers, others = _by_suffix(names)
    by_set: dict[str, list[str]] = {}
    for suffix, ix in layers.items():
        ix = sorted(set(ix))
        runs = [[ix[0], ix[0]]]
        for i in ix[1:]:
            if i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        by_set.setdefault(",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs), []).append(suffix)
    out = []
    for ranges, suffixes in by_set.items():
        prefix = {s.rsplit(".", 1)[0] for s in suffixes}
        if len(suffixes) == 1:
            tail = suffixes[0]
        elif len(prefix) == 1:
            tail = f"{prefix.pop()}.{{{','.join(s.rsplit('.', 1)[1] for s in suffixes)}}}"
        else:
            tail = f"{{{','.join(suffixes)}}}"
        out.append(f"decoder.layers.[{ranges}].{tail}")
    return ", ".join(out + others)


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def parse_precision(value: str) -> LinearPrecision:
    """A preset name, a per-GEMM spec string, or a path to a YAML/JSON spec file (GEMMs a spec does not
    name: BF16); for a plan file, its ``default`` (its per-linear entries need the layer names:
    ``PrecisionPolicy.from_args``)."""
    got = parse_rule_value(value)
    return got.over(LinearPrecision()) if isinstance(got, PartialPrecision) else got


def parse_rule_value(value: str) -> LinearPrecision | PartialPrecision:
    """What a rule's ``VALUE`` takes (what ``--precision`` takes): a spec or spec file naming only some
    GEMMs and no ``base`` is a :class:`PartialPrecision`, applied over what the layer would get."""
    value = value.strip()
    if value in presets.names():
        return presets.get(value)
    if os.path.isfile(value):
        if is_plan_file(value):  # the plan's default; PrecisionPolicy.from_args adds its entries
            return parse_precision(load_plan_file(value).default)
        return _load_spec_file(value)
    if "=" not in value:
        raise SpecError(f"unknown precision {value!r}: not a preset, a spec (GEMM=RECIPE,...) or a "
                        f"file; presets: {', '.join(presets.names())}")
    return LinearPrecision.parse_partial(value)


def _read_mapping_file(path: str) -> tuple[str, object]:
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # parse errors from either library
        msg = " ".join(str(e).split())
        raise SpecError(f"{path}: not valid YAML/JSON ({e.__class__.__name__}: {msg})") from None
    return text, data


def _load_spec_file(path: str) -> LinearPrecision | PartialPrecision:
    text, data = _read_mapping_file(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with keys {', '.join(_SPEC_FILE_KEYS)}")
    unknown = sorted(set(data) - set(_SPEC_FILE_KEYS))
    if unknown:
        raise SpecError(f"{path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_SPEC_FILE_KEYS)}")
    keys = _top_level_keys(path, text)  # a key given twice: YAML and JSON keep the last one silently
    if twice := next((k for k in keys if keys.count(k) > 1), None):
        raise SpecError(f"{path}: {twice}: given twice")
    if empty := next((k for k, v in data.items() if v is None or not str(v).strip()), None):
        raise SpecError(f"{path}: {empty}: empty value; give a preset name or a recipe, e.g. {empty}: mxfp4")
    try:
        return LinearPrecision.parse_partial(",".join(f"{k}={v}" for k, v in data.items()))
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None


def _top_level_keys(path: str, text: str) -> list[str]:
    """The keys of a spec file's top-level mapping, in order, duplicates included."""
    if path.endswith(".json"):
        return [k for k, _ in json.loads(text, object_pairs_hook=lambda pairs: pairs)]
    import yaml

    return [str(k.value) for k, _ in yaml.compose(text).value]


# ====================================================================== plan files
@dataclass(frozen=True)
class PlanFile:
    """A whole-plan file: a default precision, exact per-linear entries, ordered rules, metadata."""

    path: str
    default: str
    """A preset name or per-GEMM spec: the precision of every linear no entry matches."""
    linears: tuple[tuple[str, str], ...] = ()
    """``(exact layer name, preset or spec)``, checked before ``rules``."""
    rules: tuple[str, ...] = ()
    """``SELECTOR=VALUE`` in ``--precision-rule`` syntax, first match wins."""
    metadata: tuple[tuple[str, object], ...] = ()
    """Free ``(key, value)`` pairs (the search's cost ratio and evidence); training ignores them."""

    def policy_rules(self) -> list[tuple[str, Rule]]:
        """``(text, Rule)`` of the file's entries in match order (linears, then rules)."""
        where = f"--precision {self.path}"
        out = [(f"linears: {name}", Rule(name, parse_rule_value(value), f"{where}: {name}={value}"))
               for name, value in self.linears]
        for text in self.rules:
            selector, value = (t.strip() for t in text.split("=", 1))
            out.append((f"rules: {text}", Rule(selector, parse_rule_value(value), f"{where}: {text}")))
        return out


def is_plan_file(path: str) -> bool:
    """Whether ``path`` is a plan file (a mapping with any of default/linears/rules/metadata)."""
    try:
        _, data = _read_mapping_file(path)
    except SpecError:
        return False
    return isinstance(data, dict) and bool(set(data) & set(_PLAN_FILE_KEYS))


def load_plan_file(path: str) -> PlanFile:
    """Read and validate a plan file; every error is one line ``--precision PATH: ...``."""
    where = f"--precision {path}"
    try:
        text, data = _read_mapping_file(path)
    except SpecError as e:
        raise SpecError(f"--precision {e}") from None
    except OSError as e:
        raise SpecError(f"{where}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping with keys {', '.join(_PLAN_FILE_KEYS)}")
    spec_keys = sorted(set(data) & set(_SPEC_FILE_KEYS))
    if spec_keys:
        raise SpecError(f"{where}: mixes plan keys ({', '.join(sorted(set(data) & set(_PLAN_FILE_KEYS)))}) with "
                        f"spec keys ({', '.join(spec_keys)}); a plan file has {', '.join(_PLAN_FILE_KEYS)}")
    unknown = sorted(str(k) for k in set(data) - set(_PLAN_FILE_KEYS))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_PLAN_FILE_KEYS)}")
    keys = _top_level_keys(path, text)
    if twice := next((k for k in keys if keys.count(k) > 1), None):
        raise SpecError(f"{where}: {twice}: given twice")
    default = data.get("default")
    if default is None or not isinstance(default, str) or not default.strip():
        raise SpecError(f"{where}: default: missing or empty; give a preset or spec, e.g. default: fp8")
    try:
        parse_precision(default)
    except SpecError as e:
        raise SpecError(f"{where}: default: {e}") from None
    if os.path.isfile(default.strip()):
        raise SpecError(f"{where}: default: {default!r} is a file; give a preset name or a per-GEMM spec")
    linears = data.get("linears") or {}
    if not isinstance(linears, dict):
        raise SpecError(f"{where}: linears: expected a mapping of layer name -> preset or spec")
    for name, value in linears.items():
        if not isinstance(value, str) or not value.strip():
            raise SpecError(f"{where}: linears: {name}: expected a preset name or spec, got {value!r}")
        if any(c in str(name) for c in "*?[:"):
            raise SpecError(f"{where}: linears: {name}: an exact layer name (no glob or selector); "
                            "put selectors under rules:")
        try:
            parse_rule_value(value)
        except SpecError as e:
            raise SpecError(f"{where}: linears: {name}: {e}") from None
    rules = data.get("rules") or []
    if not isinstance(rules, list):
        raise SpecError(f"{where}: rules: expected a list of SELECTOR=VALUE strings, e.g. - first:1=bf16")
    for i, text_rule in enumerate(rules):
        if not isinstance(text_rule, str) or "=" not in text_rule:
            raise SpecError(f"{where}: rules[{i}]: {text_rule!r}: expected SELECTOR=PRESET_OR_SPEC, "
                            "e.g. first:1=bf16")
        selector, value = (t.strip() for t in text_rule.split("=", 1))
        try:
            Rule(selector, parse_rule_value(value))
        except SpecError as e:
            raise SpecError(f"{where}: rules[{i}] {text_rule!r}: {e}") from None
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise SpecError(f"{where}: metadata: expected a mapping")
    return PlanFile(path, default.strip(), tuple((str(k), v.strip()) for k, v in linears.items()),
                    tuple(r.strip() for r in rules), tuple(metadata.items()))


def write_plan_file(path: str, default: str, rules: Iterable[str] = (), linears: Mapping[str, str] | None = None,
                    metadata: Mapping | None = None, header: str = "") -> None:
    """Write a plan file (YAML) that ``--precision PATH`` takes; ``header`` becomes ``#`` comment lines."""
    import yaml

    data: dict = {"default": default}
    if linears:
        data["linears"] = dict(linears)
    data["rules"] = list(rules)
    if metadata:
        data["metadata"] = json.loads(json.dumps(dict(metadata)))  # plain types only
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    with open(path, "w") as f:
        f.write(comments + yaml.safe_dump(data, sort_keys=False, width=120))
    load_plan_file(path)  # what was written reads back


@dataclass(frozen=True)
class Rule:
    """``selector`` (see the module docstring) -> ``precision``; ``label`` says where it came from. A
    ``PartialPrecision`` replaces only its GEMMs in what the layer would get without this rule."""

    selector: str
    precision: LinearPrecision | PartialPrecision
    label: str = ""

    def __post_init__(self):
        self._check_selector()

    def _parts(self) -> list["Rule"]:
        return [Rule(part.strip(), self.precision, self.label) for part in self.selector.split(",")]

    def _check_selector(self) -> None:
        if "," in self.selector:
            self._parts()
            return
        kind, _, arg = self.selector.partition(":")
        if kind == "experts":
            if not re.fullmatch(r"\d+-\d+", arg) or int(arg.split("-")[0]) > int(arg.split("-")[1]):
                raise SpecError(f"rule {self.selector!r}: experts:A-B needs two integers A <= B, e.g. experts:0-3")
        elif kind in ("first", "last"):
            if not arg.isdigit():
                raise SpecError(f"rule {self.selector!r}: {kind}:N needs a non-negative integer N")
        elif kind == "layers":
            if not re.fullmatch(r"\d+-\d+", arg):
                raise SpecError(f"rule {self.selector!r}: layers:A-B needs two integers, e.g. layers:0-3")
            lo, hi = (int(v) for v in arg.split("-"))
            if lo > hi:
                raise SpecError(f"rule {self.selector!r}: reversed range {arg}; valid: layers:A-B with A <= B, "
                                f"e.g. layers:{hi}-{lo}")
        elif kind == "kind":
            if arg not in KINDS:
                raise SpecError(f"rule {self.selector!r}: unknown kind {arg!r}; valid: {', '.join(KINDS)}")

    @classmethod
    def parse(cls, text: str, label: str = "--precision-rule") -> "Rule":
        if "=" not in text:
            raise SpecError(f"--precision-rule {text!r}: expected SELECTOR=PRESET_OR_SPEC, e.g. first:2=bf16")
        selector, value = (s.strip() for s in text.split("=", 1))
        return cls(selector, parse_rule_value(value), f"{label} {text}")

    def range_problem(self, num_layers: int) -> str | None:
        """Why this rule's layer numbers select nothing in a model of ``num_layers`` layers, or None."""
        if "," in self.selector:
            return next(filter(None, (p.range_problem(num_layers) for p in self._parts())), None)
        kind, _, arg = self.selector.partition(":")
        if kind in ("first", "last") and not 1 <= int(arg) <= num_layers:
            return f"the model has {num_layers} layers ({kind}:1 .. {kind}:{num_layers})"
        if kind == "layers" and int(arg.split("-")[1]) >= num_layers:
            return f"layer {arg.split('-')[1]} is beyond the model ({num_layers} layers: 0-{num_layers - 1})"
        return None

    def matches(self, name: str, num_layers: int) -> bool:
        if "," in self.selector:
            return all(p.matches(name, num_layers) for p in self._parts())
        kind, _, arg = self.selector.partition(":")
        if kind == "experts":
            m = _EXPERT_RE.search(name)
            lo, hi = (int(v) for v in arg.split("-"))
            return m is not None and lo <= int(m.group(1)) <= hi
        if kind == "kind" and arg in _EXPERT_KINDS:
            fragment, last = _EXPERT_KINDS[arg]
            return fragment in f".{name}" and (last is None or name.rsplit(".", 1)[-1] == last)
        idx = layer_index(name)
        if kind == "first":
            return idx is not None and idx < int(arg)
        if kind == "last":
            return idx is not None and idx >= num_layers - int(arg)
        if kind == "layers":
            lo, hi = (int(v) for v in arg.split("-"))
            return idx is not None and lo <= idx <= hi
        if kind == "kind":
            return name.rsplit(".", 1)[-1] in KINDS[arg]
        return fnmatch.fnmatchcase(name, self.selector)


class PrecisionPlan(Mapping):
    """Resolved per-layer precision: ``plan[name] -> LinearPrecision`` (read-only)."""

    def __init__(self, entries: Mapping[str, tuple[LinearPrecision, str]]):
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> LinearPrecision:
        try:
            return self._entries[name][0]
        except KeyError:
            raise KeyError(f"precision plan has no entry for layer {name!r}") from None

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def rule_for(self, name: str) -> str:
        return self._entries[name][1]

    def table(self) -> str:
        width = max((len(n) for n in self._entries), default=5)
        lines = [f"{'layer':<{width}}  {'fprop':<22} {'dgrad':<22} {'wgrad':<24} rule"]
        for name, (p, rule) in self._entries.items():
            lines.append(f"{name:<{width}}  {p.fprop.spec():<22} {p.dgrad.spec():<22} {p.wgrad.spec():<24} {rule}")
        return "\n".join(lines)

    def summary(self) -> str:
        """The plan grouped: one line per distinct (precision, rule), its layers named compactly, e.g.
        ``decoder.layers.[0-3].{linear_proj,linear_qkv,linear_fc1,linear_fc2} (16): fprop=...  <- rule``."""
        groups: dict[tuple[str, str], list[str]] = {}
        for name, (p, rule) in self._entries.items():
            groups.setdefault((str(p), rule), []).append(name)
        lines = [f"{compact_names(names)} ({len(names)}): {p}  <- {rule}" for (p, rule), names in groups.items()]
        return "\n".join(["layer (count): precision  <- rule", *lines])

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {n: {"precision": str(p), "rule": r} for n, (p, r) in self._entries.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Mapping[str, str]]) -> "PrecisionPlan":
        return cls({n: (LinearPrecision.parse(v["precision"]), v["rule"]) for n, v in d.items()})

    def __eq__(self, other) -> bool:
        return isinstance(other, PrecisionPlan) and self.to_dict() == other.to_dict()


class PrecisionPolicy:
    """Ordered rules, first match wins; layers no rule matches get ``default``."""

    def __init__(self, default: LinearPrecision, rules: Iterable[Rule] = (), default_label: str = "default"):
        self.default = default
        self.rules = list(rules)
        self.default_label = default_label
        self.checked: list[tuple[str, Rule]] = []  # (text, rule) of --precision-rule: see check_rules
        self.plan_file: PlanFile | None = None  # --precision FILE when it is a plan file

    @classmethod
    def from_args(cls, precision: str, rules: Iterable[str] = ()) -> "PrecisionPolicy":
        """``--precision`` and ``--precision-rule`` values; the preset's own rules come after the user's."""
        default = parse_precision(precision)
        user = [Rule.parse(r) for r in rules]
        plan_file = load_plan_file(precision) if os.path.isfile(precision) and is_plan_file(precision) else None
        from_file = [r for _, r in plan_file.policy_rules()] if plan_file else []
        preset_name = precision if precision in presets.names() else "custom"
        builtin = [Rule(sel, parse_precision(val), f"preset {preset_name}: {sel}={val}")
                   for sel, val in presets.default_rules(preset_name)]
        label = f"--precision {precision}" + (f" (default {plan_file.default})" if plan_file else "")
        policy = cls(default, user + from_file + builtin, default_label=label)
        policy.checked = list(zip(rules, user))
        policy.plan_file = plan_file
        return policy

    def check_rules(self, num_layers: int, names: Iterable[str] | None = None) -> None:
        """Refuse (``SpecError``, one line naming the rule) a ``--precision-rule`` that selects nothing:
        layer numbers beyond ``num_layers``; given the model's layer ``names``, also a rule that matches
        no layer, or whose every match is taken by an earlier rule (first match wins)."""
        for text, rule in self.checked:
            if problem := rule.range_problem(num_layers):
                raise SpecError(f"--precision-rule {text!r}: {problem}")
        file_rules = self.plan_file.policy_rules() if self.plan_file else []
        for text, rule in file_rules:
            if problem := rule.range_problem(num_layers):
                raise SpecError(f"--precision {self.plan_file.path}: {text}: {problem}")
        if names is None:
            return
        names = list(names)
        for text, rule in file_rules:
            if not any(rule.matches(n, num_layers) for n in names):
                raise SpecError(f"--precision {self.plan_file.path}: {text}: matches no layer; "
                                f"layers: {describe_names(names)}")
        for i, (text, rule) in enumerate(self.checked):
            matched = [n for n in names if rule.matches(n, num_layers)]
            if not matched:
                raise SpecError(f"--precision-rule {text!r}: matches no layer; layers: {describe_names(names)}")
            earlier = [r for _, r in self.checked[:i] if not isinstance(r.precision, PartialPrecision)]
            owners = [next((r for r in earlier if r.matches(n, num_layers)), None) for n in matched]
            if all(owners):
                raise SpecError(f"--precision-rule {text!r}: selects no layer: every layer it matches is taken "
                                f"by an earlier rule ({owners[0].label})")

    def first_layers(self, n: int, precision: LinearPrecision | str) -> "PrecisionPolicy":
        """A new policy with ``first:n`` prepended (Megatron's --first-last-layers-bf16 idiom)."""
        return self._prepend(f"first:{n}", precision)

    def last_layers(self, n: int, precision: LinearPrecision | str) -> "PrecisionPolicy":
        return self._prepend(f"last:{n}", precision)

    def kind(self, kind: str, precision: LinearPrecision | str) -> "PrecisionPolicy":
        return self._prepend(f"kind:{kind}", precision)

    def _prepend(self, selector: str, precision: LinearPrecision | str) -> "PrecisionPolicy":
        p = parse_rule_value(precision) if isinstance(precision, str) else precision
        return PrecisionPolicy(self.default, [Rule(selector, p, selector)] + self.rules, self.default_label)

    def resolve(self, names: Iterable[str], num_layers: int) -> PrecisionPlan:
        return PrecisionPlan({name: self._resolve_one(name, num_layers, 0) for name in names})

    def _resolve_one(self, name: str, num_layers: int, start: int) -> tuple[LinearPrecision, str]:
        """The first rule from ``start`` on that matches ``name``; a partial rule's GEMMs over what the
        rules after it (or the default) give."""
        for i in range(start, len(self.rules)):
            rule = self.rules[i]
            if rule.matches(name, num_layers):
                label = rule.label or rule.selector
                if isinstance(rule.precision, PartialPrecision):
                    rest, rest_label = self._resolve_one(name, num_layers, i + 1)
                    return rule.precision.over(rest), f"{label} over {rest_label}"
                return rule.precision, label
        return self.default, self.default_label

"""A sweep's spec and grid: the sweep file's validation and its expansion into runs.

``load_sweep`` reads and checks a sweep YAML file (its keys, ``script``, ``seeds``,
``equivalence_margin``); ``expand_runs`` turns its ``grid`` (presets, schedules, treatments, or the
per-GEMM matrix, times any hyper-parameter flags, times the seeds) into ``Run`` objects in a stable
order, each precision validated. Every bad input raises ``SweepError`` with a one-line message that
names the file and key and what would be valid.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GEMMS", "POINT_KEYS", "RESERVED_FLAGS", "SCRIPTS", "SMOOTH_DEFAULT", "SWEEP_KEYS", "Run", "SweepError",
           "expand_runs", "load_sweep"]

GEMMS = ("fprop", "dgrad", "wgrad")
SWEEP_KEYS = {"base", "grid", "baseline", "nproc-per-node", "name", "description", "seeds", "script",
              "equivalence_margin", "descent_steps", "published", "contrasts", "smooth", "claims"}
# The training-loss window of the extra-tokens curves, in logged points, when a sweep file has no smooth:.
SMOOTH_DEFAULT = 10
# What a sweep runs: pretraining (the default) or RL post-training (``script: rl``).
SCRIPTS = {"pretrain": "pretrain.py", "rl": "rl.py"}
# The grid keys that name the runs' precision (or, for treatments, whole flag sets).
POINT_KEYS = ("presets", "schedules", "treatments")
# Flags a grid may not range over: the sweep sets them itself.
RESERVED_FLAGS = {"precision", "precision-schedule", "seed", "save", "load", "tensorboard-dir"}


class SweepError(ValueError):
    """A bad sweep file or flag; the message names the file/key and what is valid."""


@dataclass
class Run:
    """One training run: a grid point (precision ``label`` + hyper-parameter ``point``) at one seed."""

    name: str
    precision: str
    flags: list[str] = field(default_factory=list)
    label: str = ""  # the precision's name in tables (a preset name, or the matrix cell's name)
    point: dict = field(default_factory=dict)  # hyper-parameters of the grid, e.g. {"lr": 0.002}
    seed: int | None = None
    precision_flag: str = "--precision"  # or --precision-schedule; "" for a treatment (its flags say all)
    script: str = "pretrain"  # a key of SCRIPTS

    def __post_init__(self):
        self.label = self.label or self.name

    @property
    def group(self) -> str:
        """The grid point (everything but the seed): runs of one group differ only by seed."""
        return _point_name(self.label, self.point)


def _point_name(label: str, point: dict) -> str:
    return "__".join([label, *(f"{k}-{v}" for k, v in point.items())])

def load_sweep(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file {path}: not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"sweep file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SweepError(f"sweep file {path}: expected a mapping with keys {', '.join(sorted(SWEEP_KEYS))}")
    unknown = sorted(set(data) - SWEEP_KEYS)
    if unknown:
        raise SweepError(f"sweep file {path}: unknown key(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(sorted(SWEEP_KEYS))}")
    if "grid" not in data or not isinstance(data["grid"], dict):
        raise SweepError(f"sweep file {path}: 'grid' must map presets, schedules, treatments or "
                         f"fprop/dgrad/wgrad to lists")
    script = data.get("script", "pretrain")
    if script not in SCRIPTS:
        raise SweepError(f"sweep file {path}: script {script!r}: valid: {', '.join(SCRIPTS)}")
    seeds = data.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds
                              or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
                              or len(set(seeds)) != len(seeds)):
        raise SweepError(f"sweep file {path}: seeds must be a list of distinct integers, e.g. [0, 1, 2]; "
                         f"got {seeds!r}")
    margin = data.get("equivalence_margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0):
        raise SweepError(f"sweep file {path}: equivalence_margin must be a positive number (a validation-loss "
                         f"gap for pretraining, an accuracy gap for script: rl), e.g. 0.01; got {margin!r}")
    smooth = data.get("smooth")
    if smooth is not None and (isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1):
        raise SweepError(f"sweep file {path}: smooth must be a positive number of logged training losses "
                         f"to average (the extra-tokens curves), e.g. 300; got {smooth!r}")
    _check_descent(data.get("descent_steps"), path)
    _check_published(data.get("published"), path)
    _check_claims(data.get("claims"), path, script)
    if data.get("claims"):  # a YAML date becomes its ISO text (sweep.json is JSON)
        data["claims"] = {**data["claims"], "declared": str(data["claims"]["declared"])}
    contrasts = data.get("contrasts")
    if contrasts is not None and (not isinstance(contrasts, list) or not contrasts or not all(
            isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) and c[0] != c[1]
            for c in contrasts)):
        raise SweepError(f"sweep file {path}: contrasts must be a list of [label, against] pairs of two "
                         f"different labels, e.g. [[wgrad_had16, wgrad_mxfp4]]; got {contrasts!r}")
    return data


def _check_descent(window, path: str) -> None:
    """``descent_steps: [first, last]``: the training steps at which runs are compared during the descent."""
    if window is None:
        return
    ok = (isinstance(window, list) and len(window) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in window) and 1 <= window[0] < window[1])
    if not ok:
        raise SweepError(f"sweep file {path}: descent_steps must be [first, last] training steps with "
                         f"1 <= first < last, e.g. [8, 40]; got {window!r}")


def _check_published(published, path: str) -> None:
    """``published: {source: TEXT, extra_tokens: {label: TEXT}}``: figures printed beside the table."""
    if published is None:
        return
    if (not isinstance(published, dict) or set(published) != {"source", "extra_tokens"}
            or not isinstance(published["source"], str) or not isinstance(published["extra_tokens"], dict)
            or not published["extra_tokens"]):
        raise SweepError(f"sweep file {path}: published must map source (text) and extra_tokens "
                         f"({{label: figure}}), e.g. {{source: arXiv 2605.09825, extra_tokens: {{mxfp4: '+26%'}}}}; "
                         f"got {published!r}")


CLAIMS_KEYS = {"study", "declared", "study_claims", "note", "tests"}
CLAIM_KEYS = {"id", "contrast", "metric", "direction", "margin"}


def _check_claims(claims, path: str, script: str = "pretrain") -> None:
    """``claims: {study, declared, tests: [...], study_claims?, note?}`` (``pretrain.sweep.claims``);
    an RL sweep's metrics are held-out accuracy's, a pretraining sweep's the others."""
    import datetime

    from pretrain.sweep.claims import CLAIM_METRICS, DIRECTIONS, RL_CLAIM_METRICS, START

    if claims is None:
        return
    where = f"sweep file {path}: claims"
    if not isinstance(claims, dict) or not {"study", "declared", "tests"} <= set(claims) or set(claims) - CLAIMS_KEYS:
        raise SweepError(f"{where} must map study, declared (a date) and tests (a list), optionally study_claims "
                         f"and note, e.g. {{study: mxfp4_cpu, declared: 2026-12-06, tests: [...]}}; got {claims!r}")
    try:
        datetime.date.fromisoformat(str(claims["declared"]))
    except ValueError:
        raise SweepError(f"{where}.declared must be an ISO date, e.g. 2026-12-06; got {claims['declared']!r}") from None
    tests = claims["tests"]
    if not isinstance(tests, list) or not tests:
        raise SweepError(f"{where}.tests must be a non-empty list of "
                         f"{{id, contrast: [label, against], metric, direction, margin?}}")
    for t in tests:
        ok = (isinstance(t, dict) and {"id", "contrast", "metric", "direction"} <= set(t) and not set(t) - CLAIM_KEYS
              and isinstance(t["contrast"], list) and len(t["contrast"]) == 2 and t["contrast"][0] != t["contrast"][1]
              and all(isinstance(x, str) for x in t["contrast"]))
        if not ok:
            raise SweepError(f"{where}.tests: {t!r}: expected {{id, contrast: [label, against], metric, direction, "
                             f"margin?}}, e.g. {{id: fprop_cost, contrast: [mxfp4_fprop, fp8], metric: val_loss, "
                             f"direction: worse}}")
        valid = [m for m in CLAIM_METRICS if (m in RL_CLAIM_METRICS) == (script == "rl")]
        if t["metric"] not in valid:
            raise SweepError(f"{where}.tests: {t['id']}: metric {t['metric']!r}; valid for script: {script}: "
                             f"{', '.join(valid)}")
        if (t["metric"] == "gain") != (t["contrast"][1] == START):
            raise SweepError(f"{where}.tests: {t['id']}: metric gain takes contrast [label, {START}] (the run's own "
                             f"starting policy), and {START} is only for gain; got {t['contrast']!r}")
        if t["direction"] not in DIRECTIONS:
            raise SweepError(f"{where}.tests: {t['id']}: direction {t['direction']!r}; valid: {', '.join(DIRECTIONS)}")
        margin = t.get("margin", 0.0)
        if (isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0
                or (t["direction"] == "equivalent" and not margin > 0)):
            raise SweepError(f"{where}.tests: {t['id']}: margin must be a number >= 0 (> 0 for equivalent; in % "
                             f"for extra_steps/extra_tokens), e.g. 0.01; got {margin!r}")
    ids = [t["id"] for t in tests]
    if len(set(ids)) != len(ids):
        raise SweepError(f"{where}.tests: duplicate ids: {', '.join(sorted({i for i in ids if ids.count(i) > 1}))}")
    m = claims.get("study_claims", len(tests))
    if isinstance(m, bool) or not isinstance(m, int) or m < len(tests):
        raise SweepError(f"{where}.study_claims must be an integer >= the {len(tests)} tests of this file (the "
                         f"number of claims the whole study declared); got {m!r}")


def _flags_from_mapping(base) -> list[str]:
    if base is None:
        return []
    if isinstance(base, list):
        return [str(v) for v in base]
    flags = []
    for k, v in base.items():
        flags += _flag(k, v)
    return flags


def _flag(k: str, v) -> list[str]:
    if v is True:
        return [f"--{k}"]
    if v is False or v is None:
        return []
    if isinstance(v, list):
        return [x for item in v for x in (f"--{k}", str(item))]
    return [f"--{k}", str(v)]


def _per_seed(flags: list[str], seed: int | None, path: str) -> list[str]:
    """``{seed}`` in a flag's value becomes the run's seed, e.g. a per-seed starting checkpoint
    (``pretrained-checkpoint: runs/start/runs/start__seed-{seed}/checkpoints``)."""
    if not any(SEED_FIELD in f for f in flags):
        return flags
    if seed is None:
        bad = next(f for f in flags if SEED_FIELD in f)
        raise SweepError(f"sweep file {path}: {bad!r} uses {SEED_FIELD}, which needs seeds: [...] in the sweep file")
    return [f.replace(SEED_FIELD, str(seed)) for f in flags]


SEED_FIELD = "{seed}"


def _pretrain_options() -> set[str]:
    """Every long option ``launch/pretrain.py`` accepts, without the leading ``--``."""
    from pretrain.arguments import build_parser

    return _long_options(build_parser())


def _long_options(parser) -> set[str]:
    return {o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _script_options(script: str) -> set[str]:
    """The long options of the script a sweep runs (``launch/pretrain.py`` or ``launch/rl.py``)."""
    if script == "rl":
        import warnings

        with warnings.catch_warnings():  # megatron-core's import-time notices (apex missing) are no error
            warnings.simplefilter("ignore")
            from pretrain.rl.arguments import build_rl_parser

            return _long_options(build_rl_parser())
    return _pretrain_options()


def _hyper_grid(grid: dict, path: str, script: str = "pretrain") -> list[tuple[str, list]]:
    """The grid's non-precision keys: flags of the script with the values to range over."""
    keys = [k for k in grid if k not in (*POINT_KEYS, *GEMMS)]
    if not keys:
        return []
    options = _script_options(script)
    out = []
    for k in keys:
        if k in RESERVED_FLAGS:
            raise SweepError(f"{path}: grid.{k}: set by the sweep itself"
                             + ("; list seeds under 'seeds:'" if k == "seed" else "")
                             + ("; give precisions under 'presets:' or 'schedules:'" if k.startswith("precision")
                                else ""))
        if k not in options:
            raise SweepError(f"{path}: grid key(s) {k}; valid: {', '.join(POINT_KEYS)}, fprop, dgrad, wgrad, "
                             f"or a {SCRIPTS[script]} flag such as lr (python launch/{SCRIPTS[script]} --help)")
        values = grid[k]
        if not isinstance(values, list) or not values:
            raise SweepError(f"{path}: grid.{k}: expected a non-empty list of values")
        out.append((k, values))
    return out


def _labelled(item, where: str) -> tuple[str, object]:
    """A grid list item: a bare name (its own label) or a one-key mapping ``{label: value}``."""
    if isinstance(item, dict):
        if len(item) != 1:
            raise SweepError(f"{where}: expected a name or a one-key mapping {{label: value}}; got {item!r}")
        label, value = next(iter(item.items()))
        return str(label), value
    return str(item), item


def _treatment_flags(label: str, value, where: str, options: set[str]) -> list[str]:
    """A treatment's flags: a mapping of flag -> value (no leading --)."""
    if not isinstance(value, dict) or not value:
        raise SweepError(f"{where}: {label}: expected a mapping of flags, e.g. {{rollout-precision: mxfp4}}")
    for k in value:
        reserved = k in RESERVED_FLAGS - {"precision", "precision-schedule"}
        if reserved or k not in options:
            raise SweepError(f"{where}: {label}: {k}: " + ("set by the sweep itself" if reserved
                             else "not a flag of the script (see its --help)"))
    return [x for k, v in value.items() for x in _flag(k, v)]


def _precision_points(grid: dict, path: str, script: str = "pretrain") -> list[tuple[str, str, str, list[str]]]:
    """(label, precision, precision flag, extra flags) of every precision point of the grid, in a
    stable order: ``presets`` (a preset or ``{label: per-GEMM spec}``), ``schedules``
    (``{label: --precision-schedule value}``) and ``treatments`` (``{label: {flag: value, ...}}``:
    whole flag sets, e.g. an RL sweep's rollout precision x correction), or the per-GEMM matrix."""
    from precision import LinearPrecision, SpecError, presets
    from precision.recipe import Gemm, parse_gemm

    named = [k for k in POINT_KEYS if k in grid]
    if named:
        extra = sorted(set(grid) & set(GEMMS))
        if extra:
            raise SweepError(f"{path}: grid mixes {'/'.join(named)} with {', '.join(extra)}; use one or the other")
        points = []
        for item in grid.get("presets") or []:
            # a preset name, or {label: per-GEMM spec} for a precision no preset names
            label, spec = _labelled(item, f"{path}: grid.presets")
            try:
                if spec in presets.names():
                    presets.get(spec)
                elif isinstance(item, dict):
                    LinearPrecision.parse(str(spec))
                else:
                    presets.get(str(spec))
            except ValueError as e:
                where = f"grid.presets: {label}" if isinstance(item, dict) else "grid.presets"
                raise SweepError(f"{path}: {where}: {e}") from None
            points.append((label, str(spec), "--precision", []))
        for item in grid.get("schedules") or []:
            from precision.schedule import PrecisionSchedule

            label, text = _labelled(item, f"{path}: grid.schedules")
            try:
                PrecisionSchedule.parse(str(text))
            except ValueError as e:
                raise SweepError(f"{path}: grid.schedules: {label}: {e}") from None
            points.append((label, str(text), "--precision-schedule", []))
        if grid.get("treatments"):
            options = _script_options(script)
            for item in grid["treatments"]:
                label, value = _labelled(item, f"{path}: grid.treatments")
                flags = _treatment_flags(label, value, f"{path}: grid.treatments", options)
                points.append((label, " ".join(flags), "", flags))
        if not points:
            raise SweepError(f"{path}: grid.{named[0]}: expected a non-empty list")
        labels = [p[0] for p in points]
        if len(set(labels)) != len(labels):
            raise SweepError(f"{path}: the grid has duplicate labels: "
                             f"{', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
        return points
    if not set(grid) & set(GEMMS):
        raise SweepError(f"{path}: the grid names no precision: give presets, schedules, treatments, or "
                         f"fprop/dgrad/wgrad")
    lists = []
    for g in GEMMS:
        values = grid.get(g, ["fp8"])
        for v in values:
            try:
                parse_gemm(str(v), Gemm(g))
            except SpecError as e:
                raise SweepError(f"{path}: grid.{g}: {e}") from None
        lists.append([str(v) for v in values])
    points = []
    for combo in itertools.product(*lists):
        spec = ",".join(f"{g}={v}" for g, v in zip(GEMMS, combo))
        LinearPrecision.parse(spec)
        name = "__".join(f"{g}-{v}" for g, v in zip(GEMMS, combo)).replace("+", "_").replace("@", "x")
        points.append((name, spec, "--precision", []))
    return points


def expand_runs(sweep: dict, path: str = "sweep") -> list[Run]:
    """The runs of a sweep, in a stable order (grid points, then seeds), each with a validated precision."""
    grid = sweep["grid"]
    script = sweep.get("script", "pretrain")
    base = _flags_from_mapping(sweep.get("base"))
    hyper = _hyper_grid(grid, path, script)
    seeds = sweep.get("seeds") or [None]
    runs: list[Run] = []
    for label, precision, precision_flag, point_flags in _precision_points(grid, path, script):
        for values in itertools.product(*(v for _, v in hyper)):
            point = {k: v for (k, _), v in zip(hyper, values)}
            flags = base + point_flags + [x for k, v in point.items() for x in _flag(k, v)]
            for seed in seeds:
                name = _point_name(label, point) + ("" if seed is None else f"__seed-{seed}")
                runs.append(Run(name, precision, _per_seed(flags, seed, path)
                                + ([] if seed is None else ["--seed", str(seed)]),
                                label, dict(point), seed, precision_flag, script))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SweepError(f"{path}: the grid has duplicate runs")
    baseline = sweep.get("baseline")
    labels = list(dict.fromkeys(r.label for r in runs))
    if baseline is not None and baseline not in labels:
        raise SweepError(f"{path}: baseline {baseline!r} is not one of the runs: {', '.join(labels)}")
    unknown = [x for c in sweep.get("contrasts") or [] for x in c if x not in labels]
    if unknown:
        raise SweepError(f"{path}: contrasts: {', '.join(unknown)} not among the runs' labels: {', '.join(labels)}")
    from pretrain.sweep.claims import START

    unknown = [x for t in (sweep.get("claims") or {}).get("tests", []) for x in t["contrast"]
               if x not in labels and not (x == START and t["metric"] == "gain")]
    if unknown:
        raise SweepError(f"{path}: claims.tests: {', '.join(unknown)} not among the runs' labels: {', '.join(labels)}")
    unknown = [k for k in (sweep.get("published") or {}).get("extra_tokens", {}) if k not in labels]
    if unknown:
        raise SweepError(f"{path}: published.extra_tokens: {', '.join(map(str, unknown))} not among the runs' "
                         f"labels: {', '.join(labels)}")
    return runs

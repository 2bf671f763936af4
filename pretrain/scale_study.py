"""A precision's cost as a trend over model sizes: slopes against log size with intervals over paired
seeds, predictions beyond the sizes run, and the per-block mechanism table of each size.

The sweep (``configs/sweeps/wgrad_scale_cpu.yaml``) ranges ``model-size`` over a family of shapes
and runs every treatment at every size with the same seeds: a seed fixes the initialization and the
data order, so at one size the treatments of one seed are paired. Each run's extra tokens against
the sweep's baseline (``results.csv``'s ``extra_tokens_pct``) are compared on ``log(1 + x/100)``
(``pretrain.evaluation.extra_tokens``: the scale on which a ratio and its inverse are symmetric):

* ``paired_effects(records, a, b)``: per size and seed, ``log(1 + x_a) - log(1 + x_b)`` -- the log
  token ratio of ``a`` against ``b`` (both measured against the same baseline run of that seed); or,
  with ``metric="val_gap"``, the difference of their end-of-run validation gaps to that baseline run
  (a loss difference: a crossing can snap to a dip of the baseline's noisy training curve, so that
  a seed's treatments share one crossing whatever their final losses; the validation gap cannot);
* ``slope_over_sizes(effects, sizes)``: the least-squares slope of the per-size mean effect against
  ``log10`` of the size (non-embedding parameters), with two 95 % intervals: a **seed bootstrap**
  (seeds drawn with replacement, the same draw at every size, so what a seed shares across sizes --
  its data order -- stays paired) and the **regression** t-interval from the scatter of the size
  means about the line (``n_sizes - 2`` degrees of freedom; what seeds alone cannot show: a curve, or
  sizes that disagree). The verdict reads their union: ``grows with size`` / ``shrinks with size``
  where both exclude 0, else ``no trend shown`` (not "no trend"). A seed whose value is not finite
  (diverged, or no crossing) makes the slope not estimable: it is reported, never dropped;
* ``SlopeResult.predict(n_params)``: the fitted effect at another size as a % of extra tokens, with
  the union of the bootstrap's and the regression's prediction intervals -- an extrapolation, valid
  only as far as the assumptions the write-up lists;
* ``predictor_fit(bias, effect)``: how well a first-order predictor (the gradient-error bias
  ``<G, E[e]> / |G|^2`` of ``launch/gradient_error.py`` at each size) tracks the measured effect:
  least-squares slope and Pearson r over sizes;
* ``telemetry_table(tb_dir)``: the ``numerics/<layer>/<gemm>/<operand>/<metric>`` scalars of a run
  (``--numerics-interval``) as rows per step, GEMM, operand and blocking axis (tokens for Wgrad,
  features for Fprop and Dgrad), each metric's mean and max over the layers.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.evaluation.extra_tokens import log_ratio
from pretrain.evaluation.stats import t_quantile
from pretrain.trainer.tags import read_scalars

__all__ = ["AXIS", "Record", "SlopeResult", "non_embedding_params", "paired_effects", "predictor_fit",
           "records_from_per_seed", "records_from_sweep", "slope_figure", "slope_over_sizes", "slope_table",
           "telemetry_markdown", "telemetry_of_runs", "telemetry_table"]

# the axis each GEMM's operands are blocked along (its contraction axis)
AXIS = {"fprop": "features (in)", "dgrad": "features (out)", "wgrad": "tokens"}


@dataclass(frozen=True)
class Record:
    """One run of the sweep: its size (model-size name), treatment label, seed, extra tokens (%) and
    end-of-run validation gap against the baseline (loss)."""

    size: str
    treatment: str
    seed: int
    extra_pct: float
    val_gap: float = float("nan")  # final validation loss minus the baseline run's of the same seed


def non_embedding_params(model: dict) -> int:
    """Parameters of the linear layers of a GPT model-size mapping (``num_layers``, ``hidden_size``,
    ``ffn_hidden_size``, ``num_attention_heads``, ``num_query_groups``; SwiGLU unless ``swiglu`` is
    false): attention QKV and projection plus the MLP, no embeddings, output layer or norms."""
    d, L, f = model["hidden_size"], model["num_layers"], model["ffn_hidden_size"]
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    head_dim = model.get("kv_channels") or d // heads
    attn = d * (heads + 2 * groups) * head_dim + heads * head_dim * d
    mlp = d * f * (2 if model.get("swiglu", True) else 1) + f * d
    return L * (attn + mlp)


METRICS = ("extra_tokens", "val_gap")


def paired_effects(records: list[Record], a: str, b: str,
                   metric: str = "extra_tokens") -> dict[str, dict[int, float]]:
    """Per size, per seed present for both: ``log(1 + x_a/100) - log(1 + x_b/100)`` of the extra
    tokens, or with ``metric="val_gap"`` the difference of the end-of-run validation gaps (a loss
    difference, which a crossing's snapping to the baseline's curve does not touch); NaN where a value
    is not finite."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: expected one of {', '.join(METRICS)}")
    by = {(r.size, r.treatment, r.seed): r.extra_pct if metric == "extra_tokens" else r.val_gap
          for r in records}
    out: dict[str, dict[int, float]] = {}
    for (size, t, seed), xa in by.items():
        if t != a or (size, b, seed) not in by:
            continue
        xb = by[(size, b, seed)]
        ok = math.isfinite(xa) and math.isfinite(xb)
        diff = (log_ratio(xa) - log_ratio(xb)) if metric == "extra_tokens" else xa - xb
        out.setdefault(size, {})[seed] = diff if ok else float("nan")
    return out


def _ols(x: list[float], y: list[float]) -> tuple[float, float]:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx) ** 2 for v in x)
    slope = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx
    return slope, my - slope * mx


def _pct(log_ratio: float) -> float:
    """A log token ratio as % extra tokens."""
    return 100.0 * math.expm1(log_ratio)


@dataclass(frozen=True)
class SlopeResult:
    """The slope of an effect (log token ratio) per decade of non-embedding parameters."""

    sizes: tuple[str, ...]
    log10_params: tuple[float, ...]
    means: tuple[float, ...]  # per-size mean effect (log ratio)
    seeds: int
    slope: float
    intercept: float
    boot: tuple[float, float]  # seed bootstrap interval of the slope
    regression: tuple[float, float]  # t-interval from the size means' scatter about the line
    verdict: str
    not_finite: int = 0
    _draws: tuple[tuple[float, float], ...] = field(default=(), repr=False)  # bootstrap (slope, intercept)
    _resid_var: float = float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        """The union of the two intervals (what the verdict reads)."""
        return min(self.boot[0], self.regression[0]), max(self.boot[1], self.regression[1])

    def predict(self, n_params: float, confidence: float = 0.95) -> tuple[float, float, float]:
        """The fitted effect at ``n_params`` as % extra tokens (an effect on the log token ratio), and
        its interval: ``predict_effect`` back-transformed."""
        y, lo, hi = self.predict_effect(n_params, confidence)
        return _pct(y), _pct(lo), _pct(hi)

    def predict_effect(self, n_params: float, confidence: float = 0.95) -> tuple[float, float, float]:
        """The fitted effect at ``n_params`` in the effect's own unit, and its interval (the union of
        the bootstrap's percentile interval and the regression's prediction interval for a size mean)."""
        if not math.isfinite(self.slope):
            return float("nan"), float("-inf"), float("inf")
        x = math.log10(n_params)
        y = self.intercept + self.slope * x
        ys = sorted(b + s * x for s, b in self._draws)
        lo_b, hi_b = _percentiles(ys, confidence) if ys else (y, y)
        n = len(self.log10_params)
        lo_r = hi_r = y
        if n > 2 and math.isfinite(self._resid_var):
            mx = sum(self.log10_params) / n
            sxx = sum((v - mx) ** 2 for v in self.log10_params)
            se = math.sqrt(self._resid_var * (1 + 1 / n + (x - mx) ** 2 / sxx))
            q = t_quantile(confidence, n - 2)
            lo_r, hi_r = y - q * se, y + q * se
        return y, min(lo_b, lo_r), max(hi_b, hi_r)


def _percentiles(sorted_values: list[float], confidence: float) -> tuple[float, float]:
    n = len(sorted_values)
    lo = sorted_values[max(0, int(math.floor((1 - confidence) / 2 * n)))]
    hi = sorted_values[min(n - 1, int(math.ceil((1 + confidence) / 2 * n)) - 1)]
    return lo, hi


def slope_over_sizes(effects: dict[str, dict[int, float]], params: dict[str, float], *, boot: int = 2000,
                     confidence: float = 0.95, rng_seed: int = 0) -> SlopeResult:
    """The slope of the per-size mean of ``effects`` (size -> seed -> value) against
    ``log10(params[size])``, with its seed-bootstrap and regression intervals (module docstring).
    Needs at least 3 sizes and the same seeds at every size."""
    sizes = sorted(effects, key=lambda s: params[s])
    if len(sizes) < 3:
        raise ValueError(f"a slope over sizes needs at least 3 sizes with paired seeds, got {len(sizes)}: {sizes}")
    seeds = sorted(set.intersection(*(set(effects[s]) for s in sizes)))
    if len(seeds) < 2:
        raise ValueError(f"a slope over sizes needs at least 2 seeds present at every size, got {seeds}")
    x = [math.log10(params[s]) for s in sizes]
    table = [[effects[s][k] for k in seeds] for s in sizes]
    bad = sum(1 for row in table for v in row if not math.isfinite(v))
    means = [sum(row) / len(row) for row in table]
    if bad:
        nan = float("nan")
        return SlopeResult(tuple(sizes), tuple(x), tuple(means), len(seeds), nan, nan, (-math.inf, math.inf),
                           (-math.inf, math.inf), f"not estimable: {bad} seed value(s) not finite", bad)
    slope, intercept = _ols(x, means)
    rng = random.Random(rng_seed)
    draws = []
    for _ in range(boot):
        pick = [rng.randrange(len(seeds)) for _ in seeds]
        m = [sum(row[i] for i in pick) / len(pick) for row in table]
        draws.append(_ols(x, m))
    lo_b, hi_b = _percentiles(sorted(s for s, _ in draws), confidence)
    n = len(sizes)
    resid = [m - (intercept + slope * v) for v, m in zip(x, means)]
    mx = sum(x) / n
    sxx = sum((v - mx) ** 2 for v in x)
    resid_var = sum(r * r for r in resid) / (n - 2) if n > 2 else float("nan")
    q = t_quantile(confidence, n - 2) if n > 2 else float("inf")
    half = q * math.sqrt(resid_var / sxx) if n > 2 else float("inf")
    reg = (slope - half, slope + half)
    lo, hi = min(lo_b, reg[0]), max(hi_b, reg[1])
    verdict = "grows with size" if lo > 0 else "shrinks with size" if hi < 0 else "no trend shown"
    return SlopeResult(tuple(sizes), tuple(x), tuple(means), len(seeds), slope, intercept, (lo_b, hi_b), reg,
                       verdict, 0, tuple(draws), resid_var)


def predictor_fit(predictor: dict[str, float], effect: dict[str, float]) -> tuple[float, float, int]:
    """Least-squares slope of ``effect`` on ``predictor`` over the sizes both have, Pearson r and the
    number of sizes (NaN slope and r with fewer than 3)."""
    keys = [k for k in predictor if k in effect and math.isfinite(predictor[k]) and math.isfinite(effect[k])]
    if len(keys) < 3:
        return float("nan"), float("nan"), len(keys)
    x, y = [predictor[k] for k in keys], [effect[k] for k in keys]
    slope, _ = _ols(x, y)
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((u - mx) * (v - my) for u, v in zip(x, y))
    sxx, syy = sum((u - mx) ** 2 for u in x), sum((v - my) ** 2 for v in y)
    r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")
    return slope, r, len(keys)


def _size_params(size: str) -> int:
    import yaml

    from pretrain.config.model import MODEL_SIZES_DIR

    p = Path(size) if str(size).endswith(".yaml") else Path(MODEL_SIZES_DIR) / f"{size}.yaml"
    return non_embedding_params(yaml.safe_load(p.read_text()))


def _row_size(row: dict) -> str | None:
    """The model size of a per-seed row: its ``model_size`` column, or ``model-size=NAME`` in its
    ``design`` column (the sweep report's form for a grid over hyper-parameters)."""
    if row.get("model_size"):
        return row["model_size"]
    for part in (row.get("design") or "").split():
        key, _, value = part.partition("=")
        if key == "model-size":
            return value
    return None


def records_from_per_seed(sweep_file: str, paths: list[str | Path]) -> tuple[list[Record], dict[str, float]]:
    """The runs of committed per-seed CSVs (the sweep report's ``per_seed.csv``: ``design``,
    ``against``, ``treatment``, ``seed``, ``extra_tokens_pct``; or one row per treatment, size and seed
    with a ``model_size`` column, every value against the baseline) as ``Record``s: the rows against
    the sweep's baseline whose size is in the sweep's ``model-size`` grid; other rows are skipped. What
    a slope is computed from once a sweep's run directories are gone, or when its parts ran in pieces
    written out one by one. A run given twice with different values is an error."""
    from pretrain.sweep.spec import SweepError, load_sweep

    sweep = load_sweep(sweep_file)
    baseline = sweep.get("baseline")
    sizes = (sweep.get("grid") or {}).get("model-size") or []
    if not sizes:
        raise SweepError(f"sweep file {sweep_file}: no model-size in its grid (a slope needs several sizes)")
    found: dict[tuple[str, str, int], float] = {}
    gaps: dict[tuple[str, str, int], float] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"--per-seed {path}: no such file")
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows and ("extra_tokens_pct" not in rows[0] or _row_size(rows[0]) is None):
            raise SweepError(f"--per-seed {path}: needs extra_tokens_pct and a model_size column or "
                             f"model-size=NAME in design (columns: {', '.join(rows[0])})")
        for row in rows:
            size = _row_size(row)
            if size not in sizes or row.get("against", baseline) != baseline:
                continue
            key = (size, row["treatment"], int(row["seed"]))
            value = float(row["extra_tokens_pct"] or "nan")
            gap = row.get("val_loss_gap", row.get("val_loss_gap_to_fp8"))
            gaps[key] = float(gap or "nan")
            if key in found and not math.isclose(found[key], value, rel_tol=1e-6, abs_tol=1e-6):
                raise SweepError(f"--per-seed {path}: {key[1]} at {size}, seed {key[2]} is {value:g} here and "
                                 f"{found[key]:g} in an earlier file")
            found[key] = value
    records = [Record(size, t, seed, v, gaps[size, t, seed]) for (size, t, seed), v in found.items()]
    return records, {s: _size_params(s) for s in dict.fromkeys(r.size for r in records)}


def records_from_sweep(sweep_file: str, out: str | Path) -> tuple[list[Record], dict[str, float]]:
    """The runs of ``out/results.csv`` (written by ``launch/sweep.py``, ``--collect`` included) as
    ``Record``s, sized by the grid's ``model-size``, and each size's non-embedding parameters.
    A run not yet in ``results.csv`` is simply absent."""
    from pretrain.sweep.spec import SweepError, expand_runs, load_sweep

    sweep = load_sweep(sweep_file)
    runs = {r.name: r for r in expand_runs(sweep, sweep_file)}
    path = Path(out) / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no results yet; run launch/sweep.py {sweep_file} --out {out} --collect")
    records, params = [], {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            run = runs.get(row["run"])
            if run is None:
                continue
            size = run.point.get("model-size", sweep.get("base", {}).get("model-size"))
            if size is None:
                raise SweepError(f"sweep file {sweep_file}: no model-size in its grid or base")
            if size not in params:
                params[size] = _size_params(size)
            records.append(Record(size, run.label, int(row["seed"]), float(row["extra_tokens_pct"] or "nan"),
                                  float(row.get("gap_val_loss") or "nan")))
    return records, params


def slope_table(records: list[Record], params: dict[str, float], pairs: list[tuple[str, str]], *,
                metric: str = "extra_tokens", target: float, boot: int = 2000, confidence: float = 0.95) -> list[str]:
    """The printed report of ``launch/scale_study.py slopes``: a heading line and a markdown table, one
    row per pair ``(a, b)``: per-size means, the slope with its two intervals, the verdict and the
    fitted effect at ``target`` parameters (% extra tokens, or loss for ``metric="val_gap"``)."""
    tokens = metric == "extra_tokens"
    effect = ("log(1 + extra tokens)" if tokens else
              "end-of-run validation loss gap to the baseline, a minus b (loss; the baseline's row is 0)")
    unit, level = ("%" if tokens else "(loss)"), f"{100 * confidence:g}%"
    lines = [(f"{len(records)} runs over {len(params)} sizes; effect: {effect}, paired by seed; slope per decade "
              f"of non-embedding parameters; prediction at {target:.3g} parameters (an extrapolation)"), "",
             (f"| a vs b | sizes | seeds | per-size mean {unit} | slope ({level} bootstrap; regression) | verdict "
              f"| predicted {unit} at target ({level}) |"), "|---|---|---|---|---|---|---|"]
    for a, b in pairs:
        eff = paired_effects(records, a, b, metric)
        if len(eff) < 3:
            lines.append(f"| {a} vs {b} | {len(eff)} | - | - | not yet measured (needs 3 sizes) | - | - |")
            continue
        try:
            res = slope_over_sizes(eff, params, boot=boot, confidence=confidence)
        except ValueError as e:
            lines.append(f"| {a} vs {b} | {len(eff)} | - | - | {e} | - | - |")
            continue
        if tokens:
            means = ", ".join(f"{s} {_pct(m):+.2f}" for s, m in zip(res.sizes, res.means))
            predicted = "{:+.1f} ({:+.1f}, {:+.1f})".format(*res.predict(target, confidence))
        else:
            means = ", ".join(f"{s} {m:+.4f}" for s, m in zip(res.sizes, res.means))
            predicted = "{:+.4f} ({:+.4f}, {:+.4f})".format(*res.predict_effect(target, confidence))
        lines.append(f"| {a} vs {b} | {len(res.sizes)} | {res.seeds} | {means} | {res.slope:+.4f} "
                     f"({res.boot[0]:+.4f}, {res.boot[1]:+.4f}; {res.regression[0]:+.4f}, {res.regression[1]:+.4f}) "
                     f"| {res.verdict} | {predicted} |")
    return lines


def slope_figure(records: list[Record], params: dict[str, float], panels: list[tuple[str, list[tuple[str, str]]]],
                 path: str | Path, *, target: float, target_name: str, confidence: float = 0.95, boot: int = 2000,
                 published: dict[tuple[str, str], tuple[float, float]] | None = None, source: str = "",
                 title: str = "") -> Path:
    """A PNG of extra tokens against size: one panel per ``(heading, [(a, b), ...])``; per pair, the
    per-size mean over seeds of ``a`` against ``b`` (back-transformed from the log ratio, with its 95 %
    t interval over the paired seeds), the fitted line of ``slope_over_sizes`` drawn on to ``target``
    parameters (dashed beyond the sizes run) and its prediction there with the ``confidence`` interval
    (an extrapolation); where ``published`` has ``(b, a)``, that published range is drawn at ``target``
    beside it. The y axis is symmetric-log (linear within ±10 %): prediction intervals span decades."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrain.evaluation.stats import paired_interval

    published = published or {}
    rows = max(len(pairs) for _, pairs in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.2 + 0.32 * rows), squeeze=False)
    drawn_published = False
    for ax, (heading, pairs) in zip(axes[0], panels):
        top = 10.0
        for k, (a, b) in enumerate(pairs):
            color = f"C{k}"
            shift = 10 ** (0.025 * (k - (len(pairs) - 1) / 2))  # side by side on the log axis
            eff = paired_effects(records, a, b)
            sizes = sorted(eff, key=lambda s: params[s])
            for i, size in enumerate(sizes):
                iv = paired_interval(list(eff[size].values()))
                top = max(top, _pct(iv.hi) if iv.n > 1 else _pct(iv.mean))
                x = params[size] * shift
                err = [[_pct(iv.mean) - _pct(iv.lo)], [_pct(iv.hi) - _pct(iv.mean)]] if iv.n > 1 else None
                ax.errorbar(x, _pct(iv.mean), yerr=err, fmt="o", color=color, ms=4, capsize=3,
                            label=f"{a} vs {b}" if i == 0 else None)
            try:
                res = slope_over_sizes(eff, params, boot=boot, confidence=confidence)
            except ValueError:
                continue
            if not math.isfinite(res.slope):
                continue
            def fit(u, res=res):
                return _pct(res.intercept + res.slope * u)
            lo_x, hi_x = min(res.log10_params), max(res.log10_params)
            ax.plot([10 ** lo_x, 10 ** hi_x], [fit(lo_x), fit(hi_x)], "-", color=color, lw=1)
            ax.plot([10 ** hi_x, target], [fit(hi_x), fit(math.log10(target))], "--", color=color, lw=1)
            y, lo, hi = res.predict(target, confidence)
            ax.errorbar(target * shift, y, yerr=[[y - lo], [hi - y]], fmt="s", color=color, mfc="none", capsize=3,
                        label=f"  fit to {target_name}: {y:+.1f}% ({lo:+.0f}, {hi:+.0f}), "
                              f"{100 * confidence:g}% (an extrapolation)")
            if (b, a) in published:
                p_lo, p_hi = published[(b, a)]
                ax.plot([target * shift * 1.25] * 2, [p_lo, p_hi] if p_hi > p_lo else [p_lo - 0.4, p_lo + 0.4],
                        color=color, lw=6, alpha=0.55, solid_capstyle="butt",
                        label=f"  published at {target_name}: {p_lo:+g}" + (f" to {p_hi:+g}%" if p_hi > p_lo else "%")
                        + f" ({source})")
                drawn_published = True
                top = max(top, p_hi)
            top = max(top, hi)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=10.0)
        ax.set_ylim(-100.0, 2.0 * top if math.isfinite(top) else 1e6)  # -100 %: the fewest tokens there can be
        ax.set_xlabel("non-embedding parameters", fontsize=8)
        ax.set_ylabel("extra tokens to the reference's loss, %", fontsize=8)
        ax.set_title(heading, fontsize=9)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)
    note = "points: mean over paired seeds, 95% t interval (unadjusted); solid: least-squares fit; dashed: extrapolated"
    if not drawn_published and published:
        note += "; no published figure matches these pairs"
    fig.suptitle(f"{title}\n{note}" if title else note, fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def telemetry_table(tb_dir: str | Path) -> list[dict]:
    """Rows ``{step, gemm, operand, axis, metric, mean, max, layers}`` of a run's ``numerics/``
    scalars: per step, GEMM, operand and metric, the mean and max over the layers that logged it."""
    if not any(Path(tb_dir).rglob("events.out.tfevents.*")):
        raise FileNotFoundError(f"{tb_dir}: no TensorBoard event files (a run's --tensorboard-dir)")
    values: dict[tuple[int, str, str, str], list[float]] = {}
    for tag, points in read_scalars(tb_dir, prefix="numerics/").items():
        parts = tag.split("/")
        if len(parts) < 5 or parts[-3] not in AXIS:
            continue
        gemm, operand, metric = parts[-3], parts[-2], parts[-1]
        for step, value in points:
            values.setdefault((step, gemm, operand, metric), []).append(value)
    if not values:
        raise ValueError(f"{tb_dir}: no numerics/* scalars; run pretrain with --numerics-interval N")
    rows = []
    for (step, gemm, operand, metric), v in sorted(values.items()):
        finite = [u for u in v if math.isfinite(u)]
        rows.append({"step": step, "gemm": gemm, "operand": operand, "axis": AXIS[gemm], "metric": metric,
                     "mean": sum(finite) / len(finite) if finite else float("nan"),
                     "max": max(finite) if finite else float("nan"), "layers": len(v)})
    return rows


def telemetry_of_runs(paths: list[str | Path]) -> list[dict]:
    """``telemetry_table`` of every run below ``paths`` (run directories or a sweep's ``--out``: each
    directory holding TensorBoard event files, or a ``tensorboard/`` folder of them, is one run), with
    its ``run`` name; runs without ``--numerics-interval`` scalars are skipped."""
    rows = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: not a directory (a run directory or a sweep's --out)")
        runs = sorted({f.parent.parent if f.parent.name == "tensorboard" else f.parent
                       for f in p.rglob("events.out.tfevents.*")})
        if not runs:
            raise FileNotFoundError(f"{p}: no TensorBoard event files below it (runs made with --tensorboard-dir)")
        for run in runs:
            try:
                table = telemetry_table(run)
            except ValueError:  # a run without --numerics-interval
                continue
            rows += [{"run": run.name, **r} for r in table]
    return rows


def telemetry_markdown(rows: list[dict], metrics: list[str]) -> list[str]:
    """The rows of ``telemetry_of_runs`` whose metric is in ``metrics``, as a markdown table."""
    lines = ["| run | step | GEMM | operand | blocked along | metric | mean over layers | max |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['step']} | {r['gemm']} | {r['operand']} | {r['axis']} | {r['metric']} "
              f"| {r['mean']:.4g} | {r['max']:.4g} |" for r in rows if r["metric"] in metrics]
    return lines

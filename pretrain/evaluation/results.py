"""Result tables: one run's (task, metric, value, stderr) and per-sample results, and an A-vs-B
comparison that can see a small drop.

    rows = result_rows(lm_eval_output["results"])        # [{task, metric, value, stderr}, ...]
    write_results(rows, out_dir, label="bf16", extra={...}, samples=sample_rows(output["samples"]))
    write_comparison(a_dir, b_dir, out_dir, labels=("BF16", "QAT"))  # compare.csv, compare.md

The comparison is the HiF8 QAT study's table. When both runs kept their per-sample results
(``samples.jsonl``: every document's score per metric, and the gold continuation's negative
log-likelihood ``nll`` in nats), it is a **paired** test over the documents both scored: per task
and metric, A, B, ``delta = B - A`` in **percentage points** for proportions (accuracy, exact match)
and in the metric's units otherwise, the relative change ``(B - A) / |A|`` in percent, the 95% t
interval of the mean per-document difference (the two runs' scores of one document are
correlated, so this interval is far tighter than one from the two runs' separate stderrs) and a
verdict Holm-adjusted over the table (``pretrain.evaluation.stats``). The ``nll`` row is the loss
gap (nats per document; lower is better) and ``ppl ratio`` ``exp(mean nll_B - mean nll_A)``, the
per-document perplexity ratio. Without per-sample results on both sides, the table is unpaired:
delta with the combined standard error ``sqrt(stderr_A^2 + stderr_B^2)`` (None when either run
has none).
"""

from __future__ import annotations

import csv
import json
import math
import os

FIELDS = ["task", "metric", "value", "stderr"]
COMPARE_FIELDS = ["task", "metric", "a", "b", "delta", "delta_stderr"]
PAIRED_FIELDS = ["task", "metric", "n", "a", "b", "delta", "unit", "relative_pct", "lo", "hi", "verdict"]
SAMPLES_FILE = "samples.jsonl"
# proportions: deltas in percentage points (lm-eval reports them as fractions)
PROPORTIONS = ("acc", "acc_norm", "exact_match")
_NOT_METRICS = {"doc_id", "target", "doc", "arguments", "resps", "filtered_resps", "doc_hash", "prompt_hash",
                "target_hash", "filter", "metrics"}


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None  # lm-eval writes "N/A" for stderrs it did not compute
    return None if math.isnan(v) else v


def result_rows(results: dict) -> list[dict]:
    """Rows from lm-eval's ``results`` dict ({task: {"acc,none": v, "acc_stderr,none": s, ...}}).

    The metric is lm-eval's key without the ``,none`` filter (other filters stay: ``exact_match,
    strict-match``)."""
    rows = []
    for task, metrics in sorted(results.items()):
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or _num(value) is None:
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append({
                "task": task,
                "metric": metric if filt == "none" else f"{metric},{filt}",
                "value": _num(value),
                "stderr": _num(stderr),
            })
    return rows


def _gold_nll(rec: dict) -> float | None:
    """The gold continuation's negative log-likelihood (nats) of one lm-eval sample record:
    multiple choice (``filtered_resps`` one ``(loglik, greedy)`` per choice, ``target`` the gold
    index), a single loglikelihood request, or a rolling one (a bare loglik); None otherwise."""
    resps = rec.get("filtered_resps")
    if not isinstance(resps, list) or not resps:
        return None

    def ll(r):
        r = r[0] if isinstance(r, (list, tuple)) else r
        return _num(r)

    target = rec.get("target")
    if len(resps) > 1:
        if isinstance(target, list):
            target = target[0] if target else None
        if not isinstance(target, int) or not 0 <= target < len(resps):
            return None
        v = ll(resps[target])
    else:
        v = ll(resps[0])
    return None if v is None else -v


def sample_rows(samples: dict) -> list[dict]:
    """Per-document results from lm-eval's ``samples`` ({task: [record, ...]}, ``log_samples=True``):
    ``{task, doc_id, metrics: {metric: score}, nll}`` (``nll``: :func:`_gold_nll`)."""
    rows = []
    for task, recs in sorted(samples.items()):
        for rec in recs:
            metrics = {k: float(v) for k, v in rec.items()
                       if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, str)}
            rows.append({"task": task, "doc_id": int(rec["doc_id"]), "metrics": metrics, "nll": _gold_nll(rec)})
    return rows


def read_samples(run_dir: str) -> list[dict] | None:
    """``run_dir/samples.jsonl`` rows, or None when the run kept none."""
    path = os.path.join(run_dir, SAMPLES_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _is_proportion(metric: str) -> bool:
    return metric.split(",", 1)[0] in PROPORTIONS


def paired_rows(a: list[dict], b: list[dict]) -> list[dict]:
    """The paired comparison over the documents both runs scored (module docstring): one row per
    (task, metric), then per task the ``nll`` loss gap and the ``ppl ratio``."""
    from pretrain.evaluation.stats import paired_interval, table_verdicts

    b_by = {(r["task"], r["doc_id"]): r for r in b}
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for ra in a:
        rb = b_by.get((ra["task"], ra["doc_id"]))
        if rb is None:
            continue
        for m, va in ra["metrics"].items():
            if m in rb["metrics"]:
                pairs.setdefault((ra["task"], m), []).append((va, rb["metrics"][m]))
        if ra.get("nll") is not None and rb.get("nll") is not None:
            pairs.setdefault((ra["task"], "nll"), []).append((ra["nll"], rb["nll"]))
    rows, gaps, higher = [], [], []
    for (task, metric), vals in sorted(pairs.items(), key=lambda kv: (kv[0][0], kv[0][1] == "nll", kv[0][1])):
        k = 100.0 if _is_proportion(metric) else 1.0
        ma, mb = sum(v for v, _ in vals) / len(vals), sum(v for _, v in vals) / len(vals)
        gap = paired_interval([(vb - va) * k for va, vb in vals])
        rows.append({"task": task, "metric": metric, "n": len(vals), "a": ma * k, "b": mb * k, "delta": gap.mean,
                     "unit": "pp" if k == 100.0 else ("nats" if metric == "nll" else ""),
                     "relative_pct": 100.0 * (mb - ma) / abs(ma) if ma else None,
                     "lo": None if math.isnan(gap.lo) else gap.lo, "hi": None if math.isnan(gap.hi) else gap.hi})
        gaps.append(gap)
        higher.append(metric != "nll")
        if metric == "nll":
            rows.append({"task": task, "metric": "ppl ratio", "n": len(vals), "a": None, "b": None,
                         "delta": math.exp(mb - ma), "unit": "x", "relative_pct": 100.0 * (math.exp(mb - ma) - 1),
                         "lo": None if math.isnan(gap.lo) else math.exp(gap.lo),
                         "hi": None if math.isnan(gap.hi) else math.exp(gap.hi), "verdict": ""})
    # one table, Holm over its comparisons; accuracy-like rows: higher is better, nll: lower
    verdicts = {}
    for hb in (True, False):
        idx = [i for i, h in enumerate(higher) if h == hb]
        for i, v in zip(idx, table_verdicts([gaps[i] for i in idx], [False] * len(idx), higher_is_better=hb)):
            verdicts[i] = v
    j = 0
    for r in rows:
        if "verdict" not in r:
            r["verdict"] = verdicts[j]
            j += 1
    return rows


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.4f}" if signed else f"{x:.4f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _write_csv(path: str, fields: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r[k] is None else r[k] for k in fields})


def write_results(rows: list[dict], out_dir: str, *, label: str, extra: dict | None = None,
                  samples: list[dict] | None = None) -> None:
    """``out_dir/results.csv`` (FIELDS), ``results.md`` (titled ``label``), ``results.json``, and
    with ``samples`` (:func:`sample_rows`) ``samples.jsonl``, one document per line."""
    os.makedirs(out_dir, exist_ok=True)
    if samples is not None:
        with open(os.path.join(out_dir, SAMPLES_FILE), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in samples)
    _write_csv(os.path.join(out_dir, "results.csv"), FIELDS, rows)
    table = markdown_table(["task", "metric", "value", "stderr"],
                           [[r["task"], r["metric"], _fmt(r["value"]), _fmt(r["stderr"])] for r in rows])
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# {label}\n\n{table}")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"label": label, "rows": rows, **(extra or {})}, f, indent=1, default=str)


def read_rows(run_dir: str) -> list[dict]:
    """The rows of ``run_dir/results.csv`` (as written by ``write_results``)."""
    path = os.path.join(run_dir, "results.csv")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--compare: no results.csv in {run_dir} (run launch/evaluate.py --out {run_dir} first)")
    with open(path, newline="") as f:
        return [{"task": r["task"], "metric": r["metric"], "value": _num(r["value"]), "stderr": _num(r["stderr"])}
                for r in csv.DictReader(f)]


def compare_rows(a: list[dict], b: list[dict]) -> list[dict]:
    """Per (task, metric) present in both runs: a, b, delta = b - a, combined stderr (unpaired;
    the values as lm-eval reports them, fractions for proportions)."""
    b_by_key = {(r["task"], r["metric"]): r for r in b}
    out = []
    for ra in a:
        rb = b_by_key.get((ra["task"], ra["metric"]))
        if rb is None or ra["value"] is None or rb["value"] is None:
            continue
        se = (math.sqrt(ra["stderr"] ** 2 + rb["stderr"] ** 2)
              if ra["stderr"] is not None and rb["stderr"] is not None else None)
        out.append({"task": ra["task"], "metric": ra["metric"], "a": ra["value"], "b": rb["value"],
                    "delta": rb["value"] - ra["value"], "delta_stderr": se})
    return out


def write_comparison(a_dir: str, b_dir: str, out_dir: str, labels: tuple[str, str] = ("A", "B")) -> list[dict]:
    """``out_dir/compare.csv`` and ``compare.md`` for runs ``a_dir`` and ``b_dir``; returns the rows:
    the paired table (:func:`paired_rows`) when both kept per-sample results, else the unpaired
    one (:func:`compare_rows`, deltas of proportions shown in percentage points)."""
    la, lb = labels
    sa, sb = read_samples(a_dir), read_samples(b_dir)
    os.makedirs(out_dir, exist_ok=True)
    head = f"# {lb} vs {la}\n\n{la}: {os.path.abspath(a_dir)}  \n{lb}: {os.path.abspath(b_dir)}\n\n"
    if sa is not None and sb is not None:
        rows = paired_rows(sa, sb)
        _write_csv(os.path.join(out_dir, "compare.csv"), PAIRED_FIELDS, rows)
        table = markdown_table(
            ["task", "metric", "n", la, lb, f"Δ ({lb} − {la})", "relative", "95% CI (paired)", "verdict"],
            [[r["task"], r["metric"], str(r["n"]), _fmt(r["a"]), _fmt(r["b"]),
              f"{_fmt(r['delta'], signed=r['unit'] != 'x')} {r['unit']}".strip(),
              "-" if r["relative_pct"] is None else f"{r['relative_pct']:+.2f}%",
              "-" if r["lo"] is None else f"[{r['lo']:+.4f}, {r['hi']:+.4f}]" if r["unit"] != "x"
              else f"[{r['lo']:.4f}, {r['hi']:.4f}]", r["verdict"] or "-"] for r in rows],
        )
        note = ("Paired over the documents both runs scored (n); pp = percentage points; nll: the gold "
                "continuation's negative log-likelihood, nats per document (lower is better); verdicts "
                "Holm-adjusted over the table (pretrain.evaluation.stats).\n\n")
        with open(os.path.join(out_dir, "compare.md"), "w") as f:
            f.write(head + note + table)
        return rows
    rows = compare_rows(read_rows(a_dir), read_rows(b_dir))
    _write_csv(os.path.join(out_dir, "compare.csv"), COMPARE_FIELDS, rows)

    def scaled(r, x, signed=False):
        return _fmt(None if x is None else x * (100.0 if _is_proportion(r["metric"]) else 1.0), signed)

    table = markdown_table(
        ["task", "metric", la, lb, f"Δ ({lb} − {la})", "± stderr", "relative"],
        [[r["task"], r["metric"], _fmt(r["a"]), _fmt(r["b"]),
          scaled(r, r["delta"], signed=True) + (" pp" if _is_proportion(r["metric"]) else ""),
          scaled(r, r["delta_stderr"]), f"{100.0 * r['delta'] / abs(r['a']):+.2f}%" if r["a"] else "-"]
         for r in rows],
    )
    note = ("Unpaired (no per-sample results on both sides: re-run launch/evaluate.py to keep them); "
            "pp = percentage points.\n\n")
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(head + note + table)
    return rows

"""Result tables: one run's (task, metric, value, stderr), and a per-task A-vs-B delta table.

    rows = result_rows(lm_eval_output["results"])        # [{task, metric, value, stderr}, ...]
    write_results(rows, out_dir, label="bf16", extra={...})  # results.csv, results.md, results.json
    write_comparison(a_dir, b_dir, out_dir, labels=("BF16", "QAT"))  # compare.csv, compare.md

The comparison is the HiF8 QAT study's table: per task and metric, A, B, ``delta = B - A`` (in the
metric's units; percentage points for accuracies) and the combined standard error
``sqrt(stderr_A^2 + stderr_B^2)`` (None when either run has none) to judge whether it matters.
"""

from __future__ import annotations

import csv
import json
import math
import os

FIELDS = ["task", "metric", "value", "stderr"]
COMPARE_FIELDS = ["task", "metric", "a", "b", "delta", "delta_stderr"]


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


def write_results(rows: list[dict], out_dir: str, *, label: str, extra: dict | None = None) -> None:
    """``out_dir/results.csv`` (FIELDS), ``results.md`` (titled ``label``), ``results.json``."""
    os.makedirs(out_dir, exist_ok=True)
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
    """Per (task, metric) present in both runs: a, b, delta = b - a, combined stderr."""
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
    """``out_dir/compare.csv`` and ``compare.md`` for runs ``a_dir`` and ``b_dir``; returns the rows."""
    rows = compare_rows(read_rows(a_dir), read_rows(b_dir))
    os.makedirs(out_dir, exist_ok=True)
    _write_csv(os.path.join(out_dir, "compare.csv"), COMPARE_FIELDS, rows)
    la, lb = labels
    table = markdown_table(
        ["task", "metric", la, lb, f"Δ ({lb} − {la})", "± stderr"],
        [[r["task"], r["metric"], _fmt(r["a"]), _fmt(r["b"]), _fmt(r["delta"], signed=True), _fmt(r["delta_stderr"])]
         for r in rows],
    )
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(f"# {lb} vs {la}\n\n{la}: {os.path.abspath(a_dir)}  \n{lb}: {os.path.abspath(b_dir)}\n\n{table}")
    return rows

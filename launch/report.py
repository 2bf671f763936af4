#!/usr/bin/env python
"""Numerics report of one training run: which GEMM operand of which layer is breaking training?
Or, given a sweep's output directory, the sweep's results with the interval beside every gap.

    python launch/report.py RUN_DIR [--out DIR] [--step N]
    python launch/report.py SWEEP_OUT                 # the directory launch/sweep.py --out wrote
    python launch/report.py SWEEP_OUT SWEEP_OUT ...   # several sweeps of one study: claims adjusted together
    python launch/report.py --findings configs/sweeps/results --out docs/figures   # one figure per study

Reads the TensorBoard scalars ``numerics/<layer>/<gemm>/<operand>/<metric>`` written by
``launch/pretrain.py --numerics-interval N`` (under RUN_DIR, searched recursively) and writes, for
each metric, a heatmap PNG of layers x GEMM operands (``numerics_<metric>.png``) and a Markdown
summary naming the worst layers (``numerics.md``). Values are those of the last telemetry step
(or of ``--step``).

For a sweep directory (it holds ``sweep.json``) the results are collected again from the runs'
TensorBoard logs (``launch/sweep.py --collect``) and the per-grid-point table is printed: mean and
spread over seeds, the paired gap to the baseline with its (unadjusted) 95% interval, extra tokens
with theirs, and the table's Holm-adjusted verdicts (worse / better / equivalent within the sweep's
``equivalence_margin`` / not shown to differ / diverged in k of n seeds). A sweep file's declared
``claims:`` are tested first (``pretrain.sweep.claims``); given several sweep directories of one study,
their claims are Holm-adjusted together.

With ``--findings RESULTS`` it writes one PNG per study write-up from its per-seed CSV
(``RESULTS/NAME_per_seed.csv``; ``pretrain.sweep.findings``): each treatment's mean over seeds with its
95% interval, the published study's figures from the write-up's ``study (...)`` column beside the
treatments they match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

from pretrain.evaluation.numerics_report import (  # noqa: F401
    COLUMNS,
    METRICS,
    load_numerics,
    load_unquantized,
    render,
    summary,
)
from pretrain.evaluation.moe_report import load_moe, moe_section
from pretrain.sweep.report import report_sweep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", help="a run directory (or its TensorBoard directory), or a sweep's --out directory")
    ap.add_argument("more", nargs="*", metavar="SWEEP_OUT",
                    help="further sweep directories of the same study: their declared claims are Holm-adjusted "
                         "together with the first's")
    ap.add_argument("--out", help="where to write the PNGs and numerics.md (default RUN_DIR/report)")
    ap.add_argument("--step", type=int, help="telemetry step to show (default: the last)")
    ap.add_argument("--findings", metavar="RESULTS",
                    help="a directory of per-seed study CSVs (configs/sweeps/results): one figure per study into --out")
    args = ap.parse_args(argv)
    if args.findings:
        from pretrain.sweep.findings import write_findings

        if args.run_dir or not args.out:
            ap.error("--findings RESULTS takes --out DIR and no run or sweep directory")
        try:
            pngs = write_findings(Path(args.findings), Path(args.out))
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(pngs)} figure(s): " + ", ".join(str(p) for p in pngs))
        return 0
    if args.run_dir is None:
        ap.error("give a run or sweep directory (or --findings RESULTS --out DIR)")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir}: not a directory", file=sys.stderr)
        return 2
    if (run_dir / "sweep.json").is_file():
        dirs = [run_dir, *map(Path, args.more)]
        bad = next((d for d in dirs if not (d / "sweep.json").is_file()), None)
        if bad is not None:
            print(f"error: {bad}: not a sweep directory (no sweep.json; the --out of launch/sweep.py)", file=sys.stderr)
            return 2
        for d in dirs:
            report_sweep(d)
        if args.more:
            from pretrain.sweep.claims import study_table

            try:
                print("\n".join(study_table(dirs)))
            except (FileNotFoundError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        return 0
    if args.more:
        print(f"error: {args.more[0]}: several directories are for sweeps only ({run_dir} has no sweep.json)",
              file=sys.stderr)
        return 2
    try:
        table, step = load_numerics(run_dir, args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs = render(table, step, out, run_dir.name, load_unquantized(run_dir, step))
    md = summary(table, step)
    if moe := moe_section(load_moe(run_dir)):  # a mixture-of-experts run: its routing and experts' SQNR
        md += "\n\n" + moe
    (out / "numerics.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'numerics.md'} and {len(pngs)} heatmaps: " + ", ".join(p.name for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

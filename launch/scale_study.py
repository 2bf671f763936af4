"""A precision's cost as a trend with model size: slopes over a size sweep, and the per-block table.

Two reports on a sweep that ranges ``model-size`` over a family of shapes (e.g.
``configs/sweeps/wgrad_scale_cpu.yaml``; definitions in ``pretrain/scale_study.py``).

``slopes``: for each treatment against the sweep's baseline and each of its ``contrasts: [a, b]``, the
per-size mean log token ratio (paired by seed), its slope per decade of non-embedding parameters with
a seed-bootstrap and a regression interval, the verdict on their union, and the fitted effect
extrapolated to ``--predict-params`` (default Llama-3.1-8B's) -- an extrapolation, marked as such::

    python launch/scale_study.py slopes configs/sweeps/wgrad_scale_cpu.yaml --out runs/wgrad_scale_cpu

or from committed per-seed CSVs (the sweep report's ``per_seed.csv`` of each part or piece), with a
figure of the sizes, the fits and the published figures at the target::

    python launch/scale_study.py slopes configs/sweeps/wgrad_scale_cpu_part2.yaml \\
        --per-seed configs/sweeps/results/wgrad_scale_cpu_per_seed.csv \\
        --figure wgrad_scale_part2.png --published configs/sweeps/wgrad_scale_cpu.md

``--metric val_gap`` fits the end-of-run validation gaps instead (a loss difference): a loss-curve
crossing can snap to a dip of the baseline's noisy curve, the validation gap cannot::

    python launch/scale_study.py slopes configs/sweeps/wgrad_scale_cpu_part2.yaml \\
        --per-seed configs/sweeps/results/wgrad_scale_cpu_per_seed.csv --metric val_gap

``telemetry``: the per-block numerics of runs made with ``--numerics-interval`` (``flushed_nonzero``,
``block_max_median``, ``block_top_share`` and their ``had16_`` forms), one row per run, step, GEMM,
operand, blocking axis (tokens for Wgrad, features for Fprop and Dgrad) and metric, the mean and max
over the layers, as CSV and printed (a directory is searched run by run)::

    python launch/scale_study.py telemetry runs/wgrad_scale_cpu --csv runs/wgrad_scale_cpu/telemetry.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
import warnings
from pathlib import Path

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

# Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 query groups (head dim 128), SwiGLU 14336
LLAMA_8B = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
            "num_query_groups": 8}
SHOWN = ("flushed_nonzero", "had16_flushed_nonzero", "block_max_median", "had16_block_max_median",
         "block_top_share", "had16_block_top_share")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scale_study.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("slopes", help="slopes of extra tokens against log size, with intervals and a prediction")
    s.add_argument("sweep", help="the sweep YAML file (its grid ranges model-size)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--out", help="the sweep's output directory (holding results.csv)")
    src.add_argument("--per-seed", nargs="+", metavar="CSV",
                     help="committed per-seed CSVs instead (the sweep report's per_seed.csv, one per piece or part): "
                          "their rows against the sweep's baseline at the sizes of its grid")
    s.add_argument("--figure", default=None, metavar="PNG",
                   help="also draw extra tokens against size per treatment and contrast, with the fits "
                        "extrapolated to the prediction's size")
    s.add_argument("--published", default=None, metavar="WRITEUP",
                   help="a write-up whose 'study (SOURCE)' table column gives published figures at the "
                        "prediction's size, drawn beside the fits in --figure")
    s.add_argument("--predict-params", type=float, default=None,
                   help="non-embedding parameters to extrapolate to (default Llama-3.1-8B's)")
    s.add_argument("--metric", choices=("extra_tokens", "val_gap"), default="extra_tokens",
                   help="the per-seed effect: extra_tokens (log token ratio of the loss-curve crossings, default) "
                        "or val_gap (difference of the end-of-run validation gaps to the baseline, in loss: a "
                        "crossing can snap to a dip of the baseline's curve, the validation gap cannot)")
    s.add_argument("--boot", type=int, default=2000, help="seed-bootstrap resamples (default 2000)")
    s.add_argument("--confidence", type=float, default=0.95, help="interval level (default 0.95)")
    t = sub.add_parser("telemetry", help="per-block numerics per GEMM, operand and axis of runs")
    t.add_argument("runs", nargs="+", help="run directories (or a sweep's output directory)")
    t.add_argument("--csv", default=None, help="write every row to this CSV file")
    t.add_argument("--metrics", nargs="+", default=list(SHOWN), help="metrics printed (default the per-block ones)")
    return p.parse_args(argv)


def slopes(args) -> int:
    from pretrain import scale_study as study
    from pretrain.sweep.spec import SweepError, load_sweep

    sweep = load_sweep(args.sweep)
    if args.published and not args.figure:
        raise SweepError("--published draws published figures in the --figure PNG: give --figure PNG too")
    if args.figure and args.metric != "extra_tokens":
        raise SweepError("--figure draws extra tokens against size: give --metric extra_tokens, or no --figure")
    if args.published and not Path(args.published).is_file():
        raise FileNotFoundError(f"--published {args.published}: no such file (a write-up with a 'study (...)' column)")
    if args.per_seed:
        records, params = study.records_from_per_seed(args.sweep, args.per_seed)
    else:
        records, params = study.records_from_sweep(args.sweep, args.out)
    baseline = sweep.get("baseline")
    target = args.predict_params or study.non_embedding_params(LLAMA_8B)
    against_baseline = [(t, baseline) for t in dict.fromkeys(r.treatment for r in records) if t != baseline]
    contrasts = [tuple(c) for c in sweep.get("contrasts") or []]
    pairs = against_baseline + contrasts
    print("\n".join(study.slope_table(records, params, pairs, metric=args.metric, target=target,
                                       boot=args.boot, confidence=args.confidence)))
    if args.figure:
        from pretrain.sweep.findings import published_figures

        published, source = published_figures(Path(args.published).read_text()) if args.published else ({}, "")
        panels = [(f"each treatment against {baseline}", against_baseline)]
        if contrasts:
            panels.append(("the sweep's contrasts", contrasts))
        name = "Llama-3.1-8B" if not args.predict_params else f"{target:.3g} parameters"
        path = study.slope_figure(records, params, panels, args.figure, target=target, target_name=name,
                                  confidence=args.confidence, boot=args.boot, published=published, source=source,
                                  title=f"{sweep.get('name', Path(args.sweep).stem)}: extra tokens against size")
        print(f"\nfigure: {path}")
    return 0


def telemetry(args) -> int:
    from pretrain.scale_study import telemetry_markdown, telemetry_of_runs

    rows = telemetry_of_runs(args.runs)
    if not rows:
        print("error: no numerics/* scalars in these runs; train with --numerics-interval N", file=sys.stderr)
        return 2
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print("\n".join(telemetry_markdown(rows, args.metrics)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from pretrain.sweep.spec import SweepError

    try:
        return slopes(args) if args.command == "slopes" else telemetry(args)
    except (SweepError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""End-to-end pretraining throughput and loss per precision recipe, against BF16 in the same run.

    # one H200 (issue 3's check): ~350M Llama, TP=1, a fixed number of iterations per recipe
    python launch/bench_pretrain.py --model-size 350m --precisions bf16,fp8,wgrad_hadamard \\
        --train-iters 40 --out runs/bench_350m -- --global-batch-size 32 --micro-batch-size 4
    # CPU smoke run
    python launch/bench_pretrain.py --model-size tiny --train-iters 4 --out /tmp/bench_tiny

Each recipe is a fresh ``launch/pretrain.py`` process (``torchrun --nproc-per-node N``) with the
same seed, data and flags, so the runs see the same batches. From each run's TensorBoard scalars:

  tokens/s      median of ``train/tokens_per_sec`` over iterations after ``--skip`` (the first
                ones compile kernels and fill caches)
  TFLOP/s/dev   median of ``train/tflops_per_device``: model FLOPs (``model.gpt.
                training_flops_per_token``, the same count for every recipe) per second and device
  MFU           TFLOP/s/dev over the device's dense BF16 peak (``--peak-tflops``, or known GPUs:
                H100/H200 989, B200 2250); on CPU: not reported
  loss@N        ``train/loss`` at the last iteration (same batches for every recipe)

and the ratio of tokens/s to the baseline recipe (the first of ``--precisions``) measured here.
Read the ratios with the GEMM backends in mind (``--gemm-backend auto`` prints them per layer):
on a Hopper GPU FP8 GEMMs run on tensor cores, while BF16 and the MX formats are emulated with
FP32 GEMMs of exactly rounded operands, so ``bf16`` is an FP32-GEMM baseline, not cuBLAS BF16.
Writes ``OUT/bench_pretrain.json`` and ``OUT/bench_pretrain.md``; each run's log is ``OUT/<recipe>/log``.
Everything after ``--`` goes to ``pretrain.py`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "GB200": 2500.0}


def device_peak(explicit: float | None) -> tuple[str, float | None]:
    """(device name, dense BF16 peak TFLOP/s or None)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", explicit
    name = torch.cuda.get_device_name()
    if explicit is not None:
        return name, explicit
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name.replace(" ", "")), None)


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_one(precision: str, args, extra: list[str]) -> dict:
    out = Path(args.out) / precision.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    tb = out / "tb"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        str(REPO / "launch" / "pretrain.py"), "--model-size", args.model_size, "--precision", precision,
        "--train-iters", str(args.train_iters), "--eval-iters", "0", "--log-interval", "1",
        "--tensorboard-dir", str(tb), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(out / "log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        text = (out / "log").read_text()
        said = next((ln for ln in text.splitlines() if ln.startswith("pretrain.py: error:")), None)
        return {"precision": precision, "error": said or f"exit {proc.returncode} (see {out / 'log'})",
                "log_tail": text[-2000:], "wall_s": wall}
    sc = scalars(tb)
    steady = [v for s, v in sc.get("train/tokens_per_sec", []) if s > args.skip]
    tflops = [v for s, v in sc.get("train/tflops_per_device", []) if s > args.skip]
    loss = sc.get("train/loss", [])
    return {
        "precision": precision,
        "tokens_per_sec": statistics.median(steady) if steady else float("nan"),
        "tflops_per_device": statistics.median(tflops) if tflops else float("nan"),
        "final_loss": loss[-1][1] if loss else float("nan"),
        "iterations": len(loss),
        "wall_s": wall,
    }


def table(rows: list[dict], peak: float | None) -> str:
    base = rows[0].get("tokens_per_sec") if rows else None
    lines = [
        f"| recipe | tokens/s | vs {rows[0]['precision']} | TFLOP/s/device | MFU | loss@N |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['precision']} | {r['error']} | | | | |")
            continue
        ratio = r["tokens_per_sec"] / base if base else float("nan")
        mfu = f"{100 * r['tflops_per_device'] / peak:.1f}%" if peak else "n/a"
        lines.append(
            f"| {r['precision']} | {r['tokens_per_sec']:,.0f} | {ratio:.2f}x | {r['tflops_per_device']:.3g} | "
            f"{mfu} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="bench_pretrain.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="350m", help="configs/models/NAME.yaml (default 350m)")
    p.add_argument("--precisions", default="bf16,fp8,wgrad_hadamard",
                   help="comma-separated presets or specs; the first is the baseline")
    p.add_argument("--train-iters", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="iterations left out of the medians (warm-up)")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    p.add_argument("--peak-tflops", type=float, help="dense BF16 peak of one device, for MFU")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    if args.skip >= args.train_iters:
        args.skip = max(0, args.train_iters - 2)
    name, peak = device_peak(args.peak_tflops)
    rows = []
    for precision in args.precisions.split(","):
        row = run_one(precision, args, extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
    md = (
        f"{args.model_size}, {args.train_iters} iterations, {args.nproc} process(es) on {name}"
        f"{f' (BF16 peak {peak:g} TFLOP/s)' if peak else ''}; medians after iteration {args.skip}; "
        f"flags: {' '.join(extra) or '(model-size defaults)'}\n\n{table(rows, peak)}\n"
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_pretrain.md").write_text(md)
    (Path(args.out) / "bench_pretrain.json").write_text(
        json.dumps({"device": name, "peak_tflops": peak, "model_size": args.model_size, "flags": extra,
                    "runs": rows}, indent=1)
    )
    print(md)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

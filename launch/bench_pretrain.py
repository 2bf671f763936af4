#!/usr/bin/env python
"""End-to-end pretraining throughput and loss per precision recipe, against BF16 in the same run.

    # one H200 (issue 3's check): ~350M Llama, TP=1, a fixed number of iterations per recipe
    python launch/bench_pretrain.py --model-size 350m --precisions bf16,fp8,wgrad_hadamard \\
        --train-iters 40 --out runs/bench_350m -- --global-batch-size 32   # micro-batch 8 on CUDA
    # CPU: every recipe against bf16, with FP32 and with BF16 parameters/activations (--bf16)
    python launch/bench_pretrain.py --model-size tiny --precisions bf16,fp8,mxfp4,wgrad_hadamard \
        --bf16-modes off,on --train-iters 6 --out /tmp/bench_tiny
    python launch/bench_pretrain.py ... --dry-run     # print the runs' commands, run nothing
    # a tiny MoE against the dense model of the same active parameters, per recipe
    python launch/bench_pretrain.py --model-size moe_tiny --dense-model-size tiny --precisions bf16,mxfp4 \
        --train-iters 6 --out /tmp/bench_moe

Each recipe is a fresh ``launch/pretrain.py`` process (``torchrun --nproc-per-node N``) with the
same seed, data and flags, so the runs see the same batches; ``--bf16-modes`` repeats the recipes
with ``--bf16`` (``on``), ``--no-bf16`` (``off``) or pretrain's own default (``default``: BF16 on
CUDA, FP32 on CPU). From each run's TensorBoard scalars:

  tokens/s      median of ``train/tokens_per_sec`` over iterations after ``--skip`` (the first
                ones compile kernels and fill caches)
  TFLOP/s/dev   median of ``train/tflops_per_device``: model FLOPs (``model.gpt.
                training_flops_per_token``, the same count for every recipe) per second and device
  MFU           TFLOP/s/dev over the device's dense BF16 datasheet peak (``--peak-tflops``, or known
                GPUs: H100/H200 989, B200 2250), and over the BF16 GEMM ceiling measured in the same
                run (``bf16_gemm_ceiling``: the best of a few large cuBLAS BF16 GEMMs; ~790 on an
                H200) -- the fraction of what this device's GEMMs actually reach; on CPU: not reported
  loss@N        ``lm loss`` at the last iteration (same batches for every recipe)

and the ratio of tokens/s (and of step time) to the baseline recipe -- the first of ``--precisions``
-- in the same mode, measured here. Each run also reports, from inside the process (rank 0):

  peak memory   ``torch.cuda.max_memory_allocated`` on CUDA; the peak resident set on CPU
  quantizing    the fraction of step time inside the operand pipeline's quantizer
                (``kernels.operand.quantize_operand``: rotation, amax, scale, quantization), after
                ``--skip``; timed with CUDA events on a GPU (no host synchronisation added), with
                the wall clock on CPU
  GEMM paths    the start-up report's "GEMMs per backend": ``emulated`` GEMMs are FP32 GEMMs of
                FP32-dequantized operands, ``bf16_mm`` GEMMs emulate the format on BF16 tensor
                cores, ``fp8_scaled_mm`` / ``mx_scaled_mm`` run it on FP8 / FP4 tensor cores. A
                recipe with a quantized GEMM that is not on tensor cores of its own format is
                *emulated* speed, and the table says so; GEMMs the recipe keeps in BF16 (the
                output layer) run plain BF16 GEMMs on ``bf16_mm`` and do not count.

Mixture of experts (``--dense-model-size``): with a MoE ``--model-size`` (``moe_tiny``) every recipe also
runs the dense model of the same *active* parameters per token (``tiny``: its FFN width equals top-k x
expert width + shared expert width), in the same invocation, and the table gains

  vs dense      the MoE run's tokens/s over the dense run's (same recipe, mode and batches)
  experts quant the fraction of step time the quantizer spends on the routed experts' operands
                (layers named ``...mlp.experts.local_experts.E...``), within "quantizing"

The experts run as megatron's ``SequentialMLP``: one policy GEMM per expert and GEMM, on the same
per-format paths as the dense layers (the start-up report's "GEMM paths per format"; on CPU every
quantized GEMM is emulated, FP32 GEMMs of dequantized operands). torch 2.13 offers grouped entry points
-- ``torch._grouped_mm`` (BF16) and ``torch._scaled_grouped_mm`` (FP8 row-wise) -- that the experts use
with ``--moe-grouped-gemm`` (passed after ``--``; ``model.grouped_experts``, which prints the path per
format); without it a GPU run measures one GEMM launch per expert.

Writes ``OUT/bench_pretrain.json`` and ``OUT/bench_pretrain.md``; each run's log is
``OUT/<recipe>[-<mode>]/log``. Everything after ``--`` goes to ``pretrain.py`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

from pretrain.trainer.tags import LOSS, THROUGHPUT, TOKENS_PER_SEC, series

REPO = Path(__file__).resolve().parents[1]
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "GB200": 2500.0}
MODES = {"default": [], "on": ["--bf16"], "off": ["--no-bf16"]}
CHILD_FLAG = "--child-stats"  # internal: this file, run by torchrun, wraps pretrain.train.main


def device_peak(explicit: float | None) -> tuple[str, float | None]:
    """(device name, dense BF16 peak TFLOP/s or None)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", explicit
    name = torch.cuda.get_device_name()
    if explicit is not None:
        return name, explicit
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name.replace(" ", "")), None)


def bf16_gemm_ceiling(size: int = 8192, repeats: int = 10) -> float | None:
    """The best TFLOP/s of ``repeats`` cuBLAS BF16 GEMMs ``[size, size] @ [size, size]`` (after a
    warm-up), measured now on this device: what its BF16 GEMMs reach in practice. None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / best / 1e12


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_dir(args, precision: str, mode: str, model: str | None = None) -> Path:
    name = precision.replace("/", "_") + ("" if mode == "default" else f"-bf16{mode}")
    if model is not None and model != args.model_size:  # the dense comparison model (--dense-model-size)
        name = f"{Path(model).stem}-{name}"
    return Path(args.out) / name


def command(precision: str, mode: str, args, extra: list[str], stats: Path, model: str | None = None) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        str(Path(__file__).resolve()), CHILD_FLAG, str(stats),
        "--model-size", model or args.model_size, "--precision", precision, *MODES[mode],
        "--train-iters", str(args.train_iters), "--eval-iters", "0", "--log-interval", "1",
        "--tensorboard-dir", str(stats.parent / "tb"), "--log-throughput", *extra,
    ]  # fmt: skip


def _log_fields(text: str) -> dict:
    """What the run's log says: tokens per iteration, and the GEMMs per backend of rank 0's stage."""
    tokens = re.search(r"micro-batches, ([\d,]+) tokens", text)
    paths = re.search(r"^GEMMs per backend: (.+)$", text, re.MULTILINE)
    counts = {}
    if paths:
        for part in paths.group(1).split(", "):
            name, _, n = part.rpartition(" ")
            counts[name] = int(n)
    # the start-up table (kernels.backends.describe_backends): one row per group of layers with the same
    # GEMMs, "NAMES (COUNT)" where a row stands for several; rows end at "GEMMs per backend"
    table = re.search(r"^GEMM backends on .*\n.*\n((?:.*\n)*?)GEMMs per backend", text, re.MULTILINE)
    emulated = None
    for row in table.group(1).splitlines() if table else ():
        cells = re.findall(r"(\S+) -> (emulated|reference|bf16_mm|fp8_scaled_mm|mx_scaled_mm)\b", row)
        if cells:
            many = re.match(r".*? \((\d+)\)  ", row)
            emulated = (emulated or 0) + int(many.group(1) if many else 1) * sum(_gemm_emulated(*c) for c in cells)
    return {"tokens_per_iter": int(tokens.group(1).replace(",", "")) if tokens else None, "gemm_paths": counts,
            "emulated_gemms": emulated}


def _plain_bf16(spec: str) -> bool:
    """Whether a GEMM recipe (the start-up report's spec) has two unscaled BF16-exact operands."""
    # torch (through precision): the parent process only spawns and reads runs, it never loads it
    from precision import Gemm
    from precision.formats import Scaling, get_format
    from precision.recipe import parse_gemm

    try:
        r = parse_gemm(spec, Gemm.FPROP)
    except ValueError:
        return False
    return all(get_format(f.fmt).kind == Scaling.NONE and get_format(f.fmt).bf16_exact for f in (r.a, r.b))


def _gemm_emulated(spec: str, backend: str) -> bool:
    """One GEMM of the start-up report: emulated unless on FP8/MX tensor cores, or a plain BF16 GEMM
    on ``bf16_mm``."""
    if backend in ("fp8_scaled_mm", "mx_scaled_mm"):
        return False
    return not (backend == "bf16_mm" and _plain_bf16(spec))


def quant_fraction(stats: dict, steps: list[tuple[int, float]], tokens_per_iter: int | None, skip: int,
                   experts_only: bool = False) -> float:
    """Median over iterations after ``skip`` of (quantizer seconds / step seconds); ``experts_only``:
    the seconds of the routed experts' operands only."""
    calls, iters = stats.get("quant_seconds", []), stats.get("iterations", 0)
    if experts_only:
        flags = stats.get("quant_expert", [])
        if len(flags) != len(calls):
            return float("nan")
        calls = [c if f else 0.0 for c, f in zip(calls, flags, strict=True)]
    if not calls or not iters or not tokens_per_iter or len(calls) % iters:
        return float("nan")
    per = len(calls) // iters
    fractions = []
    for it, tps in steps:
        if it > skip and tps > 0 and it <= iters:
            quant = sum(calls[(it - 1) * per: it * per])
            fractions.append(quant / (tokens_per_iter / tps))
    return statistics.median(fractions) if fractions else float("nan")


def run_one(precision: str, mode: str, args, extra: list[str], model: str | None = None) -> dict:
    out = run_dir(args, precision, mode, model)
    out.mkdir(parents=True, exist_ok=True)
    stats_file = out / "child_stats.json"
    stats_file.unlink(missing_ok=True)
    cmd = command(precision, mode, args, extra, stats_file, model)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(out / "log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    row = {"precision": precision, "mode": mode, "model": model or args.model_size}
    text = (out / "log").read_text()
    if proc.returncode != 0:
        said = next((ln for ln in text.splitlines() if ln.startswith("pretrain.py: error:")), None)
        return {**row, "error": said or f"exit {proc.returncode} (see {out / 'log'})", "log_tail": text[-2000:],
                "wall_s": wall}
    sc = scalars(out / "tb")
    steps = series(sc, TOKENS_PER_SEC)
    steady = [v for s, v in steps if s > args.skip]
    tflops = [v for s, v in series(sc, THROUGHPUT) if s > args.skip]
    loss = series(sc, LOSS)
    fields = _log_fields(text)
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    return {
        **row,
        "tokens_per_sec": statistics.median(steady) if steady else float("nan"),
        "tflops_per_device": statistics.median(tflops) if tflops else float("nan"),
        "final_loss": loss[-1][1] if loss else float("nan"),
        "iterations": len(loss),
        "peak_memory_gib": stats.get("peak_memory_bytes", float("nan")) / 2**30,
        "memory_kind": stats.get("memory_kind", "?"),
        "quant_fraction": quant_fraction(stats, steps, fields["tokens_per_iter"], args.skip),
        "expert_quant_fraction": quant_fraction(stats, steps, fields["tokens_per_iter"], args.skip, experts_only=True),
        "gemm_paths": fields["gemm_paths"],
        "emulated": (fields["emulated_gemms"] > 0 if fields["emulated_gemms"] is not None
                     else is_emulated(precision, fields["gemm_paths"])),
        "emulated_gemms": fields["emulated_gemms"],
        "wall_s": wall,
    }


def is_emulated(precision: str, paths: dict) -> bool:
    """Whether some GEMM of a quantized recipe is emulated (FP32 GEMMs, or the format on BF16 tensor
    cores): its speed is an emulation's, not the format's. A preset whose operands are all BF16 runs
    plain cuBLAS BF16 GEMMs on ``bf16_mm``: not an emulation."""
    # torch (through precision): the parent process only spawns and reads runs, it never loads it
    from precision import Gemm, presets
    from precision.formats import Scaling, get_format

    try:
        plan = presets.get(precision)
        unscaled = all(get_format(f.fmt).kind == Scaling.NONE and get_format(f.fmt).bf16_exact
                       for g in Gemm for f in (plan.recipe(g).a, plan.recipe(g).b))
    except (KeyError, ValueError):  # a spec or file: judged by its GEMM paths alone
        unscaled = False
    return bool(set(paths) - ({"bf16_mm"} if unscaled else {"fp8_scaled_mm", "mx_scaled_mm"}))


def table(rows: list[dict], peak: float | None, ceiling: float | None = None) -> str:
    """One Markdown table; ratios against the first recipe of the same ``--bf16`` mode; MFU against
    the datasheet ``peak`` and the measured BF16 GEMM ``ceiling`` (TFLOP/s)."""
    base, dense = {}, {}
    models = list(dict.fromkeys(r.get("model") for r in rows))
    moe = len(models) > 1  # --dense-model-size: the first model is the MoE one, the second the dense one
    for r in rows:
        base.setdefault((r["mode"], r.get("model")), r.get("tokens_per_sec"))
        if moe and r.get("model") == models[1] and "error" not in r:
            dense[(r["precision"], r["mode"])] = r["tokens_per_sec"]
    first = rows[0]["precision"] if rows else "?"
    extra_head, extra_rule = (" vs dense | experts quant |", "---:|---:|") if moe else ("", "")
    lines = [
        (f"| {'model | ' if moe else ''}recipe | --bf16 | tokens/s | vs {first} | step time vs {first} | TFLOP/s/device "
         f"| MFU (datasheet) | MFU (measured BF16 GEMM) | peak memory | quantizing |{extra_head} GEMM paths | loss@N |"),
        f"|{'---|' if moe else ''}---|---|---:|---:|---:|---:|---:|---:|---:|---:|{extra_rule}---|---:|",
    ]
    for r in rows:
        lead = f"{r.get('model')} | " if moe else ""
        if "error" in r:
            lines.append(f"| {lead}{r['precision']} | {r['mode']} | {r['error']} | | | | | | | | {'| | ' if moe else ''}| |")
            continue
        b = base.get((r["mode"], r.get("model")))
        ratio = r["tokens_per_sec"] / b if b else float("nan")
        mfu = f"{100 * r['tflops_per_device'] / peak:.1f}%" if peak else "n/a"
        mfu_c = f"{100 * r['tflops_per_device'] / ceiling:.1f}%" if ceiling else "n/a"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r["gemm_paths"].items())) or "?"
        label = " (emulated)" if r["emulated"] else ""
        mem = f"{r['peak_memory_gib']:.2f} GiB{' RSS' if r['memory_kind'] == 'cpu_rss' else ''}"
        cells = ""
        if moe:
            d = dense.get((r["precision"], r["mode"])) if r.get("model") == models[0] else None
            vs = f"{r['tokens_per_sec'] / d:.2f}x" if d else "-"
            eq = r.get("expert_quant_fraction", float("nan"))
            cells = f" {vs} | {'-' if eq != eq or r.get('model') != models[0] else f'{100 * eq:.0f}%'} |"
        lines.append(
            f"| {lead}{r['precision']}{label} | {r['mode']} | {r['tokens_per_sec']:,.0f} | {ratio:.2f}x | "
            f"{1 / ratio if ratio else float('nan'):.2f}x | {r['tflops_per_device']:.3g} | {mfu} | {mfu_c} | {mem} | "
            f"{100 * r['quant_fraction']:.0f}% |{cells} {paths} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


# Issue 13's goals on one H200 (TP=1, --bf16): (recipe, measure, bound, "min" | "max")
GOALS = (("bf16", "MFU", 0.40, "min"), ("fp8", "tokens/s vs bf16", 1.3, "min"),
         ("wgrad_hadamard", "step time vs bf16", 1.35, "max"), ("mxfp4", "step time vs bf16", 1.3, "max"))


def goal_lines(rows: list[dict], peak: float | None) -> list[str]:
    """One line per goal whose recipe ran (and the bf16 baseline with it), per mode: value, bound, met."""
    if not peak:  # the goals are an H200's; on a CPU (no peak) ratios measure emulation overheads only
        return ["- the goals are for a GPU run (no known BF16 peak on this device): not checked"]
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        got = {r["precision"]: r for r in rows if r["mode"] == mode and "error" not in r}
        base = got.get("bf16")
        for recipe, what, bound, kind in GOALS:
            r = got.get(recipe)
            if r is None or base is None:
                continue
            if what == "MFU":
                value, shown = r["tflops_per_device"] / peak, f"{100 * r['tflops_per_device'] / peak:.1f}%"
                want = f"{100 * bound:.0f}%"
            else:
                speed = r["tokens_per_sec"] / base["tokens_per_sec"]
                value = speed if what.startswith("tokens") else 1 / speed
                shown, want = f"{value:.2f}x", f"{bound:g}x"
            met = value >= bound if kind == "min" else value <= bound
            sign = ">=" if kind == "min" else "<="
            label = " (emulated)" if r.get("emulated") else ""
            out.append(f"- {recipe}{label} {what} (--bf16 {mode}): {shown} (goal {sign} {want}): "
                       f"{'met' if met else 'NOT met'}")
    return out


# ============================================================================ inside one run
def child(stats_path: str, argv: list[str]) -> int:
    """Run ``pretrain.train.main(argv)`` with the quantizer timed and the peak memory recorded.

    The operand pipeline calls ``kernels.operand.quantize_operand`` through its module global, so
    wrapping that name times every operand of every GEMM (all backends). On CUDA each call is
    bracketed by two events (read once, after training); on CPU by the wall clock."""
    import resource
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # as launch/pretrain.py

    # megatron-core after the warning filter above, and only in the measured child process
    from kernels import operand
    from pretrain.train import main as pretrain_main

    cuda = torch.cuda.is_available()
    spans, experts, inner = [], [], operand.quantize_operand

    def timed(*a, **k):
        state = a[5] if len(a) > 5 else k.get("state")
        experts.append(".experts.local_experts." in (getattr(state, "name", None) or ""))
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*a, **k)
            end.record()
            spans.append((start, end))
        else:
            t = time.perf_counter()
            out = inner(*a, **k)
            spans.append(time.perf_counter() - t)
        return out

    operand.quantize_operand = timed
    rc = pretrain_main(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        if cuda:
            torch.cuda.synchronize()
            seconds = [s.elapsed_time(e) / 1e3 for s, e in spans]
            peak, kind = torch.cuda.max_memory_allocated(), "cuda_allocated"
        else:
            seconds = spans
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_rss"
        iters = argv[argv.index("--train-iters") + 1] if "--train-iters" in argv else "0"
        Path(stats_path).write_text(json.dumps({"quant_seconds": seconds, "quant_expert": experts, "iterations": int(iters),
                                                "peak_memory_bytes": peak, "memory_kind": kind}))
    return rc


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [CHILD_FLAG]:
        return child(argv[1], argv[2:])
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
    p.add_argument("--bf16-modes", default="default",
                   help="comma-separated: on (--bf16), off (--no-bf16), default (pretrain's: BF16 on CUDA, "
                   "FP32 on CPU); every recipe runs in each mode")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="given to every run unless the flags after -- set it (default: 8 on CUDA -- at 1 or 2 a "
                   "quantized step measures Python overhead, not the GEMMs -- and pretrain's own on CPU)")
    p.add_argument("--dense-model-size", metavar="NAME",
                   help="with a mixture-of-experts --model-size: also run every recipe on this dense model (the same "
                   "active parameters per token, e.g. tiny for moe_tiny) and report MoE tokens/s against it")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dry-run", action="store_true", help="print each run's command and exit")
    p.add_argument("--goals", action="store_true", help="check issue 13's GPU goals under the table")
    args = p.parse_args(argv)
    modes = args.bf16_modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--bf16-modes: unknown {', '.join(bad)}; valid: {', '.join(MODES)}")
    if args.skip >= args.train_iters:
        args.skip = max(0, args.train_iters - 2)
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        p.error(f"--micro-batch-size: must be >= 1, got {args.micro_batch_size}")
    mbs = args.micro_batch_size or (8 if _cuda() else None)
    if mbs and "--micro-batch-size" not in extra:
        extra = ["--micro-batch-size", str(mbs), *extra]
    models = [args.model_size] + ([args.dense_model_size] if args.dense_model_size else [])
    for flag, m in zip(("--model-size", "--dense-model-size"), models):
        if not (REPO / "configs" / "models" / f"{m}.yaml").is_file() and not (m.endswith(".yaml") and Path(m).is_file()):
            p.error(f"{flag} {m}: no configs/models/{m}.yaml (a model-size name, or a .yaml path)")
    runs = [(precision, mode, m) for mode in modes for precision in args.precisions.split(",") for m in models]
    if args.dry_run:
        for precision, mode, m in runs:
            stats = run_dir(args, precision, mode, m) / "child_stats.json"
            print(shlex.join(command(precision, mode, args, extra, stats, m)))
        return 0
    name, peak = device_peak(args.peak_tflops)
    ceiling = bf16_gemm_ceiling()
    if ceiling:
        print(f"BF16 GEMM ceiling measured on {name}: {ceiling:.0f} TFLOP/s (8192^3, best of 10)", flush=True)
    rows = []
    for precision, mode, m in runs:
        row = run_one(precision, mode, args, extra, m)
        rows.append(row)
        print(json.dumps(row), flush=True)
        md = write_results(args, extra, name, peak, rows, ceiling)  # after every run: a timeout keeps the table so far
    print(md)
    return 0 if all("error" not in r for r in rows) else 1


def write_results(args, extra: list[str], name: str, peak: float | None, rows: list[dict],
                  ceiling: float | None = None) -> str:
    md = (
        f"{args.model_size}, {args.train_iters} iterations, {args.nproc} process(es) on {name}"
        f"{f' (BF16 datasheet peak {peak:g} TFLOP/s)' if peak else ''}"
        f"{f' (BF16 GEMM ceiling measured in this run {ceiling:.0f} TFLOP/s)' if ceiling else ''}; "
        f"medians after iteration {args.skip}; "
        f"flags: {' '.join(extra) or '(model-size defaults)'}\n\n{table(rows, peak, ceiling)}\n"
    )
    if args.goals:
        md += "\nGoals (issue 13):\n" + ("\n".join(goal_lines(rows, peak)) or "- (no goal's recipes ran)") + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_pretrain.md").write_text(md)
    (Path(args.out) / "bench_pretrain.json").write_text(
        json.dumps({"device": name, "peak_tflops": peak, "bf16_gemm_ceiling_tflops": ceiling, "model_size": args.model_size, "flags": extra,
                    "runs": rows}, indent=1)
    )
    return md


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""CPU/GPU micro-benchmark of the precision core, ratios against baselines measured in this run.

    python launch/bench_quantize.py                    # defaults of the precision-core issue
    python launch/bench_quantize.py --size 2048 --tokens 1024 --repeats 5
    python launch/bench_quantize.py --only controls --controls-size 1024 --repeats 3

1. MXFP4 quantize + dequantize of a SIZE x SIZE float32 tensor: ours (fused, compiled; and the
   eager reference) against torchao's ``to_mx`` (quantize only, and quantize + dequantize).
2. The FP4 error controls in the fused quantizer (``kernels.fused``, quantize + dequantize of a
   CONTROLS_SIZE x CONTROLS_SIZE float32 tensor, rotation included): four-over-six, MS-EDEN (16- and
   128-groups) and QuEST, each against plain round-to-nearest of the same format under the same
   rotation, interleaved in the same rounds. On a CPU the fused quantizer is TorchInductor's C++
   code for the emulated operand, not a hardware kernel: the ratios are emulated/CPU figures.
3. ``policy_linear`` forward + backward under ``wgrad_hadamard`` (and other presets) against the
   all-``bf16`` recipe, TOKENS x IN x OUT.

Times are the minimum over ``--repeats`` after warm-up (compilation happens in warm-up); the
linear presets are measured in interleaved rounds, so a busy machine slows all of them alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

from kernels.fused import compile_available, fake_quantize  # noqa: E402
from model.linear import policy_linear  # noqa: E402
from precision import LayerQuantState, presets, quantize  # noqa: E402
from precision.recipe import OperandFormat  # noqa: E402
from precision.rotation import random_signs, rotation_size  # noqa: E402
from precision.srand import SRKey  # noqa: E402

# (control, its operand format, plain nearest of the same format, the rotation both run under)
CONTROLS = [
    ("nvfp4/4over6", OperandFormat("nvfp4", four_over_six="mse"), OperandFormat("nvfp4"), "none"),
    ("nvfp4/2d/4over6", OperandFormat("nvfp4", block2d=True, four_over_six="mse"), OperandFormat("nvfp4", block2d=True),
     "none"),
    ("nvfp4/eden +rht16", OperandFormat("nvfp4", rounding="ms_eden"), OperandFormat("nvfp4"), "rht16"),
    ("nvfp4/eden128 +rht128", OperandFormat("nvfp4", rounding="ms_eden128"), OperandFormat("nvfp4"), "rht128"),
    ("mxfp4/quest +had32", OperandFormat("mxfp4", scale_rule="quest"), OperandFormat("mxfp4"), "had32"),
]


def timeit(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_quantizers(size: int, repeats: int, device: str) -> dict[str, float]:
    x = torch.randn(size, size, device=device)
    res = {"ours_fused_q+dq": timeit(lambda: fake_quantize(x, "mxfp4"), repeats),
           "ours_reference_q+dq": timeit(lambda: quantize(x, "mxfp4").dequantize(), max(1, repeats // 2), 1)}
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

        def tao_q():
            return to_mx(x, torch.float4_e2m1fn_x2, 32)

        def tao_qdq():
            s, d = to_mx(x, torch.float4_e2m1fn_x2, 32)
            return to_dtype(d, s, torch.float4_e2m1fn_x2, 32, torch.float32)

        res["torchao_to_mx"] = timeit(tao_q, repeats)
        res["torchao_to_mx+to_dtype"] = timeit(tao_qdq, repeats)
    except ImportError as e:
        print(f"torchao not available ({e}); skipping its baseline")
    return res


def bench_controls(size: int, repeats: int, device: str) -> dict[str, tuple[float, float]]:
    """``{control: (its fused q+dq seconds, plain nearest's under the same rotation)}``, minima over
    interleaved rounds (a busy machine slows both alike)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=g).to(device)
    calls = {}
    for name, op, plain, rot in CONTROLS:
        n = rotation_size(rot)
        signs = random_signs(n, g).to(device) if rot.startswith("rht") else None
        key = SRKey(1)
        for tag, fmt in (("control", op), ("nearest", plain)):
            calls[(name, tag)] = (lambda f=fmt, r=rot, s=signs, k=key:
                                  fake_quantize(x, f, axis=1, rotation=r, signs=s, sr=k))
    for fn in calls.values():  # warm-up: compiles each kernel
        fn()
        fn()
    best = {k: float("inf") for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            best[k] = min(best[k], timeit(fn, 1, warmup=0))
    return {name: (best[(name, "control")], best[(name, "nearest")]) for name, *_ in CONTROLS}


def bench_linear(tokens: int, din: int, dout: int, names: list[str], repeats: int, device: str) -> dict[str, float]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, din, device=device, generator=g, requires_grad=True)
    w = torch.randn(dout, din, device=device, generator=g, requires_grad=True)
    dy = torch.randn(tokens, dout, device=device, generator=g)
    def make_step(p, st):
        def step():
            y = policy_linear(x, w, p, state=st)
            y.backward(dy)
            x.grad = w.grad = None
        return step

    steps = {name: make_step(presets.get(name), LayerQuantState(0, "bench")) for name in names}
    for step in steps.values():  # warm-up (compiles the fused quantizers)
        step()
        step()
    res = {name: float("inf") for name in names}
    for _ in range(repeats):  # interleaved rounds
        for name, step in steps.items():
            res[name] = min(res[name], timeit(step, 1, warmup=0))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="quantizer tensor is SIZE x SIZE (default 4096)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--in-features", type=int, default=1024)
    ap.add_argument("--out-features", type=int, default=1024)
    ap.add_argument("--presets", default="bf16,wgrad_hadamard,mxfp4,fp8,nvfp4",
                    help="comma-separated presets for the linear benchmark (bf16 is the baseline)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--controls-size", type=int, default=2048,
                    help="the FP4 error controls' tensor is N x N (default 2048)")
    ap.add_argument("--only", choices=("all", "mxfp4", "controls", "linear"), default="all",
                    help="run one part only (default all)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    for n in names:
        presets.get(n)  # unknown names fail before any timing
    if "bf16" not in names:
        names.insert(0, "bf16")

    print(f"device {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"torch.compile {'available' if compile_available() else 'unavailable (eager fallback)'}")
    q = lin = ctl = {}
    if args.only in ("all", "mxfp4"):
        q = bench_quantizers(args.size, args.repeats, args.device)
        print(f"\nMXFP4 quantize (+dequantize) of {args.size}x{args.size} float32")
        base = q.get("torchao_to_mx")
        print(f"{'implementation':<26}{'ms':>10}{'torchao to_mx / this':>24}")
        for k, v in q.items():
            ratio = f"{base / v:>23.2f}x" if base else f"{'n/a':>24}"
            print(f"{k:<26}{v * 1e3:>10.1f}{ratio}")

    if args.only in ("all", "controls"):
        ctl = bench_controls(args.controls_size, args.repeats, args.device)
        label = "emulated, CPU" if args.device == "cpu" else f"emulated operand, {args.device}"
        print(f"\nFP4 error controls, fused quantize + dequantize of {args.controls_size}x{args.controls_size} "
              f"float32 ({label}; "
              f"{'compiled' if compile_available() else 'eager: torch.compile unavailable'})")
        print(f"{'control':<24}{'ms':>10}{'nearest ms':>12}{'x nearest':>11}")
        for k, (c, n) in ctl.items():
            print(f"{k:<24}{c * 1e3:>10.1f}{n * 1e3:>12.1f}{c / n:>11.2f}")

    if args.only in ("all", "linear"):
        lin = bench_linear(args.tokens, args.in_features, args.out_features, names, args.repeats, args.device)
        print(f"\npolicy_linear forward+backward, {args.tokens} tokens x {args.in_features} -> {args.out_features}")
        print(f"{'preset':<22}{'ms':>10}{'x bf16':>10}")
        for k, v in lin.items():
            print(f"{k:<22}{v * 1e3:>10.1f}{v / lin['bf16']:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "quantize_s": q, "linear_s": lin,
                                               "controls_s": ctl, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

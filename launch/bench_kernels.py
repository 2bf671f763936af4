#!/usr/bin/env python
"""Quantizer and linear-layer benchmarks; every ratio is against a baseline measured in this run.

    python launch/bench_kernels.py                                   # CPU: small default sizes
    python launch/bench_kernels.py --tokens 8192 --hidden 4096 --ffn 4096,14336   # GPU sizes
    python launch/bench_kernels.py --json results/bench_kernels.json

1. Copy bandwidth: ``y.copy_(x)`` of the quantizer input (float32, SIZE x SIZE), read + write bytes.
2. Quantizers, each format x layout (blocks along the last axis = ``rowwise``, along the first =
   ``colwise``, as Wgrad's token axis) x rotation (none, had16): time, GB/s (bytes read + written)
   and the fraction of the copy bandwidth. Implementations: ``fused`` (``kernels.fused``,
   torch.compile; quantize->dequantize), ``reference`` (``precision.quantize``: codes + scales,
   eager), and on CUDA ``triton`` (``kernels.triton_quant``: codes + scales), ``triton_qdq``
   (dequantized values only, what FP32 emulation consumes), ``triton_bf16`` (the BF16 operand the
   ``bf16_mm`` backend multiplies) and ``cast_transpose_bf16`` (both layouts' BF16 operands from one
   read, as Dgrad's and Wgrad's ``dy``; listed under ``colwise``).
3. ``policy_linear`` forward + backward per preset at TOKENS x HIDDEN -> FFN, relative to the
   ``bf16`` preset through the same code (and, for context, ``torch.nn.functional.linear``); on
   CUDA also with the ``auto`` GEMM backend (FP8 / MX tensor cores where the device has them).
4. torchao's float8 and MXFP8 training paths on the same linear, where torchao can run them.
5. Host work per GEMM on the hardware path (Triton quantizer, operands in the GEMM's form): ATen
   ops dispatched, how many of them launch a device kernel, Triton launches and host-to-device
   copies (tensors made from host data) -- counted, not timed, so the same on any machine; and the
   total for one linear layer over one optimizer step of 2 micro-batches (weight quantized once per
   step, ``dy`` shared by Dgrad and Wgrad); runs wherever Triton does (CUDA, or ``TRITON_INTERPRET=1``
   on CPU: ``TRITON_INTERPRET=1 python launch/bench_kernels.py --skip-quantizers --skip-linear``).

``--json`` is rewritten after each table (and each ``--ffn`` size), so a run cut short keeps its
results. Times are the best of ``--repeats`` runs after warm-up (compilation happens in warm-up): on a shared
machine the minimum is the least noisy estimate. The copy bandwidth is measured before and after the
quantizer table and the better of the two is the reference.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401

from kernels import BACKENDS
from kernels.fused import compile_available, fake_quantize
from kernels.quantizer import TRITON_FORMATS
from model.linear import policy_linear
from precision import LayerQuantState, presets, quantize
from precision.quantize import FORMATS
from precision.rotation import rotate

FORMAT_CHOICES = TRITON_FORMATS  # the registry's formats with fused quantizers
DEFAULT_PRESETS = ("bf16", "fp8", "mxfp4_fprop", "mxfp4", "mxfp4_sr", "wgrad_hadamard", "nvfp4")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(fn, device: str, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


# ============================================================================ 1-2: quantizers
def bench_copy(x: torch.Tensor, repeats: int) -> dict:
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), str(x.device), repeats, warmup=2)
    nbytes = 2 * x.numel() * x.element_size()
    return {"seconds": t, "gbps": nbytes / t / 1e9}


def _out_bytes(fmt: str, numel: int, codes: bool, dq: bool) -> int:
    spec = FORMATS[fmt]
    b = 0
    if codes:
        b += numel + (numel // spec.block if spec.scaling == "block" else 4)
    if dq:
        b += 4 * numel
    return b


def quantizer_cases(x: torch.Tensor, fmt: str, axis: int, rotation: str, triton_ok: bool):
    """(impl, callable, bytes written) for one format x layout x rotation."""
    cases = [("fused", lambda: fake_quantize(x, fmt, axis=axis, rotation=rotation),
              _out_bytes(fmt, x.numel(), False, True))]

    def ref():
        t = rotate(x, axis % x.dim(), 16) if rotation != "none" else x
        return quantize(t, fmt, axis=axis)

    cases.append(("reference", ref, _out_bytes(fmt, x.numel(), True, False)))
    if triton_ok:
        from kernels.triton_quant import quantize_triton

        cases.append(("triton", lambda: quantize_triton(x, fmt, axis=axis, rotation=rotation),
                      _out_bytes(fmt, x.numel(), True, False)))
        cases.append(("triton_qdq", lambda: quantize_triton(x, fmt, axis=axis, rotation=rotation, codes=False,
                                                            dequantize=True),
                      _out_bytes(fmt, x.numel(), False, True)))
        spec = FORMATS[fmt]
        if spec.bf16_exact and not spec.bf16_shift:  # the BF16 operand bf16_mm multiplies, one pass
            cases.append(("triton_bf16", lambda: quantize_triton(x, fmt, axis=axis, rotation=rotation, codes=False,
                                                                 bf16_form=True, layout="contraction_last"),
                          x.numel() * 2 + (x.numel() // spec.block if spec.blocked else 0)))
            if rotation == "none" and axis == 0:  # both layouts from one read (Dgrad's and Wgrad's dy)
                from kernels.triton_quant import cast_transpose_triton

                cases.append(("cast_transpose_bf16", lambda: cast_transpose_triton(x, fmt, fmt, codes=False,
                                                                                   bf16_form=True),
                              2 * (x.numel() * 2 + (x.numel() // spec.block if spec.blocked else 0))))
    return cases


def bench_quantizers(args, device: str, copy_gbps: float, triton_ok: bool) -> list[dict]:
    x = torch.randn(args.size, args.size, device=device)
    rows = []
    for fmt in args.formats:
        for layout, axis in (("rowwise", -1), ("colwise", 0)):
            for rotation in ("none", "had16"):
                for impl, fn, out_b in quantizer_cases(x, fmt, axis, rotation, triton_ok):
                    if impl not in args.impls:
                        continue
                    reps = args.repeats if impl != "reference" else max(1, args.repeats // 2)
                    t = timeit(fn, device, reps)
                    gbps = (x.numel() * 4 + out_b) / t / 1e9
                    rows.append({"format": fmt, "layout": layout, "rotation": rotation,
                                 "impl": impl,
                                 "ms": t * 1e3, "gbps": gbps, "frac_copy": gbps / copy_gbps})
    return rows


# ============================================================================ 3-4: linear layers
def _linear_step(x, w, dy, fn):
    def step():
        xr = x.detach().requires_grad_(True)
        wr = w.detach().requires_grad_(True)
        fn(xr, wr).backward(dy)
    return step


def bench_linear(args, device: str, ffn: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    x = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(dtype)
    w = (torch.randn(ffn, args.hidden, device=device, generator=g) / args.hidden**0.5).to(dtype)
    dy = torch.randn(args.tokens, ffn, device=device, generator=g).to(dtype)
    backends = args.linear_backends
    rows = []
    t_torch = timeit(_linear_step(x, w, dy, torch.nn.functional.linear), device, args.repeats)
    rows.append({"ffn": ffn, "preset": "torch F.linear", "backend": "-", "ms": t_torch * 1e3})
    for backend in backends:
        base = None
        for name in ["bf16"] + [p for p in args.presets if p != "bf16"]:
            prec = presets.get(name)
            state = LayerQuantState(0, "bench")

            def fn(xr, wr, prec=prec, state=state, backend=backend):
                return policy_linear(xr, wr, prec, state=state, backend=backend)

            t = timeit(_linear_step(x, w, dy, fn), device, args.repeats)
            base = base or t
            rows.append({"ffn": ffn, "preset": name, "backend": backend, "ms": t * 1e3, "vs_bf16": t / base,
                         "vs_torch": t / t_torch})
    rows.extend(bench_torchao(args, device, x, w, dy, ffn, t_torch))
    return rows


def bench_torchao(args, device, x, w, dy, ffn, t_torch) -> list[dict]:
    """torchao's float8 (tensorwise) and MXFP8 training paths on an nn.Linear of the same shape."""
    out = []
    for label in ("torchao float8 tensorwise", "torchao mxfp8 (rceil)"):
        row = {"ffn": ffn, "preset": label, "backend": "torchao"}
        if not device.startswith("cuda"):
            row["na"] = "n/a (needs CUDA)"
            out.append(row)
            continue
        try:
            lin = torch.nn.Linear(args.hidden, ffn, bias=False, device=device, dtype=x.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
            model = torch.nn.Sequential(lin)
            if "float8" in label:
                from torchao.float8 import convert_to_float8_training

                convert_to_float8_training(model)
            else:
                from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
                from torchao.quantization import quantize_

                quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL))

            def step(model=model):
                xr = x.detach().requires_grad_(True)
                model(xr).backward(dy)

            t = timeit(step, device, args.repeats)
            row.update(ms=t * 1e3, vs_torch=t / t_torch)
        except Exception as e:  # noqa: BLE001 - torchao paths are optional and hardware-specific
            row["na"] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
        out.append(row)
    return out


# ============================================================================ 5: host work per operand
# ATen ops that only describe or allocate memory (no device kernel on a GPU); every other op is a
# device kernel launch of its own (fill, arithmetic, reductions, copies).
_NO_KERNEL = {"view", "_unsafe_view", "as_strided", "select", "slice", "permute", "t", "transpose", "expand",
              "unsqueeze", "squeeze", "alias", "detach", "lift_fresh", "reshape", "movedim", "empty",
              "empty_strided", "empty_like", "unflatten", "flatten", "_reshape_alias", "view_as", "unbind",
              "split", "chunk", "narrow"}


def host_work(fn) -> dict:
    """What ``fn()`` asks of the host, counted (not timed): ATen ops dispatched (``aten``), those of
    them that launch a device kernel (``kernels``: not a view or an allocation), Triton kernel
    launches (``triton``) and tensors made from host data (``host_data``: ``torch.tensor(...)`` of
    Python values, or a copy from the CPU to a device -- each a synchronous host-to-device copy on a
    GPU), with the ops by name. ATen ops inside a Triton launch (Triton's CPU
    interpreter copies tensors) are not counted: on a GPU a launch dispatches none. The counts are
    the same on any machine: the host code path does not depend on the device's speed."""
    from collections import Counter
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    import kernels.triton_quant as tq

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.paused, self.launches, self.host_data = Counter(), 0, Counter(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused:
                name = func.overloadpacket.__name__
                self.ops[name] += 1
                if name == "lift_fresh" or (name in ("_to_copy", "copy_") and _from_host(func, args, kwargs)):
                    self.host_data += 1
            return func(*args, **(kwargs or {}))

    counter = Count()
    real = tq._launch

    def launch(kernel, grid, args, meta):
        counter.launches[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
        counter.paused += 1
        try:
            real(kernel, grid, args, meta)
        finally:
            counter.paused -= 1

    with mock.patch.object(tq, "_launch", launch), counter:
        fn()
    kernels = sum(n for op, n in counter.ops.items() if op not in _NO_KERNEL)
    return {"aten": sum(counter.ops.values()), "kernels": kernels, "triton": sum(counter.launches.values()),
            "host_data": counter.host_data, "ops": dict(counter.ops.most_common()), "launches": dict(counter.launches)}


def _from_host(func, args, kwargs) -> bool:
    """Whether a copy op moves data from the CPU to another device (a host-to-device copy)."""
    kwargs = kwargs or {}
    if func.overloadpacket.__name__ == "copy_":
        dst, src = args[0], args[1]
        return src.device.type == "cpu" and dst.device.type != "cpu"
    dev = kwargs.get("device")
    return args[0].device.type == "cpu" and dev is not None and torch.device(dev).type != "cpu"


def host_work_cases(device: str) -> list[dict]:
    """Per GEMM of one linear layer on the hardware path (Triton quantizer, operands in the form the
    GEMM takes, the GEMM itself excluded): ``fp8`` on ``fp8_scaled_mm`` (per-tensor E4M3 / E5M2,
    current scaling, and delayed scaling from a recorded amax), MXFP4 and ``wgrad_hadamard``'s rotated
    Wgrad on ``bf16_mm`` (what an H200 runs)."""
    from kernels.operand import gemm_operands
    from kernels.scaled_mm import hw_operand
    from precision.recipe import Gemm, parse_gemm

    g = torch.Generator().manual_seed(0)
    t, h, f = 64, 64, 32  # host work does not depend on the shape
    x, w, dy = (torch.randn(*s, generator=g).to(device) for s in ((t, h), (f, h), (t, f)))
    operands = {Gemm.FPROP: (x, w), Gemm.DGRAD: (dy, w), Gemm.WGRAD: (dy, x)}
    rows = []

    def scaled_mm_form(g_, spec, state):
        ops = gemm_operands(g_, *operands[g_], parse_gemm(spec, g_), state, impl="triton", codes=True)
        for q in (ops.a, ops.b):
            hw = hw_operand(q, "blocked")
            _ = hw.data, hw.scale  # what torch._scaled_mm is handed

    def bf16_form(g_, spec, state):
        gemm_operands(g_, *operands[g_], parse_gemm(spec, g_), state, impl="triton", bf16=True)

    fp8 = {Gemm.FPROP: "fp8_e4m3", Gemm.DGRAD: "fp8_e5m2@fp8_e4m3", Gemm.WGRAD: "fp8_e5m2@fp8_e4m3"}
    cases = [(f"fp8 {gm.value}", "fp8_scaled_mm", lambda gm=gm: scaled_mm_form(gm, fp8[gm], LayerQuantState(0, "l")))
             for gm in Gemm]
    delayed = LayerQuantState(0, "l")
    scaled_mm_form(Gemm.FPROP, "fp8_e4m3/delayed(most_recent)", delayed)  # one step: the history has an amax
    delayed.end_step()
    cases.append(("fp8 fprop, delayed scaling", "fp8_scaled_mm",  # both operands (the kept weight dropped)
                  lambda: (delayed.step_cache.clear(), scaled_mm_form(Gemm.FPROP, "fp8_e4m3/delayed(most_recent)",
                                                                      delayed))))
    rht_state, sr_state = LayerQuantState(0, "l"), LayerQuantState(0, "l")
    cases += [("mxfp4 fprop", "bf16_mm", lambda: bf16_form(Gemm.FPROP, "mxfp4", LayerQuantState(0, "l"))),
              ("wgrad_hadamard wgrad (had16)", "bf16_mm",
               lambda: bf16_form(Gemm.WGRAD, "mxfp4+had16", LayerQuantState(0, "l"))),
              ("mxfp4_rht wgrad (rht16: the layer's signs)", "bf16_mm",
               lambda: bf16_form(Gemm.WGRAD, "mxfp4+rht16", rht_state)),
              ("mxfp4_sr dgrad (stochastic rounding)", "bf16_mm",
               lambda: bf16_form(Gemm.DGRAD, "mxfp4/sr", sr_state))]
    for label, backend, fn in cases:
        fn()  # first calls fill caches (rotation constants, compiled kernels): count the steady state
        r = host_work(fn)
        rows.append({"case": label, "backend": backend, "operands": 2, **r})

    # ---- one linear layer, one optimizer step of MICRO micro-batches (Fprop, Dgrad, Wgrad each; the
    #      weight quantized once per step; dy shared by Dgrad and Wgrad where the layer shares it)
    from kernels.cast_transpose import SharedDy
    from precision import presets

    micro = 2

    def linear_step(preset, state, form):
        p = presets.get(preset)
        for _ in range(micro):
            form(Gemm.FPROP, p.fprop, state, None)
            shared = None
            if p.dgrad.rotation == p.wgrad.rotation == "none" and p.dgrad.a.format.blocked == p.wgrad.a.format.blocked:
                shared = SharedDy(dy, state, p.dgrad.a, p.wgrad.a, form is bf16_recipe_form)
            form(Gemm.DGRAD, p.dgrad, state, shared)
            form(Gemm.WGRAD, p.wgrad, state, shared)
        state.end_step()

    def scaled_mm_recipe_form(g_, recipe, state, shared):
        ops = gemm_operands(g_, *operands[g_], recipe, state, impl="triton", codes=True, shared_dy=shared)
        for q in (ops.a, ops.b):
            hw = hw_operand(q, "blocked")
            _ = hw.data, hw.scale

    def bf16_recipe_form(g_, recipe, state, shared):
        gemm_operands(g_, *operands[g_], recipe, state, impl="triton", bf16=True, shared_dy=shared)

    for preset, backend, form in (("fp8", "fp8_scaled_mm", scaled_mm_recipe_form),
                                  ("mxfp4", "bf16_mm", bf16_recipe_form),
                                  ("wgrad_hadamard", "bf16_mm", bf16_recipe_form)):
        state = LayerQuantState(0, "l")
        linear_step(preset, state, form)  # the first step fills caches
        r = host_work(lambda: linear_step(preset, state, form))
        rows.append({"case": f"{preset} linear, one step of {micro} micro-batches (total)", "backend": backend,
                     "operands": 6 * micro, **r})
    return rows


# ============================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=None, help="quantizer input is SIZE x SIZE float32 "
                   "(default 4096 on CUDA, 1024 on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="linear: tokens (default 8192 CUDA / 1024 CPU)")
    p.add_argument("--hidden", type=int, default=None, help="linear: in-features (default 4096 / 1024)")
    p.add_argument("--ffn", default=None,
                   help="linear: comma-separated out-features (default 4096,14336 / 1024)")
    p.add_argument("--formats", default=",".join(FORMAT_CHOICES), help="quantizer formats, comma-separated")
    p.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="linear presets, comma-separated")
    p.add_argument("--impls", default="fused,reference,triton,triton_qdq,triton_bf16,cast_transpose_bf16",
                   help="quantizer implementations, comma-separated (triton ones only run on CUDA)")
    p.add_argument("--linear-backends", default=None,
                   help="GEMM backends for the linear benchmark (default: emulated; on CUDA emulated,auto -- "
                   "auto runs FP8 on FP8 tensor cores and the other formats on bf16_mm where the device has them)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-quantizers", action="store_true")
    p.add_argument("--skip-linear", action="store_true")
    p.add_argument("--skip-host-work", action="store_true")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    a.size = a.size or (4096 if cuda else 1024)
    a.tokens = a.tokens or (8192 if cuda else 1024)
    a.hidden = a.hidden or (4096 if cuda else 1024)
    a.ffn = [int(v) for v in (a.ffn or ("4096,14336" if cuda else "1024")).split(",")]
    a.formats = [f for f in a.formats.split(",") if f]
    a.presets = [q for q in a.presets.split(",") if q]
    a.impls = [i for i in a.impls.split(",") if i]
    a.linear_backends = (a.linear_backends or ("emulated,auto" if cuda else "emulated")).split(",")
    for b in a.linear_backends:
        if b not in BACKENDS:
            p.error(f"--linear-backends: unknown {b!r}; valid: {', '.join(BACKENDS)}")
    for f in a.formats:
        if f not in FORMAT_CHOICES:
            p.error(f"--formats: unknown {f!r}; valid: {', '.join(FORMAT_CHOICES)}")
    for q in a.presets:
        if q not in presets.names():
            p.error(f"--presets: unknown {q!r}; valid: {', '.join(presets.names())}")
    return a


def _print_table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    print(f"\n== {title}")
    cells = [[(fmt.format(r[k]) if k in r else r.get("na", "-") if k == cols[-1][0] else "-")
              for k, _, fmt in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    print("  ".join(h.ljust(widths[i]) for i, (_, h, _) in enumerate(cols)))
    if not cells:
        print("(no rows: none of the asked implementations runs on this device)")
    for c in cells:
        print("  ".join(v.ljust(widths[i]) for i, v in enumerate(c)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device
    from kernels.quantizer import triton_missing_reason

    probe = torch.empty(1, device=device)
    triton_why = triton_missing_reason(probe, "mxfp4") if device.startswith("cuda") else "CPU run"
    triton_ok = triton_why is None
    env = {"device": device, "torch": torch.__version__, "compile_available": compile_available(),
           "triton": "used" if triton_ok else f"not used ({triton_why})",
           "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    results: dict = {"env": env, "args": {k: v for k, v in vars(args).items() if k != "json"}}

    def save():  # after every table (and every linear size): a run cut by a timeout keeps what it measured
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=2))

    if not args.skip_host_work:  # first: small, and what a run cut by its budget should still have
        why = triton_missing_reason(probe, "fp8_e4m3")
        if why is None:
            results["host_work"] = [{k: v for k, v in r.items() if k != "ops"} for r in host_work_cases(device)]
            save()
            _print_table("host work per GEMM on the hardware path (2 operands; counted, not timed)",
                         results["host_work"],
                         [("case", "GEMM", "{}"), ("backend", "backend", "{}"), ("aten", "ATen ops", "{}"),
                          ("kernels", "of them device kernels", "{}"), ("triton", "Triton launches", "{}"),
                          ("host_data", "host-to-device copies", "{}")])
        else:
            print(f"\n== host work per GEMM: not measured ({why})")
    if not args.skip_quantizers:
        x = torch.randn(args.size, args.size, device=device)
        copy = bench_copy(x, args.repeats * 3)
        results["copy"] = copy
        print(f"\ncopy bandwidth (y.copy_(x), {args.size}x{args.size} fp32): {copy['gbps']:.2f} GB/s")
        q = bench_quantizers(args, device, copy["gbps"], triton_ok)
        copy_after = bench_copy(x, args.repeats * 3)
        if copy_after["gbps"] > copy["gbps"]:  # the machine was busier at the start: rescale
            for row in q:
                row["frac_copy"] = row["gbps"] / copy_after["gbps"]
            copy = results["copy"] = copy_after
        print(f"copy bandwidth used as the reference: {copy['gbps']:.2f} GB/s")
        results["quantizers"] = q
        save()
        _print_table(f"quantizers, {args.size}x{args.size} float32 input (GB/s = bytes read + written)", q,
                     [("format", "format", "{}"), ("layout", "layout", "{}"), ("rotation", "rotation", "{}"),
                      ("impl", "impl", "{}"), ("ms", "ms", "{:.2f}"), ("gbps", "GB/s", "{:.2f}"),
                      ("frac_copy", "of copy", "{:.1%}")])
    if not args.skip_linear:
        lin = []
        results["linear"] = lin
        for ffn in args.ffn:
            lin.extend(bench_linear(args, device, ffn))
            save()
        _print_table(f"linear fwd+bwd, tokens={args.tokens} hidden={args.hidden} (ratios vs the bf16 preset, "
                     "same backend, this run)", lin,
                     [("ffn", "ffn", "{}"), ("preset", "preset", "{}"), ("backend", "backend", "{}"),
                      ("ms", "ms", "{:.1f}"), ("vs_torch", "vs F.linear", "{:.2f}x"),
                      ("vs_bf16", "vs bf16 preset", "{:.2f}x")])
    if args.json:
        save()
        print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    main()

"""``kernels.probe``: which hardware path each format's GEMMs take on this device, found at start-up.

A tensor-core GEMM that torch cannot run here must be found before the first step, not as a
traceback mid-step, and a run that asked for hardware GEMMs and gets emulation must say so. So at
start-up, for every operand-format pair the plan sends to a tensor-core backend (per-tensor FP8 on
sm_89+, MX / NVFP4 on Blackwell and gfx950), :func:`probe_formats` runs one small GEMM through
each entry point the installed torch has (``kernels.scaled_mm.entry_points``: ``torch._scaled_mm``,
``F.scaled_mm``), in order, and checks it against the emulated specification:

* the first entry point that runs and matches serves the pair from then on
  (``kernels.backends.record_probe(entry=...)``);
* if every one is refused (or off the spec), the pair is recorded as refused with torch's reasons,
  and ``auto`` sends its GEMMs to ``bf16_mm`` (the same operands on BF16 tensor cores).

A 2-D-tiled weight (``/2d``) is probed through Fprop and then Dgrad on one layer state, so Dgrad's
``wᵀ`` is the hardware re-layout of Fprop's quantization, as in training.

:func:`startup_report` is what a run prints: the probe's lines, the per-layer table
(``kernels.backends.describe_backends``), the path of each format pair per GEMM with its entry
point, and -- where hardware GEMMs were asked for (``auto`` or a hardware backend on a GPU) and some
GEMM whose formats have a tensor-core GEMM runs emulated -- one line beginning ``WARNING``.
:func:`gemm_paths` is the same as data, for the run record kept in checkpoints.

This module sits above ``kernels.backends`` (which holds the table the probe writes) and
``kernels.scaled_mm`` (the GEMM calls); neither imports it.
"""

from __future__ import annotations

import torch

from kernels.backends import (
    REFUSED_FORMATS,
    _recipe_backend,
    capability_name,
    describe_backends,
    device_backends,
    device_capability,
    probed_entry,
    record_probe,
    select_backend,
)
from kernels.gemm import BACKENDS
from kernels.scaled_mm import REFUSALS, entry_points, hw_gemm
from precision.recipe import Gemm, GemmRecipe, LinearPrecision, parse_gemm
from precision.state import LayerQuantState

__all__ = ["PROBE_FORMATS", "PROBE_REL_TOL", "gemm_paths", "last_paths", "plan_probe_specs", "probe_formats",
           "startup_report"]

# What the device check probes without a plan: every pair a preset sends to a tensor-core GEMM.
PROBE_FORMATS = ("fp8_e4m3", "fp8_e5m2@fp8_e4m3", "mxfp8_e4m3", "mxfp4", "nvfp4", "nvfp4@nvfp4/2d")
PROBE_REL_TOL = 2.0 ** -7  # a BF16 output rounding (2^-8 relative) plus accumulation order, with room
_TENSOR_CORE = ("fp8_scaled_mm", "mx_scaled_mm")


def _pair(recipe: GemmRecipe) -> str:
    a, b = recipe.a.fmt, recipe.b.fmt
    return a if a == b else f"{a} x {b}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def probe_formats(device, *, capability="device", mm=None, entries=None, formats=PROBE_FORMATS) -> list[str]:
    """One small GEMM per spec in ``formats`` (``a@b`` or one format for both, ``/2d`` on the weight
    for a 2-D-tiled one) through each entry point in turn; records the outcome per format pair in
    ``kernels.backends`` and returns the report lines, one per spec.

    ``capability`` / ``mm`` / ``entries`` let tests simulate a device: ``mm(a, b)`` replaces every
    entry point's call, ``entries`` maps entry-point names to such calls (its keys, in
    ``entry_points`` order, are the entry points this torch is taken to have)."""
    dev = torch.device(device)
    cap = device_capability(dev) if capability == "device" else capability
    lines = [f"one-GEMM probe per format on {capability_name(cap)}:"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, 128, generator=gen).to(dev)
    w = torch.randn(96, 128, generator=gen).to(dev)
    dy = torch.randn(64, 96, generator=gen).to(dev)
    outcome: dict[tuple[str, str], str | None] = {}  # pair -> entry point (None: refused)
    for spec in formats:
        recipe = parse_gemm(spec, Gemm.FPROP)
        gemms = [(Gemm.FPROP, x, recipe)]
        if recipe.b.block2d:
            gemms.append((Gemm.DGRAD, dy, parse_gemm(spec, Gemm.DGRAD)))
        hw, why = _recipe_backend(recipe, cap)
        if hw is None or hw not in device_backends(cap):
            lines.append(f"  {spec}: {select_backend(recipe, cap)} ({why if hw is None else 'no ' + hw + ' here'})")
            continue
        names = entry_points(recipe.a.fmt)
        if entries is not None:
            names = tuple(n for n in names if n in entries) or tuple(entries)
        refused, served, err = [], None, None
        for name in names:
            call = mm if mm is not None else (entries or {}).get(name)
            try:
                err = _check(gemms, w, hw, cap, call, name)
            except REFUSALS as e:
                refused.append(f"{name}: {_first_line(e)}")
                continue
            served = name
            break
        key = (recipe.a.fmt, recipe.b.fmt)
        if served is None:
            outcome[key] = None
            reason = "; ".join(refused) if refused else "this torch has no scaled-GEMM entry point"
            record_probe(cap, key, refusal=reason)
            lines.append(f"  {spec}: {hw} refused ({reason}) -> {select_backend(recipe, cap)}")
            continue
        if outcome.get(key, served) is not None:  # a refusal of the pair by another spec stands
            outcome[key] = served
            record_probe(cap, key, entry=served)
        tried = f"; {', '.join(refused)}" if refused else ""
        what = f"{hw} via {served}"
        if len(gemms) == 1:
            lines.append(f"  {spec}: {what} (relative error vs the emulated spec {err:.1e}{tried})")
        else:
            lines.append(f"  {spec}: {what}, Fprop and Dgrad from one quantization of w (relative error vs the "
                         f"emulated spec {err:.1e}{tried})")
    return lines


def _check(gemms, w, hw, cap, call, entry) -> float:
    """Run the probe GEMMs through one entry point on fresh states; the worst relative error, or a
    ValueError (a refusal) when a result is off the emulated spec."""
    hw_state, ref_state, worst = LayerQuantState(), LayerQuantState(), 0.0
    for g, a, r in gemms:
        out = hw_gemm(g, a, w, r, hw_state, backend=hw, capability=cap, mm=call, entry=entry)
        ref = BACKENDS["reference"](g, a, w, r, ref_state)
        err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not err <= PROBE_REL_TOL:
            raise ValueError(f"result off the emulated spec in {g.value}: relative error {err:.2e} > "
                             f"{PROBE_REL_TOL:.2e}")
        worst = max(worst, err)
    return worst


def plan_probe_specs(plan, cap) -> tuple[str, ...]:
    """The probe specs of every format pair ``plan`` (``{layer: LinearPrecision}`` or one) would
    send to a tensor-core backend on ``cap``, each once (a 2-D-tiled weight as such)."""
    layers = [plan] if isinstance(plan, LinearPrecision) else list(dict(plan).values())
    specs = []
    for prec in layers:
        for g in Gemm:
            r = prec.recipe(g)
            hw, _ = _recipe_backend(r, cap)
            if hw is None or hw not in device_backends(cap):
                continue
            spec = f"{r.a.fmt}@{r.b.fmt}" + ("/2d" if r.b.block2d and g is not Gemm.WGRAD else "")
            if spec not in specs:
                specs.append(spec)
    return tuple(specs)


_PROBED: dict = {}  # (device, specs) -> report lines: the probe runs once per device and plan
_LAST: dict = {}


def _is_real_device(device) -> bool:
    if device is None or isinstance(device, tuple):
        return False
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):  # an arch string such as "gfx950": a simulated capability
        return False


def gemm_paths(plan, device, requested: str = "auto") -> dict:
    """Which path every format pair takes in each GEMM (``{"fprop": {"mxfp4": "bf16_mm", ...}}``),
    with the entry point where a tensor-core backend runs it, what the probe refused, and the
    emulation warning (empty when none): the run record's ``gemm_paths``."""
    cap = device_capability(device)
    layers = {"(all layers)": plan} if isinstance(plan, LinearPrecision) else dict(plan)
    paths: dict[str, dict[str, str]] = {g.value: {} for g in Gemm}
    emulated: dict[str, tuple[set, str]] = {}
    n_emulated = n_hw_formats = 0
    for name, prec in layers.items():
        chosen = select_backend(prec, cap, requested, layer=name)
        for g in Gemm:
            r, backend = prec.recipe(g), chosen[g]
            entry = None
            if backend in _TENSOR_CORE:
                entry = probed_entry(cap, (r.a.fmt, r.b.fmt)) or (entry_points(r.a.fmt) or ("none",))[0]
            paths[g.value][_pair(r)] = backend + (f" via {entry}" if entry else "")
            hw, why = _recipe_backend(r, cap)
            if hw is None:
                continue
            n_hw_formats += 1
            if backend not in _TENSOR_CORE:
                n_emulated += 1
                refusal = REFUSED_FORMATS.get(cap, {}).get((r.a.fmt, r.b.fmt))
                if hw not in device_backends(cap):
                    why = f"no {hw} on {capability_name(cap)}"
                elif refusal is not None:
                    why = f"torch refused it at the start-up probe ({refusal})"
                else:
                    why = f"--gemm-backend {requested}"
                gemms, _ = emulated.setdefault(_pair(r), (set(), why))
                gemms.add(g.value)
    asked = requested in ("auto", *_TENSOR_CORE) and cap is not None  # a GPU, real or simulated
    warning = ""
    if asked and n_emulated:
        parts = [f"{pair} ({', '.join(g.value for g in Gemm if g.value in gemms)}): {why}"
                 for pair, (gemms, why) in emulated.items()]
        warning = (f"WARNING: hardware GEMMs asked for (--gemm-backend {requested} on {capability_name(cap)}) but "
                   f"{n_emulated} of {n_hw_formats} GEMMs with tensor-core formats run emulated -- "
                   + "; ".join(parts))
    return {"device": capability_name(cap), "requested": requested, "paths": paths,
            "refused": {" x ".join(k): v for k, v in REFUSED_FORMATS.get(cap, {}).items()}, "warning": warning}


def last_paths() -> dict:
    """What :func:`startup_report` last found (the run record's ``gemm_paths``; empty before)."""
    return dict(_LAST)


def startup_report(plan, device, requested: str = "auto", *, probe=None) -> str:
    """What a run prints once at start-up: on a CUDA device with tensor-core backends, the probe of
    every format pair the plan sends there (once per device and plan); then the per-layer table,
    the path of each format pair per GEMM (entry points named) and the emulation warning line.
    ``probe``: a substitute for :func:`probe_formats` (tests)."""
    cap = device_capability(device)
    lines = []
    specs = plan_probe_specs(plan, cap)
    if specs and (_is_real_device(device) or probe is not None):
        key = (str(device), specs)
        if key not in _PROBED:
            _PROBED[key] = (probe or probe_formats)(device, formats=specs)
        lines += _PROBED[key]
    lines.append(describe_backends(plan, cap, requested))
    record = gemm_paths(plan, cap, requested)
    lines.append(f"GEMM paths per format on {record['device']}:")
    for g, by_pair in record["paths"].items():
        lines.append(f"  {g}: " + "; ".join(f"{pair} -> {path}" for pair, path in by_pair.items()))
    if record["warning"]:
        lines.append(record["warning"])
    _LAST.clear()
    _LAST.update(record)
    return "\n".join(lines)

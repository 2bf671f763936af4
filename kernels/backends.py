"""Which GEMM backend runs each GEMM: chosen per GEMM from the recipe and the device.

=================  ==============================================  ===============================
backend            runs                                            where
=================  ==============================================  ===============================
``emulated``       any recipe: quantize -> dequantize -> FP32 GEMM  anywhere (the specification)
``reference``      the same with the eager reference quantizers    anywhere
``fp8_scaled_mm``  per-tensor FP8 operands (E4M3/E5M2, not both      CUDA sm_89+ (Ada, Hopper,
                   E5M2) via ``torch._scaled_mm``                   Blackwell); gfx950
``mx_scaled_mm``   MXFP8 / MXFP4 / NVFP4 operands (both the same    CUDA Blackwell: sm_100, sm_103,
                   family) via ``F.scaled_mm`` or                   sm_110, sm_120, sm_121 (blocked
                   ``torch._scaled_mm`` block scaling               scales); gfx950 (MX, row-major)
``bf16_mm``        any recipe whose formats are ``bf16_exact``:     BF16 tensor cores: CUDA sm_80+,
                   quantize -> BF16 operands -> BF16 GEMM, FP32     gfx90a, gfx942, gfx950
                   accumulation and output (``kernels.bf16_mm``)
=================  ==============================================  ===============================

``select_backend(precision, device)`` picks, for each GEMM, the FP8/MX tensor-core backend that
can run its recipe on this device, else ``bf16_mm`` where the device has BF16 tensor cores and both
formats' values are exactly BF16 (``Format.bf16_exact``), else ``emulated`` (so on Hopper FP8 runs
on FP8 tensor cores, MXFP4 and the ``bf16`` preset on BF16 tensor cores, FP32 operands and every
GEMM on a CPU in FP32). ``requested`` names one backend for every GEMM instead; asking for hardware the
device lacks, or for a backend that cannot run a GEMM's formats, raises a one-line error naming the
GEMM, the layer and what the device supports. ``describe_backends(plan, device)`` is the table of
which GEMM of which layer runs on what (``kernels.probe.startup_report`` runs the one-GEMM probe
first and adds the entry point per format and GEMM). The ``auto`` GEMM backend (registered in
``kernels.gemm.BACKENDS``) applies ``select_backend`` per call, so a layer can simply use
``backend="auto"``.

What the start-up probe found (``kernels.probe``) is kept here, per device capability and format:
the entry point that served it (``probed_entry``) or torch's refusal (``REFUSED_FORMATS``), which
sends its GEMMs to ``bf16_mm``. This module reads the table; only the probe writes it
(``record_probe``).

Devices may be given as a ``torch.device``/string, or as a capability to simulate one: a
``(major, minor)`` tuple for CUDA (``(9, 0)`` = sm_90), an AMD arch string (``"gfx950"``), or
``None`` for a CPU.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping

import torch

from precision.elements import E5M2
from precision.formats import Format, Scaling
from precision.policy import compact_names
from precision.recipe import Gemm, GemmRecipe, LinearPrecision

__all__ = [
    "BACKEND_PATHS",
    "GEMM_BACKENDS",
    "HW_BACKENDS",
    "PROBED_ENTRIES",
    "REFUSED_FORMATS",
    "BackendError",
    "bf16_exact_recipe",
    "capability_name",
    "describe_backends",
    "device_backends",
    "device_capability",
    "probed_entry",
    "recipe_backend",
    "record_probe",
    "select_backend",
]

HW_BACKENDS = ("fp8_scaled_mm", "mx_scaled_mm", "bf16_mm")
GEMM_BACKENDS = ("auto", "emulated", "reference", *HW_BACKENDS)
_BF16_TENSOR_CORE_ARCHS = ("gfx90a", "gfx942", "gfx950")  # AMD: MI200, MI300, MI355X
# What each backend is, for the start-up report
BACKEND_PATHS = {
    "emulated": "FP32 GEMM of FP32-dequantized operands (the specification)",
    "reference": "the same with the eager reference quantizers",
    "bf16_mm": "BF16 tensor-core GEMM of exactly-BF16 operands, FP32 accumulation and output",
    "fp8_scaled_mm": "FP8 tensor cores (torch._scaled_mm, per-tensor scales)",
    "mx_scaled_mm": "block-scaled tensor cores (torch._scaled_mm, MX/NVFP4 scales)",
}


class BackendError(RuntimeError):
    """A GEMM backend that cannot run here; the message names the GEMM, layer and alternatives."""


@functools.cache
def _cuda_capability(index: int):
    if torch.version.hip:
        name = torch.cuda.get_device_properties(index).gcnArchName
        return name.split(":")[0]
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device) -> tuple[int, int] | str | None:
    """``(major, minor)`` for CUDA, the gfx arch for ROCm, ``None`` for CPU; capabilities pass through."""
    if device is None or isinstance(device, (tuple, str)) and not _looks_like_device(device):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return _cuda_capability(dev.index if dev.index is not None else torch.cuda.current_device())


def _looks_like_device(d) -> bool:
    return isinstance(d, str) and d.split(":")[0] in ("cpu", "cuda", "meta", "mps", "xpu")


def capability_name(cap) -> str:
    if cap is None:
        return "cpu"
    if isinstance(cap, tuple):
        return f"sm_{cap[0]}{cap[1]}"
    return str(cap)


# CUDA majors with block-scaled (MX / NVFP4) tensor cores: Blackwell sm_100/sm_103 (B200, B300),
# sm_110 (Thor), sm_120/sm_121 (RTX 50, DGX Spark). Whether torch serves each format there is the
# start-up probe's to find out.
BLACKWELL_MAJORS = (10, 11, 12)


def device_backends(cap) -> tuple[str, ...]:
    """The hardware GEMM backends a device capability supports."""
    out = []
    if isinstance(cap, tuple) and cap >= (8, 9) or cap == "gfx950":
        out.append("fp8_scaled_mm")
    if isinstance(cap, tuple) and cap[0] in BLACKWELL_MAJORS or cap == "gfx950":
        out.append("mx_scaled_mm")
    if isinstance(cap, tuple) and cap >= (8, 0) or cap in _BF16_TENSOR_CORE_ARCHS:
        out.append("bf16_mm")
    return tuple(out)


def _fp8_tensor_core(spec: Format) -> bool:
    """A per-tensor format whose element is a torch FP8 dtype (E4M3/E5M2; not HiF8)."""
    return spec.kind == Scaling.TENSOR and spec.element is not None and spec.element.torch_dtype is not None


def _block_family(spec: Format):
    """The block-scaled GEMM family of a format (MXFP8, MXFP4, NVFP4), or None (MXFP6 has none)."""
    if not spec.blocked or spec.code_bits not in (4, 8):
        return None
    return spec.kind, spec.block, spec.code_bits


def _e5m2_pair(sa: Format, sb: Format) -> bool:
    return sa.element is sb.element is E5M2


# What the one-GEMM start-up probe (``kernels.probe.probe_formats``) found per device capability
# and operand-format pair ``(a fmt, b fmt)``: {capability: {pair: torch's refusals}} for pairs every
# entry point refused (their GEMMs go elsewhere: ``auto`` then picks ``bf16_mm``), {capability:
# {pair: entry point}} for the entry point that served one (``kernels.scaled_mm.ENTRY_POINTS``).
REFUSED_FORMATS: dict = {}
PROBED_ENTRIES: dict = {}


def record_probe(cap, pair: tuple[str, str], *, entry: str | None = None, refusal: str | None = None) -> None:
    """The probe's finding for the format pair on ``cap``: the entry point that served it, or why none did."""
    if (entry is None) == (refusal is None):
        raise ValueError("record_probe: give exactly one of entry= and refusal=")
    if entry is not None:
        PROBED_ENTRIES.setdefault(cap, {})[tuple(pair)] = entry
        REFUSED_FORMATS.get(cap, {}).pop(tuple(pair), None)
    else:
        REFUSED_FORMATS.setdefault(cap, {})[tuple(pair)] = refusal
        PROBED_ENTRIES.get(cap, {}).pop(tuple(pair), None)


def probed_entry(cap, pair: tuple[str, str]) -> str | None:
    """The entry point the start-up probe chose for the format pair on ``cap`` (None: not probed)."""
    return PROBED_ENTRIES.get(cap, {}).get(tuple(pair))


def recipe_backend(recipe: GemmRecipe, cap=None) -> tuple[str | None, str]:
    """The FP8/MX tensor-core backend that can run ``recipe``'s formats (or None), and why (one
    phrase); decided from registry properties (``precision.formats``), never format names, and
    from the start-up probe's refusals on this device (``REFUSED_FORMATS``)."""
    hw, why = _recipe_backend(recipe, cap)
    pair = (recipe.a.fmt, recipe.b.fmt)
    refused = REFUSED_FORMATS.get(cap, {})
    if hw is not None and pair in refused:
        name = pair[0] if pair[0] == pair[1] else " x ".join(pair)
        return None, f"torch refused {name} here at the start-up probe: {refused[pair]}"
    return hw, why


def _recipe_backend(recipe: GemmRecipe, cap) -> tuple[str | None, str]:
    fa, fb = recipe.a.fmt, recipe.b.fmt
    sa, sb = recipe.a.format, recipe.b.format
    if _fp8_tensor_core(sa) and _fp8_tensor_core(sb):
        if _e5m2_pair(sa, sb):
            return None, "E5M2 x E5M2 has no FP8 tensor-core GEMM"
        return "fp8_scaled_mm", "per-tensor FP8"
    fam_a, fam_b = _block_family(sa), _block_family(sb)
    if fam_a is not None and fam_b is not None:
        if fam_a != fam_b:
            return None, f"mixed block formats {fa} x {fb}"
        if _e5m2_pair(sa, sb):
            return None, "MXFP8 E5M2 x E5M2 has no tensor-core GEMM"
        if sa.kind == Scaling.TWO_LEVEL and cap == "gfx950":
            return None, "NVFP4 (E4M3 scales, 16-blocks) has no gfx950 GEMM"
        return "mx_scaled_mm", "block-scaled"
    if sa.kind == sb.kind == Scaling.NONE:
        return None, "unscaled operands"
    return None, f"formats {fa} x {fb}"


def bf16_exact_recipe(recipe: GemmRecipe) -> bool:
    """Whether both operands' quantized values are exactly BF16 (``Format.bf16_exact``)."""
    return recipe.a.format.bf16_exact and recipe.b.format.bf16_exact


def _select_one(g: Gemm, recipe: GemmRecipe, cap, requested: str, layer: str | None) -> str:
    where = f"{layer} {g.value}" if layer else g.value
    if requested in ("emulated", "reference"):
        return requested
    hw, why = recipe_backend(recipe, cap)
    have = device_backends(cap)
    bf16_ok = bf16_exact_recipe(recipe)
    if requested == "auto":
        if hw is not None and hw in have:
            return hw
        return "bf16_mm" if bf16_ok and "bf16_mm" in have else "emulated"
    if requested not in HW_BACKENDS:
        raise ValueError(f"{where}: unknown GEMM backend {requested!r}; valid: {', '.join(GEMM_BACKENDS)}")
    supported = ", ".join([*have, "emulated", "reference"])
    if requested not in have:
        raise BackendError(f"{where}: backend {requested} needs {_NEEDS[requested]}; "
                           f"this device is {capability_name(cap)}, which supports: {supported}")
    if requested == "bf16_mm":
        if not bf16_ok:
            raise BackendError(f"{where}: backend bf16_mm cannot run {recipe.spec()} (values not exactly "
                               f"BF16: Format.bf16_exact); on {capability_name(cap)} use one of: {supported} "
                               "(or auto)")
        return requested
    if hw != requested:
        raise BackendError(f"{where}: backend {requested} cannot run {recipe.spec()} ({why}); "
                           f"on {capability_name(cap)} use one of: {supported} (or auto)")
    return requested


_NEEDS = {"fp8_scaled_mm": "sm_89+ or gfx950", "mx_scaled_mm": "Blackwell (sm_10x, sm_11x, sm_12x) or gfx950",
          "bf16_mm": f"sm_80+ or {', '.join(_BF16_TENSOR_CORE_ARCHS)}"}


def select_backend(recipe_or_precision: GemmRecipe | LinearPrecision, device, requested: str = "auto",
                   *, layer: str | None = None, gemm: Gemm | None = None):
    """The backend for one GEMM recipe (a name), or for a layer's three GEMMs (``{Gemm: name}``).

    ``device``: a torch device or a capability (see the module docstring). ``layer``/``gemm``:
    only used to name the GEMM in errors.
    """
    if requested not in GEMM_BACKENDS:
        raise ValueError(f"unknown GEMM backend {requested!r}; valid: {', '.join(GEMM_BACKENDS)}")
    cap = device_capability(device)
    if isinstance(recipe_or_precision, LinearPrecision):
        return {g: _select_one(g, recipe_or_precision.recipe(g), cap, requested, layer) for g in Gemm}
    g = Gemm(gemm) if gemm is not None else Gemm.FPROP
    return _select_one(g, recipe_or_precision, cap, requested, layer)


def describe_backends(plan: Mapping[str, LinearPrecision] | LinearPrecision, device,
                      requested: str = "auto") -> str:
    """``recipe -> backend`` for each GEMM, one line per group of layers that get the same (named
    compactly, with their count: an 8B model's 225 linears are a few lines), and a summary (what
    the probe found on this device, if it ran, included: ``kernels.probe.startup_report`` runs it
    first)."""
    cap = device_capability(device)
    layers = {"(all layers)": plan} if isinstance(plan, LinearPrecision) else dict(plan)
    hw = ", ".join(device_backends(cap)) or "none"
    groups: dict[tuple[str, ...], list[str]] = {}
    count = Counter()
    for name, prec in layers.items():
        chosen = select_backend(prec, cap, requested, layer=name)
        count.update(chosen.values())
        groups.setdefault(tuple(f"{prec.recipe(g).spec()} -> {chosen[g]}" for g in Gemm), []).append(name)
    rows = [(names[0] if len(names) == 1 else f"{compact_names(names)} ({len(names)})", list(cells))
            for cells, names in groups.items()]
    width = max([len(n) for n, _ in rows] + [5])
    cw = [max([len(g.value)] + [len(r[1][i]) for r in rows]) for i, g in enumerate(Gemm)]
    lines = [f"GEMM backends on {capability_name(cap)} (hardware GEMMs here: {hw}; requested: {requested})",
             f"{'layer':<{width}}  " + "  ".join(f"{g.value:<{cw[i]}}" for i, g in enumerate(Gemm)).rstrip()]
    for name, cells in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:<{cw[i]}}" for i, c in enumerate(cells)).rstrip())
    lines.append("GEMMs per backend: " + ", ".join(f"{k} {v}" for k, v in sorted(count.items())))
    lines += [f"  {k}: {BACKEND_PATHS[k]}" for k in sorted(count)]
    return "\n".join(lines)

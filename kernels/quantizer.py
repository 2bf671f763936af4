"""``kernels.quantize``: the quantizer entry point, choosing between the reference and Triton.

>>> q = kernels.quantize(x, "mxfp4", axis=0, rotation="had16")        # auto: Triton on CUDA
>>> q.codes, q.scales, q.dequantize()                                  # precision.QuantizedTensor

``backend``:

* ``reference`` -- ``precision.quantize`` (after ``precision.rotation.rotate`` when ``rotation`` is
  given): the executable specification, any device.
* ``triton`` -- ``kernels.triton_quant``: one fused pass (rotation included) on a CUDA device, or on
  CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported -- slow,
  for tests). Nearest rounding equals the reference bit for bit; so does stochastic rounding with
  ``sr=SRKey(...)`` (counter-based uniforms, ``precision.srand``, generated in-kernel). With
  ``generator`` instead, the kernel draws from a seed taken from it: reproducible, but a different
  stream.
* ``auto`` -- ``triton`` when ``x`` is on CUDA, triton is importable and the format has a kernel;
  otherwise ``reference``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from precision.enums import AmaxAlgo, Rounding
from precision.formats import QuantizedTensor, Scaling, format_names
from precision.quantize import quantize as reference_quantize
from precision.quantize import quantize_call
from precision.recipe import OperandFormat
from precision.rotation import rotate, rotation_size
from precision.srand import SRKey

__all__ = ["QUANTIZE_BACKENDS", "quantize", "triton_importable", "triton_missing_reason"]

QUANTIZE_BACKENDS = ("auto", "reference", "triton")
# The formats the fused Triton kernel handles (``Format.triton``: the registry says which)
TRITON_FORMATS = format_names(lambda f: f.triton)


@functools.cache
def triton_importable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


def triton_missing_reason(x: torch.Tensor | None = None, fmt=None) -> str | None:
    """Why the Triton quantizer cannot run here (one line), or None when it can. ``fmt``: a format
    name, or an ``OperandFormat`` (whose rounding must have a kernel too: ``Rounding.triton``)."""
    name, rounding = (fmt.fmt, fmt.rounding) if isinstance(fmt, OperandFormat) else (fmt, None)
    if name is not None and name not in TRITON_FORMATS:
        return f"no Triton kernel for format {name!r} (Triton formats: {', '.join(TRITON_FORMATS)})"
    if rounding is not None and not rounding.triton:
        return f"no Triton kernel for {rounding} rounding ({', '.join(r for r in Rounding if r.triton)} only)"
    if isinstance(fmt, OperandFormat) and fmt.triton_missing:
        return fmt.triton_missing
    if not triton_importable():
        return "triton is not installed (pip install 'lowprec-pretrain[gpu]', or pip install triton)"
    if x is not None and x.device.type != "cuda":
        from kernels.triton_quant import interpreter_problem, interpreting

        if not interpreting():
            return (f"the tensor is on {x.device.type}, Triton needs a CUDA device "
                    "(or TRITON_INTERPRET=1 set before importing triton, for the CPU interpreter)")
        return interpreter_problem()
    return None


def quantize(
    x: torch.Tensor,
    fmt,
    *,
    axis: int = -1,
    amax: torch.Tensor | float | None = None,
    sr: SRKey | torch.Generator | None = None,
    backend: str = "auto",
    rotation: str = "none",
    signs: torch.Tensor | None = None,
    **older,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt`` with blocks along ``axis``; returns a ``precision.QuantizedTensor``.

    ``fmt``: an ``OperandFormat`` (every setting but an amax history is used: rounding, scale rule,
    prescale, 2-D tiles, margin, four-over-six), or a
    format name with the older keyword settings ``rounding`` / ``scale_rule`` / ``prescale`` /
    ``generator`` (``older``: read by the one adapter, ``precision.quantize.quantize_call``).
    ``amax`` and ``sr`` (an ``SRKey``, or a ``torch.Generator``) are as in ``precision.quantize``;
    this entry point adds the backend choice and the rotation.

    ``rotation``: a ``GemmRecipe``'s rotation name (``none``, ``had16``, ``had32``, ``rht16*``; the
    ``rht*`` ones with ``signs``, the +-1 vector): the tensor is rotated by ``diag(signs)·H_n``
    along ``axis`` first (whose length must be a multiple of ``n``), and the codes are those of the
    rotated tensor.
    """
    unknown = set(older) - {"rounding", "scale_rule", "prescale", "generator"}
    if unknown:
        raise TypeError(f"kernels.quantize: unknown argument(s) {', '.join(sorted(unknown))}; valid besides the "
                        "named ones: rounding, scale_rule, prescale, generator")
    op, sr = quantize_call(fmt, sr, **older)
    # one call has no amax history (``amax`` is given or the tensor's own); every other setting of the
    # OperandFormat -- 2-D tiles, margin, four-over-six -- is kept (rebuilding it field by field dropped some)
    op = dataclasses.replace(op, amax_algo=AmaxAlgo.CURRENT, amax_history_len=1)
    spec = op.format
    if backend not in QUANTIZE_BACKENDS:
        raise ValueError(f"quantize backend: unknown {backend!r}; valid: {', '.join(QUANTIZE_BACKENDS)}")
    n = rotation_size(rotation)
    signs = signs if rotation.startswith("rht") else None
    if rotation.startswith("rht") and signs is None:
        raise ValueError(f"rotation {rotation}: needs signs= (a +-1 vector of length {n})")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_missing_reason(x, op) is None else "reference"
    if backend == "reference":
        if rotation != "none":
            x = rotate(x, axis % x.dim(), n, signs)
        return reference_quantize(x, op, axis=axis, amax=amax, sr=sr)

    why = triton_missing_reason(x, op)
    if why is not None:
        raise RuntimeError(f"kernels.quantize(backend='triton'): {why}")
    from kernels.triton_quant import quantize_triton  # optional dependency (pip install triton)

    r = quantize_triton(x, op, axis=axis, amax=amax, sr=sr, rotation=rotation, signs=signs)
    kind, fmt = spec.kind, spec.name
    if kind == Scaling.TENSOR:
        return QuantizedTensor(fmt, r.codes, r.scales, r.axis, num_clipped=r.num_clipped, amax=r.amax)
    if kind == Scaling.TWO_LEVEL:
        return QuantizedTensor(fmt, r.codes, r.scales, r.axis, tensor_scale=r.tensor_scale)
    return QuantizedTensor(fmt, r.codes, r.scales, r.axis, prescale=op.prescale_factor)

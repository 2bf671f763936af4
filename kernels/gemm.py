"""``kernels.gemm``: the one GEMM entry point every linear layer calls.

``gemm(Gemm.X, a, b, recipe, backend)`` takes the two operands in their natural layouts and
knows from the GEMM which axis each is contracted over::

    FPROP  y  = x  · wᵀ   a = x  [T, in],  b = w [out, in]   contract a.axis 1, b.axis 1
    DGRAD  dx = dy · w    a = dy [T, out], b = w [out, in]   contract a.axis 1, b.axis 0
    WGRAD  dw = dyᵀ· x    a = dy [T, out], b = x [T, in]     contract a.axis 0, b.axis 0

The ``emulated`` backend is the executable specification and runs on any device:
rotate both operands along the contraction axis (if the recipe asks), quantize each operand with
its ``OperandFormat`` (blocks along the contraction axis), dequantize into float32 -- which holds
every quantized value exactly -- and multiply with FP32 accumulation. Hardware backends register
themselves in ``BACKENDS`` and must reproduce the emulated backend's quantized operands bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kernels.fused import fake_quantize
from precision.quantize import FORMATS, quantize
from precision.recipe import Gemm, GemmRecipe, OperandFormat
from precision.rotation import rotate, rotation_size
from precision.state import LayerQuantState
from precision.telemetry import operand_stats
from precision.tensorwise import tensor_amax

__all__ = ["gemm", "BACKENDS", "CONTRACTION_AXES", "quantize_operand"]

# (a axis, b axis) contracted by each GEMM, operands in their natural layouts.
CONTRACTION_AXES = {Gemm.FPROP: (1, 1), Gemm.DGRAD: (1, 0), Gemm.WGRAD: (0, 0)}


def _pad_axis(t: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    pad = (-t.shape[axis]) % multiple
    if not pad:
        return t
    widths = [0, 0] * t.dim()
    widths[2 * (t.dim() - 1 - axis) + 1] = pad  # F.pad lists dims last-first
    return torch.nn.functional.pad(t, widths)


def whole_tensor_amax(t: torch.Tensor, state: LayerQuantState) -> float | None:
    """With tensor parallelism (``state.amax_group``): the amax of the whole operand, the maximum of
    every TP rank's shard amax (a collective: every rank of the group calls it for the same
    operands in the same order, as SPMD training does). None without a group."""
    if state.amax_group is None:
        return None
    amax = tensor_amax(t).reshape(1).to(t.device)
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=state.amax_group)
    return float(amax)


def quantize_operand(
    t: torch.Tensor, axis: int, fmt: OperandFormat, gemm: Gemm, operand: str,
    state: LayerQuantState, call: int, impl: str = "auto",
    rotation: tuple[int, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """(Rotate and) quantize one GEMM operand along ``axis``; return its float32 dequantization.

    ``impl="reference"`` runs the eager specification (``precision.rotation.rotate`` then
    ``precision.quantize``); otherwise the fused quantizer of ``kernels.fused``, rotation fused
    in (bit-identical, tested).
    """
    per_tensor = FORMATS[fmt.fmt].scaling == "tensor"
    if state.observe_only:  # QAT warm-up: BF16 GEMM; delayed-scaling operands record their amax
        if fmt.amax_algo != "current":
            whole = whole_tensor_amax(t, state)
            state.amax_history(gemm, operand, fmt).update(float(tensor_amax(t)) if whole is None else whole)
        return t.to(torch.bfloat16).float()
    whole = None
    if per_tensor and state.amax_group is not None:
        if rotation is not None:  # the whole tensor's amax is taken after the rotation
            t, rotation = rotate(t, axis, *rotation), None
        whole = whole_tensor_amax(t, state)
    if rotation is not None and (impl == "reference" or FORMATS[fmt.fmt].scaling == "none" or state.collect_stats):
        t = rotate(t, axis, *rotation)  # telemetry compares against the rotated operand
        rotation = None
    if FORMATS[fmt.fmt].scaling == "none":  # fp32 (identity) or bf16 (RNE cast)
        out = quantize(t, fmt.fmt).dequantize(torch.float32)
        if state.collect_stats:
            state.record(gemm, operand, **operand_stats(t, out, fmt.fmt, axis))
        return out
    gen = state.generator(gemm, operand, call, t.device) if fmt.rounding == "stochastic" else None
    history = state.amax_history(gemm, operand, fmt) if fmt.amax_algo != "current" else None
    amax = history.amax() if history is not None else whole  # current scaling: the whole tensor's
    kw = dict(axis=axis, rounding=fmt.rounding, scale_rule=fmt.scale_rule, generator=gen,
              prescale=fmt.prescale_factor, amax=amax)
    if impl == "reference":
        q = quantize(t, fmt.fmt, **kw)
        out, stats = q.dequantize(torch.float32), {"amax": q.amax, "num_clipped": q.num_clipped}
    else:
        out, stats = fake_quantize(t, fmt.fmt, impl=impl, rotation=rotation, **kw)
    scale_amax = None
    if stats.get("amax") is not None:
        cur = float(stats["amax"]) if whole is None else whole
        scale_amax = cur if amax is None else float(amax)
        if history is not None:
            history.update(cur)
        state.record(gemm, operand, amax=cur, num_clipped=int(stats["num_clipped"]),
                     scale_amax=scale_amax, numel=t.numel())
    if state.collect_stats:
        state.record(gemm, operand, **operand_stats(t, out, fmt.fmt, axis, scale_amax, fmt.scale_rule))
    return out


def _emulated(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe,
              state: LayerQuantState, impl: str = "auto") -> torch.Tensor:
    a_axis, b_axis = CONTRACTION_AXES[g]
    call = state.next_call(g)
    rot = None
    if recipe.rotation != "none":
        n = rotation_size(recipe.rotation)
        # Zero-pad the contraction axis of both operands to whole rotation groups and blocks:
        # zeros add nothing to the product and never change a block's amax.
        multiple = math.lcm(n, *(FORMATS[f.fmt].block or 1 for f in (recipe.a, recipe.b)))
        a, b = _pad_axis(a, a_axis, multiple), _pad_axis(b, b_axis, multiple)
        signs = None
        if recipe.rotation.startswith("rht"):
            signs = state.rotation_signs(g, n, call if recipe.rotation.endswith("resample") else None)
        rot = (n, signs)
    names = g.operands
    a_q = quantize_operand(a, a_axis, recipe.a, g, names[0], state, call, impl, rot)
    b_q = quantize_operand(b, b_axis, recipe.b, g, names[1], state, call, impl, rot)
    # === FP32-accumulated GEMM on exactly-representable operands ===
    if g is Gemm.FPROP:
        return a_q @ b_q.t()  # [T, in] @ [in, out]
    if g is Gemm.DGRAD:
        return a_q @ b_q  # [T, out] @ [out, in]
    return a_q.t() @ b_q  # [out, T] @ [T, in]


def _reference(g, a, b, recipe, state):
    return _emulated(g, a, b, recipe, state, impl="reference")


# emulated: fused (compiled) quantizers; reference: the eager specification. Same bits.
BACKENDS: dict[str, Callable] = {"emulated": _emulated, "reference": _reference}


def gemm(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, backend: str = "emulated",
         *, state: LayerQuantState | None = None) -> torch.Tensor:
    """Run GEMM ``g`` on 2-D operands ``a``, ``b`` under ``recipe``; returns a float32 result.

    ``state`` carries the layer's random streams and amax histories; without one, a fresh state
    (seed 0) is used, so stochastic rounding repeats the same draws on every call.
    """
    g = Gemm(g)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{g.value}: operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    a_axis, b_axis = CONTRACTION_AXES[g]
    if a.shape[a_axis] != b.shape[b_axis]:
        raise ValueError(f"{g.value}: contraction lengths differ: {g.operands[0]} {tuple(a.shape)} "
                         f"axis {a_axis} vs {g.operands[1]} {tuple(b.shape)} axis {b_axis}")
    try:
        impl = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"{g.value}: unknown GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}") from None
    return impl(g, a, b, recipe, state if state is not None else LayerQuantState())

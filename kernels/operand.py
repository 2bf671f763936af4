"""``kernels.operand``: the whole life of a GEMM operand, the same for every backend.

Every GEMM backend (``emulated``, ``reference``, ``fp8_scaled_mm``, ``mx_scaled_mm``) gets its two
operands from :func:`gemm_operands`; a hardware backend adds only its GEMM call and the layout of
codes and scales it needs (``kernels.scaled_mm``). One operand's road, in order::

    0. QAT warm-up (state.observe_only): record delayed-scaling amaxes, hand back BF16 values
    1. rotate      both operands of the GEMM along its contraction axis, zero-padded once to
                   whole rotation groups and blocks (:func:`pad_and_rotation`)
    2. amax        of the whole tensor: under tensor parallelism the maximum over the TP group for
                   an operand that is sharded (replicated operands already hold the whole tensor)
    3. scale       current (that amax) or delayed (the history's amax of the previous steps);
                   every format with a tensor-level scale (FP8, HiF8, NVFP4's FP32 scale) uses it
    4. quantize    reference (``precision.quantize``), fused (``kernels.fused``, torch.compile) or
                   Triton (``kernels.triton_quant``): the same bits. Stochastic rounding draws each
                   element's uniform from (seed, layer, GEMM, operand, call) and the element's index
                   in the whole TP=1 tensor (``precision.srand.SRKey``; offsets from ``state.tp``)
    5. telemetry   amax and clipped counts as device tensors; numerics on telemetry steps
    6. form        FP32 ``values`` (emulated backends), the hardware form (``codes=True``) or the
                   BF16 form (``bf16=True``: ``kernels.bf16_operand``, for the BF16 tensor-core GEMM)

A weight is quantized once per optimizer step (as TransformerEngine keeps its FP8 weights across
micro-batches): every GEMM that consumes ``w`` unrotated, with nearest rounding and no telemetry
this step, keeps its finished operand in the layer state's ``step_cache`` and the next micro-batch
is served it (:func:`quantize_operand`). A weight in 2-D tiles (``/2d``, the ``nvfp4`` preset) is
quantized once for both of its GEMMs (by the Triton kernel on the hardware path, else the
reference): Dgrad gets Fprop's codes with the square scales laid along its own contraction axis
(:func:`_block2d_weight`, ``QuantizedTensor.along``). Both caches are keyed on
the tensor's identity (storage, view, version counter) and end with the optimizer step
(``LayerQuantState.end_step``): optimizers write parameters with ``p.data.copy_`` or through a flat
buffer the parameters view, neither of which moves ``p._version``.

So "where is Wgrad's ``dy`` quantized" has one answer: :func:`quantize_operand` called from
:func:`gemm_operands` with ``Gemm.WGRAD`` and ``"dy"``, whatever backend runs the GEMM. Nothing
here reads a device value to the host (telemetry on ``collect_stats`` steps aside).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from kernels.bf16_operand import bf16_form
from kernels.fused import fake_quantize
from kernels.quantizer import triton_missing_reason
from precision.enums import AmaxAlgo, Scaling
from precision.formats import QuantizedTensor
from precision.quantize import quantize as reference_quantize
from precision.recipe import Gemm, GemmRecipe, OperandFormat
from precision.rotation import fixed_signs, rotate, rotation_size
from precision.srand import SRKey
from precision.state import LayerQuantState
from precision.telemetry import operand_stats

__all__ = [
    "CONTRACTION_AXES",
    "GemmOperands",
    "QuantizedOperand",
    "finite_amax",
    "gemm_operands",
    "pad_and_rotation",
    "quantize_operand",
    "whole_tensor_amax",
]

# (a axis, b axis) contracted by each GEMM, operands in their natural layouts.
CONTRACTION_AXES = {Gemm.FPROP: (1, 1), Gemm.DGRAD: (1, 0), Gemm.WGRAD: (0, 0)}


@dataclass
class QuantizedOperand:
    """One quantized GEMM operand.

    ``values``: float32 dequantized values in the operand's natural layout (emulated backends).
    ``codes`` / ``scales``: the hardware form, contraction axis last -- ``codes`` uint8 ``[rows, K]``
    (FP4 two per byte, ``[rows, K/2]``, when ``packed``), ``scales`` uint8 ``[rows, K/block]`` for
    block formats or the float32 encode scale (0-d) per tensor; ``tensor_scale``: NVFP4's ``g_enc``.
    ``bf16`` / ``out_scale``: the BF16 form, contraction axis last ``[rows, K]``, and the FP32 factor
    that goes to the GEMM output (``kernels.bf16_operand``; the pre-scale is ``fmt.prescale_factor``).
    ``decode_scale``: per-tensor formats in hardware form, ``1 / scales`` as the Triton kernel computed
    it (the specification's decode factor, handed to ``torch._scaled_mm`` as is); NVFP4's
    ``1 / tensor_scale`` likewise; None: compute it. ``hw``: the hardware forms made of it so far.
    """

    fmt: OperandFormat
    axis: int
    values: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None
    packed: bool = False
    bf16: torch.Tensor | None = None
    out_scale: torch.Tensor | None = None
    decode_scale: torch.Tensor | None = None
    hw: dict | None = None  # scale layout -> its kernels.scaled_mm.HwOperand, made on first use


@dataclass
class GemmOperands:
    """The two operands of one GEMM call; ``high_precision``: QAT warm-up, a plain GEMM of ``values``."""

    a: QuantizedOperand
    b: QuantizedOperand
    call: int
    high_precision: bool = False


def _tensor_level(fmt: OperandFormat) -> bool:
    """Formats whose scale involves the whole tensor's amax (per-tensor FP8/HiF8, NVFP4's FP32 scale)."""
    return fmt.format.tensor_scaled


def _no_rounding(fmt: OperandFormat) -> bool:
    return fmt.format.kind == Scaling.NONE  # fp32 (identity) and bf16 (an RNE cast): no scale


def finite_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| over the finite values (0-d float32, 0 for an empty tensor), without a host read."""
    if not t.numel():
        return torch.zeros((), device=t.device)
    a = t.detach().float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax()


def whole_tensor_amax(t: torch.Tensor, state: LayerQuantState, operand: str) -> torch.Tensor:
    """The amax of the whole operand: this shard's, maximised over the TP group when the operand is
    sharded (a collective: every rank of the group calls it for the same operands in the same
    order, as SPMD training does). A 0-d float32 tensor on ``t``'s device."""
    amax = finite_amax(t)
    if state.amax_group is not None and state.tp.shard_axis(operand) is not None:
        amax = amax.reshape(1).clone()
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=state.amax_group)
        amax = amax.reshape(())
    return amax


def _pad_axis(t: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    pad = (-t.shape[axis]) % multiple
    if not pad:
        return t
    widths = [0, 0] * t.dim()
    widths[2 * (t.dim() - 1 - axis) + 1] = pad  # F.pad lists dims last-first
    return torch.nn.functional.pad(t, widths)


def pad_and_rotation(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, state: LayerQuantState,
                     call: int):
    """``(a, b, signs)``: with a rotation (``recipe.rotation``), both operands zero-padded along the
    contraction axis to whole rotation groups *and* blocks (zeros change neither a block's amax nor
    the product) and ``signs`` the +-1 vector of an ``rht*`` rotation (None for ``had*``);
    otherwise the operands unchanged and None. The only place padding for rotations happens."""
    if recipe.rotation == "none":
        return a, b, None
    n = rotation_size(recipe.rotation)
    multiple = math.lcm(n, *(f.format.block or 1 for f in (recipe.a, recipe.b)))
    a_axis, b_axis = CONTRACTION_AXES[g]
    a, b = _pad_axis(a, a_axis, multiple), _pad_axis(b, b_axis, multiple)
    signs = fixed_signs(recipe.rotation, a.device)  # rht16_te: TransformerEngine's constant
    if signs is None and recipe.rotation.endswith("resample"):  # new signs every call
        signs = state.rotation_signs(g, n, call)
    elif signs is None and recipe.rotation.startswith("rht"):  # fixed per layer: on the device once
        signs = _layer_signs(state, g, n, a.device)
    return a, b, signs


_LAYER_SIGNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> {key: device signs}


def _layer_signs(state: LayerQuantState, g: Gemm, n: int, device) -> torch.Tensor:
    """A layer's fixed random signs for GEMM ``g`` on ``device``, drawn and copied there once."""
    kept = _LAYER_SIGNS.setdefault(state, {})
    key = (state.seed, state.name, g, n, torch.device(device))
    if key not in kept:
        kept[key] = state.rotation_signs(g, n, None).to(device)
    return kept[key]


def gemm_operands(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, state: LayerQuantState, *,
                  impl: str = "auto", codes: bool = False, bf16: bool = False, shared_dy=None) -> GemmOperands:
    """Both operands of GEMM ``g`` (natural layouts, see ``CONTRACTION_AXES``), ready for its backend.

    ``codes=False``: dequantized float32 ``values`` (``impl``: ``reference``, or the fused
    quantizer's ``auto``/``compiled``/``eager``). ``codes=True``: the hardware form (``impl``:
    ``reference``, ``triton`` or ``auto`` = Triton on CUDA when it can run the format).
    ``bf16=True``: the BF16 form (``bf16`` / ``out_scale``; quantized as for ``codes=True``).
    ``shared_dy``: a backward's ``kernels.cast_transpose.SharedDy`` plan (Dgrad's and Wgrad's ``dy``
    from one read), or None.
    """
    call = state.next_call(g)
    names = g.operands
    a_axis, b_axis = CONTRACTION_AXES[g]
    if state.observe_only:  # === QAT warm-up: a BF16 GEMM; delayed-scaling operands record their amax
        pa, pb, signs = pad_and_rotation(g, a, b, recipe, state, call)
        for t, axis, fmt, name in ((pa, a_axis, recipe.a, names[0]), (pb, b_axis, recipe.b, names[1])):
            if fmt.amax_algo != AmaxAlgo.CURRENT:
                tr = t if recipe.rotation == "none" else rotate(t, axis, rotation_size(recipe.rotation), signs)
                state.observe_amax(g, name, fmt, whole_tensor_amax(tr, state, name))
        fmt_bf16 = OperandFormat("bf16")
        qa, qb = (QuantizedOperand(fmt_bf16, axis, values=t.to(torch.bfloat16).float()) for t, axis in
                  ((a, a_axis), (b, b_axis)))
        if bf16:
            qa.bf16, qb.bf16 = a.to(torch.bfloat16).movedim(a_axis, -1), b.to(torch.bfloat16).movedim(b_axis, -1)
        return GemmOperands(qa, qb, call, True)
    a, b, signs = pad_and_rotation(g, a, b, recipe, state, call)
    kw = {"impl": impl, "rotation": recipe.rotation, "signs": signs, "codes": codes, "bf16": bf16,
          "shared_dy": shared_dy}
    qa = quantize_operand(a, a_axis, recipe.a, g, names[0], state, call, **kw)
    qb = quantize_operand(b, b_axis, recipe.b, g, names[1], state, call, **kw)
    return GemmOperands(qa, qb, call)


def _sr_keys(state: LayerQuantState, gemm: Gemm, operand: str, call: int, shape):
    """``(piece axis, [(start, length, SRKey)])``: one key per contiguous run of the operand's TP
    shard, each placing its elements in the whole TP=1 tensor (``TPLayout.pieces``)."""
    seed = state.sr_seed(gemm, operand, call)
    axis, pieces, global_cols = state.tp.pieces(operand, tuple(shape))
    keys = []
    for start, length, whole_start in pieces:
        if axis == 0:
            key = SRKey(seed, row_offset=whole_start, global_cols=global_cols)
        elif axis == 1:
            key = SRKey(seed, col_offset=whole_start, global_cols=global_cols)
        else:
            key = SRKey(seed)
        keys.append((start, length, key))
    return axis, keys


def _resolve_impl(impl: str, t: torch.Tensor, fmt: OperandFormat | str, codes: bool) -> str:
    if not codes:
        if impl not in ("auto", "compiled", "eager", "reference"):
            raise ValueError(f"quantizer: unknown {impl!r}; valid: auto, compiled, eager, reference")
        return impl
    if impl == "auto":
        return "triton" if t.is_cuda and triton_missing_reason(t, fmt) is None else "reference"
    if impl not in ("triton", "reference"):
        raise ValueError(f"quantizer: unknown {impl!r}; valid: auto, triton, reference")
    return impl


def quantize_operand(
    t: torch.Tensor, axis: int, fmt: OperandFormat, gemm: Gemm, operand: str, state: LayerQuantState,
    call: int, *, impl: str = "auto", rotation: str = "none", signs: torch.Tensor | None = None,
    codes: bool = False, bf16: bool = False, shared_dy=None,
) -> QuantizedOperand:
    """Steps 1-5 of the module docstring for one operand ``t`` (2-D, natural layout) along ``axis``.

    ``rotation`` (the recipe's, with ``signs`` from :func:`pad_and_rotation`, which padded ``t``
    already): rotate first; the
    fused and Triton quantizers rotate inside their kernels (the same bits as ``rotate``) unless
    the rotated tensor is needed here (its amax under TP, the eager reference, a 2-D weight or
    telemetry). ``bf16=True``: quantized as
    for the hardware form, handed back in the BF16 form instead (step 6). ``shared_dy``: a
    ``kernels.cast_transpose.SharedDy`` plan that may already hold (or produce) this quantization.
    """
    slot = _weight_slot(t, axis, fmt, gemm, operand, state, impl, rotation, codes, bf16)
    if slot is not None:  # the weight quantized once per optimizer step
        hit = state.step_cache.get(slot[0])
        if hit is not None and hit[1] == slot[1]:
            return hit[2]
    out = None
    if slot is not None and gemm is Gemm.FPROP and _both_weight_layouts(t, axis, fmt, state, impl, codes, bf16):
        out = _weight_with_dgrad_layout(t, fmt, state, slot, impl)
    if out is None:
        out = _quantize_operand(t, axis, fmt, gemm, operand, state, call, impl=impl, rotation=rotation,
                                signs=signs, codes=codes, bf16=bf16, shared_dy=shared_dy)
    if slot is not None and not state.frozen:
        state.step_cache[slot[0]] = (t, slot[1], out)  # t kept alive: its storage cannot be reused
    return out


def _both_weight_layouts(t, axis, fmt, state, impl, codes, bf16) -> bool:
    """Whether Fprop's weight is quantized with Dgrad's layout from the same read (as
    TransformerEngine keeps an FP8 weight's row- and column-wise copies): a per-tensor format under
    current scaling, the Triton quantizer's hardware form, no TP amax reduction or telemetry, and a
    backward to come (gradients enabled)."""
    return (codes and not bf16 and axis == 1 and t.dim() == 2 and fmt.format.kind == Scaling.TENSOR
            and fmt.amax_algo == AmaxAlgo.CURRENT and not fmt.rounding.stochastic and not state.frozen
            and state.amax_group is None and torch.is_grad_enabled()
            and _resolve_impl(impl, t, fmt, True) == "triton")


def _weight_with_dgrad_layout(t, fmt, state, slot, impl) -> QuantizedOperand:
    """Fprop's weight operand; Dgrad's (blocks along the out-features, ``[in, out]``) from the same
    cast-transpose is kept in the step cache under the slot Dgrad's own call looks up, so it is
    served only if Dgrad's recipe takes the same format (else Dgrad quantizes as always). Both
    equal the single-layout quantizations bit for bit (``cast_transpose_triton``); telemetry is
    recorded for both GEMMs, as their own calls would."""
    from kernels.triton_quant import cast_transpose_triton

    row, col = cast_transpose_triton(t, fmt, fmt)
    ops = []
    for gemm, axis, r in ((Gemm.FPROP, 1, row), (Gemm.DGRAD, 0, col)):
        state.record(gemm, "w", amax=r.amax, num_clipped=r.num_clipped, scale_amax=r.amax, numel=t.numel())
        ops.append(QuantizedOperand(fmt, axis, codes=r.codes, scales=r.scales, decode_scale=r.decode_scale))
    state.step_cache[(Gemm.DGRAD.value, 0, fmt, impl, True, False)] = (t, slot[1], ops[1])
    return ops[0]


def _identity(t: torch.Tensor) -> tuple:
    """What tells one tensor's values from another's within an optimizer step: its storage, view and
    version counter (an in-place write through autograd moves the counter; ``p.data.copy_`` does
    not, which is why the step cache ends at ``end_step``)."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version


def _weight_slot(t, axis, fmt, gemm, operand, state, impl, rotation, codes, bf16):
    """``(slot, identity)`` under which a weight operand is kept for the rest of the step, or None
    where its quantization may change within a step: stochastic rounding (a new stream per call),
    a rotation (this GEMM's own rotated copy), telemetry steps (statistics per call), unscaled
    formats (nothing to save) and inference tensors (no version counter)."""
    if torch.compiler.is_compiling():  # a traced graph quantizes every call (the same bits: no SR here)
        return None
    if (operand != "w" or rotation != "none" or fmt.rounding.stochastic or state.collect_stats
            or _no_rounding(fmt) or t.is_inference()):
        return None
    return (gemm.value, axis, fmt, impl, bool(codes), bool(bf16)), _identity(t)


def _quantize_operand(t, axis, fmt, gemm, operand, state, call, *, impl, rotation, signs, codes, bf16, shared_dy):
    name = fmt.fmt
    want_bf16, codes = bf16, codes or bf16  # the BF16 form is decoded from the hardware form
    impl = _resolve_impl(impl, t, fmt, codes)
    # stochastic rounding: one key per contiguous run of the shard in the whole tensor
    sr = fmt.rounding.stochastic
    piece_axis, keys = _sr_keys(state, gemm, operand, call, t.shape) if sr else (None, [(0, None, None)])
    sharded = state.amax_group is not None and state.tp.shard_axis(operand) is not None
    needs_whole = _tensor_level(fmt) and (sharded or len(keys) > 1)  # one tensor-level amax for all runs
    rotated = rotation != "none"  # this GEMM's own rotated copy of t (a 2-D weight then is not kept)
    if rotated and (impl == "reference" or _no_rounding(fmt) or state.collect_stats or needs_whole):
        t, rotation, signs = rotate(t, axis, rotation_size(rotation), signs), "none", None

    # === 1. no rounding: fp32 / bf16
    if _no_rounding(fmt):
        if want_bf16:  # the RNE cast is the BF16 form itself (a no-op for BF16 activations)
            if not fmt.format.bf16_exact:
                raise ValueError(f"{gemm.value} {operand}: {name} values are not exactly BF16 (Format.bf16_exact); "
                                 "its GEMM runs on the FP32 emulated backend")
            cast = t.to(torch.bfloat16)
            out = QuantizedOperand(fmt, axis, bf16=cast.movedim(axis, -1))
            if state.collect_stats:
                out.values = cast.float()
        else:
            q = reference_quantize(t, fmt)
            out = QuantizedOperand(fmt, axis, values=q.dequantize(torch.float32))
            if codes:
                out.codes = q.codes.movedim(axis, -1)
        if state.collect_stats:
            state.record(gemm, operand, **operand_stats(t, out.values, name, axis, rotated=rotated))
        return out

    # === 2-D weight tiles: quantized once, the same codes serve Fprop and Dgrad (_block2d_weight)
    if fmt.block2d:
        if rotation != "none":  # a rotation along this GEMM's contraction axis: this GEMM's own weight
            t = rotate(t, axis, rotation_size(rotation), signs)
        return _block2d_weight(t, axis, fmt, gemm, operand, state, needs_whole, codes, want_bf16,
                               cacheable=not rotated, impl=impl)

    # === 2-3. whole-tensor amax; the amax the tensor-level scale comes from
    whole = whole_tensor_amax(t, state, operand) if needs_whole else None
    delayed = fmt.amax_algo != AmaxAlgo.CURRENT
    scale_amax = state.amax_history(gemm, operand, fmt).amax(t.device) if delayed else None
    if scale_amax is None:
        scale_amax = whole  # current scaling (None: the quantizer takes the tensor's own amax)

    # === 4. quantize (run by run when a strided TP shard has several SR keys); a backward's dy may
    #        come with Wgrad's copy from Dgrad's one read (kernels.cast_transpose)
    res = None
    if shared_dy is not None and impl == "triton" and codes:
        res = shared_dy.result(t, gemm, operand, fmt, state, keys, scale_amax)
    if res is None:
        parts = []
        for start, length, key in keys:
            piece = t if length is None or piece_axis is None else t.narrow(piece_axis, start, length)
            parts.append(_quantize(piece, axis, fmt, impl, codes, key, scale_amax, rotation, signs, state,
                                   bf16=want_bf16))
        res = parts[0] if len(parts) == 1 else _concat(parts, piece_axis, axis)

    # === 5. telemetry (device tensors; numerics only on telemetry steps)
    if fmt.format.kind == Scaling.TENSOR:  # per-tensor FP8 / HiF8: amax and clipped count
        cur = whole if whole is not None else res["amax"]
        if delayed:
            state.observe_amax(gemm, operand, fmt, cur)
        state.record(gemm, operand, amax=cur, num_clipped=res["num_clipped"],
                     scale_amax=cur if scale_amax is None else scale_amax, numel=t.numel())
    if state.collect_stats:
        deq = res["values"]
        stats_amax = None if scale_amax is None else float(scale_amax)
        spec = fmt.format  # per-tensor: values clip beyond scale_amax * max_normal / scale_target
        headroom = spec.max_normal / fmt.scale_target if spec.kind == Scaling.TENSOR else 1.0
        state.record(gemm, operand, **operand_stats(t, deq, name, axis, stats_amax, fmt.scale_rule, headroom,
                                                   rotated=rotated))
    out = QuantizedOperand(fmt, axis, values=None if codes else res["values"], codes=res.get("codes"),
                           scales=res.get("scales"), tensor_scale=res.get("tensor_scale"),
                           packed=res.get("packed", False), decode_scale=res.get("decode_scale"))
    if want_bf16 and res.get("bf16") is not None:  # === 6. the BF16 form, written by the Triton kernel
        out.bf16, out.out_scale = res["bf16"], res["out_scale"]
    elif want_bf16:  # === 6. the BF16 form, decoded from the codes (which stay for inspection)
        out.bf16, out.out_scale = bf16_form(fmt, out.codes, out.scales, out.tensor_scale)
    return out


def _block2d_weight(t, axis, fmt, gemm, operand, state, needs_whole, codes, want_bf16, cacheable,
                    impl) -> QuantizedOperand:
    """A weight in 2-D tiles (``fmt.block2d``): quantized once per optimizer step (the Triton kernel
    where ``impl`` is ``triton`` and the rounding is deterministic, else the eager reference
    quantizer: the same bits) and kept in the layer's ``step_cache`` with the tensor it came from, so the
    next GEMM that consumes the same tensor -- Dgrad after Fprop -- is served the same codes and
    square scales laid out along its own contraction axis (``QuantizedTensor.along``) instead of
    quantizing again. A rotated weight (a rotation on this GEMM) is this GEMM's own and is not kept.
    Read-only states (evaluation) keep nothing new. ``LayerQuantState.end_step`` drops it."""
    keep = cacheable and not torch.compiler.is_compiling() and not t.is_inference()  # (as _weight_slot)
    slot, ident = ("block2d", fmt), _identity(t) if keep else None
    hit = state.step_cache.get(slot) if ident is not None else None
    if hit is not None and hit[1] == ident:
        q = hit[2]
    else:
        amax = whole_tensor_amax(t, state, operand) if needs_whole else None
        if impl == "triton" and not fmt.rounding.stochastic:
            q = _block2d_triton(t, axis, fmt, amax)
        else:
            q = reference_quantize(t, fmt, axis=axis, amax=amax)
        if ident is not None and not state.frozen:
            state.step_cache[slot] = (t, ident, q)  # t kept alive: its storage cannot be reused
    q = q.along(axis)
    out = QuantizedOperand(fmt, axis, tensor_scale=q.tensor_scale)
    if not codes or state.collect_stats:
        out.values = q.dequantize(torch.float32)
    if codes:
        out.codes, out.scales = q.codes.movedim(axis, -1), q.scales.movedim(axis, -1)
    if state.collect_stats:
        state.record(gemm, operand, **operand_stats(t, out.values, fmt.fmt, axis, None, fmt.scale_rule,
                                                   rotated=not cacheable))
    if want_bf16:
        out.bf16, out.out_scale = bf16_form(fmt, out.codes, out.scales, out.tensor_scale)
    if codes and not want_bf16 and not state.collect_stats:
        out.values = None
    return out


def _block2d_triton(t, axis, fmt, amax) -> QuantizedTensor:
    """The Triton kernel's 2-D-tiled weight as the reference's ``QuantizedTensor`` (codes shaped like
    ``t``, square scales repeated on their rows along ``axis``: the reference's layout, so that
    ``along`` serves the other GEMM the same way)."""
    from kernels.triton_quant import quantize_triton

    r = quantize_triton(t, fmt, axis=axis, amax=amax, codes=True)
    return QuantizedTensor(fmt.fmt, r.codes, r.scales, axis % t.dim(), tensor_scale=r.tensor_scale,
                           prescale=r.prescale, block2d=True)


def _quantize(t, axis, fmt, impl, codes, key, amax, rotation, signs, state, bf16=False) -> dict:
    """One quantizer call. Returns values (natural layout; None unless asked or telemetry), and in
    hardware form codes/scales (contraction-last; FP4 packed two per byte unless ``bf16``), plus
    tensor_scale, amax, num_clipped. ``bf16`` on Triton: the kernel writes the BF16 form itself
    (``bf16`` / ``out_scale``, no codes) where the format allows (no ``Format.bf16_shift``)."""
    spec = fmt.format
    # every quantizer takes the OperandFormat whole (rounding, scale rule, prescale)
    kw = {"axis": axis, "sr": key}
    if amax is not None and spec.tensor_scaled:
        kw["amax"] = amax
    if impl == "triton":
        from kernels.triton_quant import quantize_triton

        if rotation != "none":  # fused into the kernel: diag(signs)·H_n in rotate()'s order
            kw.update(rotation=rotation, signs=signs)
        if bf16 and not spec.bf16_shift and not state.collect_stats:  # === BF16 operand, one pass
            r = quantize_triton(t, fmt, layout="contraction_last", codes=False, bf16_form=True, **kw)
            return {"bf16": r.bf16, "out_scale": r.out_scale, "scales": r.scales, "tensor_scale": r.tensor_scale,
                    "amax": r.amax, "num_clipped": r.num_clipped}
        packed = not bf16 and spec.code_bits == 4 and t.shape[axis] % 32 == 0
        r = quantize_triton(t, fmt, layout="contraction_last", pack=packed, dequantize=state.collect_stats, **kw)
        return {"values": r.dequantized, "codes": r.codes, "scales": r.scales, "tensor_scale": r.tensor_scale,
                "amax": r.amax, "num_clipped": r.num_clipped, "packed": packed,
                "decode_scale": r.decode_scale}
    if impl == "reference" or codes:
        q = reference_quantize(t, fmt, **kw)
        out = {"amax": q.amax, "num_clipped": q.num_clipped, "tensor_scale": q.tensor_scale}
        if not codes or state.collect_stats:
            out["values"] = q.dequantize(torch.float32)
        if codes:
            out["codes"] = q.codes.movedim(axis, -1)
            out["scales"] = q.scales.movedim(axis, -1) if spec.blocked else q.scales
        return out
    values, stats = fake_quantize(t, fmt, impl=impl, rotation=rotation, signs=signs, **kw)
    return {"values": values, **stats}


def _concat(parts: list[dict], piece_axis: int, axis: int) -> dict:
    """Join the results of a strided shard's runs (along ``piece_axis`` of the natural layout)."""
    hw_dim = 1 if piece_axis == axis else 0  # the contraction axis is last in the hardware form
    out = {}
    for field in ("values", "codes", "scales", "bf16"):
        vals = [p.get(field) for p in parts]
        if vals[0] is None or (field == "scales" and vals[0].dim() == 0):
            out[field] = vals[0]
        else:
            out[field] = torch.cat(vals, dim=piece_axis if field == "values" else hw_dim)
    out["tensor_scale"], out["amax"] = parts[0].get("tensor_scale"), parts[0].get("amax")
    out["out_scale"] = parts[0].get("out_scale")  # a tensor-level factor: the same for every run
    out["decode_scale"] = parts[0].get("decode_scale")
    if parts[0].get("num_clipped") is not None:
        out["num_clipped"] = sum(p["num_clipped"] for p in parts)
    out["packed"] = parts[0].get("packed", False)
    return out

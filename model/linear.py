"""The policy-routed linear function: every linear layer's three GEMMs go through ``kernels.gemm``.

A linear layer ``y = x·wᵀ (+ b)`` with ``x`` of shape ``[..., in]`` and ``w`` of shape
``[out, in]`` runs three GEMMs per training step. Tokens are all leading dims of ``x`` flattened
in order, ``T = prod(x.shape[:-1])``::

    === FPROP: y = x · wᵀ ===          x [T, in],  w [out, in]  -> y  [T, out]
        contraction over in-features:  x blocks along its last axis, w along its last axis
    === DGRAD: dx = dy · w ===         dy [T, out], w [out, in] -> dx [T, in]
        contraction over out-features: dy blocks along its last axis, w along its FIRST axis
    === WGRAD: dw = dyᵀ · x ===        dy [T, out], x [T, in]   -> dw [out, in]
        contraction over tokens:       dy and x blocks along their FIRST (token) axis

So the same tensor is quantized differently for different GEMMs: ``w`` row-wise for Fprop and
column-wise for Dgrad; ``x`` row-wise for Fprop and column-wise (over tokens) for Wgrad. That is
why each GEMM quantizes its own operands from the high-precision originals (``x_hp``, ``w_hp``,
``dy_hp``) rather than reusing another GEMM's quantized copy -- exactly what hardware MX kernels
need, and why a rotation (e.g. the deterministic 16-point Hadamard for Wgrad) applies along the
token axis for Wgrad only. On CUDA, ``dy``'s two copies (Dgrad's and Wgrad's, both in backward)
come from one read of it, bit for bit the same (``kernels.cast_transpose``).

Layout rules: a contraction length that is not a multiple of the block size (32 for MX, 16 for
NVFP4) or of the rotation size is **zero-padded** for the block computation; zeros change neither
a block's amax nor the product. The bias gradient is the plain high-precision sum of ``dy``.

Each GEMM draws its random numbers (stochastic rounding, resampled Hadamard signs) from its own
stream in the layer's ``LayerQuantState``, so changing one GEMM's recipe never changes another
GEMM's output (the GEMM-isolation property, tested bit-for-bit).

A forward run without autograd (``torch.no_grad``: evaluation, generation) reads the layer's
quantization state and changes nothing -- no call counter advances, no amax is recorded -- so
evaluating between training steps leaves training bit-identical (``precision.state``).

**Backward operands** (``backward``): ``"hp"`` (the default, and what ``hif8_w8a8`` uses) --
Dgrad and Wgrad quantize their own operands from the high-precision ``w`` and ``x`` under their
own recipes, as above (TransformerEngine's ``override_linear_precision`` keeps a QAT backward in
high precision the same way). ``"ste"`` -- the fake-quant straight-through estimator of QAT
libraries: Dgrad consumes Fprop's quantized ``Q(w)`` and Wgrad Fprop's quantized ``Q(x)``
(``dx = dy·Q(w)``, ``dw = dyᵀ·Q(x)``; the gradient of the quantized forward, with the rounding's
derivative taken as 1), each then under its own recipe (a BF16 Dgrad / Wgrad rounds the
dequantized values to BF16). ``Q`` is Fprop's quantizer re-read at the same call and scale, so it
equals what Fprop consumed bit for bit; during a QAT warm-up (``observe_only``) that is BF16. A
rotated Fprop has no unrotated ``Q(x)``: refused.

``fprop_x`` (rollout-guided QAT, ``pretrain.rl.qat``): a function of ``x`` whose result Fprop
consumes as its ``x`` operand (e.g. the rollout's recorded rounding replayed on ``x``); Dgrad and
Wgrad still consume the high-precision ``x`` itself -- a straight-through estimator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cast_transpose import share_dy
from kernels.gemm import OUT_DTYPES, gemm
from kernels.operand import CONTRACTION_AXES, quantize_operand
from precision.recipe import Gemm, LinearPrecision
from precision.state import LayerQuantState

__all__ = ["BACKWARD_OPERANDS", "fprop_quantized", "policy_linear"]

BACKWARD_OPERANDS = ("hp", "ste")  # what Dgrad / Wgrad consume: high-precision w, x or Fprop's Q(w), Q(x)


def fprop_quantized(x2d: torch.Tensor, w: torch.Tensor, precision: LinearPrecision, state: LayerQuantState):
    """``(Q(x), Q(w))``: the float32 values Fprop's last call consumed (re-quantized read-only at
    that call, so delayed scales, SR streams and TP amaxes are the same; BF16 in a QAT warm-up)."""
    recipe = precision.fprop
    if recipe.rotation != "none":
        raise ValueError(f"backward='ste': Fprop's {recipe.rotation} rotation leaves no unrotated Q(x), Q(w); "
                         "use backward='hp'")
    if state.observe_only:
        return x2d.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
    call = state.calls[Gemm.FPROP.value] - (0 if state.frozen else 1)
    ax, aw = CONTRACTION_AXES[Gemm.FPROP]
    with state.read_only():
        qx = quantize_operand(x2d, ax, recipe.a, Gemm.FPROP, "x", state, call, impl="reference").values
        qw = quantize_operand(w, aw, recipe.b, Gemm.FPROP, "w", state, call, impl="reference").values
    return qx, qw


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a GEMM writes for a result wanted in ``dtype`` (any other is cast from FP32)."""
    return dtype if dtype in OUT_DTYPES else torch.float32


class _PolicyLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_hp, w_hp, bias, precision: LinearPrecision, state: LayerQuantState, backend: str,
                fprop_x: Callable | None, backward: str):
        in_features = x_hp.shape[-1]
        lead = x_hp.shape[:-1]
        x2d = x_hp.reshape(-1, in_features)
        x_fprop = x2d if fprop_x is None else fprop_x(x_hp).reshape(-1, in_features)
        # === FPROP: y = x @ w.T ===  [T, in] x [out, in] -> [T, out]
        # the GEMM rounds its FP32 result to the activations' dtype itself (FP32 when a bias follows)
        y = gemm(Gemm.FPROP, x_fprop, w_hp, precision.fprop, backend, state=state,
                 out_dtype=_out_dtype(x_hp.dtype) if bias is None else torch.float32)
        if bias is not None:
            y = y + bias.float()
        if backward == "ste" and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            x_q, w_q = fprop_quantized(x_fprop, w_hp, precision, state)  # Wgrad's x, Dgrad's w
            ctx.save_for_backward(x_q, w_q)
        else:
            ctx.save_for_backward(x2d, w_hp)
        ctx.precision, ctx.state, ctx.backend = precision, state, backend
        ctx.lead, ctx.has_bias = lead, bias is not None
        ctx.dtypes = (x_hp.dtype, w_hp.dtype, bias.dtype if bias is not None else None)
        return y.to(x_hp.dtype)  # 2-D: reshaping here would return a view megatron's loss edits in place

    @staticmethod
    def backward(ctx, dy):
        x2d, w_hp = ctx.saved_tensors
        p, state, backend = ctx.precision, ctx.state, ctx.backend
        dy2d = dy.reshape(-1, w_hp.shape[0])
        dx = dw = db = None
        shared = share_dy(dy2d, p, state, backend)  # on CUDA: dy's two layouts from one read, same bits
        if ctx.needs_input_grad[0]:
            # === DGRAD: dx = dy @ w ===  [T, out] x [out, in] -> [T, in]
            dx = gemm(Gemm.DGRAD, dy2d, w_hp, p.dgrad, backend, state=state, shared_dy=shared,
                      out_dtype=_out_dtype(ctx.dtypes[0]))
            dx = dx.to(ctx.dtypes[0]).reshape(*ctx.lead, w_hp.shape[1])
        if ctx.needs_input_grad[1]:
            # === WGRAD: dw = dy.T @ x ===  [T, out] x [T, in] -> [out, in]  (contraction over tokens)
            dw = gemm(Gemm.WGRAD, dy2d, x2d, p.wgrad, backend, state=state, shared_dy=shared,
                      out_dtype=_out_dtype(ctx.dtypes[1])).to(ctx.dtypes[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(ctx.dtypes[2])
        return dx, dw, db, None, None, None, None, None


def policy_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    precision: LinearPrecision,
    bias: torch.Tensor | None = None,
    *,
    state: LayerQuantState | None = None,
    backend: str = "emulated",
    fprop_x: Callable[[torch.Tensor], torch.Tensor] | None = None,
    backward: str = "hp",
) -> torch.Tensor:
    """``y = x·wᵀ + bias`` with Fprop, Dgrad and Wgrad each run under ``precision``'s recipe.

    ``x``: ``[..., in]``; ``w``: ``[out, in]``; returns ``[..., out]`` in ``x``'s dtype.
    ``state``: the layer's :class:`LayerQuantState` (random streams, amax histories); layers
    keep one for their lifetime -- without it each call starts a fresh seed-0 state.
    ``fprop_x``: Fprop's ``x`` operand is ``fprop_x(x)`` (same shape) instead of ``x``; Dgrad and
    Wgrad see ``x`` (module docstring). ``backward``: ``"hp"`` (Dgrad / Wgrad from the
    high-precision ``w`` / ``x``) or ``"ste"`` (from Fprop's quantized ``Q(w)`` / ``Q(x)``).
    """
    if backward not in BACKWARD_OPERANDS:
        raise ValueError(f"policy_linear: backward {backward!r}; valid: {', '.join(BACKWARD_OPERANDS)}")
    if not isinstance(precision, LinearPrecision):
        raise TypeError(f"policy_linear: precision must be a LinearPrecision, got {type(precision).__name__}")
    if w.dim() != 2:
        raise ValueError(f"policy_linear: weight must be [out, in], got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"policy_linear: x has {x.shape[-1]} in-features, weight expects {w.shape[1]}")
    if state is None:
        state = LayerQuantState()
    if not torch.is_grad_enabled() and not state.frozen:
        # no autograd: evaluation or generation, never a training step -- read the state, change nothing
        with state.read_only():
            y2d = _PolicyLinearFn.apply(x, w, bias, precision, state, backend, fprop_x, backward)
    else:
        y2d = _PolicyLinearFn.apply(x, w, bias, precision, state, backend, fprop_x, backward)
    return y2d.reshape(*x.shape[:-1], w.shape[0])

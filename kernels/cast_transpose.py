"""One read of ``dy`` for Dgrad and Wgrad: the fused cast-transpose inside the operand pipeline.

In a linear layer's backward the same ``dy [T, out]`` feeds two GEMMs in different layouts::

    === DGRAD: dx = dy · w ===   dy blocks along out-features (axis 1)
    === WGRAD: dw = dyᵀ· x ===   dy blocks along tokens       (axis 0)

``share_dy(dy, precision, state, backend)`` (called by ``model.linear`` before its two backward
GEMMs) returns a :class:`SharedDy` plan, or None where sharing does not apply; passed to both GEMMs
(``gemm(..., shared_dy=plan)``), it lets the first quantization of ``dy`` -- Dgrad's -- produce
Wgrad's copy too from the same read (``kernels.triton_quant.cast_transpose_triton``), with Wgrad's
own format, rounding, SR key (its next call index), delayed-scaling amax and output form; Wgrad's
quantization then takes that copy instead of reading ``dy`` again. The plan is an argument, never
ambient state: a GEMM not handed one quantizes ``dy`` itself. Every other step of the pipeline
(call counters, telemetry, amax records) runs as before, and the copies are bit-identical to the
separate quantizations, so results, the GEMM-isolation property and memory (nothing is saved for
later) are unchanged.

Where it applies: on CUDA (the Triton quantizer), both GEMMs on a backend that consumes quantized
operands (``bf16_mm``, ``fp8_scaled_mm``, ``mx_scaled_mm``), no rotation on either GEMM (a rotated
operand is another tensor), no tensor parallelism across the amax, no telemetry or QAT warm-up
step. Otherwise each GEMM quantizes ``dy`` itself, as always.

Why only ``dy``: ``x`` (Fprop and Wgrad) and ``w`` (Fprop and Dgrad) are consumed in the forward
and in the backward; fusing their two layouts would mean saving Wgrad's (Dgrad's) quantized copy
from the forward for the backward -- more memory than the BF16 original for ``w``, call indices
and delayed-scaling reads taken a pass early, and recomputation would re-quantize them. ``dy``'s
two consumers run back to back in the same backward call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import operand as pipeline
from kernels.backends import BackendError, select_backend
from precision.enums import AmaxAlgo
from precision.recipe import Gemm, LinearPrecision, OperandFormat
from precision.state import LayerQuantState

__all__ = ["SharedDy", "share_dy"]

_CONSUMERS = ("bf16_mm", "fp8_scaled_mm", "mx_scaled_mm")  # backends that take quantized operands


def _as_result(r, bf16: bool) -> dict:
    out = {"values": None, "codes": r.codes, "scales": r.scales, "tensor_scale": r.tensor_scale, "amax": r.amax,
           "num_clipped": r.num_clipped, "packed": False, "decode_scale": r.decode_scale}
    if bf16:
        out.update(bf16=r.bf16, out_scale=r.out_scale)
    return out


@dataclass
class SharedDy:
    """One backward's ``dy``, quantized for Dgrad and Wgrad from one read (see the module docstring).

    Made by :func:`share_dy` and handed to both GEMMs explicitly; Dgrad's quantization of ``dy``
    keeps Wgrad's copy here (``wgrad_res``) and Wgrad's takes it."""

    dy: torch.Tensor
    state: LayerQuantState
    dgrad_fmt: OperandFormat
    wgrad_fmt: OperandFormat
    bf16: bool  # both GEMMs take the BF16 form the kernel writes (else: codes)
    wgrad_res: dict | None = None

    def result(self, t, gemm: Gemm, operand: str, fmt: OperandFormat, state: LayerQuantState, keys,
               scale_amax) -> dict | None:
        """Step 4 of ``kernels.operand.quantize_operand`` for a shared ``dy``: Dgrad's call quantizes
        both layouts in one read and keeps Wgrad's; Wgrad's call takes it. None: quantize as usual."""
        from kernels.triton_quant import cast_transpose_triton

        if operand != "dy" or t is not self.dy or state is not self.state:
            return None
        if gemm is Gemm.WGRAD:
            res, self.wgrad_res = self.wgrad_res, None
            return res
        if gemm is not Gemm.DGRAD or fmt != self.dgrad_fmt or len(keys) != 1:
            return None
        wfmt = self.wgrad_fmt
        w_keys = [(0, None, None)]
        if wfmt.rounding.stochastic:  # Wgrad's next call: the index its own quantization would use
            _, w_keys = pipeline._sr_keys(state, Gemm.WGRAD, "dy", state.calls[Gemm.WGRAD.value], tuple(t.shape))
        if len(w_keys) != 1:
            return None
        w_amax = state.amax_history(Gemm.WGRAD, "dy", wfmt).amax(t.device) if wfmt.amax_algo != AmaxAlgo.CURRENT else None
        row, col = cast_transpose_triton(
            t, fmt, wfmt, sr_row=keys[0][2], sr_col=w_keys[0][2],
            amax_row=scale_amax if fmt.format.tensor_scaled else None,
            amax_col=w_amax if wfmt.format.tensor_scaled else None,
            codes=not self.bf16, bf16_form=self.bf16)
        self.wgrad_res = _as_result(col, self.bf16)
        return _as_result(row, self.bf16)


def share_dy(dy: torch.Tensor, precision: LinearPrecision, state: LayerQuantState, backend: str) -> SharedDy | None:
    """The plan by which Dgrad's and Wgrad's quantizations of ``dy`` share one read, or None where
    they cannot (pass it to both GEMMs: ``gemm(..., shared_dy=plan)``)."""

    dgrad, wgrad = precision.dgrad, precision.wgrad
    if (dy.dim() != 2 or dgrad.rotation != "none" or wgrad.rotation != "none" or state.observe_only
            or state.collect_stats or state.amax_group is not None or backend in ("emulated", "reference")):
        return None
    try:
        chosen = [select_backend(r, dy.device, backend, gemm=g) for g, r in ((Gemm.DGRAD, dgrad), (Gemm.WGRAD, wgrad))]
    except (BackendError, ValueError):
        return None
    fmts = (dgrad.a, wgrad.a)
    if any(c not in _CONSUMERS for c in chosen) or any(
            pipeline._resolve_impl("auto", dy, f, True) != "triton" for f in fmts):
        return None
    bf16 = all(c == "bf16_mm" for c in chosen) and not any(f.format.bf16_shift for f in fmts)
    return SharedDy(dy, state, dgrad.a, wgrad.a, bf16)

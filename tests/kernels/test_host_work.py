"""Host work per operand on the hardware path, counted (not timed): ATen ops dispatched, the device
kernels among them, and Triton launches (``launch/bench_kernels.py``'s ``host_work``). A quantized
step at a realistic micro-batch is host-bound when each operand costs dozens of eager ops; these
counts are the same on any machine, so they are pinned here. On CPU the Triton kernels run in the
interpreter (``tests/kernels/conftest.py``); ops inside a launch are not counted."""

import importlib

import pytest
import torch

from kernels.quantizer import triton_missing_reason

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_PROBLEM = triton_missing_reason(torch.zeros(1, device=DEV))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TRITON_PROBLEM is not None, reason=str(TRITON_PROBLEM))]


def _bench():
    return importlib.import_module("launch.bench_kernels")


def test_host_work_per_operand_is_pinned():
    rows = {r["case"]: r for r in _bench().host_work_cases(DEV)}
    for gemm in ("fprop", "dgrad", "wgrad"):
        r = rows[f"fp8 {gemm}"]  # per-tensor current scaling: amax pass + quantize pass per operand
        assert r["triton"] == 4, r
        # one device kernel per operand (zeroing the amax / clip-count cell); the scale, 1/scale and
        # clip count come from the kernel, 1/scale already in the 1-element form torch._scaled_mm
        # takes (before: 18 kernels and 29 ATen ops per operand; then 24 ATen ops per GEMM)
        fprop = gemm == "fprop"  # Fprop's weight also writes Dgrad's layout (one more zero fill)
        assert r["kernels"] == 2 + fprop, r["ops"]
        assert r["aten"] <= (24 if fprop else 22), r["ops"]
    r = rows["fp8 fprop, delayed scaling"]  # the amax is known: one launch per operand finds this
    assert r["triton"] == 2 and r["aten"] <= 28, r  # step's amax while it quantizes
    r = rows["mxfp4 fprop"]
    assert (r["triton"], r["kernels"]) == (2, 0) and r["aten"] <= 4, r["ops"]
    r = rows["wgrad_hadamard wgrad (had16)"]  # the rotation runs inside the kernel: no eager FP32 ops
    assert (r["triton"], r["kernels"]) == (2, 0) and r["aten"] <= 4, r["ops"]
    # no tensor is made from host data on any call after the first: the layer's rotation signs are on
    # the device once, stochastic rounding's key goes to the kernel as arguments
    assert all(r["host_data"] == 0 for r in rows.values()), {k: r["host_data"] for k, r in rows.items()}
    for case in ("mxfp4_rht wgrad (rht16: the layer's signs)", "mxfp4_sr dgrad (stochastic rounding)"):
        assert (rows[case]["triton"], rows[case]["kernels"]) == (2, 0), rows[case]["ops"]


def test_host_work_per_linear_step_is_pinned():
    """One linear layer, one optimizer step of 2 micro-batches (12 GEMMs): the weight quantized once
    per step (both layouts from one read: Fprop's and Dgrad's), dy shared by Dgrad and Wgrad (its
    two layouts sharing one set of tensor numbers). fp8: at most 8 ATen ops and 2 Triton launches
    per GEMM (89 and 14 in all; before: 122 and 16), one device kernel (a zero fill) per fresh
    operand; the MX presets no worse than before."""
    rows = {r["case"]: r for r in _bench().host_work_cases(DEV)}
    fp8 = rows["fp8 linear, one step of 2 micro-batches (total)"]
    assert fp8["triton"] == 14 and fp8["kernels"] == 10 and fp8["aten"] <= 89, fp8["ops"]
    assert fp8["aten"] / 12 <= 8 and fp8["triton"] / 12 <= 2
    assert fp8["launches"] == {"_amax_kernel": 7, "_quant_kernel": 4, "_cast_transpose_kernel": 3}, fp8["launches"]
    mx = rows["mxfp4 linear, one step of 2 micro-batches (total)"]
    assert (mx["triton"], mx["kernels"]) == (8, 0) and mx["aten"] <= 20, mx["ops"]
    wh = rows["wgrad_hadamard linear, one step of 2 micro-batches (total)"]
    assert (wh["triton"], wh["kernels"]) == (10, 0) and wh["aten"] <= 20, wh["ops"]

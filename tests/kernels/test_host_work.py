"""Host work per operand on the hardware path, counted (not timed): ATen ops dispatched, the device
kernels among them, and Triton launches (``launch/bench_kernels.py``'s ``host_work``). A quantized
step at a realistic micro-batch is host-bound when each operand costs dozens of eager ops; these
counts are the same on any machine, so they are pinned here. On CPU the Triton kernels run in the
interpreter (``tests/kernels/conftest.py``); ops inside a launch are not counted."""

import importlib.util
from pathlib import Path

import pytest
import torch

from kernels.quantizer import triton_missing_reason

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_PROBLEM = triton_missing_reason(torch.zeros(1, device=DEV))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TRITON_PROBLEM is not None, reason=str(TRITON_PROBLEM))]


def _bench():
    path = Path(__file__).resolve().parents[2] / "launch" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_work_per_operand_is_pinned():
    rows = {r["case"]: r for r in _bench().host_work_cases(DEV)}
    for gemm in ("fprop", "dgrad", "wgrad"):
        r = rows[f"fp8 {gemm}"]  # per-tensor current scaling: amax pass + quantize pass per operand
        assert r["triton"] == 4, r
        # one device kernel per operand (zeroing the amax / clip-count cell); the scale, 1/scale and
        # clip count come from the kernel (before: 18 kernels and 29 ATen ops per operand)
        assert r["kernels"] == 2, r["ops"]
        assert r["aten"] <= 26, r["ops"]
    r = rows["fp8 fprop, delayed scaling"]  # the amax is known: one launch per operand finds this
    assert r["triton"] == 2, r                # step's amax while it quantizes
    r = rows["mxfp4 fprop"]
    assert (r["triton"], r["kernels"]) == (2, 0) and r["aten"] <= 4, r["ops"]
    r = rows["wgrad_hadamard wgrad (had16)"]  # the rotation runs inside the kernel: no eager FP32 ops
    assert (r["triton"], r["kernels"]) == (2, 0) and r["aten"] <= 4, r["ops"]

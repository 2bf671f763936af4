"""Quantize/GEMM implementations behind one entry point (``kernels.gemm``).

Every backend takes its operands from one pipeline, ``kernels.operand.gemm_operands`` (rotation,
TP-reduced whole-tensor amax, current or delayed scale, quantization, telemetry). The emulated
backend is the reference and runs anywhere; hardware backends plug into
``kernels.gemm.BACKENDS`` (``fp8_scaled_mm``, ``mx_scaled_mm``, ``bf16_mm`` -- emulated formats on
BF16 tensor cores, ``kernels.bf16_mm`` -- and ``auto`` which picks per GEMM: see ``kernels.backends``;
``kernels.probe.startup_report`` finds and prints which path each format takes on this device).
``kernels.quantize`` quantizes one tensor with the reference or the
fused Triton kernels (``kernels.triton_quant``, optional: ``pip install triton``).
"""

from kernels import bf16_mm as _bf16_mm  # noqa: F401  (registers the BF16 tensor-core backend)
from kernels import scaled_mm as _scaled_mm  # noqa: F401  (registers the hardware GEMM backends)
from kernels.backends import describe_backends, select_backend
from kernels.gemm import BACKENDS, CONTRACTION_AXES, gemm
from kernels.probe import gemm_paths, startup_report
from kernels.quantizer import quantize
from precision.recipe import Gemm

__all__ = ["BACKENDS", "CONTRACTION_AXES", "Gemm", "describe_backends", "gemm", "gemm_paths", "quantize",
           "select_backend", "startup_report"]

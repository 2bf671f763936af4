"""Quantize/GEMM implementations behind one entry point (``kernels.gemm``).

The emulated backend is the reference and runs anywhere; hardware backends plug into
``kernels.gemm.BACKENDS``.
"""

from kernels.gemm import BACKENDS, CONTRACTION_AXES, gemm
from precision.recipe import Gemm

__all__ = ["gemm", "Gemm", "BACKENDS", "CONTRACTION_AXES"]

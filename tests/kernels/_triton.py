"""Where a module of Triton quantizer tests runs: the compiled kernels on a CUDA device, else Triton's
CPU interpreter (``TRITON_INTERPRET=1``, set by tests/kernels/conftest.py before triton is first
imported). ``device()`` skips the calling module, in one line, where neither can run, and returns
the device its tensors go to."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'lowprec-pretrain[gpu]')")

from kernels.triton_quant import interpreter_problem, interpreting


def device() -> str:
    if not torch.cuda.is_available() and not interpreting():
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)
    if not torch.cuda.is_available() and interpreter_problem():
        pytest.skip(interpreter_problem(), allow_module_level=True)
    return "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"

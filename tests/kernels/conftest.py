"""Kernel tests run Triton's CPU interpreter when there is no CUDA device.

TRITON_INTERPRET=1 has to be in the environment before *triton* is first imported (its standard
library, e.g. ``tl.max``, is decorated at import time), and torch.compile, torchao and megatron
all import triton. This conftest is loaded before any module under tests/kernels is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

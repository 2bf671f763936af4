"""The FP4 error controls in the fused quantizer (``kernels.fused``) and the dispatch around them.

Four-over-six, MS-EDEN (16- and 128-groups) and QuEST run as one compiled expression in the fused
quantizer, rotation and tensor amax included; each is held bit for bit to the reference quantizer
(``precision.quantize`` after ``precision.rotation.rotate``), eagerly on every case and compiled on
two (compilation is the slow part). The Triton quantizer has them too (bit for bit:
``test_triton_controls.py``); ``kernels.quantize(backend="auto")`` runs it on CUDA only and gives the
reference's bits elsewhere.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fused import compile_available, fake_quantize
from precision.quantize import quantize
from precision.recipe import OperandFormat
from precision.rotation import random_signs, rotate, rotation_size
from precision.srand import SRKey

# (label, operand format, rotation of the GEMM)
CONTROLS = [
    ("nvfp4/4over6", OperandFormat("nvfp4", four_over_six="mse"), "none"),
    ("nvfp4/4over6+had16", OperandFormat("nvfp4", four_over_six="mse"), "had16"),
    ("nvfp4/sr/4over6(mae)", OperandFormat("nvfp4", rounding="stochastic", four_over_six="mae"), "none"),
    ("nvfp4/4over6(abs_max)", OperandFormat("nvfp4", four_over_six="abs_max"), "none"),
    ("nvfp4/2d/4over6", OperandFormat("nvfp4", block2d=True, four_over_six="mse"), "none"),
    ("nvfp4/eden+rht16", OperandFormat("nvfp4", rounding="ms_eden"), "rht16"),
    ("nvfp4/eden128+rht128", OperandFormat("nvfp4", rounding="ms_eden128"), "rht128"),
    ("mxfp4/quest+had32", OperandFormat("mxfp4", scale_rule="quest"), "had32"),
    ("mxfp4/sr/quest+had16", OperandFormat("mxfp4", scale_rule="quest", rounding="stochastic"), "had16"),
]
# compiled: one NVFP4 and one MXFP4 control (each compile takes tens of seconds on a CPU; every
# control and axis was checked compiled once, by hand, with the same function)
COMPILED = ["nvfp4/eden128+rht128", "mxfp4/quest+had32"]


def _case(op, rotation, axis, seed=0, shape=(128, 256)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[5, 17] = 40.0  # an outlier: the tensor amax and one block's scale
    x.select(1 - axis, 2).zero_()  # a line of all-zero blocks
    n = rotation_size(rotation)
    signs = random_signs(n, g) if rotation.startswith("rht") else None
    key = SRKey(seed + 7)
    ref = quantize(rotate(x, axis, n, signs) if n > 1 else x, op, axis=axis, sr=key).dequantize()
    return x, signs, key, ref


def _bits_equal(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("label,op,rotation", CONTROLS, ids=[c[0] for c in CONTROLS])
@pytest.mark.parametrize("axis", [0, 1])
def test_fused_expression_equals_the_reference(label, op, rotation, axis):
    x, signs, key, ref = _case(op, rotation, axis)
    out, _ = fake_quantize(x, op, axis=axis, sr=key, rotation=rotation, signs=signs, impl="eager")
    assert _bits_equal(out, ref)


# 2-D weight tiles without a control (the plain MX / NVFP4 kernels quantize 1-D blocks: these go
# through the same whole-tensor expression as the controls; before, they were quantized 1-D silently)
PLAIN_2D = [("nvfp4/2d", OperandFormat("nvfp4", block2d=True)), ("mxfp4/2d", OperandFormat("mxfp4", block2d=True)),
            ("mxfp8/2d", OperandFormat("mxfp8_e4m3", block2d=True)),
            ("nvfp4/2d/sr", OperandFormat("nvfp4", block2d=True, rounding="stochastic"))]


@pytest.mark.parametrize("label,op", PLAIN_2D, ids=[c[0] for c in PLAIN_2D])
@pytest.mark.parametrize("axis", [0, 1])
def test_plain_2d_tiles_equal_the_reference(label, op, axis):
    x, _, key, ref = _case(op, "none", axis)
    out, _ = fake_quantize(x, op, axis=axis, sr=key, impl="eager")
    assert _bits_equal(out, ref)
    one_d = quantize(x, OperandFormat(op.fmt, rounding=op.rounding), axis=axis, sr=key).dequantize()
    assert not _bits_equal(out, one_d)  # the tiles change the bits here


@pytest.mark.skipif(not compile_available(), reason="torch.compile has no working backend here")
@pytest.mark.parametrize("label", COMPILED)
def test_compiled_equals_the_reference(label):
    op, rotation = next((o, r) for name, o, r in CONTROLS if name == label)
    x, signs, key, ref = _case(op, rotation, 1, seed=3)
    out, _ = fake_quantize(x, op, axis=1, sr=key, rotation=rotation, signs=signs, impl="compiled")
    assert _bits_equal(out, ref)


def test_given_amax_and_partial_blocks():
    """A given (TP-reduced) amax sets NVFP4's tensor scale as in the reference; a partial last
    block (in-features not a multiple of 16 / 32) is zero-padded as the reference pads it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 40, generator=g)
    for op in (OperandFormat("nvfp4", four_over_six="mse"), OperandFormat("mxfp4", scale_rule="quest")):
        amax = torch.tensor(7.5) if op.fmt == "nvfp4" else None
        ref = quantize(x, op, axis=1, amax=amax).dequantize()
        out, _ = fake_quantize(x, op, axis=1, amax=amax, impl="eager")
        assert _bits_equal(out, ref)
    op = OperandFormat("nvfp4", rounding="ms_eden")
    key = SRKey(2)
    assert _bits_equal(fake_quantize(x, op, axis=1, sr=key, impl="eager")[0],
                       quantize(x, op, axis=1, sr=key).dequantize())


def test_an_sr_generator_gets_the_references_draws():
    op = OperandFormat("nvfp4", rounding="ms_eden")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    out, _ = fake_quantize(x, op, sr=torch.Generator().manual_seed(9))
    assert _bits_equal(out, quantize(x, op, sr=torch.Generator().manual_seed(9)).dequantize())


@pytest.mark.parametrize("label,op,rotation", CONTROLS[:1] + CONTROLS[5:8], ids=[c[0] for c in CONTROLS[:1] + CONTROLS[5:8]])
def test_auto_on_a_cpu_gives_the_reference(label, op, rotation):
    x = torch.randn(16, 128)
    assert op.triton_missing is None and op.rounding.triton  # a Triton kernel (used on CUDA)
    out = kernels.quantize(x, op, backend="auto", sr=SRKey(1))  # CPU: the reference
    ref = quantize(x, op, sr=SRKey(1))
    assert torch.equal(out.codes, ref.codes) and torch.equal(out.scales, ref.scales)

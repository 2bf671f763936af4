"""The FP4 error controls in the Triton quantizer equal the reference quantizer bit for bit.

Four-over-six (``mse``, ``mae``, ``abs_max``; nearest and SR), MS-EDEN over 16- and 128-element
groups under ``rht16`` / ``rht128`` and QuEST (nearest and SR) under a Hadamard: codes, scale bytes,
tensor scale and dequantized values of ``quantize_triton`` (rotation fused) against
``precision.quantize`` after ``precision.rotation.rotate``, with the SR key's counter-based uniforms,
along either axis, and 4/6 on 2-D weight tiles (``/2d``: a 16x16 square's amax and summed error).
Without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is
imported: tests/kernels/conftest.py), so shapes are a few tiles.
"""

import pytest
import torch

# isort: off
from tests.kernels._triton import device  # first: skips the module where triton is not installed
# isort: on

import kernels
from kernels.operand import gemm_operands
from kernels.triton_quant import cast_transpose_triton, quantize_triton
from precision.blocks import to_blocks
from precision.eden import VAL_MAX
from precision.elements import e2m1_decode
from precision.four_over_six import fouroversix_quantize_blocks
from precision.quantize import quantize
from precision.recipe import Gemm, OperandFormat, parse_gemm
from precision.rotation import random_signs, rotate, rotation_size
from precision.srand import SRKey
from precision.state import LayerQuantState

DEV = device()
pytestmark = pytest.mark.gpu  # on a CUDA device the compiled kernels; without one the interpreter

# (label, operand format, the GEMM's rotation, shape [rows, cols])
CONTROLS = [
    ("nvfp4/4over6", OperandFormat("nvfp4", four_over_six="mse"), "none", (24, 40)),
    ("nvfp4/sr/4over6(mae)+had16", OperandFormat("nvfp4", rounding="stochastic", four_over_six="mae"), "had16",
     (32, 32)),
    ("nvfp4/4over6(abs_max)", OperandFormat("nvfp4", four_over_six="abs_max"), "none", (16, 48)),
    ("nvfp4/2d/4over6", OperandFormat("nvfp4", block2d=True, four_over_six="mse"), "none", (40, 48)),
    ("nvfp4/2d/4over6(abs_max)+had16", OperandFormat("nvfp4", block2d=True, four_over_six="abs_max"), "had16",
     (32, 32)),
    ("nvfp4/eden+rht16", OperandFormat("nvfp4", rounding="ms_eden"), "rht16", (32, 32)),
    ("nvfp4/eden128+rht128", OperandFormat("nvfp4", rounding="ms_eden128"), "rht128", (128, 128)),
    ("mxfp4/quest+had32", OperandFormat("mxfp4", scale_rule="quest"), "had32", (32, 64)),
    ("mxfp4/sr/quest", OperandFormat("mxfp4", scale_rule="quest", rounding="stochastic"), "none", (16, 80)),
]


def bits_equal(a, b):
    """Same bits everywhere, except that any NaN equals any NaN."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def assert_same(ref, out):
    assert torch.equal(ref.codes, out.codes.cpu()), "codes differ"
    assert torch.equal(ref.scales, out.scales.cpu()), "scale bytes differ"
    if ref.tensor_scale is not None:
        assert bits_equal(ref.tensor_scale.reshape(1), out.tensor_scale.cpu().reshape(1)), "tensor scale differs"
    assert bits_equal(ref.dequantize(), out.dequantized.cpu()), "dequantized values differ"


def operand(shape, axis, rotation, seed=0):
    """Gaussian with an outlier (the tensor amax), a line of zero blocks, signed zeros, E2M1
    midpoints and -- unrotated -- a block holding NaN and one holding Inf (a rotation would spread
    them over its group); partial last blocks where the shape has them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[1, 3] = 40.0
    x.select(1 - axis, 2).zero_()
    x.select(1 - axis, 4)[:8] = -0.0
    x.select(1 - axis, 5)[:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 40 / 6
    if rotation == "none":
        x.select(1 - axis, 6)[3] = float("nan")
        x.select(1 - axis, 7)[9] = -float("inf")
    n = rotation_size(rotation)
    signs = random_signs(n, g) if rotation.startswith("rht") else None
    return x, signs


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("label,op,rotation,shape", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_control_bit_exact(label, op, rotation, shape, axis):
    x, signs = operand(shape, axis, rotation)
    key = SRKey(2**40 + 3, row_offset=2, col_offset=5, global_cols=200)
    n = rotation_size(rotation)
    ref = quantize(rotate(x, axis, n, signs) if n > 1 else x, op, axis=axis, sr=key)
    out = quantize_triton(x.to(DEV), op, axis=axis, sr=key, rotation=rotation, signs=signs, dequantize=True)
    assert_same(ref, out)


def test_the_cases_exercise_each_controls_choice():
    """The data above reach what each control decides: 4/6 keeps 4 on some blocks and 6 on others,
    MS-EDEN's stochastic scale rounds both ways, QuEST clips -- so the equalities above can fail."""
    x, signs = operand((32, 32), 1, "rht16")
    chose_4 = fouroversix_quantize_blocks(to_blocks(x, 1, 16), x.abs().amax())[3]
    assert bool(chose_4.any()) and not bool(chose_4.all())
    eden = OperandFormat("nvfp4", rounding="ms_eden")
    xr = rotate(x, 1, 16, signs)
    a = quantize(xr, eden, axis=1, sr=SRKey(1)).scales
    b = quantize(xr, eden, axis=1, sr=SRKey(2)).scales
    assert bool((a > b).any()) and bool((a < b).any())
    q = quantize(rotate(x, 1, 32), OperandFormat("mxfp4", scale_rule="quest"), axis=1)
    assert bool((e2m1_decode(q.codes).abs() == 6).any())


MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # E2M1's: QuEST rounds them down, MS-EDEN up


def test_midpoints_round_each_controls_way():
    """Hand vectors whose scaled values are exactly E2M1's midpoints: a QuEST block whose scale is
    2^0 (std 2.85) rounds them towards zero, an MS-EDEN block under s_dec = 1 and s_b = 1 (a given
    tensor amax of 255.99 x VAL_MAX, a block amax of VAL_MAX) away from zero; the kernel as the
    reference, each rule checked on the reference's own codes first."""
    mids = torch.tensor(MIDPOINTS)
    xq = torch.cat([mids, -mids, torch.full((9,), 3.0), torch.full((9,), -3.0)]).reshape(1, 32)
    op = OperandFormat("mxfp4", scale_rule="quest")
    ref = quantize(xq, op)
    assert ref.scales.item() == 127 and e2m1_decode(ref.codes[0, :7]).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4]
    assert_same(ref, quantize_triton(xq.to(DEV), op, dequantize=True))
    val_max = torch.tensor(VAL_MAX)
    xe = torch.cat([mids, -mids, val_max.reshape(1), torch.zeros(1)]).reshape(1, 16)
    amax = torch.tensor(255.99) * val_max
    op = OperandFormat("nvfp4", rounding="ms_eden")
    ref = quantize(xe, op, amax=amax, sr=SRKey(3))
    assert ref.tensor_scale.item() == 1.0 and e2m1_decode(ref.codes[0, :7]).tolist() == [0.5, 1, 1.5, 2, 3, 4, 6]
    assert_same(ref, quantize_triton(xe.to(DEV), op, amax=amax.to(DEV), sr=SRKey(3), dequantize=True))


@pytest.mark.parametrize("op", [OperandFormat("nvfp4", four_over_six="mse"), OperandFormat("nvfp4", rounding="ms_eden")],
                         ids=["4over6", "eden"])
def test_given_amax_sets_the_tensor_scale(op):
    """A given (TP-reduced) amax: the control's own tensor scale from it, as in the reference."""
    x, _ = operand((16, 32), 1, "none")
    amax = torch.tensor(55.0)
    ref = quantize(x, op, axis=1, amax=amax, sr=SRKey(4))
    assert_same(ref, quantize_triton(x.to(DEV), op, axis=1, amax=amax.to(DEV), sr=SRKey(4), dequantize=True))


def test_eden128_pads_the_last_group_with_zero_blocks():
    """Without a rotation the 128-group may overhang the axis (80 = 5 blocks): the reference pads
    zero blocks, the kernel's masked 128-wide tile reads zeros -- the same sums."""
    x, _ = operand((16, 80), 1, "none")
    op = OperandFormat("nvfp4", rounding="ms_eden128")
    assert_same(quantize(x, op, axis=1, sr=SRKey(6)), quantize_triton(x.to(DEV), op, axis=1, sr=SRKey(6),
                                                                      dequantize=True))


def test_contraction_last_packed_bf16_form_and_cast_transpose():
    """The hardware forms: packed contraction-last codes; the BF16 form is element x E4M3 block
    scale (1 / g_enc for the GEMM output); a cast-transpose quantizes both layouts as two calls."""
    x, _ = operand((32, 64), 0, "none")
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    op = OperandFormat("nvfp4", four_over_six="mse")
    ref = quantize(x, op, axis=0)
    out = quantize_triton(x.to(DEV), op, axis=0, layout="contraction_last", pack=True)
    assert torch.equal(out.codes.cpu(), quantize(x.t().contiguous(), op, axis=1).packed())
    assert torch.equal(out.scales.cpu(), ref.scales.t())
    bf = quantize_triton(x.to(DEV), op, axis=0, layout="contraction_last", codes=False, bf16_form=True)
    scale = ref.scales.t().view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    assert torch.equal(bf.bf16.cpu().float(), e2m1_decode(ref.codes.t()) * scale)
    assert bits_equal(bf.out_scale.cpu().reshape(1), (1.0 / ref.tensor_scale).reshape(1))
    eden = OperandFormat("nvfp4", rounding="ms_eden")
    row, col = cast_transpose_triton(x.to(DEV), op, eden, sr_col=SRKey(8))
    assert torch.equal(row.codes.cpu(), quantize(x, op, axis=1).codes)
    ref_col = quantize(x, eden, axis=0, sr=SRKey(8))
    assert torch.equal(col.codes.cpu(), ref_col.codes.t()) and torch.equal(col.scales.cpu(), ref_col.scales.t())
    tiles = OperandFormat("nvfp4", block2d=True, four_over_six="mse")  # 16x16 squares seen from both sides
    row, col = cast_transpose_triton(x.to(DEV), tiles, tiles)
    ref_col = quantize(x, tiles, axis=0)
    assert torch.equal(row.codes.cpu(), quantize(x, tiles, axis=1).codes) and torch.equal(col.codes.cpu(), ref_col.codes.t())
    assert torch.equal(col.scales.cpu(), ref_col.scales.t())
    with pytest.raises(ValueError, match="cast_transpose: nvfp4/eden128: the EDEN group"):
        cast_transpose_triton(x.to(DEV), op, OperandFormat("nvfp4", rounding="ms_eden128"))


def test_kernels_quantize_triton_backend():
    x, signs = operand((32, 32), 1, "rht16")
    op = OperandFormat("nvfp4", rounding="ms_eden")
    kw = {"axis": 1, "sr": SRKey(5), "rotation": "rht16", "signs": signs}
    ref = kernels.quantize(x, op, backend="reference", **kw)
    out = kernels.quantize(x.to(DEV), op, backend="triton", **kw)
    assert torch.equal(ref.codes, out.codes.cpu()) and torch.equal(ref.scales, out.scales.cpu())
    assert bits_equal(ref.dequantize(), out.dequantize().cpu())


def test_what_stays_refused_is_refused_in_one_line():
    """4/6 on 2-D tiles rounds to nearest (as the reference refuses SR there); a 128-group is wider
    than the cast-transpose's 64-element tile (the cast-transpose test above)."""
    op = OperandFormat("nvfp4", block2d=True, rounding="stochastic", four_over_six="mse")
    with pytest.raises(ValueError, match=r"^nvfp4/sr/2d/4over6: 4over6 with 2-D tiles rounds to nearest \(one quantized "
                                         r"weight serves Fprop and Dgrad\)$"):
        quantize_triton(torch.randn(32, 32, device=DEV), op, sr=SRKey(1))
    with pytest.raises(ValueError, match="4over6 with 2-D tiles rounds to nearest"):
        quantize(torch.randn(32, 32), op, sr=SRKey(1))


@pytest.mark.parametrize("w_fmt", ["nvfp4/2d", "nvfp4/2d/4over6", "mxfp4/2d"])
def test_operand_pipeline_quantizes_a_2d_weight_with_the_kernel(w_fmt, monkeypatch):
    """A ``/2d`` weight in the hardware-GEMM operand path (``impl="triton"``) is quantized by the
    Triton kernel, once for Fprop and Dgrad, with the reference pipeline's codes and scales on both
    GEMMs (Dgrad's scales laid along its own axis from the same squares)."""
    calls = {"n": 0}
    orig = kernels.triton_quant.quantize_triton

    def counted(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(kernels.triton_quant, "quantize_triton", counted)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(40, 48, generator=g) * torch.exp2(torch.randint(-3, 3, (40, 1), generator=g))).to(DEV)
    x, dy = torch.randn(8, 48, generator=g).to(DEV), torch.randn(8, 40, generator=g).to(DEV)
    a_fmt = w_fmt.split("/")[0]
    fprop, dgrad = parse_gemm(f"{a_fmt}@{w_fmt}", Gemm.FPROP), parse_gemm(f"{a_fmt}@{w_fmt}", Gemm.DGRAD)
    got, want = LayerQuantState(), LayerQuantState()
    for gemm, recipe, act in ((Gemm.FPROP, fprop, x), (Gemm.DGRAD, dgrad, dy)):
        before = calls["n"]
        t = gemm_operands(gemm, act, w, recipe, got, impl="triton", codes=True).b
        weight_calls = calls["n"] - before - 1  # the activation's own call
        r = gemm_operands(gemm, act, w, recipe, want, impl="reference", codes=True).b
        assert weight_calls == (1 if gemm is Gemm.FPROP else 0), (gemm, weight_calls)  # Dgrad reuses Fprop's
        assert torch.equal(t.codes.view(torch.uint8), r.codes.view(torch.uint8)), (w_fmt, gemm)
        assert torch.equal(t.scales.view(torch.uint8), r.scales.view(torch.uint8)), (w_fmt, gemm)
        if r.tensor_scale is not None:
            assert torch.equal(t.tensor_scale, r.tensor_scale)

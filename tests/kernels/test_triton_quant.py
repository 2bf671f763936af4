"""The fused Triton quantizers equal the CPU reference bit for bit.

Without CUDA they run in Triton's interpreter: TRITON_INTERPRET=1 must be set before the kernels
are decorated (``@triton.jit`` reads it then), so tests/kernels/conftest.py sets it before triton is
first imported (``tests.kernels._triton``: where the module runs, or its one-line skip). With CUDA the same tests run the compiled kernels on the GPU
against the reference computed on the CPU. Shapes are small: the interpreter runs every program
instance through numpy.
"""

import pytest
import torch

# isort: off
from tests.kernels._triton import device  # first: skips the module where triton is not installed
# isort: on

import kernels
from kernels.fused import _sr_uniforms
from kernels.triton_quant import quantize_triton
from precision import FORMATS, OperandFormat, quantize
from precision.rotation import random_signs, rotate

DEV = device()
# pytest -m gpu selects these: on a CUDA device they check the compiled kernels; without one they
# run in Triton's interpreter (tests/kernels/conftest.py), as every CPU run does
pytestmark = pytest.mark.gpu
ALL_FORMATS = kernels.quantizer.TRITON_FORMATS  # the registry's formats with a Triton kernel (MXFP6 too)


def bits_equal(a, b):
    """Same bits everywhere, except that any NaN equals any NaN."""
    nan = torch.isnan(a)
    same_nan = torch.equal(nan, torch.isnan(b))
    return same_nan and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def data(rows=48, cols=80):
    """Wide dynamic range, a partial last block (80 = 2.5 blocks of 32), NaN, Inf, zero and
    FP32-subnormal blocks, and E2M1 ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)
    x[3, 5] = float("nan")
    x[7:9, 40] = float("inf")
    x[9, 41] = -float("inf")
    x[10, :32] = 0
    x[11, :32] = 1e-40
    x[12, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    x[13, :8] = -0.0
    return x.to(DEV)


def ref_quantize(x, *args, **kw):
    """The specification, computed on the CPU."""
    return quantize(x.cpu(), *args, **kw)


def assert_same(ref, out):
    assert torch.equal(ref.codes.cpu(), out.codes.cpu()), "codes differ"
    assert torch.equal(ref.scales.cpu(), out.scales.cpu()), "scales differ"
    assert bits_equal(ref.dequantize().cpu(), out.dequantized.cpu()), "dequantized values differ"


ALL_CASES = [(f, axis, str(rule)) for f in ALL_FORMATS for axis in (0, 1) for rule in FORMATS[f].scale_rules]
# every scale rule has a kernel (quest here without its rotation; the FP4 error controls under their
# rotations: test_triton_controls.py)
CASES = [c for c in ALL_CASES if not OperandFormat(c[0], scale_rule=c[2]).triton_missing]


@pytest.mark.parametrize("fmt,axis,rule", CASES)
def test_nearest_bit_exact(fmt, axis, rule):
    x = data()
    ref = ref_quantize(x, fmt, axis=axis, scale_rule=rule)
    out = quantize_triton(x, OperandFormat(fmt, scale_rule=rule), axis=axis, dequantize=True)
    assert_same(ref, out)


@pytest.mark.parametrize("fmt,rule", [("nvfp4", "floor"), ("mxfp4", "floor"), ("mxfp8_e4m3", "rceil")])
@pytest.mark.parametrize("axis", [0, 1])
def test_2d_tiles_bit_exact(fmt, rule, axis):
    """2-D weight tiles (``/2d``): each square's amax (NaN/Inf: the whole square) scales all its
    blocks, along either axis; partial edge squares (40 x 80 in 16- and 32-squares)."""
    x = data(40, 80)
    op = OperandFormat(fmt, scale_rule=rule, block2d=True)
    assert CASES == ALL_CASES and op.triton_missing is None  # nothing is refused
    assert_same(ref_quantize(x, op, axis=axis), quantize_triton(x, op, axis=axis, dequantize=True))
    with pytest.raises(ValueError, match=rf"^{fmt}/2d.*: 2-D block scaling takes a 2-D tensor \(a weight \[out, in\]\), "
                                         r"got shape \(2, 40, 80\)$"):
        quantize_triton(torch.stack([x, x]), op, axis=-1)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e5m2"])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_any_axis_bf16_input_no_copy(fmt, axis):
    """3-D bf16 input, blocks along the first, a middle or the last axis (strided loads)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 40, 6, generator=g) * 5).bfloat16().to(DEV)
    ref = ref_quantize(x, fmt, axis=axis)
    assert_same(ref, quantize_triton(x, fmt, axis=axis, dequantize=True))


@pytest.mark.parametrize("axis", [0, 1])
def test_transposed_view_input(axis):
    x = data().t()  # non-contiguous: handled through strides
    ref = ref_quantize(x, "mxfp4", axis=axis)
    assert_same(ref, quantize_triton(x, "mxfp4", axis=axis, dequantize=True))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_delayed_amax_counts_clipping(fmt):
    x = data(32, 64)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    ref = ref_quantize(x, fmt, amax=1.0)
    out = quantize_triton(x, fmt, amax=1.0, dequantize=True)
    assert_same(ref, out)
    assert int(out.num_clipped) == int(ref.num_clipped) > 0


# ------------------------------------------------------------------ rotations
def smooth(rows=64, cols=64, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, cols)
    x[5, 3] = 0
    x[6, 7] = 300.0  # an outlier for the rotation to spread
    return x.to(DEV)


ROT_CASES = [(f, axis, rot) for rot in ("had16", "rht16")
             for f in ("mxfp4", "nvfp4", "mxfp8_e4m3", "fp8_e4m3") for axis in (0, 1)]


@pytest.mark.parametrize("fmt,axis,rotation", ROT_CASES)
def test_fused_hadamard16_bit_exact(fmt, axis, rotation):
    """had16/rht16: the fused butterfly sums in the CPU reference matmul's order -> same bits."""
    x = smooth()
    signs = random_signs(16, torch.Generator().manual_seed(3)) if rotation == "rht16" else None
    ref = ref_quantize(rotate(x.cpu(), axis, 16, signs), fmt, axis=axis)
    out = quantize_triton(x, fmt, axis=axis, rotation=rotation, signs=signs, dequantize=True)
    assert_same(ref, out)


@pytest.mark.parametrize("fmt,axis", [("mxfp4", 0), ("mxfp4", 1), ("nvfp4", 1), ("fp8_e4m3", 0), ("mxfp8_e4m3", 0)])
def test_fused_hadamard32_bit_exact(fmt, axis):
    """had32: 1/sqrt(32) is inexact, so where it is multiplied in matters; the kernel multiplies it
    in after the butterflies, as the specification's rotate does -> the same bits (it used to scale
    first and flipped codes on rounding boundaries)."""
    x = smooth()
    ref = ref_quantize(rotate(x.cpu(), axis, 32), fmt, axis=axis)
    assert_same(ref, quantize_triton(x, fmt, axis=axis, rotation="had32", dequantize=True))


@pytest.mark.parametrize("rotation,n", [("had32", 32), ("had16", 16)])
def test_fused_rotation_gives_the_spec_rotated_values(rotation, n):
    """The rotated values themselves, seen through the per-tensor amax (max |rotate(x)|, float32
    bits): 16 tensors, each exactly the spec's (before, with 1/sqrt(32) multiplied in first, 9 of
    16 had32 amaxes were 1 ulp off)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        x = torch.randn(8, 64, generator=g)
        r = quantize_triton(x.to(DEV), "fp8_e4m3", axis=1, rotation=rotation)
        assert bits_equal(r.amax.cpu().reshape(1), rotate(x, 1, n).abs().amax().reshape(1))


def test_fused_rotation_keeps_the_spec_order_at_the_float32_edges():
    """Where scaling first and scaling last differ even for had16 (1/4 is exact): sums that overflow
    float32 before the final 1/4 and subnormal products. The kernel follows the spec there too."""
    x = torch.zeros(32, 32)
    x[0, :16] = 3.0e38  # the butterflies overflow to inf before the 1/4: the spec gives inf (a NaN block)
    x[1, :16] = torch.tensor([2.0 ** -148, 2.0 ** -149] * 8)  # x/4 underflows; the sums do not
    x[2] = torch.linspace(-5, 5, 32)
    x = x.to(DEV)
    for axis in (0, 1):
        ref = ref_quantize(rotate(x.cpu(), axis, 16), "mxfp8_e4m3", axis=axis)
        assert_same(ref, quantize_triton(x, "mxfp8_e4m3", axis=axis, rotation="had16", dequantize=True))


def test_rotation_needs_whole_groups_and_signs():
    x = smooth(8, 40)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        quantize_triton(x, "mxfp4", rotation="had16")
    with pytest.raises(ValueError, match="needs signs"):
        quantize_triton(smooth(), "mxfp4", rotation="rht16")


# ------------------------------------------------------------------ stochastic rounding
@pytest.mark.parametrize("fmt,axis", [("mxfp4", 0), ("mxfp4", 1), ("nvfp4", 0), ("mxfp8_e5m2", 1),
                                      ("fp8_e4m3", 1)])
def test_sr_with_reference_draws_bit_exact(fmt, axis):
    """Given the reference's uniforms (what the hardware GEMM backends pass), SR is bit-exact too."""
    x = data()
    prescale = 0.75 if FORMATS[fmt].has_scale_rules else 1.0
    ref = quantize(x, fmt, axis=axis, rounding="stochastic", prescale=prescale,
                   generator=torch.Generator(DEV).manual_seed(5))
    gen = torch.Generator(DEV).manual_seed(5)
    spec_block = {"mxfp4": 32, "nvfp4": 16, "mxfp8_e5m2": 32}.get(fmt)
    if spec_block:
        u = _sr_uniforms(x, axis, spec_block, gen)
    else:
        u = torch.rand(x.shape, generator=gen, device=DEV)
    out = quantize_triton(x, OperandFormat(fmt, rounding="stochastic", prescale=prescale == 0.75), axis=axis,
                          sr=u, dequantize=True)
    assert_same(ref, out)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e5m2"])
def test_in_kernel_sr_reproducible_and_seeded(fmt):
    x = smooth()
    op = OperandFormat(fmt, rounding="stochastic")
    a = quantize_triton(x, op, axis=0, sr=torch.Generator(DEV).manual_seed(11))
    b = quantize_triton(x, op, axis=0, sr=torch.Generator(DEV).manual_seed(11))
    c = quantize_triton(x, op, axis=0, sr=torch.Generator(DEV).manual_seed(12))
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)


@pytest.mark.parametrize("fmt,lo,hi", [("mxfp4", 1.0, 1.5), ("fp8_e4m3", 1.0, 1.125)])
@pytest.mark.parametrize("axis", [0, 1])
def test_in_kernel_sr_unbiased(fmt, lo, hi, axis):
    """E[Q(v)] = v: blocks of one large value (fixing the scale at 1) and many copies of v."""
    v = lo + 0.3 * (hi - lo)
    x = torch.full((64, 64), v)
    if fmt == "mxfp4":
        x[:, ::32] = 4.0  # block amax 4 -> E8M0 scale 2^0: v sits between the E2M1 values lo and hi
    else:
        x[0, 0] = 448.0  # per-tensor scale 1
    x = x.to(DEV)
    if axis == 0:
        x = x.t().contiguous()
    out = quantize_triton(x, OperandFormat(fmt, rounding="stochastic"), axis=axis,
                          sr=torch.Generator(DEV).manual_seed(7), dequantize=True).dequantized.cpu()
    vals = out[x.cpu() == v]
    assert set(vals.unique().tolist()) <= {lo, hi}
    assert abs(vals.mean().item() - v) < 0.02 * (hi - lo) * 4  # ~4 standard errors
    assert 0.2 < (vals == hi).float().mean().item() < 0.4  # P(up) = 0.3


# ------------------------------------------------------------------ layouts for the hardware
@pytest.mark.parametrize("fmt,axis", [("mxfp4", 0), ("mxfp4", 1), ("nvfp4", 0), ("mxfp8_e4m3", 0)])
def test_contraction_last_layout_and_packing(fmt, axis):
    x = smooth()
    ref = ref_quantize(x.movedim(axis, -1).contiguous(), fmt, axis=-1)
    out = quantize_triton(x, fmt, axis=axis, layout="contraction_last", pack=fmt != "mxfp8_e4m3")
    want = ref.packed() if fmt != "mxfp8_e4m3" else ref.codes
    assert out.codes.is_contiguous() and out.scales.is_contiguous()
    assert torch.equal(out.codes.cpu(), want.cpu())
    assert torch.equal(out.scales.cpu(), ref.scales.cpu())


# ------------------------------------------------------------------ the public entry point
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e4m3"])
def test_kernels_quantize_triton_equals_reference(fmt):
    x = smooth()
    for kw in ({"axis": 0}, {"axis": 1, "rotation": "had16"}):
        ref = kernels.quantize(x.cpu(), fmt, backend="reference", **kw)
        out = kernels.quantize(x, fmt, backend="triton", **kw)
        assert type(out) is type(ref)
        assert torch.equal(ref.codes, out.codes.cpu()) and torch.equal(ref.scales, out.scales.cpu())
        assert bits_equal(ref.dequantize(), out.dequantize().cpu())


def test_kernels_quantize_sr_generator_reproducible():
    x = smooth()
    a = kernels.quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator(DEV).manual_seed(1),
                         backend="triton")
    b = kernels.quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator(DEV).manual_seed(1),
                         backend="triton")
    assert torch.equal(a.codes, b.codes)


# ------------------------------------------------------------------ counter-based SR, tensor amax
@pytest.mark.parametrize("fmt,axis", [("mxfp4", 0), ("mxfp4", 1), ("nvfp4", 1), ("mxfp8_e5m2", 0),
                                      ("fp8_e4m3", 1)])
def test_sr_key_in_kernel_equals_reference(fmt, axis):
    """SRKey uniforms are generated in the kernel from the key: the same codes as the reference."""
    from precision.srand import SRKey

    x = data(24, 48)
    key = SRKey(2**62 + 7, row_offset=5, col_offset=3, global_cols=100)
    ref = ref_quantize(x, fmt, axis=axis, rounding="stochastic", sr=key)
    out = quantize_triton(x, OperandFormat(fmt, rounding="stochastic"), axis=axis, sr=key, dequantize=True)
    assert_same(ref, out)
    assert not torch.equal(ref.codes, ref_quantize(x, fmt, axis=axis).codes)  # SR did round differently


def test_sr_key_3d_any_axis_equals_reference():
    from precision.srand import SRKey

    x = (torch.randn(2, 40, 3, generator=torch.Generator().manual_seed(4)) * 3).to(DEV)
    for axis in (0, 1, 2):
        ref = ref_quantize(x, "mxfp4", axis=axis, rounding="stochastic", sr=SRKey(9))
        assert_same(ref, quantize_triton(x, OperandFormat("mxfp4", rounding="stochastic"), axis=axis, sr=SRKey(9),
                                         dequantize=True))


def test_nvfp4_external_amax_and_tie_vector():
    """The tensor scale from a given amax (the TP-reduced one), and NUMERICS.md's tie vector:
    one true FP32 division gives scale bytes [0x7e, 0x72]."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 4.3125, 1.6171875
    out = quantize_triton(x.to(DEV), "nvfp4", dequantize=True)
    assert out.scales.cpu().flatten().tolist() == [0x7E, 0x72]
    y = data(16, 48)
    amax = torch.tensor(1e5, device=DEV)
    ref = ref_quantize(y, "nvfp4", amax=amax.cpu())
    out = quantize_triton(y, "nvfp4", amax=amax, dequantize=True)
    assert_same(ref, out)
    assert torch.equal(ref.tensor_scale.cpu(), out.tensor_scale.cpu())


def test_zero_blocks_keep_their_sign_and_nvfp4_zero_scales_store_zero_codes():
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([-0.0, 1e-40, -1e-40, 0.0])  # an MX zero / subnormal block
    x[1, 0] = 1e4
    x[1, 16:20] = torch.tensor([1e-4, -1e-4, 5e-5, -0.0])  # NVFP4: this block's scale underflows
    mx = quantize_triton(x.to(DEV), "mxfp4", dequantize=True)
    assert mx.codes.cpu()[0, :4].tolist() == [0x8, 0, 0x8, 0]
    assert torch.signbit(mx.dequantized.cpu()[0, :4]).tolist() == [True, False, True, False]
    nv = quantize_triton(x[1:].to(DEV), "nvfp4", dequantize=True)
    assert nv.scales.cpu()[0, 1].item() == 0 and nv.codes.cpu()[0, 16:20].tolist() == [0, 0x8, 0, 0x8]


# ------------------------------------------------------------------ MXFP6 (registry entries only)
@pytest.mark.parametrize("fmt,axis,rule", [("mxfp6_e2m3", 0, "floor"), ("mxfp6_e2m3", 1, "rceil"),
                                           ("mxfp6_e3m2", 1, "floor"), ("mxfp6_e3m2", 0, "rceil")])
def test_mxfp6_nearest_and_sr_key_bit_exact(fmt, axis, rule):
    from precision.srand import SRKey

    x = data(24, 80)
    assert_same(ref_quantize(x, fmt, axis=axis, scale_rule=rule),
                quantize_triton(x, OperandFormat(fmt, scale_rule=rule), axis=axis, dequantize=True))
    ref = ref_quantize(x, fmt, axis=axis, scale_rule=rule, rounding="stochastic", sr=SRKey(31))
    assert_same(ref, quantize_triton(x, OperandFormat(fmt, rounding="stochastic", scale_rule=rule), axis=axis,
                                     sr=SRKey(31), dequantize=True))


def test_operand_format_travels_whole():
    """An OperandFormat carries its rounding / scale rule / prescale into every quantizer."""
    from kernels.fused import fake_quantize
    from precision import OperandFormat
    from precision.srand import SRKey

    x = data(16, 64)
    op = OperandFormat("mxfp6_e3m2", rounding="stochastic", scale_rule="rceil", prescale=True)
    ref = ref_quantize(x, op, axis=0, sr=SRKey(4))
    assert ref.prescale == 0.75
    assert_same(ref, quantize_triton(x, op, axis=0, sr=SRKey(4), dequantize=True))
    assert bits_equal(ref.dequantize(), fake_quantize(x.cpu(), op, axis=0, sr=SRKey(4), impl="eager")[0])
    assert torch.equal(kernels.quantize(x, op, axis=0, sr=SRKey(4), backend="reference").codes.cpu(), ref.codes)
    with pytest.raises(TypeError, match="rounding"):  # one signature: the OperandFormat brings its settings
        quantize_triton(x, op, rounding="nearest")

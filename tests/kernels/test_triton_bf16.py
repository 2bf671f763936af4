"""The fused Triton quantizer writes the BF16 operand of ``bf16_mm`` directly, equal bit for bit to
the reference pipeline's BF16 form (``kernels.bf16_operand``). On CPU it runs in Triton's
interpreter (``tests/kernels/conftest.py`` sets TRITON_INTERPRET=1): tiny shapes."""

import pytest
import torch

from kernels.operand import gemm_operands
from kernels.quantizer import triton_missing_reason
from precision import FORMATS, Gemm, LayerQuantState
from precision.recipe import parse_gemm

TRITON_PROBLEM = triton_missing_reason(torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"))
# pytest -m gpu selects these: on a CUDA device they check the compiled kernels; without one they
# run in Triton's interpreter (tests/kernels/conftest.py), as every CPU run does
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TRITON_PROBLEM is not None, reason=str(TRITON_PROBLEM))]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def data(t=64, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g) * torch.exp2(torch.randint(-30, 30, (t, 1), generator=g).float())
    x[3, 7], x[20, 1] = float("nan"), -0.0
    return x


@pytest.mark.parametrize("spec,g", [
    ("mxfp4", Gemm.FPROP), ("mxfp4+sr+prescale", Gemm.WGRAD), ("mxfp6_e2m3+rceil", Gemm.FPROP),
    ("nvfp4/sr@nvfp4", Gemm.WGRAD), ("fp8_e4m3@fp8_e5m2", Gemm.FPROP), ("mxfp8_e4m3", Gemm.WGRAD),
])
def test_triton_bf16_operands_equal_the_reference(spec, g):
    a, b = data(), data(seed=1)
    if g is Gemm.FPROP:
        b = b[:16]
    else:
        b = b[:, :16]
    recipe = parse_gemm(spec, g)
    ops = {impl: gemm_operands(g, a.to(DEV), b.to(DEV), recipe, LayerQuantState(4, "l"), impl=impl, bf16=True)
           for impl in ("reference", "triton")}
    for ref, tri in ((ops["reference"].a, ops["triton"].a), (ops["reference"].b, ops["triton"].b)):
        assert tri.bf16.dtype == torch.bfloat16 and tri.bf16.shape == ref.bf16.shape
        # one pass writes the BF16 operand (no codes); MXFP8's shift needs the codes' largest scale
        assert (tri.codes is None) == (FORMATS[ref.fmt.fmt].bf16_shift == 0)
        assert same_bits(tri.bf16, ref.bf16), f"{spec} {g.value} {ref.fmt.fmt}"
        assert (tri.out_scale is None) == (ref.out_scale is None)
        if ref.out_scale is not None:
            assert same_bits(tri.out_scale, ref.out_scale)


ROTATED = [("mxfp4+had16", Gemm.WGRAD), ("mxfp4/sr+had32", Gemm.WGRAD), ("nvfp4/sr@nvfp4+rht16_te", Gemm.WGRAD),
           ("fp8_e4m3@fp8_e5m2+rht16", Gemm.DGRAD), ("mxfp8_e4m3+had16", Gemm.FPROP)]


@pytest.mark.parametrize("form", ["bf16", "codes"])
@pytest.mark.parametrize("spec,g", ROTATED)
def test_hardware_path_fuses_the_rotation(monkeypatch, spec, g, form):
    """A rotated GEMM on the hardware path (``wgrad_hadamard``'s Wgrad): the Triton kernel rotates
    as it quantizes -- no eager FP32 rotation -- and its operands are the reference's bit for bit,
    in BF16 form (``bf16_mm``) and in codes + scales (``torch._scaled_mm``)."""
    import kernels.operand as op

    a, b = data(), data(seed=1)
    b = b[:16] if g is Gemm.FPROP else b[:, :16] if g is Gemm.WGRAD else data(seed=1)[:32, :16]
    if g is Gemm.DGRAD:
        a = a[:, :32]
    recipe = parse_gemm(spec, g)
    eager = []
    real_rotate = op.rotate
    monkeypatch.setattr(op, "rotate", lambda *x, **k: eager.append(1) or real_rotate(*x, **k))
    kw = {"bf16": True} if form == "bf16" else {"codes": True}
    ops = {}
    for impl in ("reference", "triton"):
        eager.clear()
        ops[impl] = gemm_operands(g, a.to(DEV), b.to(DEV), recipe, LayerQuantState(4, "l"), impl=impl, **kw)
        assert len(eager) == (2 if impl == "reference" else 0), f"{impl}: eager rotations {len(eager)}"
    for ref, tri in ((ops["reference"].a, ops["triton"].a), (ops["reference"].b, ops["triton"].b)):
        if form == "bf16":
            assert same_bits(tri.bf16, ref.bf16), f"{spec} {g.value} {ref.fmt.fmt}"
            assert (tri.out_scale is None) == (ref.out_scale is None)
            if ref.out_scale is not None:
                assert same_bits(tri.out_scale, ref.out_scale)
        else:  # as torch._scaled_mm takes them (FP4 packed two per byte, padded)
            from kernels.scaled_mm import hw_operand

            hr, ht = hw_operand(ref), hw_operand(tri)
            assert torch.equal(ht.codes.cpu(), hr.codes.cpu()), f"{spec} {g.value} {ref.fmt.fmt}: codes"
            assert same_bits(ht.scales.float(), hr.scales.float()), f"{spec} {g.value}: scales"
            if ref.tensor_scale is not None:
                assert same_bits(tri.tensor_scale, ref.tensor_scale)

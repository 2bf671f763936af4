"""Hardware GEMM backends: scale layouts against torchao, operands against the emulated backend.

On CPU, ``hw_gemm(..., capability=..., mm=emulated_scaled_mm)`` runs the whole hardware path --
quantize contraction-major, pad, pack FP4, swizzle scales -- and then *decodes* the prepared
operands instead of calling ``torch._scaled_mm``: those decoded operands must equal the emulated
backend's, bit for bit, for every GEMM layout. The ``_scaled_mm`` call itself is tested on the GPU
(``@pytest.mark.gpu``).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import math

import pytest

from kernels.backends import BackendError, device_capability
from kernels.gemm import CONTRACTION_AXES, gemm
from kernels.operand import _pad_axis
from kernels.layouts import blocked_offsets, from_blocked, pack_fp4, to_blocked, unpack_fp4
from kernels.scaled_mm import HwOperand, emulated_scaled_mm, hw_gemm
from kernels.torch_api import scaled_mm_enums
from tests.kernels._promises import assert_one_bf16_rounding_of
from precision import Gemm, LayerQuantState, quantize
from precision.quantize import FORMATS
from precision.recipe import parse_gemm
from precision.rotation import rotate, rotation_size
from precision.srand import SRKey


def _triton_problem() -> str | None:
    from kernels.quantizer import triton_importable

    if not triton_importable():
        return "triton is not installed (pip install 'lowprec-pretrain[gpu]')"
    if torch.cuda.is_available():
        return None
    from kernels.triton_quant import interpreter_problem, interpreting

    return "no CUDA device and TRITON_INTERPRET is not 1" if not interpreting() else interpreter_problem()


TRITON_PROBLEM = _triton_problem()


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("rows,cols", [(128, 4), (130, 3), (1, 1), (300, 17), (256, 8), (64, 2)])
def test_to_blocked_matches_torchao_and_round_trips(rows, cols):
    ao = pytest.importorskip("torchao.prototype.mx_formats.utils", reason="torchao is the independent oracle")
    s = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    b = to_blocked(s)
    assert torch.equal(b, ao.to_blocked(s))
    assert torch.equal(from_blocked(b, rows, cols), s)
    e8 = s.view(torch.float8_e8m0fnu)  # the dtype the hardware takes is kept
    assert to_blocked(e8).dtype == torch.float8_e8m0fnu
    assert torch.equal(from_blocked(to_blocked(e8), rows, cols).view(torch.uint8), s)


def test_blocked_layout_small_example():
    """Element (r, c) of a 128x4 tile sits at (r % 32) * 16 + (r // 32) * 4 + c."""
    off = blocked_offsets(128, 4)
    assert off[0, 0] == 0 and off[0, 3] == 3 and off[1, 0] == 16 and off[32, 0] == 4 and off[127, 3] == 511
    off2 = blocked_offsets(256, 8)  # tiles: row-tile major, 512 bytes each
    assert off2[0, 4] == 512 and off2[128, 0] == 1024
    with pytest.raises(ValueError, match="cannot hold a blocked"):
        from_blocked(torch.zeros(100, dtype=torch.uint8), 128, 4)


def test_fp4_pack_round_trip():
    c = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    p = pack_fp4(c)
    assert p.shape == (5, 32) and torch.equal(p[:, 0], c[:, 0] | (c[:, 1] << 4))
    assert torch.equal(unpack_fp4(p), c)
    q = quantize(torch.randn(5, 64), "mxfp4")
    assert torch.equal(pack_fp4(q.codes), q.packed())  # the reference's convention


# ------------------------------------------------------------------ operands == emulated operands
def operands(seed=1, t=70, n_in=96, n_out=40):
    """Odd token and feature counts: padding of rows and of the contraction axis."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g)
    dy = torch.randn(t, n_out, generator=g)
    return {Gemm.FPROP: (x, w), Gemm.DGRAD: (dy, w), Gemm.WGRAD: (dy, x)}


def emulated_operands(g, a, b, recipe, seed=3):
    """The emulated backend's dequantized operands, contraction axis last ([rows, K])."""
    state = LayerQuantState(seed, "l")
    a_axis, b_axis = CONTRACTION_AXES[g]
    if recipe.rotation != "none":
        n = rotation_size(recipe.rotation)
        signs = state.rotation_signs(g, n, 0 if recipe.rotation.endswith("resample") else None) \
            if recipe.rotation.startswith("rht") else None
        multiple = math.lcm(n, *(FORMATS[f.fmt].block or 1 for f in (recipe.a, recipe.b)))
        a, b = _pad_axis(a, a_axis, multiple), _pad_axis(b, b_axis, multiple)  # as the emulated backend
        a, b = rotate(a, a_axis, n, signs), rotate(b, b_axis, n, signs)
    out = []
    for t, axis, fmt, name in ((a, a_axis, recipe.a, g.operands[0]), (b, b_axis, recipe.b, g.operands[1])):
        # SR: counter-based uniforms keyed by (seed, layer, GEMM, operand, call) and the element index
        sr = SRKey(state.sr_seed(g, name, 0)) if fmt.rounding == "stochastic" else None
        q = quantize(t, fmt.fmt, axis=axis, rounding=fmt.rounding, scale_rule=fmt.scale_rule, sr=sr,
                     prescale=fmt.prescale_factor)
        out.append(q.dequantize().movedim(axis, -1))
    return out


SPECS = ["fp8", "mxfp4", "mxfp8_e4m3", "nvfp4", "mxfp4+had16", "mxfp4+rceil", "mxfp4+sr+prescale",
         "nvfp4/sr@nvfp4+rht16", "fp8+sr"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("g", list(Gemm))
def test_hardware_operands_equal_emulated(spec, g):
    a, b = operands()[g]
    recipe = parse_gemm(spec, g)
    backend = "fp8_scaled_mm" if spec.startswith("fp8") else "mx_scaled_mm"
    seen = {}

    def capture(qa: HwOperand, qb: HwOperand):
        seen["a"], seen["b"] = qa, qb
        return emulated_scaled_mm(qa, qb)

    out = hw_gemm(g, a, b, recipe, LayerQuantState(3, "l"), backend=backend, capability=(10, 0), mm=capture,
                  quantizer="reference")
    want_a, want_b = emulated_operands(g, a, b, recipe)
    for key, want in (("a", want_a), ("b", want_b)):
        got = seen[key].decode()
        rows, k = want.shape
        assert torch.equal(got[:rows, :k], want), f"{key} operand differs"
        assert not got[rows:].any() and not got[:, k:].any(), "padding must decode to zeros"
        assert seen[key].codes.is_contiguous()
    # "reference" = the emulated backend with eager quantizers (same bits, no compile time)
    ref = gemm(g, a, b, recipe, "reference", state=LayerQuantState(3, "l"))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(TRITON_PROBLEM is not None, reason=str(TRITON_PROBLEM))
@pytest.mark.parametrize("spec,g", [("mxfp4", Gemm.WGRAD), ("nvfp4/sr@nvfp4+rht16", Gemm.DGRAD),
                                    ("fp8+sr", Gemm.WGRAD), ("mxfp8_e4m3", Gemm.FPROP)])
def test_triton_quantizer_gives_the_same_hardware_operands(spec, g):
    a, b = operands()[g]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = a.to(dev), b.to(dev)
    recipe = parse_gemm(spec, g)
    backend = "fp8_scaled_mm" if spec.startswith("fp8") else "mx_scaled_mm"
    got = {}
    for quantizer in ("reference", "triton"):
        def capture(qa, qb, quantizer=quantizer):
            got[quantizer] = (qa, qb)
            return emulated_scaled_mm(qa, qb)

        hw_gemm(g, a, b, recipe, LayerQuantState(3, "l"), backend=backend, capability=(10, 0), mm=capture,
                quantizer=quantizer)
    for r, t in zip(got["reference"], got["triton"]):
        assert torch.equal(r.codes.cpu(), t.codes.cpu())
        assert torch.equal(r.scales.cpu(), t.scales.cpu())


def test_hw_gemm_refuses_what_it_cannot_run():
    a, b = operands()[Gemm.FPROP]
    with pytest.raises(BackendError, match="fprop: backend mx_scaled_mm is not available on sm_90"):
        hw_gemm(Gemm.FPROP, a, b, parse_gemm("mxfp4", Gemm.FPROP), LayerQuantState(), backend="mx_scaled_mm",
                capability=(9, 0))
    with pytest.raises(BackendError, match=r"cannot run mxfp4 \(block-scaled\)"):
        hw_gemm(Gemm.FPROP, a, b, parse_gemm("mxfp4", Gemm.FPROP), LayerQuantState(), backend="fp8_scaled_mm",
                capability=(10, 0))
    with pytest.raises(BackendError, match="not available on cpu"):
        gemm(Gemm.FPROP, a, b, parse_gemm("fp8", Gemm.FPROP), "fp8_scaled_mm")


def test_gfx950_scales_are_row_major():
    a, b = operands()[Gemm.FPROP]
    seen = {}

    def capture(qa, qb):
        seen["a"] = qa
        return emulated_scaled_mm(qa, qb)

    hw_gemm(Gemm.FPROP, a, b, parse_gemm("mxfp4", Gemm.FPROP), LayerQuantState(), backend="mx_scaled_mm",
            capability="gfx950", mm=capture, quantizer="reference")
    qa = seen["a"]
    assert qa.scale_layout == "row_major" and qa.scale.shape == (qa.rows, qa.k // 32)
    assert qa.scale.dtype == torch.float8_e8m0fnu and qa.data.dtype == torch.float4_e2m1fn_x2


# ------------------------------------------------------------------ the real thing (GPU)
def _needs(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels.backends import device_backends

    cap = device_capability("cuda")
    if backend not in device_backends(cap):
        pytest.skip(f"{backend} needs other hardware than {cap}")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fp8", "fp8+had16"])
@pytest.mark.parametrize("g", list(Gemm))
def test_fp8_scaled_mm_on_gpu(spec, g):
    _needs("fp8_scaled_mm")
    a, b = (t.cuda() for t in operands(t=256, n_in=256, n_out=128)[g])
    recipe = parse_gemm(spec, g)
    ref = gemm(g, a, b, recipe, "emulated", state=LayerQuantState(3, "l"))
    out = gemm(g, a, b, recipe, "fp8_scaled_mm", state=LayerQuantState(3, "l"))
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "mxfp4", "nvfp4", "mxfp4+had16"])
@pytest.mark.parametrize("g", list(Gemm))
def test_mx_scaled_mm_on_gpu(spec, g):
    _needs("mx_scaled_mm")
    a, b = (t.cuda() for t in operands(t=256, n_in=256, n_out=128)[g])
    recipe = parse_gemm(spec, g)
    ref = gemm(g, a, b, recipe, "emulated", state=LayerQuantState(3, "l"))
    out = gemm(g, a, b, recipe, "mx_scaled_mm", state=LayerQuantState(3, "l"))
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


# ------------------------------------------------------------------ BF16 output from the GEMM itself
@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fp8", "fp8+had16"])
@pytest.mark.parametrize("g", list(Gemm))
def test_scaled_mm_bf16_output_is_one_rounding_of_an_fp32_accumulation(spec, g):
    """``out_dtype=torch.bfloat16``: ``torch._scaled_mm`` writes BF16 itself (per-tensor FP8 applies
    its scales inside the GEMM). What is promised (``_promises``): its FP32 product rounded once to
    BF16, up to the summation order the library picks for that output type, and the same bits when
    the call is repeated. Without a GPU this is torch's CPU ``_scaled_mm`` kernel (the device
    answering as an sm_90); on a GPU, cuBLAS."""
    cuda = torch.cuda.is_available()
    if cuda:
        _needs("fp8_scaled_mm")
    dev, cap = ("cuda", "device") if cuda else ("cpu", (9, 0))
    a, b = (t.to(dev) for t in (operands(t=256, n_in=256, n_out=128) if cuda else operands(t=64, n_in=64, n_out=32))[g])
    recipe = parse_gemm(spec, g)
    quantizer = "auto" if cuda else "reference"

    def run(dt):
        return hw_gemm(g, a, b, recipe, LayerQuantState(3, "l"), backend="fp8_scaled_mm", capability=cap,
                       quantizer=quantizer, out_dtype=dt)

    f32, b16 = run(torch.float32), run(torch.bfloat16)
    k = a.shape[CONTRACTION_AXES[g][0]]
    assert_one_bf16_rounding_of(b16, f32, k, f"{spec} {g.value}")
    assert torch.equal(run(torch.bfloat16).view(torch.int16), b16.view(torch.int16))  # repeatable
    # and through the one entry point, as a BF16 linear layer asks for it: the same call, the same bits
    if cuda:
        out = gemm(g, a, b, recipe, "fp8_scaled_mm", state=LayerQuantState(3, "l"), out_dtype=torch.bfloat16)
        assert torch.equal(out.view(torch.int16), b16.view(torch.int16))


def test_gemm_out_dtype_is_one_rounding_of_the_spec_and_refuses_others():
    a, b = operands()[Gemm.FPROP]
    recipe = parse_gemm("mxfp4", Gemm.FPROP)
    f32 = gemm(Gemm.FPROP, a, b, recipe, "reference", state=LayerQuantState(3, "l"))
    b16 = gemm(Gemm.FPROP, a, b, recipe, "reference", state=LayerQuantState(3, "l"), out_dtype=torch.bfloat16)
    assert b16.dtype == torch.bfloat16 and torch.equal(b16, f32.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"^fprop: out_dtype torch.int8 is not supported; valid: float32, bfloat16"):
        gemm(Gemm.FPROP, a, b, recipe, "reference", out_dtype=torch.int8)


# ------------------------------------------------------------------ NVFP4: tensor scales in the GEMM
@pytest.mark.skipif(scaled_mm_enums() is None, reason="this torch has no F.scaled_mm")
@pytest.mark.parametrize("g", list(Gemm))
def test_nvfp4_bf16_output_from_the_two_level_gemm(monkeypatch, g):
    """NVFP4 on ``F.scaled_mm``: the GEMM takes both scale levels and writes BF16 itself (no FP32
    output and no elementwise passes after it); on ``torch._scaled_mm`` (block scales only) the FP32
    output is scaled and rounded after, as before. The stand-in for the CUDA kernel decodes what
    it is handed (E2M1 codes, swizzled E4M3 block scales, the per-tensor factors), accumulates in
    FP32 and applies ``g_dec_a * g_dec_b`` before the one rounding -- the two-level recipe's
    semantics; the result is one BF16 rounding of the emulated spec's FP32 product."""
    enums = scaled_mm_enums()
    calls = []

    def stand_in(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, swizzle_a, swizzle_b, output_dtype):
        calls.append((list(recipe_a), output_dtype))
        assert list(recipe_a) == [enums["block16"], enums["tensor"]] and list(swizzle_a)[0] == enums["swizzle"]

        e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])  # OCP's E2M1

        def decode(data, scales, rows):
            codes = unpack_fp4(data.view(torch.uint8)).long()
            s = from_blocked(scales[0].view(torch.uint8), rows, codes.shape[1] // 16)
            return (e2m1[codes].reshape(rows, -1, 16)
                    * s.view(torch.float8_e4m3fn).float()[..., None]).reshape(rows, -1), scales[1]

        va, ga = decode(mat_a, scale_a, mat_a.shape[0])
        vb, gb = decode(mat_b.t(), scale_b, mat_b.shape[1])
        return ((va @ vb.t()) * (ga * gb)).to(output_dtype)

    monkeypatch.setattr(torch.nn.functional, "scaled_mm", stand_in)
    a, b = operands()[g]
    recipe = parse_gemm("nvfp4", g)

    def run(entry, dt):
        return hw_gemm(g, a, b, recipe, LayerQuantState(3, "l"), backend="mx_scaled_mm", capability=(10, 0),
                       quantizer="reference", out_dtype=dt, entry=entry)

    b16 = run("F.scaled_mm", torch.bfloat16)
    assert calls == [([enums["block16"], enums["tensor"]], torch.bfloat16)]  # BF16 written by the GEMM
    spec = gemm(g, a, b, recipe, "reference", state=LayerQuantState(3, "l"))
    assert_one_bf16_rounding_of(b16, spec, a.shape[CONTRACTION_AXES[g][0]], f"nvfp4 {g.value}")
    f32 = run("F.scaled_mm", torch.float32)  # FP32 asked for: the GEMM still applies both levels
    torch.testing.assert_close(f32, spec, rtol=1e-5, atol=1e-5 * spec.abs().max().item())


def test_a_kept_weight_brings_its_laid_out_scales(monkeypatch):
    """Block scales are laid out (``to_blocked``) once per prepared operand: the weight, kept for the
    optimizer step, is laid out once per step however many micro-batches consume it."""
    import kernels.scaled_mm as ksm

    calls = []
    real = ksm.to_blocked
    monkeypatch.setattr(ksm, "to_blocked", lambda s: calls.append(tuple(s.shape)) or real(s))
    a, b = operands()[Gemm.FPROP]
    recipe, state = parse_gemm("mxfp4", Gemm.FPROP), LayerQuantState(3, "l")

    def micro_batch():
        return hw_gemm(Gemm.FPROP, a, b, recipe, state, backend="mx_scaled_mm", capability=(10, 0),
                       quantizer="reference", mm=lambda qa, qb: (qa.scale, qb.scale, emulated_scaled_mm(qa, qb))[-1])

    first = micro_batch()
    assert torch.equal(micro_batch(), first) and len(calls) == 3  # x, w; then x only
    state.end_step()  # a new step: the weight may have changed
    micro_batch()
    assert len(calls) == 5

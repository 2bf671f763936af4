"""Emulated GEMMs on BF16 tensor cores (``kernels.bf16_mm``), proved on CPU.

* ``Format.bf16_exact`` is a registry property, checked exhaustively: every code under every scale
  byte of every BF16-exact format survives the BF16 form bit for bit.
* Through the one operand pipeline, on adversarial data (FP32-subnormal and saturated block
  scales, NaN/Inf blocks, RCEIL, SR, the 3/4 pre-scale, rotations), each BF16 operand with its
  output factor equals the FP32 spec's dequantization bit for bit (NVFP4: exactly ``e2m1 * s_block``,
  within 1 ulp of the spec once ``g_dec`` is applied -- the one place the factor moves).
* Dispatch: a simulated sm_90 runs BF16-exact GEMMs on ``bf16_mm`` (FP8 on ``fp8_scaled_mm``), a
  CPU runs every GEMM on the FP32 ``emulated`` path; the start-up report says so.
"""

import pytest
import torch

import kernels.backends as kb
from kernels import BACKENDS, describe_backends, gemm, select_backend
from kernels.bf16_mm import bf16_gemm
from kernels.bf16_operand import bf16_form, fp32_values
from kernels.operand import gemm_operands
from model.linear import policy_linear
from precision import Gemm, LayerQuantState, presets
from precision.elements import e2m1_decode
from precision.formats import FORMATS, QuantizedTensor, Scaling
from precision.recipe import OperandFormat, parse_gemm
from tests.kernels._promises import assert_one_bf16_rounding_of

SM90 = (9, 0)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal as float32 bit patterns, NaN anywhere matching NaN (payloads aside)."""
    if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return False
    keep = ~want.isnan()
    return torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))


# ------------------------------------------------------------------ the registry property, exhaustively
def test_bf16_exact_is_a_format_property():
    exact = {n for n, f in FORMATS.items() if f.bf16_exact}
    assert exact == set(FORMATS) - {"fp32"}
    assert {n: f.bf16_shift for n, f in FORMATS.items() if f.bf16_shift} == {"mxfp8_e4m3": 3, "mxfp8_e5m2": 10}
    with pytest.raises(ValueError, match="fp32: its dequantized values are not exactly BF16"):
        bf16_form(OperandFormat("fp32"), torch.zeros(2, 2, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="fprop x: fp32 values are not exactly BF16"):
        gemm_operands(Gemm.FPROP, torch.ones(2, 4), torch.ones(3, 4), parse_gemm("fp32", Gemm.FPROP),
                      LayerQuantState(), bf16=True)


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.blocked])
def test_every_code_under_every_scale_byte_is_exact(name):
    """One operand per scale byte (the MX shift is per operand): all codes x bytes 0x00..0xFE (0xFF NaN)."""
    spec = FORMATS[name]
    ncodes = 1 << spec.code_bits
    codes = torch.arange(ncodes, dtype=torch.uint8).repeat(2).reshape(1, -1)[:, : -(-ncodes // spec.block)
                                                                              * spec.block]
    k = codes.shape[1]
    bytes_ = range(0x7F) if spec.kind == Scaling.TWO_LEVEL else range(0x100)  # E4M3 scales: 0x7F is NaN
    fmt = OperandFormat(name)
    g_enc = torch.tensor(0.37)
    for byte in bytes_:
        scales = torch.full((1, k // spec.block), byte, dtype=torch.uint8)
        q = QuantizedTensor(name, codes, scales, 1, tensor_scale=g_enc if spec.kind == Scaling.TWO_LEVEL else None)
        bf, out_scale = bf16_form(fmt, codes, scales, q.tensor_scale)
        if spec.kind == Scaling.TWO_LEVEL:  # e2m1 * s_block exactly; g_dec is the output factor
            want = e2m1_decode(codes) * scales.view(torch.float8_e4m3fn).float().repeat_interleave(spec.block, 1)
            assert same_bits(bf.float(), want), f"{name} scale byte {byte:#x}"
            assert torch.equal(out_scale, 1.0 / g_enc)
        else:
            assert same_bits(fp32_values(bf, out_scale), spec.dequantize(q)), f"{name} scale byte {byte:#x}"


# ------------------------------------------------------------------ adversarial operands through the pipeline
def adversarial(kind: str, rows=64, cols=32, seed=0) -> torch.Tensor:
    """N(0,1) with rows spread over binades: ``tiny`` reaches FP32 subnormals (block scale 0x00),
    ``huge`` reaches 2^127 (the largest scales), ``mixed`` both in one tensor; NaN, +-Inf, -0 and
    an all-zero row everywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    lo, hi = {"normal": (-12, 12), "tiny": (-150, -110), "huge": (100, 126), "mixed": (-150, 126)}[kind]
    x = x * torch.exp2(torch.randint(lo, hi + 1, (rows, 1), generator=g).float())
    x[0] = 0.0
    x[1, ::2] = -0.0
    x[2, 5], x[7, 20], x[9, 1], x[40, 13] = float("nan"), float("inf"), -float("inf"), float("nan")
    return x


SPECS = ["bf16", "fp8_e4m3", "fp8_e5m2+sr", "hif8", "mxfp4", "mxfp4+rceil", "mxfp4+sr+prescale", "mxfp4+had16",
         "mxfp6_e2m3", "mxfp6_e3m2+sr", "mxfp8_e4m3", "mxfp8_e4m3+sr+rceil", "mxfp8_e5m2+rceil", "nvfp4",
         "nvfp4+sr", "nvfp4+rht16"]


def _kinds(spec):
    # MXFP8 spans 264 binades, BF16 261: blocks at both ends of one tensor are the documented limit
    return ["normal", "tiny", "huge"] + ([] if spec.startswith("mxfp8") else ["mixed"])


@pytest.mark.parametrize("spec,kind", [(s, k) for s in SPECS for k in _kinds(s)])
@pytest.mark.parametrize("g", [Gemm.FPROP, Gemm.WGRAD])  # blocks along features, along tokens
def test_bf16_operands_equal_the_fp32_spec(spec, kind, g):
    x = adversarial(kind)
    other = adversarial("normal", seed=1)
    a, b = (x, other[:16]) if g is Gemm.FPROP else (x, other[:, :16])
    recipe = parse_gemm(spec, g)
    spec_ops = gemm_operands(g, a, b, recipe, LayerQuantState(5, "l"), impl="reference")
    bf_ops = gemm_operands(g, a, b, recipe, LayerQuantState(5, "l"), impl="reference", bf16=True)
    for want, got in ((spec_ops.a, bf_ops.a), (spec_ops.b, bf_ops.b)):
        assert got.bf16.dtype == torch.bfloat16
        want_k = want.values.movedim(want.axis, -1)
        rebuilt = fp32_values(got.bf16, got.out_scale, got.fmt.prescale_factor)
        if FORMATS[got.fmt.fmt].kind == Scaling.TWO_LEVEL:
            exact = e2m1_decode(got.codes) * got.scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
            exact = torch.where(got.scales.repeat_interleave(16, -1) == 0x7F, float("nan"), exact)
            assert same_bits(got.bf16.float(), exact[:, : got.bf16.shape[1]])
            assert torch.equal(rebuilt.isnan(), want_k.isnan())
            fin = ~want_k.isnan()
            ulps = (rebuilt[fin].view(torch.int32).long() - want_k[fin].view(torch.int32).long()).abs()
            # g_dec rounded in at another place: 1 ulp; 3 x 2^-149 where s_block * g_dec is an FP32 subnormal
            normal = want_k[fin].abs() >= 2.0**-123
            assert int(ulps.max()) <= 3 and (ulps[normal] <= 1).all()
        else:
            assert same_bits(rebuilt, want_k), f"{spec} {kind} {g.value}: {got.fmt.fmt} operand differs"


def test_mxfp8_shift_reaches_subnormal_scales():
    """E4M3 elements under scale byte 0x00 reach 2^-136: only the shift keeps them exact in BF16."""
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 2.0**-126, 2.0**-136  # FLOOR: byte 0x00; element 2^-9 -> 2^-136
    recipe = parse_gemm("mxfp8_e4m3", Gemm.FPROP)
    ops = gemm_operands(Gemm.FPROP, x, x, recipe, LayerQuantState(), impl="reference", bf16=True)
    assert int(ops.a.scales[0, 0]) == 0 and float(ops.a.out_scale) == 2.0**-3
    assert fp32_values(ops.a.bf16, ops.a.out_scale)[0, 1].item() == 2.0**-136
    assert ops.a.bf16[0, 1].float().item() == 2.0**-133  # shifted by 2^3, BF16's smallest subnormal


# ------------------------------------------------------------------ the GEMM and its dispatch
@pytest.mark.parametrize("preset", ["bf16", "mxfp4", "wgrad_hadamard", "mxfp4_sr", "fp8", "nvfp4", "hif8_w8a8"])
def test_bf16_gemm_matches_the_emulated_gemm(preset):
    torch.manual_seed(0)
    shapes = {Gemm.FPROP: ((48, 64), (40, 64)), Gemm.DGRAD: ((48, 40), (40, 64)), Gemm.WGRAD: ((48, 40), (48, 64))}
    for g in Gemm:
        recipe = presets.get(preset).recipe(g)
        a, b = torch.randn(*shapes[g][0]), torch.randn(*shapes[g][1])
        want = gemm(g, a, b, recipe, "reference", state=LayerQuantState(2, "l"))
        got = bf16_gemm(g, a, b, recipe, LayerQuantState(2, "l"), quantizer="reference")
        if g is Gemm.FPROP and preset in ("bf16", "mxfp4"):  # no factor moved: the very same FP32 product
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_dispatch_simulated_sm90_and_cpu(monkeypatch):
    chosen = {p: select_backend(presets.get(p), SM90) for p in ("bf16", "mxfp4", "wgrad_hadamard", "fp8", "nvfp4",
                                                                "hif8_w8a8", "mxfp4_fprop")}
    assert set(chosen["bf16"].values()) == set(chosen["mxfp4"].values()) == {"bf16_mm"}
    assert set(chosen["wgrad_hadamard"].values()) == set(chosen["nvfp4"].values()) == {"bf16_mm"}
    assert set(chosen["fp8"].values()) == {"fp8_scaled_mm"}
    assert chosen["mxfp4_fprop"] == {Gemm.FPROP: "bf16_mm", Gemm.DGRAD: "fp8_scaled_mm", Gemm.WGRAD: "fp8_scaled_mm"}
    assert select_backend(parse_gemm("fp32", Gemm.FPROP), SM90) == "emulated"  # FP32 operands
    assert select_backend(parse_gemm("fp8_e5m2", Gemm.DGRAD), SM90) == "bf16_mm"  # no E5M2 x E5M2 FP8 GEMM
    assert select_backend(presets.get("mxfp4"), (7, 5)) == dict.fromkeys(Gemm, "emulated")  # no BF16 tensor cores
    assert set(select_backend(presets.get("mxfp4"), "cpu").values()) == {"emulated"}
    with pytest.raises(kb.BackendError, match=r"^fprop: backend bf16_mm cannot run fp32 \(values not exactly BF16"):
        select_backend(parse_gemm("fp32", Gemm.FPROP), SM90, "bf16_mm")
    with pytest.raises(kb.BackendError, match="bf16_mm needs sm_80"):
        select_backend(presets.get("mxfp4"), "cpu", "bf16_mm")

    # the auto backend of a real layer, with the capability query answering sm_90
    ran = []
    impls = {"bf16_mm": BACKENDS["bf16_mm"], "emulated": BACKENDS["reference"]}  # reference: same bits, no compile
    for name, impl in impls.items():
        monkeypatch.setitem(BACKENDS, name, lambda g, *a, _n=name, _f=impl, **k: ran.append((g, _n)) or _f(g, *a, **k))
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    policy_linear(x, w, presets.get("mxfp4"), backend="auto").sum().backward()
    assert ran == [(Gemm.FPROP, "emulated"), (Gemm.DGRAD, "emulated"), (Gemm.WGRAD, "emulated")]  # CPU
    ran.clear()
    monkeypatch.setattr(kb, "device_capability", lambda device: SM90)
    y = policy_linear(x, w, presets.get("mxfp4"), backend="auto")
    y.sum().backward()
    assert ran == [(Gemm.FPROP, "bf16_mm"), (Gemm.DGRAD, "bf16_mm"), (Gemm.WGRAD, "bf16_mm")]


def test_startup_report_names_the_path_of_every_gemm():
    plan = {"decoder.layers.0.self_attention.linear_qkv": presets.get("mxfp4_fprop"),
            "decoder.layers.0.mlp.linear_fc1": presets.get("fp32")}
    text = describe_backends(plan, SM90)
    assert "linear_qkv  mxfp4 -> bf16_mm" in text
    assert "fp32 -> emulated" in text
    assert "GEMMs per backend: bf16_mm 1, emulated 3, fp8_scaled_mm 2" in text
    assert "bf16_mm: BF16 tensor-core GEMM of exactly-BF16 operands, FP32 accumulation and output" in text
    assert "emulated: FP32 GEMM of FP32-dequantized operands" in text
    assert "bf16_mm" not in describe_backends(plan, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["bf16", "mxfp4", "wgrad_hadamard", "nvfp4"])
def test_bf16_mm_on_gpu(preset):
    """cuBLAS BF16 GEMM with FP32 output against the FP32 spec on the same device."""
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda")
    w = torch.randn(384, 512, device="cuda")
    for g, (a, b) in ((Gemm.FPROP, (x, w)), (Gemm.WGRAD, (torch.randn(256, 384, device="cuda"), x))):
        recipe = presets.get(preset).recipe(g)
        want = gemm(g, a, b, recipe, "reference", state=LayerQuantState(2, "l"))
        got = BACKENDS["bf16_mm"](g, a, b, recipe, LayerQuantState(2, "l"))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["bf16", "mxfp4", "wgrad_hadamard", "fp8"])
def test_bf16_output_is_one_rounding_of_an_fp32_accumulation(preset, monkeypatch):
    """``gemm(..., out_dtype=torch.bfloat16)`` on ``bf16_mm``: where no FP32 factor follows the
    product (``bf16``, MXFP4) cuBLAS writes BF16 itself with FP32 reductions; elsewhere (FP8's
    1/scale on the output) the FP32 result is rounded. cuBLAS does not promise the BF16-output GEMM
    the FP32-output one's algorithm (split-K, kernel), so what is checked is what it promises
    (``_promises``): one BF16 rounding of an FP32 accumulation, and the same bits on a repeat. On
    CPU (no BF16-output GEMM there) the same through the FP32 fallback, the device answering sm_90."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setattr(kb, "device_capability", lambda device: SM90)
    g_ = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g_).to(dev) for s in ((128, 256), (192, 256), (128, 192)))
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    for g, (a, b) in ((Gemm.FPROP, (x, w)), (Gemm.DGRAD, (dy, w)), (Gemm.WGRAD, (dy, x))):
        recipe = presets.get(preset).recipe(g)
        f32, b16, again = (gemm(g, a, b, recipe, "bf16_mm", state=LayerQuantState(2, "l"), out_dtype=dt)
                           for dt in (torch.float32, torch.bfloat16, torch.bfloat16))
        assert_one_bf16_rounding_of(b16, f32, a.shape[0 if g is Gemm.WGRAD else 1], f"{preset} {g.value}")
        assert torch.equal(again.view(torch.int16), b16.view(torch.int16)), (preset, g.value)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == flag  # the switch is restored

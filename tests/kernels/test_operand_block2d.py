"""A weight in 2-D tiles through the operand pipeline: quantized once, the same codes serve Fprop
and Dgrad (emulated values, the hardware form and its layouts, packed rollout storage)."""

import pytest
import torch

from kernels.layouts import transpose_tiled
from kernels.operand import gemm_operands, pad_and_rotation
from kernels.scaled_mm import hw_operand
from model.linear import policy_linear
from precision import formats, presets
from precision.recipe import Gemm, LinearPrecision, parse_gemm
from precision.rotation import TE_SIGNS, rotation_size
from precision.state import LayerQuantState

ONE_D = "fprop=nvfp4,dgrad=nvfp4/sr@nvfp4,wgrad=nvfp4/sr@nvfp4+rht16_te"
MX_2D = "fprop=mxfp4@mxfp4/2d,dgrad=mxfp4@mxfp4/2d,wgrad=mxfp4"


def _weight_and_inputs(out=48, inp=80, tokens=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(out, inp, generator=g) * torch.exp2(torch.randint(-4, 4, (out, 1), generator=g)))
    x = torch.randn(tokens, inp, generator=g, requires_grad=True)
    dy = torch.randn(tokens, out, generator=g)
    return w, x, dy


@pytest.fixture
def count_2d(monkeypatch):
    """How many 2-D quantizations ran (NVFP4 and MX)."""
    n = {"calls": 0}
    for cls in (formats.NVFP4Format, formats.MXFormat):
        orig = cls._quantize

        def counted(self, *a, _orig=orig, **k):
            n["calls"] += bool(k.get("block2d"))
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, "_quantize", counted)
    return n


@pytest.mark.parametrize("spec", ["nvfp4", MX_2D])
def test_fprop_and_dgrad_consume_the_same_weight(spec):
    p = presets.get(spec) if "=" not in spec else LinearPrecision.parse(spec)
    w, x, dy = _weight_and_inputs()
    st = LayerQuantState()
    w_fprop = gemm_operands(Gemm.FPROP, x.detach(), w.detach(), p.fprop, st, impl="reference").b.values
    w_dgrad = gemm_operands(Gemm.DGRAD, dy, w.detach(), p.dgrad, st, impl="reference").b.values
    assert torch.equal(w_fprop, w_dgrad)
    # the 1-D recipe rounds the weight differently for the two GEMMs (what the 2-D tiles fix)
    one = LinearPrecision.parse(ONE_D if "nvfp4" == spec else "fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4")
    st = LayerQuantState()
    a = gemm_operands(Gemm.FPROP, x.detach(), w.detach(), one.fprop, st, impl="reference").b.values
    b = gemm_operands(Gemm.DGRAD, dy, w.detach(), one.dgrad, st, impl="reference").b.values
    assert not torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference"])  # the 2-D weight takes the reference quantizer on both
def test_quantized_once_per_weight_version(backend, count_2d):
    w, x, dy = _weight_and_inputs()
    st = LayerQuantState()
    p = presets.get("nvfp4")
    policy_linear(x, w, p, state=st, backend=backend).backward(dy)
    assert count_2d["calls"] == 1  # Fprop quantized it, Dgrad reused the codes
    policy_linear(x, w, p, state=st, backend=backend).backward(dy)
    assert count_2d["calls"] == 1  # the next micro-batch: the same weight, the same codes
    with torch.no_grad():
        w.mul_(0.5)  # an optimizer step changes the weight in place (a new version)
    policy_linear(x, w, p, state=st, backend=backend).backward(dy)
    assert count_2d["calls"] == 2
    # and the reused codes are those a fresh quantization gives: the same results as a fresh state
    x2 = x.detach().clone().requires_grad_(True)
    w2 = torch.nn.Parameter(w.detach().clone())
    y_fresh = policy_linear(x2, w2, p, state=LayerQuantState(), backend=backend)
    y_fresh.backward(dy)
    x3 = x.detach().clone().requires_grad_(True)
    w3 = torch.nn.Parameter(w.detach().clone())
    st3 = LayerQuantState()
    policy_linear(x3, w3, p, state=st3, backend=backend)  # fills the kept weight
    y3 = policy_linear(x3, w3, p, state=st3, backend=backend)
    y3.backward(dy)
    assert torch.equal(y3, y_fresh) and torch.equal(x3.grad, x2.grad)


def test_gemm_isolation_with_2d_weights():
    """Changing Fprop's recipe changes neither Dgrad's nor Wgrad's output, bit for bit."""
    w, x, dy = _weight_and_inputs()
    te = presets.get("nvfp4")
    other = LinearPrecision(parse_gemm("bf16", Gemm.FPROP), te.dgrad, te.wgrad)
    grads = []
    for p in (te, other):
        xx, ww = x.detach().clone().requires_grad_(True), torch.nn.Parameter(w.detach().clone())
        policy_linear(xx, ww, p, state=LayerQuantState(seed=3), backend="reference").backward(dy)
        grads.append((xx.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_evaluation_keeps_nothing(count_2d):
    w, x, _ = _weight_and_inputs()
    st = LayerQuantState()
    with torch.no_grad():
        policy_linear(x, w, presets.get("nvfp4"), state=st, backend="reference")
    assert not st.step_cache and count_2d["calls"] == 1


@pytest.mark.parametrize("spec", ["nvfp4", MX_2D])
def test_hardware_form_one_quantization_two_layouts(spec):
    """Dgrad's hardware ``B_k = wᵀ`` is Fprop's ``B_k = w`` transposed with its squares re-laid
    (``kernels.layouts.transpose_tiled``), and both decode to the emulated weight."""
    p = presets.get(spec) if "=" not in spec else LinearPrecision.parse(spec)
    w, x, dy = _weight_and_inputs(out=64, inp=96)
    st = LayerQuantState()
    fprop = gemm_operands(Gemm.FPROP, x.detach(), w.detach(), p.fprop, st, impl="reference", codes=True).b
    dgrad = gemm_operands(Gemm.DGRAD, dy, w.detach(), p.dgrad, st, impl="reference", codes=True).b
    tile = formats.FORMATS[p.fprop.b.fmt].tile
    hw_f = hw_operand(fprop)  # packed FP4, scales padded
    codes_t, scales_t = transpose_tiled(hw_f.codes[:64], hw_f.scales[:64, : 96 // p.fprop.b.format.block], tile,
                                        packed=True)
    hw_d = hw_operand(dgrad)
    assert torch.equal(codes_t, hw_d.codes[:96, : 64 // 2])
    assert torch.equal(scales_t, hw_d.scales[:96, : 64 // p.fprop.b.format.block])
    emulated = gemm_operands(Gemm.FPROP, x.detach(), w.detach(), p.fprop, LayerQuantState(), impl="reference").b.values
    assert torch.equal(hw_f.decode()[:64, :96], emulated)
    assert torch.equal(hw_d.decode()[:96, :64], emulated.t())


def test_transpose_tiled_refuses_odd_rows():
    with pytest.raises(ValueError, match="33 rows cannot pack"):
        transpose_tiled(torch.zeros(33, 8, dtype=torch.uint8), torch.zeros(33, 1, dtype=torch.uint8), 16, packed=True)


def test_wgrad_rotation_uses_te_signs():
    _w, x, dy = _weight_and_inputs()
    recipe = presets.get("nvfp4").wgrad
    _, _, signs = pad_and_rotation(Gemm.WGRAD, dy, x.detach(), recipe, LayerQuantState(seed=5), 0)
    assert rotation_size(recipe.rotation) == 16 and torch.equal(signs, torch.tensor(TE_SIGNS, dtype=torch.float32))
    _, _, signs7 = pad_and_rotation(Gemm.WGRAD, dy, x.detach(), recipe, LayerQuantState(seed=7), 3)
    assert torch.equal(signs7, signs)  # the same constant in every layer and call


def test_packed_rollout_weight_keeps_one_scale_per_square():
    from model.rollout import pack_weight

    w, x, _ = _weight_and_inputs(out=64, inp=96)
    recipe = presets.get("nvfp4").fprop
    pw = pack_weight(w, recipe, LayerQuantState())
    assert pw.scales.shape == (4, 6) and pw.codes.shape == (64, 48)
    trainer = gemm_operands(Gemm.FPROP, x.detach(), w.detach(), recipe, LayerQuantState(), impl="reference").b.values
    assert torch.equal(pw.values(), trainer)
    one_d = pack_weight(w, parse_gemm("nvfp4", Gemm.FPROP), LayerQuantState())
    assert pw.nbytes < one_d.nbytes and one_d.scales.shape == (64, 6)


def test_rollout_precision_takes_2d_weights():
    from model.rollout_plan import parse_rollout

    r = parse_rollout("linear=nvfp4@nvfp4/2d,kv=nvfp4")
    assert r.linear.b.block2d and str(r) == "linear=nvfp4@nvfp4/2d,kv=nvfp4"
    with pytest.raises(Exception, match="operand x .*weights only"):
        parse_rollout("linear=nvfp4/2d@nvfp4,kv=bf16")


def test_rotated_2d_weight_is_not_kept():
    """A rotation on Fprop rotates the weight along in-features: that copy is Fprop's own."""
    w, x, _ = _weight_and_inputs()
    st = LayerQuantState()
    recipe = parse_gemm("nvfp4@nvfp4/2d+had16", Gemm.FPROP)
    gemm_operands(Gemm.FPROP, x.detach(), w.detach(), recipe, st, impl="reference")
    assert not st.step_cache

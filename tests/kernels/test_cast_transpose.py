"""The fused cast-transpose: one read of a 2-D tensor gives both quantized layouts -- blocks along
the features (Dgrad's ``dy``, Fprop's ``x``) and along the tokens (Wgrad's ``dy`` and ``x``) --
each equal bit for bit to the reference quantizer and to the one-layout Triton kernel. On CPU it
runs in Triton's interpreter (``tests/kernels/conftest.py``): tiny shapes, partial tiles and blocks."""

import pytest
import torch

from kernels.quantizer import triton_missing_reason
from precision import quantize
from precision.formats import get_format
from precision.recipe import OperandFormat
from precision.srand import SRKey

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_PROBLEM = triton_missing_reason(torch.zeros(1, device=DEV))
# pytest -m gpu selects these: on a CUDA device they check the compiled kernels; without one they
# run in Triton's interpreter (tests/kernels/conftest.py), as every CPU run does
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(TRITON_PROBLEM is not None, reason=str(TRITON_PROBLEM))]


def same(a, b) -> bool:
    a, b = a.float().cpu(), b.float().cpu()
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def data(t=70, h=96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-20, 20, (t, 1), generator=g).float())
    x[3, 5], x[40, 80], x[7] = float("nan"), float("inf"), 0.0
    return x.to(DEV)


PAIRS = [  # (row layout: blocks along features, column layout: blocks along tokens)
    (OperandFormat("mxfp4"), OperandFormat("mxfp4", rounding="stochastic", scale_rule="rceil")),
    (OperandFormat("fp8_e4m3"), OperandFormat("fp8_e5m2", rounding="stochastic")),
    (OperandFormat("nvfp4", rounding="stochastic"), OperandFormat("mxfp8_e4m3")),
    (OperandFormat("mxfp6_e3m2"), OperandFormat("nvfp4")),
    # one per-tensor format both ways: the second layout shares the first's scale, amax and clip count
    (OperandFormat("fp8_e5m2"), OperandFormat("fp8_e5m2")),
]


@pytest.mark.parametrize("fr,fc", PAIRS, ids=lambda f: f.spec() if hasattr(f, "spec") else str(f))
def test_both_layouts_from_one_read_equal_the_reference(fr, fc):
    from kernels.triton_quant import cast_transpose_triton, quantize_triton

    x = data()
    keys = [SRKey(11) if f.rounding == "stochastic" else None for f in (fr, fc)]
    row, col = cast_transpose_triton(x, fr, fc, sr_row=keys[0], sr_col=keys[1])
    assert row.codes.shape == (70, 96) and col.codes.shape == (96, 70)  # contraction axis last
    for res, f, axis, key in ((row, fr, 1, keys[0]), (col, fc, 0, keys[1])):
        ref = quantize(x.cpu(), f.fmt, axis=axis, rounding=f.rounding, scale_rule=f.scale_rule, sr=key)
        assert same(res.codes, ref.codes.movedim(axis, -1)), f"{f.fmt} axis {axis}: codes"
        spec = get_format(f.fmt)
        assert same(res.scales, ref.scales.movedim(axis, -1) if spec.blocked else ref.scales)
        if spec.tensor_scaled and ref.tensor_scale is not None:
            assert same(res.tensor_scale, ref.tensor_scale)
        if ref.num_clipped is not None:
            assert int(res.num_clipped) == int(ref.num_clipped) and same(res.amax, ref.amax)
    if all(get_format(f.fmt).bf16_shift == 0 for f in (fr, fc)):  # the BF16 operands too, from one read
        pair = cast_transpose_triton(x, fr, fc, sr_row=keys[0], sr_col=keys[1], codes=False, bf16_form=True)
        for res, f, axis, key in ((pair[0], fr, 1, keys[0]), (pair[1], fc, 0, keys[1])):
            one = quantize_triton(x, f, axis=axis, sr=key, layout="contraction_last", codes=False, bf16_form=True)
            assert res.bf16.dtype == torch.bfloat16 and same(res.bf16, one.bf16)
            assert (res.out_scale is None and one.out_scale is None) or same(res.out_scale, one.out_scale)

def test_cast_transpose_refuses_what_it_cannot_do():
    from kernels.triton_quant import cast_transpose_triton

    with pytest.raises(ValueError, match=r"x must be 2-D \[T, H\]"):
        cast_transpose_triton(torch.zeros(2, 3, 4, device=DEV), "mxfp4", "mxfp4")
    with pytest.raises(ValueError, match="bf16_form: mxfp8_e4m3 needs a format with Format.bf16_exact and no"):
        cast_transpose_triton(data(), "mxfp4", "mxfp8_e4m3", codes=False, bf16_form=True)


@pytest.mark.parametrize("preset,shared", [("mxfp4_sr", True), ("wgrad_hadamard", False)])
def test_backward_shares_dy_between_dgrad_and_wgrad(monkeypatch, preset, shared):
    """policy_linear on a simulated sm_90 with CUDA's quantizer choice (Triton): Dgrad's read of dy
    gives Wgrad's copy too (not under a Wgrad rotation), and dx, dw are bit-identical to unshared."""
    import kernels.backends as kb
    import kernels.operand as op
    import kernels.triton_quant as tq
    from model import linear
    from model.linear import policy_linear
    from precision import LayerQuantState, presets

    monkeypatch.setattr(kb, "device_capability", lambda device: (9, 0))  # auto: bf16_mm for MXFP4
    resolve = op._resolve_impl
    monkeypatch.setattr(op, "_resolve_impl", lambda impl, t, fmt, codes: "triton" if codes and impl == "auto"
                        and triton_missing_reason(t, fmt) is None else resolve(impl, t, fmt, codes))
    calls = []
    real = tq.cast_transpose_triton
    monkeypatch.setattr(tq, "cast_transpose_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)

    def grads():
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        policy_linear(xr, wr, presets.get(preset), state=LayerQuantState(3, "l"), backend="auto").backward(dy)
        return xr.grad, wr.grad

    with_sharing = grads()
    assert len(calls) == (1 if shared else 0)
    monkeypatch.setattr(linear, "share_dy", lambda *a: None)
    without = grads()
    for a, b in zip(with_sharing, without):
        assert torch.equal(a, b)


def test_the_shared_dy_plan_is_an_argument_not_ambient_state(monkeypatch):
    """share_dy returns a plan that each GEMM gets explicitly: Dgrad handed it quantizes both layouts
    in one read, Wgrad handed it takes its copy (the same bits as its own quantization); a GEMM not
    handed it quantizes dy itself, and no module-level switch exists to leave set."""
    import kernels.backends as kb
    import kernels.operand as op
    import kernels.triton_quant as tq
    from kernels.cast_transpose import SharedDy, share_dy
    from kernels.gemm import gemm
    from precision import LayerQuantState, presets
    from precision.recipe import Gemm

    monkeypatch.setattr(kb, "device_capability", lambda device: (9, 0))
    resolve = op._resolve_impl
    monkeypatch.setattr(op, "_resolve_impl", lambda impl, t, fmt, codes: "triton" if codes and impl == "auto"
                        and triton_missing_reason(t, fmt) is None else resolve(impl, t, fmt, codes))
    calls = []
    real = tq.cast_transpose_triton
    monkeypatch.setattr(tq, "cast_transpose_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not hasattr(op, "_SHARED_DY")
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)
    p = presets.get("mxfp4_sr")

    def run(plan_for):  # plan_for: which GEMMs get the plan
        state = LayerQuantState(5, "l")
        plan = share_dy(dy, p, state, "auto")
        assert isinstance(plan, SharedDy)
        dx = gemm(Gemm.DGRAD, dy, w, p.dgrad, "auto", state=state, shared_dy=plan if "d" in plan_for else None)
        dw = gemm(Gemm.WGRAD, dy, x, p.wgrad, "auto", state=state, shared_dy=plan if "w" in plan_for else None)
        return dx, dw

    both = run("dw")
    assert len(calls) == 1
    calls.clear()
    alone = run("")
    assert not calls  # nobody handed the plan: each GEMM read dy itself
    only_dgrad = run("d")  # Wgrad not handed the plan quantizes dy itself, with the same bits
    assert len(calls) == 1
    for r in (alone, only_dgrad):
        assert all(torch.equal(a, b) for a, b in zip(both, r))


@pytest.mark.parametrize("dgrad_w", ["fp8_e4m3", "fp8_e5m2"])
def test_fprop_weight_gives_dgrad_its_layout_from_the_same_read(monkeypatch, dgrad_w):
    """fp8's weight on the hardware path: Fprop's quantization also writes Dgrad's layout (one
    cast-transpose), kept for the step; Dgrad takes it when its recipe has the same format and
    quantizes for itself otherwise. Either way Dgrad's codes and scale equal the reference
    quantizer's along the out-features; none of it without a backward to come (no_grad)."""
    import kernels.triton_quant as tq
    from kernels.operand import gemm_operands
    from precision import LayerQuantState
    from precision.recipe import Gemm, parse_gemm

    launches = []
    real = tq._launch
    monkeypatch.setattr(tq, "_launch", lambda k, *a: launches.append(getattr(k, "__name__", None) or k.fn.__name__)
                        or real(k, *a))
    g = torch.Generator().manual_seed(1)
    x, w, dy = (torch.randn(*s, generator=g).to(DEV) for s in ((64, 64), (32, 64), (64, 32)))
    w[3, 7] = 1e6  # an outlier sets the per-tensor scale
    state = LayerQuantState(0, "l")
    fprop = gemm_operands(Gemm.FPROP, x, w, parse_gemm("fp8_e4m3", Gemm.FPROP), state, impl="triton", codes=True)
    assert launches.count("_cast_transpose_kernel") == 1
    launches.clear()
    dgrad = gemm_operands(Gemm.DGRAD, dy, w, parse_gemm(f"fp8_e5m2@{dgrad_w}", Gemm.DGRAD), state, impl="triton",
                          codes=True)
    served = dgrad_w == "fp8_e4m3"
    assert launches == ["_amax_kernel", "_quant_kernel"] * (1 if served else 2), launches  # dy (and w)
    for q, axis, f in ((fprop.b, 1, "fp8_e4m3"), (dgrad.b, 0, dgrad_w)):
        ref = quantize(w.cpu(), f, axis=axis)
        assert same(q.codes, ref.codes.movedim(axis, -1)) and same(q.scales, ref.scales), (f, axis)
        assert same(q.decode_scale, (1.0 / ref.scales).reshape(1))  # what torch._scaled_mm takes
    assert state.stats["dgrad/w"]["numel"] == w.numel()
    with torch.no_grad():
        launches.clear()
        gemm_operands(Gemm.FPROP, x, w.clone(), parse_gemm("fp8_e4m3", Gemm.FPROP), LayerQuantState(0, "l"),
                      impl="triton", codes=True)
        assert "_cast_transpose_kernel" not in launches

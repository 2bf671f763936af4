"""QAT's backward operands: ``hp`` (Dgrad / Wgrad from the high-precision w, x) and ``ste``
(from Fprop's quantized Q(w), Q(x)), each checked against the quantizer called directly."""

import pytest
import torch

from model.linear import policy_linear
from precision import LayerQuantState, LinearPrecision, OperandFormat, quantize

G = torch.Generator().manual_seed(0)
X, W, DY = torch.randn(16, 32, generator=G), torch.randn(8, 32, generator=G), torch.randn(16, 8, generator=G)


def grads(precision, backward, state=None):
    x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
    policy_linear(x, w, precision, state=state or LayerQuantState(0, "l"), backend="reference",
                  backward=backward).backward(DY)
    return x.grad, w.grad


def test_ste_backward_is_dy_times_fprop_quantized_operands():
    p = LinearPrecision.parse("fprop=hif8,dgrad=fp32,wgrad=fp32")
    qx = quantize(X, "hif8", axis=1).dequantize()  # current scaling: each tensor's own amax -> 2^3
    qw = quantize(W, "hif8", axis=1).dequantize()
    assert not torch.equal(qw, W)
    dx, dw = grads(p, "ste")
    torch.testing.assert_close(dx, DY @ qw, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, DY.t() @ qx, rtol=1e-6, atol=1e-6)
    dx_hp, dw_hp = grads(p, "hp")  # the default: the unquantized operands
    torch.testing.assert_close(dx_hp, DY @ W, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw_hp, DY.t() @ X, rtol=1e-6, atol=1e-6)
    assert (dx - dx_hp).norm() / dx_hp.norm() > 1e-3  # the two estimators differ


def test_ste_reads_the_delayed_scale_fprop_used_and_records_nothing_twice():
    p = LinearPrecision.parse("fprop=hif8+delayed(max,64),dgrad=fp32,wgrad=fp32")
    st = LayerQuantState(0, "l")
    grads(p, "ste", st)
    st.end_step()  # history: step 1's amaxes
    hist_w = st.amax["fprop/w"].amax()
    assert st.calls["fprop"] == 1 and len(st.amax["fprop/w"].history) == 1
    x2, w2 = (X * 3).requires_grad_(True), W.clone().requires_grad_(True)
    policy_linear(x2, w2, p, state=st, backend="reference", backward="ste").backward(DY)
    qw = quantize(W, OperandFormat("hif8"), axis=1, amax=hist_w).dequantize()
    torch.testing.assert_close(x2.grad, DY @ qw, rtol=1e-6, atol=1e-6)
    assert st.calls["fprop"] == 2  # the read-only re-quantization advanced no counter


def test_ste_in_a_qat_warmup_is_bf16_and_rotations_are_refused():
    p = LinearPrecision.parse("fprop=hif8+delayed(max,64),dgrad=fp32,wgrad=fp32")
    st = LayerQuantState(0, "l")
    st.observe_only = True
    dx, dw = grads(p, "ste", st)  # every GEMM of a warm-up is BF16: Q is the BF16 cast, as hp's
    st_hp = LayerQuantState(0, "l")
    st_hp.observe_only = True
    dx_hp, dw_hp = grads(p, "hp", st_hp)
    assert torch.equal(dx, dx_hp) and torch.equal(dw, dw_hp)
    with pytest.raises(ValueError, match="backward='ste': Fprop's had16 rotation leaves no unrotated"):
        grads(LinearPrecision.parse("fprop=mxfp4+had16,dgrad=fp32,wgrad=fp32"), "ste")
    with pytest.raises(ValueError, match="backward 'fake'; valid: hp, ste"):
        grads(p, "fake")

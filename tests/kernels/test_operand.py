"""The one operand pipeline (``kernels.operand``) and what every backend gets from it: QAT warm-up on
hardware backends, IEEE FP32 in the emulated GEMM whatever TF32 flag is set, no host reads on the
GEMM path, the ``_scaled_mm`` output-dtype fallback, and device-resident amax histories in
checkpoints (new and old format)."""

import logging

import pytest
import torch

import kernels.scaled_mm as sm
from kernels.gemm import fp32_gemm, gemm
from kernels.scaled_mm import HwOperand, emulated_scaled_mm, hw_gemm
from model.linear import policy_linear
from precision import Gemm, LayerQuantState, presets
from precision.recipe import parse_gemm


def operands(t=64, n_in=64, n_out=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(t, n_in, generator=g), torch.randn(n_out, n_in, generator=g), torch.randn(t, n_out, generator=g)
    return {Gemm.FPROP: (x, w), Gemm.DGRAD: (dy, w), Gemm.WGRAD: (dy, x)}


# ------------------------------------------------------------------ QAT warm-up on hardware backends
@pytest.mark.parametrize("cap,backend,spec", [((9, 0), "fp8_scaled_mm", "fp8+delayed(max,4)"),
                                              ((10, 0), "mx_scaled_mm", "mxfp4"),
                                              ((10, 0), "mx_scaled_mm", "nvfp4+rht16")])
@pytest.mark.parametrize("g", list(Gemm))
def test_qat_warmup_runs_bf16_on_hardware_backends(cap, backend, spec, g):
    """During the warm-up (``observe_only``) a hardware backend runs the emulated backend's BF16 GEMM,
    never its quantized one, and delayed-scaling operands still record their amax."""
    a, b = operands()[g]
    recipe = parse_gemm(spec, g)
    calls = []

    def mm(qa, qb):
        calls.append((qa, qb))
        return emulated_scaled_mm(qa, qb)

    st = LayerQuantState(1, "l")
    st.observe_only = True
    out = hw_gemm(g, a, b, recipe, st, backend=backend, capability=cap, mm=mm, quantizer="reference")
    ref_state = LayerQuantState(1, "l")
    ref_state.observe_only = True
    ref = gemm(g, a, b, recipe, "reference", state=ref_state)
    assert not calls, "the quantized hardware GEMM ran during the BF16 warm-up"
    assert torch.equal(out, ref)
    assert torch.equal(out, fp32_gemm(g, a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()))
    if "delayed" in spec:
        st.end_step()
        assert st.amax[f"{g.value}/{g.operands[0]}"].history == [a.abs().max().item()]


# ------------------------------------------------------------------ TF32 never leaks into the emulated GEMM
@pytest.mark.parametrize("backend", ["emulated", "reference"])
def test_emulated_gemm_is_ieee_fp32_even_when_the_user_allows_tf32(backend, monkeypatch):
    a, b = operands()[Gemm.FPROP]
    seen = []
    matmul = torch.Tensor.__matmul__

    def recording(x, y):  # the GEMM's product records the cuBLAS FP32 precision in force
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return matmul(x, y)

    monkeypatch.setattr(torch.Tensor, "__matmul__", recording)
    torch.backends.cuda.matmul.allow_tf32 = True  # what a user's script may do
    try:
        gemm(Gemm.FPROP, a, b, parse_gemm("mxfp4", Gemm.FPROP), backend)
        assert seen and all(p == "ieee" for p in seen), seen
        assert torch.backends.cuda.matmul.allow_tf32 is True  # the user's setting is back afterwards
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


# ------------------------------------------------------------------ no host reads on the GEMM path
class _HostReads:
    """Counts Tensor -> Python conversions (``item``, ``tolist``, ``float``, ``int``, ``bool``)."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.count, self.where = 0, []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def counted(t, *args, _orig=orig, _name=name):
                self.count += 1
                if len(self.where) < 5:
                    import traceback

                    self.where.append(_name + "".join(traceback.format_stack(limit=4)[:-1]))
                return _orig(t, *args)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("preset", ["mxfp4", "mxfp4_sr", "wgrad_hadamard", "nvfp4", "fp8", "hif8_w8a8",
                                    "fprop=fp8+delayed(max,4),dgrad=fp8,wgrad=fp8"])
def test_training_step_reads_nothing_back_to_the_host(preset, monkeypatch):
    """A policy_linear forward + backward (emulated backend, telemetry off) converts no device value
    to a Python number: amaxes, histories and clipped counts stay tensors."""
    from precision import LinearPrecision

    p = presets.get(preset) if "=" not in preset else LinearPrecision.parse(preset)
    st = LayerQuantState(0, "l")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)
    dy = torch.randn(64, 32, generator=g)

    def step():
        policy_linear(x, w, p, state=st, backend="emulated").backward(dy)
        st.end_step()

    step()  # compiles the fused quantizers (tracing may read shapes and constants)
    reads = _HostReads(monkeypatch)
    step()
    step()  # the second step scales delayed operands from the first step's history
    monkeypatch.undo()
    assert reads.count == 0, "\n".join(reads.where)


# ------------------------------------------------------------------ _scaled_mm output dtype fallback
def _hw(fmt):
    block = 16 if fmt == "nvfp4" else 32
    return HwOperand(fmt, torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(32, 32 // block, dtype=torch.uint8),
                     "row_major", 32, 32, tensor_scale=torch.tensor(1.0) if fmt == "nvfp4" else None)


def test_scaled_mm_falls_back_to_bf16_only_on_the_output_dtype_refusal(monkeypatch, caplog):
    tried = []

    def refuses_fp32(a, b, out_dtype, entry):
        tried.append((a.fmt, out_dtype))
        if a.fmt == "mxfp4" and out_dtype is torch.float32:
            raise RuntimeError("Block-wise scaling only supports BFloat16 or Half output types")
        return torch.zeros(32, 32, dtype=out_dtype)

    monkeypatch.setattr(sm, "_OUT_DTYPE", {})
    monkeypatch.setattr(sm, "_call_scaled_mm", refuses_fp32)
    with caplog.at_level(logging.WARNING, logger="kernels.scaled_mm"):
        for _ in range(2):
            assert sm.torch_scaled_mm(_hw("mxfp4"), _hw("mxfp4")).dtype == torch.float32
        sm.torch_scaled_mm(_hw("nvfp4"), _hw("nvfp4"))
    # mxfp4: FP32 refused once, BF16 from then on; nvfp4 (another format) still asks for FP32
    assert tried == [("mxfp4", torch.float32), ("mxfp4", torch.bfloat16), ("mxfp4", torch.bfloat16),
                     ("nvfp4", torch.float32)]
    warnings = [r for r in caplog.records if "refused FP32 output" in r.getMessage()]
    assert len(warnings) == 1 and "mxfp4" in warnings[0].getMessage()


def test_scaled_mm_other_errors_propagate(monkeypatch):
    tried = []

    def broken(a, b, out_dtype, entry):
        tried.append(out_dtype)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sm, "_OUT_DTYPE", {})
    monkeypatch.setattr(sm, "_call_scaled_mm", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        sm.torch_scaled_mm(_hw("mxfp8_e4m3"), _hw("mxfp8_e4m3"))
    assert tried == [torch.float32] and sm._OUT_DTYPE == {}  # not retried in BF16, nothing cached


# ------------------------------------------------------------------ amax histories in checkpoints
def test_amax_histories_save_as_tensors_and_old_lists_still_load(tmp_path):
    p = presets.get("hif8_w8a8")
    st = LayerQuantState(3, "l")
    w = torch.randn(32, 64)
    for scale in (1.0, 4.0):
        policy_linear(torch.randn(16, 64) * scale, w, p, state=st, backend="reference")
        st.end_step()
    sd = st.state_dict()
    assert isinstance(sd["amax"]["fprop/x"]["history"], torch.Tensor)
    torch.save(sd, tmp_path / "state.pt")
    again = LayerQuantState()
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    h0, h1 = st.amax["fprop/x"], again.amax["fprop/x"]
    assert h1.history == h0.history and len(h0.history) == 2 and torch.equal(h1.amax(), h0.amax())
    # a checkpoint from before: histories as lists of Python floats
    old = {"seed": 3, "name": "l", "calls": {"fprop": 2, "dgrad": 2, "wgrad": 2},
           "amax": {"fprop/x": {"algo": "max", "history_len": 64, "ema_decay": 0.9, "history": [1.5, 3.0, 2.0],
                                "ema": 2.1}}}
    st_old = LayerQuantState()
    st_old.load_state_dict(old)
    h = st_old.amax["fprop/x"]
    assert h.history == [1.5, 3.0, 2.0] and h.amax().item() == 3.0
    y_old = policy_linear(torch.ones(16, 64), w, p, state=st_old, backend="reference")  # it runs from there
    assert torch.isfinite(y_old).all() and st_old.stats["fprop/x"]["scale_amax"].item() == 3.0



# ------------------------------------------------------------------ evaluation / generation read only
def test_forwards_without_autograd_read_the_state_and_change_nothing():
    p = presets.get("hif8_w8a8")
    sr = presets.get("mxfp4_sr")
    st = LayerQuantState(2, "l")
    w = torch.randn(32, 64)
    policy_linear(torch.randn(16, 64), w, p, state=st, backend="reference")
    st.end_step()
    before = (dict(st.calls), st.amax["fprop/x"].history, {k: dict(v) for k, v in st.stats.items()})
    with torch.no_grad():  # evaluation, generation
        y1 = policy_linear(torch.randn(16, 64) * 100, w, p, state=st, backend="reference")
        policy_linear(torch.randn(16, 64), w, sr, state=st, backend="reference")
    st.end_step()  # nothing was observed: no history entry
    assert (dict(st.calls), st.amax["fprop/x"].history, {k: dict(v) for k, v in st.stats.items()}) == before
    assert torch.isfinite(y1).all()
    # the next training call draws exactly what it would have drawn without the evaluation
    x = torch.randn(16, 64, requires_grad=True)
    fresh = LayerQuantState(2, "l")
    fresh.load_state_dict(st.state_dict())
    a = policy_linear(x, w, sr, state=st, backend="reference")
    b = policy_linear(x, w, sr, state=fresh, backend="reference")
    assert torch.equal(a, b)


def test_rotation_signs_are_made_once_per_device():
    """The sign vectors a rotation multiplies by are made on the device once (not copied from the host
    on every call): TransformerEngine's constant and a layer's fixed random signs; resampled signs
    are new on every call."""
    from kernels.operand import pad_and_rotation
    from precision.recipe import parse_gemm

    x, dy = torch.randn(32, 16), torch.randn(32, 8)
    state = LayerQuantState(seed=4, name="l")
    for spec in ("mxfp4+rht16_te", "mxfp4+rht16"):
        recipe = parse_gemm(spec, Gemm.WGRAD)
        first = pad_and_rotation(Gemm.WGRAD, dy, x, recipe, state, 0)[2]
        again = pad_and_rotation(Gemm.WGRAD, dy, x, recipe, state, 1)[2]
        assert first is again and first.shape == (16,)
    other = pad_and_rotation(Gemm.WGRAD, dy, x, parse_gemm("mxfp4+rht16", Gemm.WGRAD), LayerQuantState(5, "l"), 0)[2]
    assert not torch.equal(other, first)  # another layer seed: other signs
    resample = parse_gemm("mxfp4+rht16_resample", Gemm.WGRAD)
    a = pad_and_rotation(Gemm.WGRAD, dy, x, resample, state, 0)[2]
    b = pad_and_rotation(Gemm.WGRAD, dy, x, resample, state, 1)[2]
    assert not torch.equal(a, b)

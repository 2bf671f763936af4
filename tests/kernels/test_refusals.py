"""What the hardware GEMM paths do when torch refuses them, shown on CPU.

* ``bf16_mm`` falls back to FP32 GEMMs only on the one refusal it means (no ``mm(out_dtype=)``).
* ``torch_scaled_mm``'s BF16-output retry also catches ValueError / NotImplementedError (what
  ``F.scaled_mm`` raises), still only for the FP32-output refusal.
* The start-up probe (``kernels.probe``) tries every entry point the installed torch has
  (``F.scaled_mm``, then ``torch._scaled_mm``) before a format is emulated, on Blackwell (sm_100,
  sm_103, sm_110, sm_120) and for FP8 on Hopper; it reports which path each format takes, and a
  format every entry point refused goes to ``bf16_mm`` with one WARNING line at start-up. The
  decision logic is the real code; only torch's GEMM calls and the device capability are simulated.
* ``F.scaled_mm``'s enums are found under either spelling torch has used.
"""

import pytest
import torch

from kernels import backends as kb
from kernels import probe as kp
from kernels import scaled_mm as ksm
from kernels import torch_api
from kernels.bf16_mm import refuses_out_dtype
from precision import presets
from precision.recipe import Gemm, parse_gemm
from precision.state import LayerQuantState

SM100 = (10, 0)


def _raised(fn) -> BaseException:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what torch raised
        return e
    raise AssertionError("expected torch to refuse")


def test_bf16_mm_falls_back_only_on_the_missing_out_dtype_overload():
    a = torch.ones(4, 4, dtype=torch.bfloat16)
    # torch's own refusal: the overload has no kernel for this device
    assert refuses_out_dtype(_raised(lambda: torch.mm(a, a, out_dtype=torch.float32)))
    # an older torch without the overload (its TypeError lists overloads without out_dtype)
    old = TypeError("mm() received an invalid combination of arguments - got (Tensor, Tensor, "
                    "out_dtype=torch.dtype), but expected one of:\n * (Tensor input, Tensor mat2, *, Tensor out = None)")
    assert refuses_out_dtype(old)
    # real failures whose text mentions "dtype" are not that refusal: they must propagate
    mixed = _raised(lambda: torch.mm(a, torch.ones(4, 4)))
    assert "dtype" in str(mixed) and not refuses_out_dtype(mixed)
    assert not refuses_out_dtype(_raised(lambda: torch.mm(a, a, out_dtype_typo=torch.float32)))
    assert not refuses_out_dtype(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))


@pytest.mark.parametrize("exc", [ValueError, NotImplementedError, RuntimeError])
def test_scaled_mm_retries_bf16_output_whatever_exception_class_refuses_fp32(exc, monkeypatch):
    calls = []

    def fake(a, b, out_dtype, entry):
        calls.append(out_dtype)
        if out_dtype is torch.float32:
            raise exc("Block-wise scaling only supports BFloat16 or Half output types")
        return ksm.emulated_scaled_mm(a, b).to(out_dtype)

    monkeypatch.setattr(ksm, "_call_scaled_mm", fake)
    monkeypatch.setattr(ksm, "_OUT_DTYPE", {})
    ops = _hw_operands("mxfp8_e4m3")
    out = ksm.torch_scaled_mm(*ops)
    assert calls == [torch.float32, torch.bfloat16] and out.dtype is torch.float32
    # any other refusal propagates, whatever its class
    monkeypatch.setattr(ksm, "_OUT_DTYPE", {})
    monkeypatch.setattr(ksm, "_call_scaled_mm", lambda a, b, dt, entry: (_ for _ in ()).throw(exc("mat2 shape mismatch")))
    with pytest.raises(exc, match="shape mismatch"):
        ksm.torch_scaled_mm(*ops)


def _hw_operands(fmt):
    from kernels.operand import gemm_operands
    from precision.state import LayerQuantState

    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
    ops = gemm_operands(Gemm.FPROP, x, w, parse_gemm(fmt, Gemm.FPROP), LayerQuantState(),
                        impl="reference", codes=True)
    return ksm.hw_operand(ops.a), ksm.hw_operand(ops.b)


SM90, SM120 = (9, 0), (12, 0)


@pytest.fixture
def clean_refusals():
    def clean():
        for table in (kb.REFUSED_FORMATS, kb.PROBED_ENTRIES):
            for cap in (SM100, SM90, SM120, (11, 0)):
                table.pop(cap, None)
        kp._PROBED.clear()

    clean()
    yield
    clean()


def _no_fbgemm(a, b):  # F.scaled_mm on a torch built without FBGEMM GenAI refuses MXFP4
    if a.fmt == "mxfp4":
        raise NotImplementedError("MXFP4 scaled_mm requires PyTorch built with FBGEMM GenAI\nmore")
    return ksm.emulated_scaled_mm(a, b)


def _refuses(message):
    def call(a, b):
        raise RuntimeError(message)
    return call


def _refuses_mxfp4(a, b):
    if a.fmt == "mxfp4":
        raise RuntimeError("CUDA error: operation not supported\nwhen calling cublasLtMatmul")
    return ksm.emulated_scaled_mm(a, b)


def test_sm100_probe_tries_every_entry_point_before_emulating_mxfp4(clean_refusals):
    entries = {"torch._scaled_mm": _refuses_mxfp4, "F.scaled_mm": ksm.emulated_scaled_mm}
    lines = kp.probe_formats("cpu", capability=SM100, entries=entries)
    assert lines[0] == "one-GEMM probe per format on sm_100:"
    by_fmt = {ln.split(":")[0].strip(): ln for ln in lines[1:]}
    assert set(by_fmt) == set(kp.PROBE_FORMATS)
    assert by_fmt["fp8_e4m3"].startswith("  fp8_e4m3: fp8_scaled_mm via torch._scaled_mm (relative error")
    assert by_fmt["nvfp4"].startswith("  nvfp4: mx_scaled_mm via F.scaled_mm (relative error")  # two-level first
    assert by_fmt["mxfp4"].startswith("  mxfp4: mx_scaled_mm via F.scaled_mm (relative error")
    assert by_fmt["mxfp4"].endswith("; torch._scaled_mm: RuntimeError: CUDA error: operation not supported)")
    mxfp4, nvfp4 = parse_gemm("mxfp4", Gemm.FPROP), parse_gemm("nvfp4", Gemm.FPROP)
    assert kb.select_backend(mxfp4, SM100) == "mx_scaled_mm"  # served, by the second entry point
    assert kb.probed_entry(SM100, ("mxfp4", "mxfp4")) == "F.scaled_mm"
    assert kb.probed_entry(SM100, ("nvfp4", "nvfp4")) == "F.scaled_mm"
    assert kb.select_backend(nvfp4, SM100) == "mx_scaled_mm"


def test_training_gemms_take_the_probed_entry_point(clean_refusals, monkeypatch):
    kb.record_probe(SM100, ("mxfp4", "mxfp4"), entry="F.scaled_mm")
    used = []
    for name in ksm.ENTRY_POINTS:
        monkeypatch.setitem(ksm.ENTRY_POINTS, name,
                            lambda a, b, dt, _n=name: used.append(_n) or ksm.emulated_scaled_mm(a, b).to(dt))
    x, w = torch.randn(64, 128), torch.randn(96, 128)
    ksm.hw_gemm(Gemm.FPROP, x, w, parse_gemm("mxfp4", Gemm.FPROP), LayerQuantState(), backend="mx_scaled_mm",
                capability=SM100)
    ksm.hw_gemm(Gemm.FPROP, x, w, parse_gemm("nvfp4", Gemm.FPROP), LayerQuantState(), backend="mx_scaled_mm",
                capability=SM100)  # not probed: the first entry point this torch offers
    assert used == ["F.scaled_mm", ksm.entry_points("nvfp4")[0]]


def test_a_format_every_entry_point_refuses_is_emulated_and_said_in_one_line(clean_refusals):
    entries = {"F.scaled_mm": _no_fbgemm, "torch._scaled_mm": _refuses("CUDA error: invalid argument\nat Blas.cpp")}
    lines = kp.probe_formats("cpu", capability=SM100, entries=entries, formats=("mxfp4",))
    assert lines[1] == ("  mxfp4: mx_scaled_mm refused (torch._scaled_mm: RuntimeError: CUDA error: invalid argument; "
                        "F.scaled_mm: NotImplementedError: MXFP4 scaled_mm requires PyTorch built with FBGEMM GenAI) "
                        "-> bf16_mm")
    mxfp4 = parse_gemm("mxfp4", Gemm.FPROP)
    assert kb.select_backend(mxfp4, SM100) == "bf16_mm"
    with pytest.raises(kb.BackendError, match="torch refused mxfp4 here at the start-up probe"):
        kb.select_backend(mxfp4, SM100, "mx_scaled_mm")
    assert kb.select_backend(mxfp4, (10, 3)) == "mx_scaled_mm"  # another device is not affected
    text = kp.startup_report({"decoder.layers.0.mlp.linear_fc1": presets.get("mxfp4")}, SM100)
    warnings = [ln for ln in text.splitlines() if ln.startswith("WARNING")]
    assert warnings == ["WARNING: hardware GEMMs asked for (--gemm-backend auto on sm_100) but 3 of 3 GEMMs with "
                        "tensor-core formats run emulated -- mxfp4 (fprop, dgrad, wgrad): torch refused it at the "
                        "start-up probe (torch._scaled_mm: RuntimeError: CUDA error: invalid argument; F.scaled_mm: "
                        "NotImplementedError: MXFP4 scaled_mm requires PyTorch built with FBGEMM GenAI)"]
    assert "  fprop: mxfp4 -> bf16_mm" in text
    assert kp.last_paths()["paths"]["wgrad"] == {"mxfp4": "bf16_mm"} and kp.last_paths()["warning"] == warnings[0]


def test_probe_refuses_a_format_whose_result_is_off_the_spec(clean_refusals):
    lines = kp.probe_formats("cpu", capability=SM100, formats=("nvfp4",),
                             mm=lambda a, b: ksm.emulated_scaled_mm(a, b) * 1.1)
    assert "nvfp4: mx_scaled_mm refused (F.scaled_mm: ValueError: result off the emulated spec" in lines[1]
    assert "; torch._scaled_mm: ValueError: result off the emulated spec" in lines[1]  # each entry tried
    assert lines[1].endswith("-> bf16_mm")


def test_sm90_probe_says_block_formats_take_bf16_mm(clean_refusals):
    lines = kp.probe_formats("cpu", capability=SM90, formats=("mxfp4", "nvfp4"))
    assert lines[1:] == ["  mxfp4: bf16_mm (no mx_scaled_mm here)", "  nvfp4: bf16_mm (no mx_scaled_mm here)"]


def test_hopper_probes_fp8_at_start_up(clean_refusals):
    """A refused FP8 GEMM is found before the first step (not a traceback mid-step): its GEMMs go to
    bf16_mm and the run says so; E4M3 x E4M3 and E5M2 x E4M3 are probed separately."""
    plan = {"decoder.layers.0.self_attention.linear_qkv": presets.get("fp8")}
    assert kp.plan_probe_specs(plan, SM90) == ("fp8_e4m3@fp8_e4m3", "fp8_e5m2@fp8_e4m3")

    def no_e5m2(a, b):
        if a.fmt == "fp8_e5m2":
            raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported")
        return ksm.emulated_scaled_mm(a, b)

    entries = {"torch._scaled_mm": no_e5m2, "F.scaled_mm": no_e5m2}
    text = kp.startup_report(plan, SM90, probe=lambda _dev, formats: kp.probe_formats(
        "cpu", capability=SM90, entries=entries, formats=formats))
    lines = text.splitlines()
    assert lines[0] == "one-GEMM probe per format on sm_90:"
    assert lines[1].startswith("  fp8_e4m3@fp8_e4m3: fp8_scaled_mm via torch._scaled_mm (relative error")
    assert lines[2].startswith("  fp8_e5m2@fp8_e4m3: fp8_scaled_mm refused (torch._scaled_mm: RuntimeError")
    assert "  fprop: fp8_e4m3 -> fp8_scaled_mm via torch._scaled_mm" in lines
    assert "  dgrad: fp8_e5m2 x fp8_e4m3 -> bf16_mm" in lines
    assert lines[-1].startswith("WARNING: hardware GEMMs asked for (--gemm-backend auto on sm_90) but 2 of 3 GEMMs")


@pytest.mark.parametrize("cap", [(10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
def test_every_blackwell_part_is_recognised(cap):
    assert "mx_scaled_mm" in kb.device_backends(cap)
    assert kb.select_backend(presets.get("mxfp4"), cap) == dict.fromkeys(Gemm, "mx_scaled_mm")
    assert "mx_scaled_mm" not in kb.device_backends((9, 0)) and "mx_scaled_mm" not in kb.device_backends((8, 9))


def test_entry_points_follow_what_this_torch_has():
    assert ksm.entry_points("mxfp4", f_scaled_mm=True, torch_scaled_mm=True) == ("torch._scaled_mm", "F.scaled_mm")
    assert ksm.entry_points("mxfp4", f_scaled_mm=False, torch_scaled_mm=True) == ("torch._scaled_mm",)
    assert ksm.entry_points("mxfp4", f_scaled_mm=True, torch_scaled_mm=False) == ("F.scaled_mm",)
    assert ksm.entry_points("nvfp4", f_scaled_mm=False, torch_scaled_mm=False) == ()
    # NVFP4: F.scaled_mm first, its two-level recipe applies the tensor scales in the GEMM (BF16 output)
    assert ksm.entry_points("nvfp4", f_scaled_mm=True, torch_scaled_mm=True) == ("F.scaled_mm", "torch._scaled_mm")
    assert ksm.entry_points("nvfp4", f_scaled_mm=False, torch_scaled_mm=True) == ("torch._scaled_mm",)


class _OldScaling:  # the enum spellings of another torch release
    Tensorwise, Blockwise_1x16, Blockwise_1x32 = "t", "b16", "b32"


class _OldSwizzle:
    Swizzle_32_4_4, NoSwizzle = "sw", "none"


def test_scaled_mm_enums_under_either_spelling(monkeypatch):
    torch_api.scaled_mm_enums.cache_clear()
    try:
        assert torch_api.scaled_mm_enums() is not None  # this torch's spelling
        monkeypatch.setattr(torch.nn.functional, "ScalingType", _OldScaling)
        monkeypatch.setattr(torch.nn.functional, "SwizzleType", _OldSwizzle)
        torch_api.scaled_mm_enums.cache_clear()
        assert torch_api.scaled_mm_enums() == {"tensor": "t", "block16": "b16", "block32": "b32", "swizzle": "sw",
                                               "no_swizzle": "none"}
        monkeypatch.delattr(torch.nn.functional, "scaled_mm")
        torch_api.scaled_mm_enums.cache_clear()
        assert torch_api.scaled_mm_enums() is None  # -> the positional torch._scaled_mm call
    finally:
        monkeypatch.undo()
        torch_api.scaled_mm_enums.cache_clear()


def test_api_report_names_every_api_the_gpu_path_uses():
    text = "\n".join(torch_api.api_report())
    for name in ("torch.mm(out_dtype=)", "torch._scaled_mm", "F.scaled_mm", "fp32_precision", "enable_gqa"):
        assert name in text
    missing = [ln for ln in text.splitlines() if "MISSING" in ln]
    # this torch has them all; only F.scaled_mm's meta check still counts MXFP4 scales from the packed K
    assert missing == ["  F.scaled_mm meta check of MXFP4 scales: MISSING -> counts the packed K: MXFP4 calls run "
                       "outside torch.compile graphs"] or not missing


def test_sm100_probe_runs_a_2d_weight_through_fprop_and_dgrad_from_one_quantization(clean_refusals):
    """The nvfp4 preset's 2-D-tiled weight: Fprop's w and Dgrad's wᵀ reach torch._scaled_mm as the
    same quantized values (one quantization, two layouts); with 1-D blocks the two differ."""
    seen = []

    def recording_scaled_mm(a, b):
        seen.append(b.decode())
        return ksm.emulated_scaled_mm(a, b)

    lines = kp.probe_formats("cpu", capability=SM100, mm=recording_scaled_mm, formats=("nvfp4@nvfp4/2d",))
    assert lines[1].startswith("  nvfp4@nvfp4/2d: mx_scaled_mm via F.scaled_mm, Fprop and Dgrad from one "
                               "quantization of w (relative error vs the emulated spec")
    w_fprop, wt_dgrad = seen  # [out, in] and [in, out], each zero-padded to the hardware multiples
    assert torch.equal(w_fprop[:96, :128], wt_dgrad[:128, :96].t())

    seen.clear()  # the same two GEMMs with 1-D weight blocks: two quantizations, other values
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(0))
    for g, a in ((Gemm.FPROP, torch.randn(64, 128)), (Gemm.DGRAD, torch.randn(64, 96))):
        ksm.hw_gemm(g, a, w, parse_gemm("nvfp4", g), LayerQuantState(), backend="mx_scaled_mm",
                    capability=SM100, mm=recording_scaled_mm)
    assert not torch.equal(seen[0][:96, :128], seen[1][:128, :96].t())


def test_a_refused_2d_weight_probe_reroutes_its_format(clean_refusals):
    def refusing(a, b):
        if a.rows == 64 and b.rows == 128:  # Dgrad's wᵀ [in, out]
            raise RuntimeError("CUDA error: invalid argument")
        return ksm.emulated_scaled_mm(a, b)

    lines = kp.probe_formats("cpu", capability=SM100, mm=refusing, formats=("nvfp4@nvfp4/2d",))
    assert lines[1] == ("  nvfp4@nvfp4/2d: mx_scaled_mm refused (F.scaled_mm: RuntimeError: CUDA error: invalid "
                        "argument; torch._scaled_mm: RuntimeError: CUDA error: invalid argument) -> bf16_mm")
    assert kb.select_backend(parse_gemm("nvfp4", Gemm.FPROP), SM100) == "bf16_mm"


def test_a_run_that_asked_for_emulation_gets_no_warning(clean_refusals):
    plan = {"l": presets.get("fp8")}
    for requested in ("bf16_mm", "emulated", "reference"):
        text = kp.startup_report(plan, SM90, requested)
        assert "WARNING" not in text and f"  fprop: fp8_e4m3 -> {requested}" in text
    assert kp.gemm_paths(plan, "cpu")["warning"] == ""  # a CPU run asks for no hardware

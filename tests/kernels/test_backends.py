"""GEMM backend selection per device capability, its errors, the start-up report, and the
``auto`` backend; plus a smoke run of ``launch/bench_kernels.py --json``."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from kernels import BACKENDS, describe_backends, gemm, select_backend
from kernels.backends import BackendError, capability_name, device_backends, device_capability
from model.linear import policy_linear
from precision import Gemm, LayerQuantState, presets, quantize
from precision.recipe import parse_gemm
from precision.rotation import rotate
from tests._dist import run_scaled

SM80, SM89, SM90, SM100 = (8, 0), (8, 9), (9, 0), (10, 0)
ROOT = Path(__file__).resolve().parents[2]


def test_backends_registered():
    assert {"emulated", "reference", "fp8_scaled_mm", "mx_scaled_mm", "bf16_mm", "auto"} <= set(BACKENDS)


def test_device_capabilities():
    assert device_capability("cpu") is None and device_capability(torch.device("cpu")) is None
    assert device_capability(SM90) == SM90 and device_capability("gfx950") == "gfx950"
    assert [capability_name(c) for c in (None, SM90, SM100, "gfx950")] == ["cpu", "sm_90", "sm_100", "gfx950"]
    assert device_backends(None) == () and device_backends((7, 5)) == () and device_backends(SM80) == ("bf16_mm",)
    assert device_backends(SM89) == device_backends(SM90) == ("fp8_scaled_mm", "bf16_mm")
    assert device_backends(SM100) == device_backends("gfx950") == ("fp8_scaled_mm", "mx_scaled_mm", "bf16_mm")


@pytest.mark.parametrize("cap,preset,want", [
    (None, "mxfp4_fprop", ("emulated", "emulated", "emulated")),
    ((7, 5), "fp8", ("emulated", "emulated", "emulated")),                   # no BF16 tensor cores
    (SM80, "fp8", ("bf16_mm", "bf16_mm", "bf16_mm")),                        # FP8 emulated on BF16 ones
    (SM90, "fp8", ("fp8_scaled_mm",) * 3),
    (SM90, "mxfp4_fprop", ("bf16_mm", "fp8_scaled_mm", "fp8_scaled_mm")),    # MXFP4 emulated on Hopper
    (SM100, "mxfp4_fprop", ("mx_scaled_mm", "fp8_scaled_mm", "fp8_scaled_mm")),
    (SM100, "wgrad_hadamard", ("mx_scaled_mm",) * 3),
    (SM100, "nvfp4", ("mx_scaled_mm",) * 3),
    ("gfx950", "nvfp4", ("bf16_mm",) * 3),                                   # no NVFP4 GEMM on gfx950
    ("gfx950", "mxfp4", ("mx_scaled_mm",) * 3),
    (SM100, "bf16", ("bf16_mm",) * 3),                                       # plain cuBLAS BF16
    (SM100, "hif8_w8a8", ("bf16_mm",) * 3),
])
def test_auto_selection(cap, preset, want):
    chosen = select_backend(presets.get(preset), cap)
    assert tuple(chosen[g] for g in Gemm) == want


def test_selection_of_one_recipe_and_explicit_requests():
    rec = parse_gemm("fp8_e5m2@fp8_e4m3", Gemm.DGRAD)
    assert select_backend(rec, SM90) == "fp8_scaled_mm"
    assert select_backend(rec, SM90, "emulated") == "emulated"
    assert select_backend(parse_gemm("fp8_e5m2", Gemm.DGRAD), SM90) == "bf16_mm"  # E5M2 x E5M2: no FP8 GEMM
    assert select_backend(parse_gemm("mxfp4@mxfp8_e4m3", Gemm.FPROP), SM100) == "bf16_mm"  # mixed families
    assert select_backend(parse_gemm("fp8_e5m2", Gemm.DGRAD), (7, 5)) == "emulated"  # no BF16 tensor cores


def test_errors_name_gemm_layer_and_what_the_device_supports():
    layer = "decoder.layers.3.mlp.linear_fc2"
    with pytest.raises(BackendError) as e:
        select_backend(presets.get("mxfp4"), SM90, "mx_scaled_mm", layer=layer)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"{layer} fprop: backend mx_scaled_mm needs Blackwell (sm_10x, sm_11x, sm_12x) "
                   "or gfx950; this device is sm_90, "
                   "which supports: fp8_scaled_mm, bf16_mm, emulated, reference")
    cpu_msg = (r"^fprop: backend mx_scaled_mm needs Blackwell \(sm_10x, sm_11x, sm_12x\) or gfx950; this device is cpu, "
               "which supports: emulated, ")
    with pytest.raises(BackendError, match=cpu_msg + "reference$"):
        select_backend(presets.get("mxfp4"), "cpu", "mx_scaled_mm")
    with pytest.raises(BackendError, match=r"^l wgrad: backend fp8_scaled_mm cannot run mxfp4\+had16 "
                                           r"\(block-scaled\); on sm_100 use one of"):
        select_backend(parse_gemm("mxfp4+had16", Gemm.WGRAD), SM100, "fp8_scaled_mm", layer="l",
                       gemm=Gemm.WGRAD)
    with pytest.raises(ValueError, match="unknown GEMM backend 'tensorcores'"):
        select_backend(presets.get("fp8"), SM90, "tensorcores")


def test_describe_backends_report():
    plan = {"decoder.layers.0.mlp.linear_fc1": presets.get("mxfp4_fprop"),
            "output_layer": presets.get("bf16")}
    text = describe_backends(plan, SM90)
    lines = text.splitlines()
    assert lines[0] == "GEMM backends on sm_90 (hardware GEMMs here: fp8_scaled_mm, bf16_mm; requested: auto)"
    assert lines[1].split() == ["layer", "fprop", "dgrad", "wgrad"]
    assert "mxfp4 -> bf16_mm" in lines[2] and lines[2].count("-> fp8_scaled_mm") == 2
    assert lines[3].split()[0] == "output_layer" and lines[3].count("bf16 -> bf16_mm") == 3
    assert lines[4] == "GEMMs per backend: bf16_mm 4, fp8_scaled_mm 2"
    assert lines[5].startswith("  bf16_mm: BF16 tensor-core GEMM") and lines[6].startswith("  fp8_scaled_mm: FP8")
    assert "hardware GEMMs here: none" in describe_backends(presets.get("nvfp4"), "cpu")
    # layers that get the same recipes and backends are one line, named compactly with their count
    many = {f"decoder.layers.{i}.mlp.{fc}": presets.get("fp8") for i in range(12) for fc in ("linear_fc1", "linear_fc2")}
    many["decoder.layers.5.mlp.linear_fc2"] = presets.get("bf16")
    rows = describe_backends(many, SM90).splitlines()[2:-3]
    assert [r.split("  ")[0] for r in rows] == [
        "decoder.layers.[0-11].mlp.linear_fc1, decoder.layers.[0-4,6-11].mlp.linear_fc2 (23)",
        "decoder.layers.5.mlp.linear_fc2"]


def test_auto_backend_on_cpu_is_the_emulated_backend():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g)
    dy = torch.randn(64, 32, generator=g)
    outs = []
    for backend in ("reference", "auto"):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = policy_linear(xr, wr, presets.get("mxfp4_fprop"), state=LayerQuantState(1, "l"), backend=backend)
        y.backward(dy)
        outs.append((y, xr.grad, wr.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(gemm(Gemm.FPROP, x, w, parse_gemm("fp8", Gemm.FPROP), "auto"),
                       gemm(Gemm.FPROP, x, w, parse_gemm("fp8", Gemm.FPROP), "reference"))


def test_bench_kernels_json_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "launch" / "bench_kernels.py"), "--device", "cpu", "--size", "64",
           "--tokens", "64", "--hidden", "64", "--ffn", "32", "--formats", "mxfp4,fp8_e4m3",
           "--presets", "bf16,mxfp4", "--repeats", "1", "--impls", "reference",
           "--linear-backends", "reference", "--json", str(out)]
    r = run_scaled(cmd, 300, capture_output=True, text=True, cwd=ROOT)  # idle-machine budget, grows with load
    assert r.returncode == 0, r.stderr[-2000:]
    assert "copy bandwidth" in r.stdout and "n/a (needs CUDA)" in r.stdout
    res = json.loads(out.read_text())
    assert res["copy"]["gbps"] > 0
    q = res["quantizers"]
    assert {(r["format"], r["layout"], r["rotation"]) for r in q} == {
        (f, lay, rot) for f in ("mxfp4", "fp8_e4m3") for lay in ("rowwise", "colwise")
        for rot in ("none", "had16")}
    assert all(r["gbps"] > 0 and 0 < r["frac_copy"] for r in q)
    lin = {(r["preset"], r["backend"]): r for r in res["linear"]}
    assert lin[("bf16", "reference")]["vs_bf16"] == 1.0 and lin[("mxfp4", "reference")]["vs_bf16"] > 0
    assert lin[("torchao float8 tensorwise", "torchao")]["na"] == "n/a (needs CUDA)"


def test_kernels_quantize_backend_errors(monkeypatch):
    """Asking for Triton where it cannot run: one line naming what is missing (no triton needed)."""
    import kernels
    import kernels.quantizer as kq

    x = torch.randn(16, 32)
    prefix = r"^kernels.quantize\(backend='triton'\): "
    triton_formats = re.escape(", ".join(kq.TRITON_FORMATS))  # the registry's list
    with pytest.raises(RuntimeError, match=prefix + rf"no Triton kernel for format 'hif8' \(Triton formats: {triton_formats}\)"):
        kernels.quantize(x, "hif8", backend="triton")
    with pytest.raises(ValueError, match="unknown 'cuda'; valid: auto, reference, triton"):
        kernels.quantize(x, "mxfp4", backend="cuda")
    with pytest.raises(ValueError, match="rotation rht16: needs signs="):
        kernels.quantize(x, "mxfp4", rotation="rht16")
    monkeypatch.setattr(kq, "triton_importable", lambda: False)
    missing = r"triton is not installed \(pip install 'lowprec-pretrain\[gpu\]', or pip install triton\)$"
    with pytest.raises(RuntimeError, match=prefix + missing):
        kernels.quantize(x, "mxfp4", backend="triton")
    ref = kernels.quantize(x, "mxfp4", axis=0, rotation="had16")  # auto on CPU: the reference
    assert torch.equal(ref.codes, quantize(rotate(x, 0, 16), "mxfp4", axis=0).codes)


def test_kernels_quantize_cpu_without_interpreter(monkeypatch):
    import kernels

    if not kernels.quantizer.triton_importable():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"the tensor is on cpu, Triton needs a CUDA device \(or TRITON_INTERPRET"):
        kernels.quantize(torch.randn(4, 32), "mxfp4", backend="triton")


def test_both_public_quantizers_read_their_arguments_through_one_adapter():
    """``kernels.quantize`` and ``precision.quantize`` take the same older keyword forms through
    ``precision.quantize.quantize_call`` and give the same codes; a misspelt keyword is one line."""
    import kernels
    from precision.quantize import quantize as precision_quantize
    from precision.recipe import OperandFormat

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    a = kernels.quantize(x, "mxfp4", rounding="stochastic", scale_rule="rceil", generator=g1, backend="reference")
    b = precision_quantize(x, "mxfp4", rounding="stochastic", scale_rule="rceil", generator=g2)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    with pytest.raises(ValueError, match="is an OperandFormat, which carries its own rounding"):
        kernels.quantize(x, OperandFormat("mxfp4"), rounding="stochastic")
    with pytest.raises(TypeError, match=r"^kernels.quantize: unknown argument\(s\) roundng; valid besides"):
        kernels.quantize(x, "mxfp4", roundng="stochastic")


@pytest.mark.parametrize("op", ["fp8_e4m3 margin 2", "nvfp4 /2d", "mxfp4 /2d", "nvfp4 /2d/4over6"])
def test_kernels_quantize_keeps_every_setting_of_the_operand_format(op):
    """``kernels.quantize`` gives ``precision.quantize``'s bits for an ``OperandFormat`` with 2-D weight
    tiles or a margin (it used to rebuild the format without them and quantize 1-D blocks / at margin 0)."""
    import kernels
    from precision.enums import FourOverSix
    from precision.quantize import quantize as precision_quantize
    from precision.recipe import OperandFormat

    fmt = {"fp8_e4m3 margin 2": OperandFormat("fp8_e4m3", margin=2),
           "nvfp4 /2d": OperandFormat("nvfp4", block2d=True), "mxfp4 /2d": OperandFormat("mxfp4", block2d=True),
           "nvfp4 /2d/4over6": OperandFormat("nvfp4", block2d=True, four_over_six=FourOverSix.MSE)}[op]
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    a, b = kernels.quantize(w, fmt, backend="reference"), precision_quantize(w, fmt)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert torch.equal(a.dequantize(), b.dequantize())
    plain = precision_quantize(w, OperandFormat(fmt.fmt))
    assert not torch.equal(a.dequantize(), plain.dequantize())  # the setting changes the bits here

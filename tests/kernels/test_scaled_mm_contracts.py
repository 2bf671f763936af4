"""Every hardware GEMM call the backends make, replayed on ``meta`` tensors so torch's own argument
checks run without a GPU.

For each format pair a preset sends to a tensor-core GEMM, each GEMM (Fprop, Dgrad, Wgrad; a 2-D
weight's Dgrad as the re-layout of Fprop's quantization), odd and whole-tile shapes, both entry
points (``torch._scaled_mm``, ``F.scaled_mm``) and both output dtypes the backend asks for: the
operands come from the real pipeline (``gemm_operands(..., codes=True)`` -> ``hw_operand``, the
blocked scale layout of CUDA), are moved to ``meta`` and handed to the very functions the backend
calls (``kernels.scaled_mm.ENTRY_POINTS``). A wrong dtype, layout, scale count or signature fails
here with torch's message instead of on the first GPU run. The negative cases show the checks bite.

Where this torch's meta check of MXFP4 counts scales from the packed K (``F.scaled_mm`` in 2.11 and
2.13, ``torch._scaled_mm`` in 2.11: ``kernels.torch_api.fp4_meta_check_ok``), the CUDA kernel counts
them from K as we do; such calls are expected to be refused on meta with that message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import scaled_mm as ksm
from kernels.operand import gemm_operands
from kernels.probe import PROBE_FORMATS
from kernels.torch_api import fp4_meta_check_ok, scaled_mm_enums
from precision.formats import FORMATS
from precision.recipe import Gemm, parse_gemm
from precision.state import LayerQuantState

SHAPES = [(50, 72, 40), (64, 128, 96), (256, 512, 384)]  # (tokens, in, out): odd, whole tiles, several tiles
ENTRIES = [e for e in ksm.ENTRY_POINTS if e != "F.scaled_mm" or scaled_mm_enums() is not None]


def _meta(h: ksm.HwOperand) -> ksm.HwOperand:
    m = (lambda t: None if t is None else t.to("meta"))
    return dataclasses.replace(h, codes=m(h.codes), scales=m(h.scales), tensor_scale=m(h.tensor_scale),
                               decode_scale=m(h.decode_scale))


def _hw_operands(spec: str, shape):
    """``{Gemm: (A, B)}`` in hardware form for one spec, as one layer state produces them."""
    t, inp, out = shape
    g = torch.Generator().manual_seed(sum(shape))
    x, w, dy = (torch.randn(*s, generator=g) for s in ((t, inp), (out, inp), (t, out)))
    state, ops = LayerQuantState(), {}
    for gemm, (a, b) in ((Gemm.FPROP, (x, w)), (Gemm.DGRAD, (dy, w)), (Gemm.WGRAD, (dy, x))):
        try:
            recipe = parse_gemm(spec, gemm)
        except Exception:  # noqa: BLE001 - a 2-D weight spec has no Wgrad (no weight there)
            continue
        q = gemm_operands(gemm, a, b, recipe, state, impl="reference", codes=True)
        ops[gemm] = (ksm.hw_operand(q.a), ksm.hw_operand(q.b))
    return ops


def _k(h: ksm.HwOperand) -> int:
    return h.k


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("spec", PROBE_FORMATS)
def test_every_hardware_call_passes_torchs_checks_on_meta(spec, shape):
    for gemm, (a, b) in _hw_operands(spec, shape).items():
        ma, mb = _meta(a), _meta(b)
        assert ma.data.is_meta and ma.data.stride(1) == 1 and mb.data.t().stride(0) == 1  # A row-, B column-major
        for entry in ENTRIES:
            for out_dtype in (torch.float32, torch.bfloat16):
                fp4_stale = FORMATS[a.fmt].bits == 4 and FORMATS[a.fmt].block == 32 and _k(a) > 128 \
                    and not fp4_meta_check_ok(entry)
                where = f"{spec} {gemm.value} {shape} {entry} {out_dtype}"
                if fp4_stale:
                    with pytest.raises(RuntimeError, match=r"(?i)scal"):
                        ksm.ENTRY_POINTS[entry](ma, mb, out_dtype)
                    continue
                out = ksm.ENTRY_POINTS[entry](ma, mb, out_dtype)
                assert out.is_meta and out.dtype == out_dtype, where
                assert tuple(out.shape) == (a.rows, b.rows), where


def _mxfp4_pair():
    (a, b), = [v for g, v in _hw_operands("mxfp4", (64, 128, 96)).items() if g is Gemm.FPROP]
    return _meta(a), _meta(b)


def test_a_row_major_mat2_is_refused():
    a, b = _mxfp4_pair()
    with pytest.raises(RuntimeError, match="mat2 must be col_major"):
        torch._scaled_mm(a.data, b.data.t().contiguous(), a.scale, b.scale, out_dtype=torch.bfloat16)


def test_one_d_rowwise_scales_are_refused():
    (a, b), = [v for g, v in _hw_operands("fp8_e4m3", (64, 128, 96)).items() if g is Gemm.FPROP]
    a, b = _meta(a), _meta(b)
    sa = torch.empty(a.rows, device="meta")
    sb = torch.empty(b.rows, device="meta")
    with pytest.raises(RuntimeError, match="scale tensors must be 2D"):
        torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=torch.bfloat16)


def test_too_few_block_scales_are_refused():
    a, b = _mxfp4_pair()  # K = 128: 128 rows x 4 scale columns = 512 scales each
    assert a.scale.numel() == 512
    with pytest.raises(RuntimeError, match="Invalid blockwise scaling configuration"):
        torch._scaled_mm(a.data, b.data.t(), a.scale[:256], b.scale, out_dtype=torch.bfloat16)


def test_the_guard_matches_this_torchs_meta_checks():
    """``fp4_meta_check_ok`` is what this torch's checks do: a K = 512 MXFP4 call from the pipeline."""
    (a, b), = [v for g, v in _hw_operands("mxfp4", (64, 512, 96)).items() if g is Gemm.FPROP]
    a, b = _meta(a), _meta(b)
    for entry in ENTRIES:
        try:
            ksm.ENTRY_POINTS[entry](a, b, torch.bfloat16)
            ok = True
        except RuntimeError:
            ok = False
        assert ok == fp4_meta_check_ok(entry), entry


@pytest.mark.skipif(scaled_mm_enums() is None, reason="this torch has no F.scaled_mm")
def test_nvfp4_through_f_scaled_mm_is_the_two_level_recipe():
    """NVFP4's tensor scales go into the GEMM (1x16 E4M3 blocks, then one FP32 decode factor per
    operand, swizzled block scales) so it can write BF16 itself; torch checks that form too: a
    global factor that is not one element is refused."""
    (a, b), = [v for g, v in _hw_operands("nvfp4", (64, 128, 96)).items() if g is Gemm.FPROP]
    a, b = _meta(a), _meta(b)
    assert a.two_level_in_gemm("F.scaled_mm") and not a.two_level_in_gemm("torch._scaled_mm")
    assert a.tensor_decode.shape == (1,) and a.tensor_decode.dtype == torch.float32
    out = ksm.ENTRY_POINTS["F.scaled_mm"](a, b, torch.bfloat16)
    assert out.is_meta and out.dtype == torch.bfloat16 and tuple(out.shape) == (a.rows, b.rows)
    enums = scaled_mm_enums()
    rec, sw = [enums["block16"], enums["tensor"]], [enums["swizzle"], enums["no_swizzle"]]
    two = torch.empty(2, device="meta")
    with pytest.raises(RuntimeError, match="(?i)scal"):
        torch.nn.functional.scaled_mm(a.data, b.data.t(), [a.scale, two], rec, [b.scale, b.tensor_decode], rec,
                                      swizzle_a=sw, swizzle_b=sw, output_dtype=torch.bfloat16)

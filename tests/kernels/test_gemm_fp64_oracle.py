"""Every GEMM of a real model step against an independent FP64 computation on the same quantized operands.

The operands are the real ``x``, ``w`` and ``dy`` of every linear layer of a small megatron GPT
(one forward and backward pass), captured at the ``policy_linear`` seam. For each preset and each
of the three GEMMs, the oracle quantizes each operand *as the design specifies* -- its own
``OperandFormat``, blocks along the GEMM's contraction axis, the GEMM's rotation on both operands
-- with the eager reference quantizer, then multiplies in float64. The emulated backend must agree
to FP32-accumulation accuracy. This is the check that FP8 beating BF16 in a sweep is not a GEMM
that consumes the wrong operand (for instance Fprop's row-wise ``w`` reused in Dgrad, a scale
applied twice, or the BF16 baseline skipping its rounding).
"""

import pytest
import torch

import model.layers
from kernels import gemm
from model.gpt import apply_precision_plan, build_gpt, policy_linear_names
from precision import presets
from precision.quantize import quantize
from precision.recipe import Gemm
from precision.rotation import rotate, rotation_size
from precision.state import LayerQuantState
from tests.model._fakes import TINY_LLAMA

pytestmark = pytest.mark.usefixtures("world_of_one")

# contraction axes of the operands in their natural layouts (x [T, in], w [out, in], dy [T, out])
AXES = {Gemm.FPROP: (1, 1), Gemm.DGRAD: (1, 0), Gemm.WGRAD: (0, 0)}
PRESETS = ["fp32", "bf16", "fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4", "wgrad_hadamard",
           "mxfp4_hadamard_all"]


@pytest.fixture(scope="module")
def operands():
    """(x, w, dy) of every linear of one training step of a 2-layer Llama-style GPT."""
    torch.manual_seed(0)
    gpt = build_gpt(TINY_LLAMA)
    apply_precision_plan(gpt, {n: presets.get("bf16") for n in policy_linear_names(gpt)})
    captured = []
    real = model.layers.policy_linear

    def capture(x, w, precision, bias=None, **kw):
        y = real(x, w, precision, bias, **kw)
        rec = {"x": x.detach().reshape(-1, x.shape[-1]).clone(), "w": w.detach().clone()}
        y.register_hook(lambda g: rec.__setitem__("dy", g.detach().reshape(-1, g.shape[-1]).clone()))
        captured.append(rec)
        return y

    model.layers.policy_linear = capture
    try:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, TINY_LLAMA.vocab_size, (2, TINY_LLAMA.seq_length), generator=gen)
        pos = torch.arange(TINY_LLAMA.seq_length).expand_as(tokens)
        gpt(tokens, pos, None, labels=torch.roll(tokens, -1, 1)).mean().backward()
    finally:
        model.layers.policy_linear = real
    assert len(captured) == len(policy_linear_names(gpt)) and all("dy" in r for r in captured)
    return captured


def oracle(g: Gemm, a: torch.Tensor, b: torch.Tensor, recipe, b_axis=None) -> torch.Tensor:
    """The GEMM in float64 on operands quantized per the spec (``b_axis`` overrides b's axis)."""
    a_axis, spec_b_axis = AXES[g]
    b_axis = spec_b_axis if b_axis is None else b_axis
    if recipe.rotation != "none":
        n = rotation_size(recipe.rotation)
        assert recipe.rotation.startswith("had")  # deterministic: no signs to reproduce
        a, b = rotate(a, a_axis, n), rotate(b, b_axis, n)
    qa = quantize(a, recipe.a.fmt, axis=a_axis, rounding=recipe.a.rounding, scale_rule=recipe.a.scale_rule)
    qb = quantize(b, recipe.b.fmt, axis=b_axis, rounding=recipe.b.rounding, scale_rule=recipe.b.scale_rule)
    a64, b64 = qa.dequantize().double(), qb.dequantize().double()
    if g is Gemm.FPROP:
        return a64 @ b64.t()
    if g is Gemm.DGRAD:
        return a64 @ b64
    return a64.t() @ b64


def _bound(g, a, b) -> torch.Tensor:
    """Elementwise FP32 accumulation bound K * 2^-23 * (|a| |b|), plus a tiny absolute floor."""
    k = a.shape[AXES[g][0]]
    aa, bb = a.abs().double(), b.abs().double()
    mag = {Gemm.FPROP: lambda: aa @ bb.t(), Gemm.DGRAD: lambda: aa @ bb, Gemm.WGRAD: lambda: aa.t() @ bb}[g]()
    return k * 2.0**-23 * mag + 1e-30


@pytest.mark.parametrize("preset", PRESETS)
def test_every_gemm_equals_fp64_on_the_same_quantized_operands(operands, preset):
    prec = presets.get(preset)
    for rec in operands:
        for g in Gemm:
            a, b = (rec[n] for n in g.operands)
            recipe = prec.recipe(g)
            ours = gemm(g, a, b, recipe, "emulated", state=LayerQuantState()).double()
            exact = oracle(g, a, b, recipe)
            err = (ours - exact).abs()
            assert (err <= _bound(g, a, b)).all(), (preset, g.value, float(err.max()))


def test_the_oracle_tells_the_dgrad_weight_layout_apart(operands):
    """The check can fail: Dgrad with w blocked along in-features (Fprop's layout) is far off."""
    recipe = presets.get("mxfp4").dgrad
    rec = max(operands, key=lambda r: r["w"].numel())
    dy, w = rec["dy"], rec["w"]
    ours = gemm(Gemm.DGRAD, dy, w, recipe, "emulated", state=LayerQuantState()).double()
    wrong = oracle(Gemm.DGRAD, dy, w, recipe, b_axis=1)
    assert ((ours - wrong).abs() > _bound(Gemm.DGRAD, dy, w)).any()


def test_bf16_baseline_rounds_its_operands_and_fp32_does_not(operands):
    rec = operands[0]
    x, w = rec["x"], rec["w"]
    exact = x.double() @ w.double().t()
    y32 = gemm(Gemm.FPROP, x, w, presets.get("fp32").fprop, "emulated", state=LayerQuantState()).double()
    y16 = gemm(Gemm.FPROP, x, w, presets.get("bf16").fprop, "emulated", state=LayerQuantState()).double()
    rel = lambda y: float((y - exact).norm() / exact.norm())  # noqa: E731
    assert rel(y32) < 1e-6  # no rounding of the operands at all
    assert 1e-4 < rel(y16) < 1e-2  # BF16 operands: ~2^-9 relative rounding of each

"""Named precision presets: the MXFP4 pretraining study's ablation ladder, plus NVFP4, the FP4
error controls (four-over-six, Quartet II's MS-EDEN backward, Quartet's QuEST forward) and HiF8.

FP8 (TransformerEngine's hybrid: E4M3 for ``x`` and ``w``, E5M2 for ``dy``, per-tensor current
scaling) is the base format for the GEMMs a preset leaves out of MXFP4. Each preset's docstring
tables what each GEMM consumes. Evidence (arXiv 2605.09825, Llama-3.1-8B, native FP4 hardware,
extra tokens to reach the FP8 loss): MXFP4 Fprop+Dgrad +8-11%; plain MXFP4 Wgrad +26%; Wgrad with
stochastic rounding or a randomized Hadamard did not converge; Wgrad with a deterministic 16-point
Hadamard +8-9%, a ~10% end-to-end win over FP8.

``get(name)`` returns the preset's ``LinearPrecision``; ``default_rules(name)`` returns the
per-layer rules a preset brings with it (e.g. which layers ``hif8_w8a8`` leaves in BF16).
"""

from __future__ import annotations

from precision.recipe import PRESETS as _REGISTRY
from precision.recipe import Gemm, LinearPrecision, parse_gemm, preset
from precision.recipe import register_preset as _preset

__all__ = ["default_rules", "describe", "get", "names"]


def _lp(fprop: str, dgrad: str, wgrad: str) -> LinearPrecision:
    return LinearPrecision(parse_gemm(fprop, Gemm.FPROP), parse_gemm(dgrad, Gemm.DGRAD),
                           parse_gemm(wgrad, Gemm.WGRAD))


@_preset
def bf16() -> LinearPrecision:
    """All three GEMMs in BF16 (operands rounded to BF16, FP32 accumulation).

    | GEMM  | consumes        | rotation |
    |-------|-----------------|----------|
    | fprop | x bf16, w bf16  | none     |
    | dgrad | dy bf16, w bf16 | none     |
    | wgrad | dy bf16, x bf16 | none     |
    """
    return LinearPrecision()


@_preset
def fp32() -> LinearPrecision:
    """All three GEMMs in FP32: operands not rounded at all, exact FP32 GEMMs -- the reference
    the other presets are measured against. Unlike every other preset it keeps the output layer
    in FP32 too (its default rules), so no GEMM of the model is rounded.

    | GEMM  | consumes        | rotation |
    |-------|-----------------|----------|
    | fprop | x fp32, w fp32  | none     |
    | dgrad | dy fp32, w fp32 | none     |
    | wgrad | dy fp32, x fp32 | none     |
    """
    return _lp("fp32", "fp32", "fp32")


@_preset
def fp8() -> LinearPrecision:
    """FP8 hybrid, per-tensor current scaling -- the study's baseline.

    | GEMM  | consumes                | rotation |
    |-------|-------------------------|----------|
    | fprop | x fp8_e4m3, w fp8_e4m3  | none     |
    | dgrad | dy fp8_e5m2, w fp8_e4m3 | none     |
    | wgrad | dy fp8_e5m2, x fp8_e4m3 | none     |
    """
    return _lp("fp8", "fp8", "fp8")


@_preset
def mxfp4_fprop() -> LinearPrecision:
    """MXFP4 Fprop; Dgrad and Wgrad FP8.

    | GEMM  | consumes                | rotation |
    |-------|-------------------------|----------|
    | fprop | x mxfp4, w mxfp4        | none     |
    | dgrad | dy fp8_e5m2, w fp8_e4m3 | none     |
    | wgrad | dy fp8_e5m2, x fp8_e4m3 | none     |
    """
    return _lp("mxfp4", "fp8", "fp8")


@_preset
def mxfp4_fprop_dgrad() -> LinearPrecision:
    """MXFP4 Fprop and Dgrad; Wgrad FP8 (study: +8-11% tokens vs FP8).

    | GEMM  | consumes                | rotation |
    |-------|-------------------------|----------|
    | fprop | x mxfp4, w mxfp4        | none     |
    | dgrad | dy mxfp4, w mxfp4       | none     |
    | wgrad | dy fp8_e5m2, x fp8_e4m3 | none     |
    """
    return _lp("mxfp4", "mxfp4", "fp8")


@_preset
def mxfp4() -> LinearPrecision:
    """All three GEMMs in plain MXFP4 (study: Wgrad in MXFP4 costs +26% tokens).

    | GEMM  | consumes          | rotation |
    |-------|-------------------|----------|
    | fprop | x mxfp4, w mxfp4  | none     |
    | dgrad | dy mxfp4, w mxfp4 | none     |
    | wgrad | dy mxfp4, x mxfp4 | none     |
    """
    return _lp("mxfp4", "mxfp4", "mxfp4")


@_preset
def mxfp4_sr() -> LinearPrecision:
    """All MXFP4, stochastic rounding on both Wgrad operands (study: did not converge).

    | GEMM  | consumes                            | rotation |
    |-------|-------------------------------------|----------|
    | fprop | x mxfp4, w mxfp4                    | none     |
    | dgrad | dy mxfp4, w mxfp4                   | none     |
    | wgrad | dy mxfp4 (SR), x mxfp4 (SR)         | none     |
    """
    return _lp("mxfp4", "mxfp4", "mxfp4+sr")


@_preset
def mxfp4_rht() -> LinearPrecision:
    """All MXFP4, random-sign 16-point Hadamard (fixed per layer) on Wgrad (study: did not converge).

    | GEMM  | consumes          | rotation                     |
    |-------|-------------------|------------------------------|
    | fprop | x mxfp4, w mxfp4  | none                         |
    | dgrad | dy mxfp4, w mxfp4 | none                         |
    | wgrad | dy mxfp4, x mxfp4 | rht16 along tokens           |
    """
    return _lp("mxfp4", "mxfp4", "mxfp4+rht16")


@_preset
def wgrad_hadamard() -> LinearPrecision:
    """All MXFP4, deterministic 16-point Hadamard on Wgrad along tokens (study: +8-9% tokens vs
    FP8 for Wgrad, ~10% end-to-end win over FP8).

    | GEMM  | consumes          | rotation           |
    |-------|-------------------|--------------------|
    | fprop | x mxfp4, w mxfp4  | none               |
    | dgrad | dy mxfp4, w mxfp4 | none               |
    | wgrad | dy mxfp4, x mxfp4 | had16 along tokens |
    """
    return _lp("mxfp4", "mxfp4", "mxfp4+had16")


@_preset
def mxfp4_hadamard_all() -> LinearPrecision:
    """All MXFP4 with the deterministic 16-point Hadamard on every GEMM's contraction axis.

    | GEMM  | consumes          | rotation                 |
    |-------|-------------------|--------------------------|
    | fprop | x mxfp4, w mxfp4  | had16 along in-features  |
    | dgrad | dy mxfp4, w mxfp4 | had16 along out-features |
    | wgrad | dy mxfp4, x mxfp4 | had16 along tokens       |
    """
    return _lp("mxfp4+had16", "mxfp4+had16", "mxfp4+had16")


@_preset
def nvfp4() -> LinearPrecision:
    """NVFP4 as TransformerEngine's NVFP4BlockScaling trains it (and arXiv 2509.25149): weights in
    2-D 16x16 tiles (one E4M3 scale per tile under the FP32 tensor scale), quantized once -- Fprop
    and Dgrad consume the same weight codes; activations and gradients in 1-D 16-element blocks;
    stochastic rounding on the gradient ``dy`` (both backward GEMMs); the 16-point Hadamard with
    TE's fixed sign vector (``rht16_te``) on both Wgrad operands along tokens.

    | GEMM  | consumes                                   | rotation              |
    |-------|--------------------------------------------|-----------------------|
    | fprop | x nvfp4 (1-D 16), w nvfp4 (2-D 16x16)      | none                  |
    | dgrad | dy nvfp4 (1-D 16, SR), w nvfp4 (2-D 16x16) | none                  |
    | wgrad | dy nvfp4 (1-D 16, SR), x nvfp4 (1-D 16)    | rht16_te along tokens |

    The earlier 1-D recipe (weights in 1-D blocks along each GEMM's contraction axis, per-layer
    random Hadamard signs) is the spec
    ``fprop=nvfp4,dgrad=nvfp4/sr@nvfp4,wgrad=nvfp4/sr@nvfp4+rht16``.
    """
    return _lp("nvfp4@nvfp4/2d", "nvfp4/sr@nvfp4/2d", "nvfp4/sr@nvfp4+rht16_te")


@_preset
def nvfp4_4over6() -> LinearPrecision:
    """TransformerEngine's NVFP4 recipe (the ``nvfp4`` preset) with four-over-six scaling on every
    NVFP4 operand (arXiv 2512.02010; TE's ``nvfp4_4over6``; the authors' ``fouroversix`` applies
    the ``mse`` rule to weights, activations and gradients by default): each block keeps the scale
    mapping its amax to 4 or to 6, whichever block error is smaller (``precision.four_over_six``).

    | GEMM  | consumes                                                 | rotation              |
    |-------|----------------------------------------------------------|-----------------------|
    | fprop | x nvfp4 (1-D 16, 4over6), w nvfp4 (2-D 16x16, 4over6)      | none                  |
    | dgrad | dy nvfp4 (1-D 16, SR, 4over6), w nvfp4 (2-D 16x16, 4over6) | none                  |
    | wgrad | dy nvfp4 (1-D 16, SR, 4over6), x nvfp4 (1-D 16, 4over6)    | rht16_te along tokens |

    Evidence here (docs/controls.md; synthetic tensors, 2-core CPU, reference quantizer): 4/6 adds
    0.8 dB SQNR to plain NVFP4 on Gaussian operands and 0.35 dB on Student-t(3); with SR both
    candidates share one uniform, so the SR operands are not unbiased. In training
    (configs/sweeps/fp4_presets_cpu.md: 2 x 128 model, continuation design, 6 paired seeds): 0.68 %
    fewer full-batch steps than the ``nvfp4`` recipe (95 %: 0.44 to 0.92 % fewer; a declared claim,
    supported).
    """
    return _lp("nvfp4/4over6@nvfp4/2d/4over6", "nvfp4/sr/4over6@nvfp4/2d/4over6",
               "nvfp4/sr/4over6@nvfp4/4over6+rht16_te")


@_preset
def nvfp4_quartet2() -> LinearPrecision:
    """Quartet II (arXiv 2601.22813): NVFP4 Fprop rounded to nearest in 1-D 16-blocks, and both
    backward GEMMs in MS-EDEN (``eden128``: round to nearest, EDEN's correction over each 128-group
    put into the E4M3 block scales, which round stochastically) under a 128-point randomized
    Hadamard with new signs on every call, as the authors' backward does.

    | GEMM  | consumes                                  | rotation                           |
    |-------|-------------------------------------------|------------------------------------|
    | fprop | x nvfp4 (1-D 16), w nvfp4 (1-D 16)        | none                               |
    | dgrad | dy nvfp4 (eden128), w nvfp4 (eden128)     | rht128_resample along out-features |
    | wgrad | dy nvfp4 (eden128), x nvfp4 (eden128)     | rht128_resample along tokens       |

    Differences from the authors' training code: their Dgrad and Wgrad re-quantize Fprop's
    already-quantized ``w`` and ``x`` (here each backward GEMM quantizes the high-precision tensor
    under ``--qat-backward hp``; ``--qat-backward ste`` re-quantizes Fprop's as they do); their amax may be the previous step's (``delayed_amax``), here it is the
    current tensor's. Evidence here (docs/controls.md; a synthetic Gaussian, 2-core CPU): ``eden128``
    has 0.52x SR's squared error and a bias of -0.62e-3 +- 0.10e-3 (shown non-zero, 7x smaller
    than round-to-nearest's under the same rotations; 16-groups' is zero within its s.e.); on
    Wgrad's gradient at four continuation start points its projection on the gradient is
    -0.0005 +- 0.0001, a twelfth of NVFP4 SR's (-0.0058 +- 0.0005). In training
    (configs/sweeps/fp4_presets_cpu.md: 2 x 128 model, continuation design, 6 paired seeds): 1.02 %
    fewer full-batch steps than the ``nvfp4`` recipe (0.78 to 1.26 % fewer; a declared claim, supported).
    """
    return _lp("nvfp4", "nvfp4+eden128+rht128_resample", "nvfp4+eden128+rht128_resample")


@_preset
def mxfp4_quartet() -> LinearPrecision:
    """Quartet's recipe shape (arXiv 2505.14669): a QuEST-style MXFP4 forward -- each 32-block
    scaled from its standard deviation after a 32-point Hadamard, values beyond ~2.9 sigma clipped
    (``precision.quest``) -- and an MXFP4 backward with stochastic rounding after the same rotation.

    | GEMM  | consumes                       | rotation                  |
    |-------|--------------------------------|---------------------------|
    | fprop | x mxfp4 (quest), w mxfp4 (quest) | had32 along in-features |
    | dgrad | dy mxfp4 (SR), w mxfp4 (SR)    | had32 along out-features  |
    | wgrad | dy mxfp4 (SR), x mxfp4 (SR)    | had32 along tokens        |

    Differences from the authors: their backward rotation is randomized and their QuEST forward
    pairs with a trust-mask gradient (the clipped elements get no gradient), which
    ``--qat-backward`` does not implement. Evidence here (docs/controls.md; synthetic tensors,
    2-core CPU): the authors' power-of-two floor of the scale costs about 3 dB SQNR against plain
    MXFP4 on Gaussian operands after had32 and shrinks values (bias about -0.06). In training
    (configs/sweeps/fp4_presets_cpu.md: 2 x 128 model, continuation design, 6 paired seeds): +4.11 %
    full-batch steps against nearest MXFP4 under the same had32 on every GEMM (+3.65 to +4.56; a
    declared claim, supported).
    """
    return _lp("mxfp4/quest+had32", "mxfp4/sr+had32", "mxfp4/sr+had32")


@_preset
def hif8_w8a8() -> LinearPrecision:
    """HiF8 W8A8 QAT (arXiv 2605.26189): Fprop weights and activations in HiF8 with delayed
    per-tensor scaling, amax = max over a 64-step window; backward GEMMs in BF16. Its default
    rules keep attention, the first 3 and last 2 layers and the output layer in BF16.

    | GEMM  | consumes                                     | rotation |
    |-------|----------------------------------------------|----------|
    | fprop | x hif8 delayed(max,64), w hif8 delayed(max,64) | none   |
    | dgrad | dy bf16, w bf16                              | none     |
    | wgrad | dy bf16, x bf16                              | none     |
    """
    return _lp("hif8+delayed(max,64)", "bf16", "bf16")


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> LinearPrecision:
    """The preset's ``LinearPrecision``; a one-line error listing the valid names."""
    return preset(name)


def describe(name: str) -> str:
    """The preset's docstring (with its table)."""
    get(name)
    return _REGISTRY[name].__doc__ or ""


def default_rules(name: str) -> list[tuple[str, str]]:
    """Per-layer rules a preset brings, as ``(selector, preset-or-spec)`` pairs, first match wins.

    Selectors use :class:`precision.policy.PrecisionPolicy`'s syntax. Every preset keeps the output
    layer in BF16 (a rule the user overrides with their own, which come first), except ``fp32``,
    which keeps it in FP32; and every preset keeps a mixture-of-experts router's GEMM in FP32 (Megatron
    keeps ``--moe-router-dtype fp32``): quantizing the routing is a rule the user writes.
    """
    rules = [("kind:output", "fp32" if name == "fp32" else "bf16"), ("kind:router", "fp32")]
    if name == "hif8_w8a8":
        rules = [("first:3", "bf16"), ("last:2", "bf16"), ("kind:qkv", "bf16"), ("kind:proj", "bf16")] + rules
    return rules


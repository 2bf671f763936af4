"""What a precision plan buys on a target device: a roofline cost model of every linear's three GEMMs.

For each linear (shapes per tensor-parallel rank, ``T = micro-batch x seq-length`` tokens,
``K`` in-features, ``N`` out-features) and each of its GEMMs::

    === FPROP: y  = x . w^T    [T,K] x [K,N] -> [T,N]    contraction over K (in-features)
    === DGRAD: dx = dy . w     [T,N] x [N,K] -> [T,K]    contraction over N (out-features)
    === WGRAD: dw = dy^T . x   [N,T] x [T,K] -> [N,K]    contraction over T (tokens)

every GEMM is ``2 T K N`` FLOPs. Its time is

    time = max(FLOPs / tensor-core rate, GEMM bytes / HBM bandwidth)   (the GEMM kernel: roofline)
         + quantization bytes / HBM bandwidth                         (separate kernels: they add)

* **Rate**: each operand format has a *rate class* on the target (``fp32``, ``bf16``, ``fp8``,
  ``fp6``, ``fp4``); a GEMM whose operands differ runs at the slower operand's rate. A format the
  device has no tensor cores for is **emulated** (quantize, dequantize to BF16, BF16 GEMM: our
  ``bf16_mm`` path) and runs at the BF16 rate with BF16-sized operands.
* **GEMM bytes**: both stored operands (codes + block scales: ``Format.bits_per_element`` of the
  registry, or 2 bytes/element when emulated, 4 for FP32) plus the output (``y``/``dx`` BF16,
  ``dw`` FP32 for gradient accumulation).
* **Quantization bytes**, per operand in a rounded format: read the BF16 operand, write its stored
  form; a per-tensor current scale reads the operand once more (the amax); a rotation is one more
  unfused pass over both operands (read and write BF16). Each GEMM quantizes its own operands (an
  operand two GEMMs share, e.g. ``x`` for Fprop and Wgrad, is quantized once per GEMM along that
  GEMM's contraction axis, as the emulated pipeline does). BF16 operands need no pass.
  With ``fused=True`` quantization is fused into the kernel that produces the operand (as
  TransformerEngine fuses casts into norms and AMD fuses the Hadamard into its quantizer): only the
  write of the stored form counts -- no BF16 read, amax pass or rotation pass. Small models are
  memory-bound, and there separate quantization passes cost more than the narrower GEMM saves.

**Not modelled** (the same for every plan, so they only dilute the ratio): attention's core
(``q.k^T``, softmax, ``attention.v``), norms, activations, embeddings, the loss, communication
(tensor/data parallel), the optimizer, kernel launch overheads and cache effects. The reported
ratio is therefore *linear-layer GEMM time*, an upper bound on the end-to-end speed-up.

Dense peak rates used (no sparsity), TFLOP/s, and HBM bandwidth:

==========  ======  ======  ======  ======  ======  ========  =======================================
target      FP32    BF16    FP8     FP6     FP4     HBM TB/s  native formats beyond BF16/FP8
==========  ======  ======  ======  ======  ======  ========  =======================================
``b200``    80      2250    4500    4500    9000    8.0       MXFP8, MXFP6, MXFP4, NVFP4
``mi355x``  157.3   2516.6  5033.2  10066   10066   8.0       MXFP8, MXFP6, MXFP4 (OCP MX only)
``h200``    67      989.5   1979    --      --      4.8       none: MX / NVFP4 / FP6 emulated at BF16
==========  ======  ======  ======  ======  ======  ========  =======================================

Sources: NVIDIA HGX B200 (1,000 W) datasheet -- BF16 2.25 PF, FP8/FP6 4.5 PF, FP4 9 PF dense, FP32
80 TF, 8 TB/s (tabulated at glennklockwood.com/garden/processors/B200); AMD Instinct MI355X
datasheet -- FP16/BF16 2.5 PF, FP8 5.0 PF, MXFP6 = MXFP4 10.1 PF dense, FP32 vector 157.3 TF,
8 TB/s (MXFP6 = MXFP4 = 2x FP8 = 4x BF16); NVIDIA H200 SXM datasheet -- BF16 989.5 TF, FP8 1,979 TF
dense (the often-quoted 1,979 / 3,958 are with 2:4 sparsity), FP32 67 TF, 4.8 TB/s; Hopper has no
FP4/FP6 or block-scaled tensor cores. HiF8 has tensor cores on none of these (emulated everywhere);
NVFP4 (E4M3 scales per 16) is native on Blackwell only.

>>> from precision.recipe import parse_gemm
>>> t = TARGETS["b200"]; round(gemm_cost(LinearShape("l", 4096, 4096, 4096), Gemm.FPROP,
...     parse_gemm("mxfp4", Gemm.FPROP), t).compute_s * 1e6, 2)
15.27
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from precision.enums import AmaxAlgo, Scaling
from precision.formats import FORMATS
from precision.recipe import Gemm, GemmRecipe, LinearPrecision, OperandFormat

__all__ = [
    "ASSUMPTIONS",
    "TARGETS",
    "GemmCost",
    "LinearShape",
    "PlanCost",
    "Target",
    "gemm_cost",
    "get_target",
    "linear_shapes",
    "plan_cost",
    "rate_class",
    "target_names",
]

_BF16_BYTES = 2.0  # the high-precision operand on GPU (--bf16)
_OUT_BYTES = {Gemm.FPROP: 2.0, Gemm.DGRAD: 2.0, Gemm.WGRAD: 4.0}  # y, dx BF16; dw FP32

ASSUMPTIONS = (
    "per GEMM: time = max(FLOPs / tensor-core rate, GEMM bytes / HBM bandwidth) + quantization bytes / "
    "HBM bandwidth; mixed operands run at the slower operand's rate; formats without tensor cores on "
    "the target are emulated at the BF16 rate with BF16 operands; high-precision operands are BF16; "
    "each GEMM quantizes its own operands (no cast reuse); separate quantization kernels (read BF16, write "
    "codes + scales, an amax pass for current per-tensor scales, a rotation an extra pass) or, fused, only the "
    "write of codes + scales; "
    "not modelled: attention core, norms, activations, embeddings, loss, communication, optimizer, "
    "launch overheads (the ratio is of linear-layer GEMM time: an upper bound on the end-to-end gain)"
)


# ====================================================================== targets
@dataclass(frozen=True)
class Target:
    """A device: dense tensor-core rates per rate class and its HBM bandwidth."""

    name: str
    description: str
    tflops: Mapping[str, float]
    """Dense peak TFLOP/s per rate class (``fp32``, ``bf16``, ``fp8`` and, where native, ``fp6``, ``fp4``)."""
    hbm_tb_s: float
    """HBM bandwidth, TB/s."""
    native_kinds: tuple[Scaling, ...] = (Scaling.NONE, Scaling.TENSOR)
    """The scaling kinds this device's tensor cores take (FP32/BF16 and per-tensor FP8 everywhere here;
    ``block``: OCP MX; ``two_level``: NVFP4). A format runs natively when its kind is one of them and it
    has a tensor-core rate class at all (``Format.rate_class``: HiF8 has none)."""

    @property
    def native(self) -> dict[str, str]:
        """Registered format name -> rate class, for the formats this device's tensor cores take
        (read from the registry: ``Format.kind`` and ``Format.rate_class``)."""
        return {f.name: f.rate_class for f in FORMATS.values() if f.rate_class and f.kind in self.native_kinds}

    def rate(self, cls: str) -> float:
        """FLOP/s of a rate class."""
        return self.tflops[cls] * 1e12

    @property
    def bandwidth(self) -> float:
        """Bytes/s."""
        return self.hbm_tb_s * 1e12


_DENSE = (Scaling.NONE, Scaling.TENSOR)  # FP32, BF16, per-tensor FP8

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("b200", "NVIDIA B200 (HGX, 1,000 W; Blackwell sm_100)",
               {"fp32": 80.0, "bf16": 2250.0, "fp8": 4500.0, "fp6": 4500.0, "fp4": 9000.0}, 8.0,
               (*_DENSE, Scaling.BLOCK, Scaling.TWO_LEVEL)),
        Target("mi355x", "AMD Instinct MI355X (CDNA 4, gfx950)",
               {"fp32": 157.3, "bf16": 2516.6, "fp8": 5033.2, "fp6": 10066.0, "fp4": 10066.0}, 8.0,
               (*_DENSE, Scaling.BLOCK)),
        Target("h200", "NVIDIA H200 SXM (Hopper sm_90: FP8 tensor cores, no FP4/FP6/MX)",
               {"fp32": 67.0, "bf16": 989.5, "fp8": 1979.0}, 4.8, _DENSE),
    )
}


def target_names() -> tuple[str, ...]:
    return tuple(TARGETS)


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"--target {name!r}: unknown; valid: {', '.join(TARGETS)}") from None


def rate_class(op: OperandFormat, target: Target) -> str:
    """The rate class an operand runs at on ``target`` (``bf16`` when emulated)."""
    return target.native.get(op.fmt, "bf16")


def _stored_bytes(op: OperandFormat, target: Target) -> float:
    """Bytes per element the GEMM reads for this operand (codes + block scales, or BF16 if emulated)."""
    if op.fmt == "fp32":
        return 4.0
    if op.fmt not in target.native:
        return _BF16_BYTES  # emulated: dequantized to BF16 before a BF16 GEMM
    return op.format.bits_per_element / 8.0


def _quant_bytes(op: OperandFormat, target: Target, fused: bool = False) -> float:
    """Bytes per element moved to quantize this operand from BF16 (0 for BF16 / FP32 operands);
    ``fused``: only the write of the stored form (the producer's kernel quantizes)."""
    if op.is_high_precision:
        return 0.0
    if fused:
        return _stored_bytes(op, target)
    nbytes = _BF16_BYTES + _stored_bytes(op, target)  # read BF16, write the stored form
    if op.format.kind == Scaling.TENSOR and op.amax_algo == AmaxAlgo.CURRENT:
        nbytes += _BF16_BYTES  # the amax pass of current per-tensor scaling
    return nbytes


# ====================================================================== shapes
@dataclass(frozen=True)
class LinearShape:
    """One linear layer's GEMM sizes on one tensor-parallel rank."""

    name: str
    tokens: int  # T = micro-batch x sequence length
    in_features: int  # K (per rank)
    out_features: int  # N (per rank)

    def operand_elements(self, operand: str) -> int:
        return {"x": self.tokens * self.in_features, "w": self.out_features * self.in_features,
                "dy": self.tokens * self.out_features}[operand]


def linear_shapes(cfg, micro_batch_size: int, tp_size: int = 1) -> list[LinearShape]:
    """The policy linears of a ``model.gpt.ModelConfig`` (plan names, per-rank shapes): column-parallel
    ``linear_qkv``/``linear_fc1``/``output_layer`` split out-features, row-parallel
    ``linear_proj``/``linear_fc2`` split in-features. The output layer uses the padded vocabulary."""
    h, ffn, tp = cfg.hidden_size, cfg.ffn_hidden_size, tp_size
    head_dim = h // cfg.num_attention_heads
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * head_dim
    fc1_out = ffn * (2 if cfg.activation == "swiglu" else 1)
    vocab = -(-cfg.vocab_size // (cfg.make_vocab_size_divisible_by * tp)) * cfg.make_vocab_size_divisible_by * tp
    t = micro_batch_size * cfg.seq_length
    out = []
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out += [LinearShape(p + "self_attention.linear_proj", t, h // tp, h),
                LinearShape(p + "self_attention.linear_qkv", t, h, qkv_out // tp),
                LinearShape(p + "mlp.linear_fc1", t, h, fc1_out // tp),
                LinearShape(p + "mlp.linear_fc2", t, ffn // tp, h)]
    return out + [LinearShape("output_layer", t, h, vocab // tp)]


# ====================================================================== costs
@dataclass(frozen=True)
class GemmCost:
    """One GEMM's modelled cost: FLOPs and bytes, and the seconds they take on the target."""

    gemm: Gemm
    flops: float
    rate_class: str  # the rate the GEMM runs at (the slower operand's)
    compute_s: float  # FLOPs / rate
    gemm_bytes: float  # stored operands + output
    gemm_memory_s: float  # gemm_bytes / bandwidth
    quant_bytes: float  # quantization (and rotation) passes
    quant_s: float  # quant_bytes / bandwidth
    time_s: float  # max(compute_s, gemm_memory_s) + quant_s

    @property
    def bound(self) -> str:
        """``compute`` or ``memory``: what limits the GEMM kernel itself."""
        return "compute" if self.compute_s >= self.gemm_memory_s else "memory"


def gemm_cost(shape: LinearShape, gemm: Gemm, recipe: GemmRecipe, target: Target, fused: bool = False) -> GemmCost:
    """The modelled time of one GEMM of one linear (see the module docstring); ``fused``: quantization
    fused into the kernel producing each operand (only the stored form's write counts)."""
    gemm = Gemm(gemm)
    flops = 2.0 * shape.tokens * shape.in_features * shape.out_features
    a_name, b_name = gemm.operands
    classes = [rate_class(recipe.a, target), rate_class(recipe.b, target)]
    cls = min(classes, key=target.rate)  # the slower operand decides
    compute_s = flops / target.rate(cls)
    out_elems = {Gemm.FPROP: shape.tokens * shape.out_features, Gemm.DGRAD: shape.tokens * shape.in_features,
                 Gemm.WGRAD: shape.out_features * shape.in_features}[gemm]
    na, nb = shape.operand_elements(a_name), shape.operand_elements(b_name)
    gemm_bytes = (na * _stored_bytes(recipe.a, target) + nb * _stored_bytes(recipe.b, target)
                  + out_elems * _OUT_BYTES[gemm])
    quant_bytes = na * _quant_bytes(recipe.a, target, fused) + nb * _quant_bytes(recipe.b, target, fused)
    if recipe.rotation != "none" and not fused:
        quant_bytes += 2 * _BF16_BYTES * (na + nb)  # read and write both operands once more
    gemm_memory_s, quant_s = gemm_bytes / target.bandwidth, quant_bytes / target.bandwidth
    return GemmCost(gemm, flops, cls, compute_s, gemm_bytes, gemm_memory_s, quant_bytes, quant_s,
                    max(compute_s, gemm_memory_s) + quant_s)


@dataclass(frozen=True)
class PlanCost:
    """Modelled GEMM time of every linear under a plan: ``per[(layer name, gemm)] -> GemmCost``."""

    target: Target
    per: Mapping[tuple[str, Gemm], GemmCost]

    @property
    def total_s(self) -> float:
        return sum(c.time_s for c in self.per.values())

    def ratio(self, other: PlanCost) -> float:
        """This plan's modelled time over ``other``'s (< 1: this plan is faster)."""
        return self.total_s / other.total_s


def plan_cost(shapes: Iterable[LinearShape], plan: Mapping[str, LinearPrecision], target: Target,
              fused: bool = False) -> PlanCost:
    """The cost of ``plan`` (layer name -> ``LinearPrecision``) over ``shapes`` on ``target``."""
    per = {}
    for s in shapes:
        lp = plan[s.name]
        for g in Gemm:
            per[(s.name, g)] = gemm_cost(s, g, lp.recipe(g), target, fused)
    return PlanCost(target, per)


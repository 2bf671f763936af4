"""Fused quantize->dequantize of one GEMM operand, compiled with ``torch.compile``.

The emulated GEMM only needs each operand's dequantized values. Written as one branch-free
expression (``precision.blocks.mx_fake_quantize_blocks`` and friends), TorchInductor fuses the
whole chain -- block layout along any axis, amax, scale, rounding, rescale -- into one loop: C++
with OpenMP on CPU, Triton on GPU. The eager reference ``precision.quantize(...).dequantize()`` is
the specification; ``tests/kernels`` holds the two equal bit for bit.

Stochastic rounding: with ``sr=SRKey(...)`` (what training uses) the counter-based uniforms of
``precision.srand`` are computed by a compiled kernel from the key (the key's numbers are tensors,
so a new seed is no recompile); with the older ``generator=`` they are drawn eagerly from the caller's
``torch.Generator`` in the same order and shape as the reference. Either way compiled and reference
results are bit-identical for SR too.

``fake_quantize(..., impl=...)``: ``"compiled"``, ``"eager"`` (the same expression uncompiled) or
``"auto"`` (compiled where ``torch.compile`` works on this machine, else eager).

The FP4 error controls (``OperandFormat.control``: ``4over6``, ``eden`` / ``eden128``, ``quest``)
compile the reference's own block expressions (``precision.four_over_six``, ``precision.eden``,
``precision.quest``), rotation, tensor amax and dequantization included, into one kernel: their
sums run in ``precision.blocks.pairwise_sum``'s fixed order and every division is one FP32 division,
so compiled and reference results are bit-identical (``tests/kernels/test_fused_controls.py``).
``impl="auto"`` compiles them on CUDA only (on a CPU the eager expression, the same bits).
With an SR ``generator`` (not an ``SRKey``) a control runs the reference itself (its draws' order).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from precision import blocks
from precision.elements import round_to_grid
from precision.enums import FourOverSix
from precision.formats import Scaling, get_format
from precision.quantize import margin_amax
from precision.recipe import OperandFormat
from precision.rotation import rotate, rotation_size
from precision.srand import SRKey, uniforms_from_params
from precision.tensorwise import scale_from_amax, tensor_amax

__all__ = ["fake_quantize", "compile_available"]

log = logging.getLogger(__name__)


def _to_blocks_padded(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    return blocks.to_blocks(x.float(), axis, block)


def _rotated(x, signs, axis, rot_n):
    return rotate(x, axis, rot_n, signs) if rot_n > 1 else x.float()


def _uniforms_fn(srp, *, shape, axis, block):
    """SRKey uniforms of a tensor of ``shape`` (natural layout), in the block layout when ``block``.

    Its own compiled kernel: fused into the quantizer's loops the int64 hash is recomputed per
    loop and runs ~4x slower on CPU than this extra pass (measured, 2048x2048 MXFP4)."""
    u = uniforms_from_params(shape, srp)
    return blocks.to_blocks(u, axis, block) if block else u


def _mx_fn(x, u, signs, *, spec, axis, scale_rule, rounding, prescale, rot_n):
    x = _rotated(x, signs, axis, rot_n)
    n = x.shape[axis]
    xb = _to_blocks_padded(x, axis, spec.block)
    q = blocks.mx_fake_quantize_blocks(xb, spec.element, scale_rule, rounding, u, prescale)
    return blocks.from_blocks(q, axis, n).contiguous()


def _nvfp4_fn(x, u, signs, amax_used, *, spec, axis, scale_rule, rounding, prescale, rot_n):
    block = spec.block
    x = _rotated(x, signs, axis, rot_n)
    n = x.shape[axis]
    amax_cur = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax()
    amax_t = torch.where(amax_used < 0, amax_cur, amax_used)  # amax_used < 0: this tensor's own
    g_enc = blocks.nvfp4_tensor_scale(amax_t)
    xb = _to_blocks_padded(x, axis, block)
    q = blocks.nvfp4_fake_quantize_blocks(xb, g_enc, rounding, u)
    return blocks.from_blocks(q, axis, n).contiguous()


def _control_fn(x, u, signs, amax_used, *, op, axis, rot_n):
    """An FP4 error control (4over6, MS-EDEN, QuEST): the reference's quantizer and dequantizer as
    one expression; ``u``: SRKey uniforms in the natural layout (or None)."""
    xf = _rotated(x, signs, axis, rot_n)
    spec = op.format
    amax = None
    if spec.tensor_scaled:  # NVFP4's FP32 tensor scale: this tensor's finite amax unless given
        amax = torch.where(amax_used < 0, tensor_amax(xf), amax_used)
    extra = {} if op.four_over_six == FourOverSix.NONE else {"four_over_six": op.four_over_six}
    q = spec._quantize(xf, axis, op.rounding, op.scale_rule, None, op.prescale_factor, amax, u,
                       block2d=op.block2d, **extra)
    return spec.dequantize(q).contiguous()


def _tensor_fn(x, u, signs, amax_used, *, spec, rounding, axis, rot_n):
    """Per-tensor FP8: returns (dequantized, current amax, number clipped)."""
    xf = _rotated(x, signs, axis, rot_n)
    finite = torch.isfinite(xf)
    amax_cur = torch.where(finite, xf.abs(), torch.zeros_like(xf)).amax()
    amax = torch.where(amax_used < 0, amax_cur, amax_used)  # amax_used < 0: current scaling
    scale = scale_from_amax(amax, spec.scale_target)
    v = xf * scale
    clipped = ((v.abs() > spec.max_normal) & finite).sum()
    q = round_to_grid(v, spec.element, rounding, u=u)
    if spec.element.nonfinite == "nan":  # E4M3: every non-finite value is NaN
        q = torch.where(finite, q, torch.full_like(q, float("nan")))
    else:  # E5M2 keeps +-Inf and NaN
        q = torch.where(finite, q, xf)
    return q * (1.0 / scale), amax_cur, clipped


@functools.lru_cache(maxsize=None)
def compile_available() -> bool:
    """Whether ``torch.compile`` can build a kernel here (needs a C++ compiler on CPU)."""
    try:
        f = torch.compile(lambda t: t * 2 + 1, fullgraph=True)
        return bool(torch.equal(f(torch.ones(4)), torch.full((4,), 3.0)))
    except Exception as e:  # any backend failure means: use the eager expression
        log.warning("torch.compile unavailable (%s); fused quantizers run eagerly", e)
        return False


@functools.lru_cache(maxsize=None)
def _kernel(kind: str, compiled: bool, **static):
    fn = {"mx": _mx_fn, "nvfp4": _nvfp4_fn, "tensor": _tensor_fn, "uniforms": _uniforms_fn,
          "control": _control_fn}[kind]
    bound = functools.partial(fn, **static)
    if not compiled:
        return bound
    # Every (format, axis, rounding, shape) variant is a recompile of the same three Python
    # functions; dynamo's default limit (8) is sized for one model's graphs, not a kernel library.
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 256)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
    compiled_fn = torch.compile(bound, fullgraph=True, dynamic=False)

    def run(*args):
        # Under a Python dispatch mode (profilers, FLOP and host-read counters) dynamo does not
        # trace, and a refused frame can stay refused after the mode is gone: run eagerly, and
        # never call the compiled function there.
        if _get_current_dispatch_mode() is not None:
            return bound(*args)
        # Past the recompile limit (workloads with ever new shapes, e.g. lm-eval's variable batch
        # widths and decode steps) fullgraph raises, and a frame dynamo has stopped compiling
        # raises "found no compiled frames"; the eager expression gives the same bits.
        try:
            return compiled_fn(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            _warn_not_compiled(kind, "torch.compile's recompile limit reached (too many tensor shapes)")
            return bound(*args)
        except RuntimeError as e:
            if "found no compiled frames" not in str(e):
                raise
            _warn_not_compiled(kind, "torch.compile did not compile this call")
            return bound(*args)

    return run


@functools.lru_cache(maxsize=None)
def _warn_not_compiled(kind: str, why: str) -> None:
    log.warning("fused %s quantizer: %s; such calls run the same expression eagerly", kind, why)


def _sr_uniforms(x: torch.Tensor, axis: int, block: int, generator) -> torch.Tensor:
    """The reference's SR draws: one per element of the zero-padded block layout."""
    shape = list(x.movedim(axis, -1).shape)
    nblocks = -(-shape[-1] // block)
    return torch.rand([*shape[:-1], nblocks, block], generator=generator, device=x.device, dtype=torch.float32)


def fake_quantize(
    x: torch.Tensor,
    fmt: OperandFormat | str,
    *,
    axis: int = -1,
    amax: torch.Tensor | float | None = None,
    sr: SRKey | torch.Generator | None = None,
    rotation: str = "none",
    signs: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, dict]:
    """(rotate ->) quantize -> dequantize ``x`` (float32 result), equal to the reference bit for bit.

    ``fmt``: an ``OperandFormat`` (rounding, scale rule, prescale, margin), or a format name for its
    defaults (``OperandFormat(name)``). ``rotation``: a ``GemmRecipe``'s rotation name, applied
    first as ``precision.rotation.rotate(x, axis, n, signs)`` (``n`` its size, ``signs`` the +-1
    vector of ``rht*``), fused into the same kernel (``x.shape[axis]`` must be a multiple of n).
    ``amax`` (a float or a 0-d float32 tensor, no host read): the amax of the tensor-level scale --
    per-tensor formats and NVFP4's FP32 tensor scale -- instead of this tensor's own. ``sr``:
    stochastic rounding's counter-based key (``precision.srand.SRKey``), or a ``torch.Generator``
    (eager draws in the reference's order).
    Returns ``(values, stats)``; per-tensor formats report ``amax`` (this tensor's) and
    ``num_clipped`` in ``stats``. The formats without a fused expression (FP32, BF16, HiF8) go
    through the reference directly.
    """
    op = fmt if isinstance(fmt, OperandFormat) else OperandFormat(get_format(fmt).name)
    rot_n = rotation_size(rotation)  # 1: no rotation
    if op.margin:  # scale by amax * 2^margin
        amax = margin_amax(op, rotate(x, axis % x.dim(), rot_n, signs) if rot_n > 1 else x, amax)
    spec, typed_rounding, prescale = op.format, op.rounding, op.prescale_factor
    generator, sr = (sr, None) if isinstance(sr, torch.Generator) else (None, sr)
    rounding, scale_rule = str(typed_rounding), str(op.scale_rule)  # plain strings: kernel cache keys
    axis = axis % x.dim()
    if impl not in ("auto", "compiled", "eager"):
        raise ValueError(f"impl: unknown {impl!r}; valid: auto, compiled, eager")
    compiled = impl == "compiled" or (impl == "auto" and compile_available())
    # the FP4 error controls and 2-D weight tiles: the reference's own expression (the plain MX / NVFP4
    # kernels below quantize 1-D blocks only)
    whole = op.control is not None or op.block2d
    reference = whole and typed_rounding.stochastic and sr is None  # a generator's draws
    if spec.kind == Scaling.NONE or spec.element is None or reference:  # fp32, bf16, hif8: the reference
        if rot_n > 1:
            x = rotate(x, axis, rot_n, signs)
        q = spec.quantize(x, op, axis=axis, amax=amax if spec.tensor_scaled else None,
                          sr=sr if sr is not None else generator)
        stats = {"amax": q.amax, "num_clipped": q.num_clipped} if spec.kind == Scaling.TENSOR else {}
        return q.dequantize(torch.float32), stats
    stochastic = typed_rounding.stochastic
    srp = sr.params(x.shape, x.device) if stochastic and sr is not None else None
    draw = stochastic and sr is None  # the older API: eager draws from ``generator``
    used = (torch.full((), -1.0, device=x.device) if amax is None
            else torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(()))
    def key_uniforms(shape, block):
        return _kernel("uniforms", compiled, shape=tuple(shape), axis=axis, block=block)(srp)

    if whole:  # the FP4 error controls and 2-D tiles: the reference's expression, compiled
        # ``auto`` compiles them on CUDA only: on a (loaded 2-core) CPU their compiled kernels ran at
        # 0.8-2x the eager expression's speed and each new shape costs a compile of tens of seconds
        compiled = impl == "compiled" or (impl == "auto" and x.is_cuda and compile_available())
        u = key_uniforms(x.shape, 0) if srp is not None else None
        k = _kernel("control", compiled, op=op, axis=axis, rot_n=rot_n)
        return k(x, u, signs, used), {}
    if spec.kind == Scaling.TENSOR:
        u = torch.rand(x.shape, generator=generator, device=x.device) if draw else None
        if srp is not None:
            u = key_uniforms(x.shape, 0)
        k = _kernel("tensor", compiled, spec=spec, rounding=rounding, axis=axis, rot_n=rot_n)
        out, amax_cur, clipped = k(x, u, signs, used)
        return out, {"amax": amax_cur, "num_clipped": clipped}
    u = _sr_uniforms(x, axis, spec.block, generator) if draw else None
    if srp is not None:  # the padded shape: positions of real elements are unchanged by end padding
        padded = list(x.shape)
        padded[axis] = -(-padded[axis] // spec.block) * spec.block
        u = key_uniforms(padded, spec.block)
    kind = "nvfp4" if spec.kind == Scaling.TWO_LEVEL else "mx"
    k = _kernel(kind, compiled, spec=spec, axis=axis, scale_rule=scale_rule, rounding=rounding,
                prescale=prescale, rot_n=rot_n)
    extra = (used,) if kind == "nvfp4" else ()
    n = x.shape[axis]
    pad = (-n) % spec.block
    if pad and rot_n > 1:  # rotation groups never straddle blocks: callers pad to lcm(n, block)
        raise ValueError(f"fake_quantize: axis length {n} must be a multiple of the block size {spec.block} "
                         "when a rotation is fused")
    if pad:
        # Zero-pad outside the compiled region: TorchInductor (torch 2.13, CPU) miscompiles a
        # padded last axis followed by the block reshape (reads garbage for the partial block).
        widths = [0, 0] * x.dim()
        widths[2 * (x.dim() - 1 - axis) + 1] = pad
        return k(torch.nn.functional.pad(x, widths), u, signs, *extra).narrow(axis, 0, n), {}
    return k(x, u, signs, *extra), {}

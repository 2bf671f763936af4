"""``python -m precision.controls_report``: the FP4 error controls beside nearest, SR and the Hadamards.

For each synthetic operand -- ``x``, ``w`` and ``dy`` shapes, Gaussian and Student-t(3) values --
and each control, quantize along the operand's contraction axis, map the result back through the
GEMM's rotation (the values the GEMM effectively multiplies; SQNR does not depend on it) and report:

* ``SQNR dB``: 10 log10(sum x^2 / sum (x - x_hat)^2);
* the relative error ``|x - x_hat| / |x|`` over non-zero elements: median, 90th and 99th
  percentiles, and its mean over each block's largest element in the quantizer's frame (where
  E2M1's 4 -> 6 step bites: the error four-over-six aims at);
* with ``--histogram``, the relative error's histogram: % of elements below 1/64, 1/64-1/16, 1/16-1/4,
  1/4-1, exactly 1 (flushed to zero) and above 1;
* ``bias``: ``<x, E[x_hat - x]> / |x|^2``, the gradient-error tool's projection (shrinkage shows as
  a negative bias); for controls that draw (SR uniforms, resampled rotation signs) the mean over
  ``--draws`` draws with its standard error, for the others the one fixed value.

Rows: NVFP4 nearest, SR, had16, rht16 + SR, 4over6, 4over6 + had16, MS-EDEN (rht16_resample),
rht128 + SR, MS-EDEN over 128-groups (rht128_resample); MXFP4 nearest, SR, had16, had32, QuEST
(had32). Pure PyTorch on the reference quantizers, CPU.

With ``--checkpoint DIR`` (a training checkpoint directory: the ``--save`` / ``--load`` directory of a
pretrain run) the same rows are measured on the checkpoint's own operands: the model is built from
the checkpoint (``--pretrained-checkpoint DIR``: shape and tokenizer from it), and one training-mode
forward and backward on its first global batch, with no operand rounded (``--precision fp32``),
records every policy linear's ``x`` and ``dy`` and its ``w`` (the output layer excluded, as its
logits are edited in place by the loss). Pretrain flags after ``--`` choose the batch (e.g.
``--fixed-train-set 16 --micro-batch-size 16 --global-batch-size 16 --seq-length 128``). Each
operand's row pools its tensors -- SQNR as the sum of signal over the sum of noise, the bias as
``sum <x, x_hat - x> / sum |x|^2`` per draw -- over the tensors whose contraction length the
control's block and rotation divide; the ``tensors`` column says how many of them that is::

    python -m precision.controls_report                                     # synthetic tensors
    python -m precision.controls_report --dist none --checkpoint CKPT -- --fixed-train-set 16 ...
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

from precision.quantize import quantize
from precision.recipe import OperandFormat
from precision.rotation import rotate, rotation_size
from precision.srand import SRKey

__all__ = ["CHECKPOINT_AXES", "CONTROLS", "HIST_EDGES", "HIST_HEADER", "CheckpointArgError", "Control", "Parts",
           "checkpoint_operands", "checkpoint_table", "combine", "main", "measure", "measure_parts"]


@dataclass(frozen=True)
class Control:
    name: str
    op: OperandFormat
    rotation: str = "none"

    @property
    def draws(self) -> bool:
        """Whether the result depends on a seed (SR uniforms or random rotation signs)."""
        return self.op.rounding.stochastic or self.rotation.endswith("_resample")

    @property
    def multiple(self) -> int:
        """The contraction length must be a multiple of this (the block and the rotation)."""
        return math.lcm(self.op.format.block, rotation_size(self.rotation))


CONTROLS = (
    Control("nvfp4 nearest", OperandFormat("nvfp4")),
    Control("nvfp4 sr", OperandFormat("nvfp4", rounding="stochastic")),
    Control("nvfp4 had16", OperandFormat("nvfp4"), "had16"),
    Control("nvfp4 sr rht16_resample", OperandFormat("nvfp4", rounding="stochastic"), "rht16_resample"),
    Control("nvfp4 4over6", OperandFormat("nvfp4", four_over_six="mse")),
    Control("nvfp4 4over6 had16", OperandFormat("nvfp4", four_over_six="mse"), "had16"),
    Control("nvfp4 eden rht16_resample", OperandFormat("nvfp4", rounding="ms_eden"), "rht16_resample"),
    Control("nvfp4 sr rht128_resample", OperandFormat("nvfp4", rounding="stochastic"), "rht128_resample"),
    Control("nvfp4 eden128 rht128_resample", OperandFormat("nvfp4", rounding="ms_eden128"), "rht128_resample"),
    Control("mxfp4 nearest", OperandFormat("mxfp4")),
    Control("mxfp4 sr", OperandFormat("mxfp4", rounding="stochastic")),
    Control("mxfp4 had16", OperandFormat("mxfp4"), "had16"),
    Control("mxfp4 had32", OperandFormat("mxfp4"), "had32"),
    Control("mxfp4 quest had32", OperandFormat("mxfp4", scale_rule="quest"), "had32"),
)

# operand -> (shape, contraction axis): Fprop's x [tokens, in] and w [out, in] along in-features,
# Wgrad's dy [tokens, out] along tokens
OPERANDS = {"x": ((2048, 512), 1), "w": ((1024, 512), 1), "dy": ((2048, 1024), 0)}


def sample(dist: str, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    if dist == "gaussian":
        return z
    if dist == "student_t3":
        chi2 = torch.randn((3, *shape), generator=g).square().sum(0)
        return z / (chi2 / 3).sqrt()
    raise ValueError(f"--dist: unknown {dist!r}; valid: gaussian, student_t3")


def _signs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def quantize_back(x: torch.Tensor, axis: int, c: Control, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_hat in x's frame, the tensor the quantizer saw)`` for one draw ``seed``."""
    n = rotation_size(c.rotation)
    signs = _signs(n, seed) if c.rotation.startswith("rht") else None
    xr = rotate(x, axis, n, signs) if n > 1 else x
    q = quantize(xr, c.op, axis=axis, sr=SRKey(seed) if c.op.rounding.stochastic else None).dequantize()
    if n == 1:
        return q, xr
    back = rotate(q, axis, n)  # H is symmetric and orthonormal: (x diag(s) H) H diag(s) = x
    if signs is not None:
        shape = [1] * x.dim()
        shape[axis] = x.shape[axis]
        back = back * signs.repeat(x.shape[axis] // n).reshape(shape)
    return back, xr


def _block_max_err(x: torch.Tensor, xq: torch.Tensor, axis: int, block: int) -> tuple[float, int]:
    """(sum, count) of the relative error on each non-zero block's largest element."""
    xb = x.movedim(axis, -1).reshape(*x.movedim(axis, -1).shape[:-1], -1, block)
    qb = xq.movedim(axis, -1).reshape(xb.shape)
    idx = xb.abs().argmax(dim=-1, keepdim=True)
    top, qtop = xb.gather(-1, idx), qb.gather(-1, idx)
    ok = top != 0
    return float(((top - qtop).abs()[ok] / top.abs()[ok]).double().sum()), int(ok.sum())


@dataclass
class Parts:
    """What one tensor contributes to a pooled row (``combine``)."""

    signal: float  # sum x^2
    noise: float  # sum (x - x_hat)^2, draw 0
    rel: torch.Tensor  # |x - x_hat| / |x| over non-zero x, draw 0 (float64)
    block_max: tuple[float, int]  # (sum, count) over blocks, draw 0, in the quantizer's frame
    proj: list[float]  # <x, x_hat - x> per draw


def measure_parts(x: torch.Tensor, axis: int, c: Control, draws: int = 8) -> Parts:
    xq, xr = quantize_back(x, axis, c, 0)
    err = xq - x
    nz = x != 0
    seen = quantize(xr, c.op, axis=axis, sr=SRKey(0) if c.op.rounding.stochastic else None).dequantize()
    proj = [float((x.double() * err.double()).sum())]
    for s in range(1, draws if c.draws else 1):
        proj.append(float((x.double() * (quantize_back(x, axis, c, s)[0] - x).double()).sum()))
    return Parts(float(x.double().square().sum()), float(err.double().square().sum()),
                 (err.abs()[nz] / x.abs()[nz]).double(), _block_max_err(xr, seen, axis, c.op.format.block), proj)


def combine(parts: list[Parts]) -> dict[str, float]:
    """One row from the tensors' parts: pooled SQNR, relative-error percentiles over all elements (a
    fixed subsample of 2^20 beyond that), mean block-maximum error, and the bias per draw as the
    pooled projection, its mean over draws and standard error (0 for a fixed control)."""
    signal, noise = sum(p.signal for p in parts), sum(p.noise for p in parts)
    rel = torch.cat([p.rel for p in parts])
    hist = _histogram(rel)
    if rel.numel() > 1 << 20:
        rel = rel[torch.randperm(rel.numel(), generator=torch.Generator().manual_seed(0))[:1 << 20]]
    qs = torch.quantile(rel, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    bm = sum(p.block_max[0] for p in parts) / max(sum(p.block_max[1] for p in parts), 1)
    t = torch.tensor([sum(col) / signal for col in zip(*(p.proj for p in parts))], dtype=torch.float64)
    return {"sqnr_db": 10 * math.log10(signal / max(noise, 1e-300)), "rel_p50": qs[0], "rel_p90": qs[1],
            "rel_p99": qs[2], "rel_block_max": bm, "bias": float(t.mean()),
            "bias_se": float(t.std() / math.sqrt(len(t))) if len(t) > 1 else 0.0, "hist": hist}


# the relative-error histogram's bins: [0, 1/64), [1/64, 1/16), [1/16, 1/4), [1/4, 1), exactly 1
# (flushed to zero, or rarely doubled), above 1 (an element that takes more than its own size in error)
HIST_EDGES = (2.0**-6, 2.0**-4, 2.0**-2, 1.0)
HIST_HEADER = ["| operand | control | < 1/64 | 1/64-1/16 | 1/16-1/4 | 1/4-1 | = 1 | > 1 |",
               "|---|---|---|---|---|---|---|---|"]


def _histogram(rel: torch.Tensor) -> list[float]:
    """Fractions of ``rel`` in the ``HIST_EDGES`` bins (every element, no subsample)."""
    n = max(rel.numel(), 1)
    below = [float((rel < e).sum()) for e in HIST_EDGES]
    counts = [below[0], *(b - a for a, b in itertools.pairwise(below)), float((rel == 1).sum()), float((rel > 1).sum())]
    return [c / n for c in counts]


def measure(x: torch.Tensor, axis: int, c: Control, draws: int = 8) -> dict[str, float]:
    """One tensor's row (``combine`` of its ``measure_parts``)."""
    return combine([measure_parts(x, axis, c, draws)])


HEADER = ["| operand | control | SQNR dB | rel. err p50 | p90 | p99 | block max | bias (x 1e-3, +- s.e.) |",
          "|---|---|---|---|---|---|---|---|"]


def _row(role: str, c: Control, m: dict[str, float], extra: str = "") -> str:
    bias = f"{1e3 * m['bias']:+.2f}" + (f" +- {1e3 * m['bias_se']:.2f}" if c.draws else " (fixed)")
    return (f"| {role} | {c.name} | {m['sqnr_db']:.2f} | {m['rel_p50']:.4f} | {m['rel_p90']:.4f} "
            f"| {m['rel_p99']:.3f} | {m['rel_block_max']:.4f} | {bias} |{extra}")


def _hist_row(role: str, c: Control, m: dict[str, float] | None) -> str:
    cells = ["n/a"] * 6 if m is None else [f"{100 * f:.2f}" for f in m["hist"]]
    return f"| {role} | {c.name} | " + " | ".join(cells) + " |"


def _hist_table(title: str, measured: list[tuple[str, Control, dict | None]]) -> str:
    return "\n".join([f"{title}: relative error |x - x_hat| / |x| over non-zero x, % of elements (draw 0)", "",
                      *HIST_HEADER, *(_hist_row(*r) for r in measured)])


def table(dist: str, draws: int, histogram: bool = False) -> str:
    rows, measured = [f"#### {dist}", "", *HEADER], []
    for role, (shape, axis) in OPERANDS.items():
        x = sample(dist, shape, {"x": 1, "w": 2, "dy": 3}[role])
        for c in CONTROLS:
            m = measure(x, axis, c, draws) if shape[axis] % c.multiple == 0 else None
            measured.append((role, c, m))
            rows.append(_row(role, c, m) if m else f"| {role} | {c.name} | " + " | ".join(["n/a"] * 6) + " |")
    return "\n".join(rows) + (f"\n\n{_hist_table(dist, measured)}" if histogram else "")


# ================================================================================================
# Checkpoint operands: x, w, dy of every policy linear, one forward/backward, nothing rounded
# ================================================================================================


class CheckpointArgError(ValueError):
    """A ``--checkpoint`` (or the pretrain flags with it) that cannot be used; one line."""


def checkpoint_operands(ckpt: str, flags: list[str]) -> tuple[dict[str, list[tuple[str, torch.Tensor]]], str]:
    """``({"x"|"w"|"dy": [(layer, tensor)]}, description)`` of the checkpoint ``ckpt``: every policy
    linear's ``x`` [tokens, in], ``w`` [out, in] and ``dy`` [tokens, out] (output layer excluded)
    from one training-mode forward and backward on the first global batch, no operand rounded."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no TE / Apex: expected
    from pretrain.checkpointing import TRACKER, CheckpointError, read_tracker

    if not os.path.isdir(ckpt):
        raise CheckpointArgError(f"--checkpoint {ckpt}: no such directory (give a pretrain run's --save directory)")
    if not os.path.isfile(os.path.join(ckpt, TRACKER)):
        raise CheckpointArgError(f"--checkpoint {ckpt}: not a training checkpoint directory (no {TRACKER}; "
                                 f"give a pretrain run's --save directory)")
    try:
        iteration = read_tracker(ckpt)
    except CheckpointError as e:
        raise CheckpointArgError(f"--checkpoint {ckpt}: {e}") from None
    for f in ("--load", "--pretrained-checkpoint", "--precision", "--precision-rule"):
        if f in flags:
            raise CheckpointArgError(f"pretrain flags after '--': drop {f} (the report loads --checkpoint "
                                     f"and records the operands with nothing rounded)")
    # megatron-core (through model and pretrain): not loaded for --help or the synthetic tables
    from pretrain import runtime
    from pretrain.arguments import ConfigError, parse_run_config
    from pretrain.evaluation.operand_capture import capture_operands
    from pretrain.pretrained import PretrainedError
    from pretrain.train import setup

    runtime.filter_expected_warnings()
    if "--train-iters" not in flags:  # required by pretrain's validation; nothing is trained here
        flags = [*flags, "--train-iters", "1"]
    try:
        run = parse_run_config([*flags, "--pretrained-checkpoint", ckpt, "--precision", "fp32"], 1, False)
        trainer = setup(run)
    except (ConfigError, PretrainedError, CheckpointError) as e:
        raise CheckpointArgError(str(e)) from None
    # the whole global batch, micro-batch by micro-batch
    got, tokens_seen, loss = capture_operands(trainer, run.training.global_batch_size // run.training.micro_batch_size)
    desc = f"{ckpt} at iteration {iteration}: {len(got['w'])} linears, {tokens_seen} tokens (loss {loss:.3f})"
    return got, desc


# operand -> its contraction axis in the captured layout ([tokens, in], [out, in], [tokens, out])
CHECKPOINT_AXES = {"x": 1, "w": 1, "dy": 0}


def checkpoint_table(operands: dict[str, list[tuple[str, torch.Tensor]]], draws: int,
                     histogram: bool = False) -> str:
    """The checkpoint's table (and its histogram): each operand's tensors pooled per control, along
    ``CHECKPOINT_AXES`` (Fprop's in-features for ``x`` and ``w``, Wgrad's tokens for ``dy``)."""
    rows, measured = ["#### checkpoint", "", HEADER[0] + " tensors |", HEADER[1] + "---|"], []
    for role, axis in CHECKPOINT_AXES.items():
        tensors = operands[role]
        for c in CONTROLS:
            fit = [t for _, t in tensors if t.shape[axis] % c.multiple == 0]
            if not fit:
                measured.append((role, c, None))
                rows.append(f"| {role} | {c.name} | " + " | ".join(["n/a"] * 6) + f" | 0 of {len(tensors)} |")
                continue
            m = combine([measure_parts(t, axis, c, draws) for t in fit])
            measured.append((role, c, m))
            rows.append(_row(role, c, m, f" {len(fit)} of {len(tensors)} |"))
    return "\n".join(rows) + (f"\n\n{_hist_table('checkpoint', measured)}" if histogram else "")


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPU cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}").replace("  ", " ")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m precision.controls_report", description=__doc__.splitlines()[0],
                                usage="%(prog)s [--dist D] [--draws N] [--histogram] [--checkpoint DIR [-- PRETRAIN FLAGS]]")
    p.add_argument("--dist", choices=("gaussian", "student_t3", "both", "none"), default="both",
                   help="synthetic tables (none: only the checkpoint's)")
    p.add_argument("--draws", type=int, default=8, help="draws of the seed for the bias column (>= 2)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--histogram", action="store_true",
                   help="also print each table's relative-error histogram (%% of elements in 6 bins)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="also measure a training checkpoint's own x, w, dy (a pretrain run's --save directory); "
                        "pretrain flags after '--' choose the batch")
    args = p.parse_args(ours)
    if args.draws < 2:
        p.error(f"--draws {args.draws}: the bias needs at least 2 draws")
    if flags and not args.checkpoint:
        p.error("pretrain flags after '--' need --checkpoint DIR")
    if args.dist == "none" and not args.checkpoint:
        p.error("--dist none: nothing to measure without --checkpoint DIR")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    operands = None
    if args.checkpoint:  # refused before the synthetic tables take minutes
        try:
            operands, desc = checkpoint_operands(args.checkpoint, flags)
        except CheckpointArgError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    dists = {"both": ("gaussian", "student_t3"), "none": ()}.get(args.dist, (args.dist,))
    tables = [table(d, args.draws, args.histogram) for d in dists]
    if dists:
        tables[-1] += ("\n\nShapes: " + ", ".join(f"{r} {list(s)} along axis {a}" for r, (s, a) in OPERANDS.items())
                       + f"; bias over {args.draws} draws.")
    if operands is not None:
        shapes = {r: sorted({tuple(t.shape) for _, t in ts}) for r, ts in operands.items()}
        tables.append(checkpoint_table(operands, args.draws, args.histogram) + f"\n\nCheckpoint {desc}; x along in-features, "
                      "w along in-features, dy along tokens; shapes " + "; ".join(
                          f"{r} " + ", ".join(str(list(s)) for s in ss) for r, ss in shapes.items())
                      + f"; bias over {args.draws} draws.")
    print("\n\n".join(tables))
    print(f"\nMachine: {machine()}; {time.time() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

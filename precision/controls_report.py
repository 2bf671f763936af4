"""``python -m precision.controls_report``: the FP4 error controls beside nearest, SR and the Hadamards.

For each synthetic operand -- ``x``, ``w`` and ``dy`` shapes, Gaussian and Student-t(3) values --
and each control, quantize along the operand's contraction axis, map the result back through the
GEMM's rotation (the values the GEMM effectively multiplies; SQNR does not depend on it) and report:

* ``SQNR dB``: 10 log10(sum x^2 / sum (x - x_hat)^2);
* the relative error ``|x - x_hat| / |x|`` over non-zero elements: median, 90th and 99th
  percentiles, and its mean over each block's largest element in the quantizer's frame (where
  E2M1's 4 -> 6 step bites: the error four-over-six aims at);
* ``bias``: ``<x, E[x_hat - x]> / |x|^2``, the gradient-error tool's projection (shrinkage shows as
  a negative bias); for controls that draw (SR uniforms, resampled rotation signs) the mean over
  ``--draws`` draws with its standard error, for the others the one fixed value.

Rows: NVFP4 nearest, SR, had16, rht16 + SR, 4over6, 4over6 + had16, MS-EDEN (rht16_resample);
MXFP4 nearest, SR, had16, had32, QuEST (had32). Pure PyTorch on the reference quantizers, CPU.
"""

from __future__ import annotations

import argparse
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

__all__ = ["CONTROLS", "Control", "measure", "main"]


@dataclass(frozen=True)
class Control:
    name: str
    op: OperandFormat
    rotation: str = "none"

    @property
    def draws(self) -> bool:
        """Whether the result depends on a seed (SR uniforms or random rotation signs)."""
        return self.op.rounding.stochastic or self.rotation == "rht16_resample"


CONTROLS = (
    Control("nvfp4 nearest", OperandFormat("nvfp4")),
    Control("nvfp4 sr", OperandFormat("nvfp4", rounding="stochastic")),
    Control("nvfp4 had16", OperandFormat("nvfp4"), "had16"),
    Control("nvfp4 sr rht16_resample", OperandFormat("nvfp4", rounding="stochastic"), "rht16_resample"),
    Control("nvfp4 4over6", OperandFormat("nvfp4", four_over_six="mse")),
    Control("nvfp4 4over6 had16", OperandFormat("nvfp4", four_over_six="mse"), "had16"),
    Control("nvfp4 eden rht16_resample", OperandFormat("nvfp4", rounding="ms_eden"), "rht16_resample"),
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


def _block_max_rel_err(x: torch.Tensor, xq: torch.Tensor, axis: int, block: int) -> float:
    xb = x.movedim(axis, -1).reshape(*x.movedim(axis, -1).shape[:-1], -1, block)
    qb = xq.movedim(axis, -1).reshape(xb.shape)
    idx = xb.abs().argmax(dim=-1, keepdim=True)
    top, qtop = xb.gather(-1, idx), qb.gather(-1, idx)
    ok = top != 0
    return float(((top - qtop).abs()[ok] / top.abs()[ok]).mean())


def measure(x: torch.Tensor, axis: int, c: Control, draws: int = 8) -> dict[str, float]:
    xq, xr = quantize_back(x, axis, c, 0)
    err = x - xq
    sqnr = 10 * math.log10(float(x.square().sum()) / max(float(err.square().sum()), 1e-300))
    nz = x != 0
    rel = (err.abs()[nz] / x.abs()[nz]).double()
    qs = torch.quantile(rel[torch.randperm(rel.numel(), generator=torch.Generator().manual_seed(0))[:1 << 20]],
                        torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    out = {"sqnr_db": sqnr, "rel_p50": qs[0], "rel_p90": qs[1], "rel_p99": qs[2],
           "rel_block_max": _block_max_rel_err(xr, quantize(xr, c.op, axis=axis, sr=SRKey(0)
                                                            if c.op.rounding.stochastic else None).dequantize(),
                                               axis, c.op.format.block)}
    proj = [float((x * -err).sum()) / float(x.square().sum())]  # err = x - x_hat
    for s in range(1, draws if c.draws else 1):
        e = quantize_back(x, axis, c, s)[0] - x
        proj.append(float((x * e).sum()) / float(x.square().sum()))
    t = torch.tensor(proj, dtype=torch.float64)
    out["bias"], out["bias_se"] = float(t.mean()), float(t.std() / math.sqrt(len(proj))) if len(proj) > 1 else 0.0
    return out


def table(dist: str, draws: int) -> str:
    rows = [f"#### {dist}", "",
            "| operand | control | SQNR dB | rel. err p50 | p90 | p99 | block max | bias (x 1e-3, +- s.e.) |",
            "|---|---|---|---|---|---|---|---|"]
    for role, (shape, axis) in OPERANDS.items():
        x = sample(dist, shape, {"x": 1, "w": 2, "dy": 3}[role])
        for c in CONTROLS:
            m = measure(x, axis, c, draws)
            bias = f"{1e3 * m['bias']:+.2f}" + (f" +- {1e3 * m['bias_se']:.2f}" if c.draws else " (fixed)")
            rows.append(f"| {role} | {c.name} | {m['sqnr_db']:.2f} | {m['rel_p50']:.4f} | {m['rel_p90']:.4f} "
                        f"| {m['rel_p99']:.3f} | {m['rel_block_max']:.4f} | {bias} |")
    return "\n".join(rows)


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPU cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}").replace("  ", " ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m precision.controls_report", description=__doc__.splitlines()[0])
    p.add_argument("--dist", choices=("gaussian", "student_t3", "both"), default="both")
    p.add_argument("--draws", type=int, default=8, help="draws of the seed for the bias column (>= 2)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.draws < 2:
        p.error(f"--draws {args.draws}: the bias needs at least 2 draws")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    dists = ("gaussian", "student_t3") if args.dist == "both" else (args.dist,)
    print("\n\n".join(table(d, args.draws) for d in dists))
    print(f"\nShapes: " + ", ".join(f"{r} {list(s)} along axis {a}" for r, (s, a) in OPERANDS.items())
          + f"; bias over {args.draws} draws. Machine: {machine()}; {time.time() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where should a per-tensor scale put the amax? SQNR of HiF8 per scale target, and clipping after
an amax jump -- the measurement behind ``precision.hif8.HIF8_SCALE_TARGET``.

HiF8 is tapered: 3 mantissa bits for |exponent| <= 3, 2 bits at 2^4..2^7, 1 bit at 2^8..2^15. The
scale ``target / amax`` decides which binades a tensor's values land in. This tool quantizes, for
every target 2^0 .. 2^15 (``OperandFormat("hif8", margin=3 - k)``), and prints the SQNR of

- ``gaussian``: 2^20 draws of N(0, 1); ``student_t``: 2^20 draws of a Student-t with 3 degrees of
  freedom (heavy tails: the amax sits far above the bulk);
- with ``-- PRETRAIN FLAGS --load CKPT``: the ``x``, ``w`` and ``dy`` of every policy-routed linear of
  the checkpoint's model but the output layer, from one training-mode forward/backward on its next global batch
  (pooled per operand: the SQNR of the sum of signal over the sum of noise);

with per-tensor FP8 E4M3 (amax -> 448) beside it. Then, for the targets 2^3, 2^4, 2^5 and 2^15, the
fraction of values clipped and the SQNR when the amax jumps by J between the step the scale
came from and this one (a delayed-scaling history lagging J-fold), on the Gaussian draws::

    python launch/scale_target.py                                   # synthetic tensors only
    python launch/scale_target.py -- --load CKPT --num-layers 8 ... # and the checkpoint's operands
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch

from precision import OperandFormat, quantize

TARGETS = list(range(16))  # log2 of the scale target
JUMPS = (1, 2, 8, 64, 512, 4096, 8192)


def sqnr_parts(x: torch.Tensor, fmt, amax=None) -> tuple[float, float, int]:
    """(signal energy, noise energy, clipped count) of quantizing ``x``."""
    q = quantize(x.float().reshape(1, -1), fmt, amax=amax)
    err = x.float().reshape(1, -1) - q.dequantize()
    return float(x.double().square().sum()), float(err.double().square().sum()), int(q.num_clipped)


def db(signal: float, noise: float) -> float:
    return 200.0 if noise == 0 else 10 * math.log10(signal / noise)


def hif8(k: int):
    return OperandFormat("hif8", margin=3 - k)  # target 2^3 / 2^margin = 2^k


def checkpoint_operands(flags: list[str]) -> dict[str, list[torch.Tensor]]:
    """``x``, ``w`` and ``dy`` of every policy linear, one forward/backward on the next micro-batch."""
    # megatron-core (through pretrain): not loaded for --help
    from pretrain.arguments import ConfigError, fail, parse_run_config
    from pretrain.evaluation.operand_capture import capture_operands
    from pretrain.train import setup

    try:
        run = parse_run_config(flags + ["--precision", "bf16"], 1, False)
    except ConfigError as e:
        fail(str(e))
    got = capture_operands(setup(run), micro_batches=1)[0]
    return {k: [t for _, t in v] for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="scale_target.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic draws (default 0)")
    a = p.parse_args(ours)
    if flags and "--load" not in flags:
        p.error("the pretrain flags after '--' need --load CKPT (the checkpoint whose operands are measured)")
    g = torch.Generator().manual_seed(a.seed)
    torch.manual_seed(a.seed)  # torch.distributions draws from the global generator
    tensors = {"gaussian": [torch.randn(1 << 20, generator=g)],
               "student_t": [torch.distributions.StudentT(3.0).sample((1 << 20,))]}
    if flags:
        for k, v in checkpoint_operands(flags).items():
            tensors[f"ckpt {k}"] = v
    names = list(tensors)
    print("SQNR (dB) of per-tensor HiF8 by scale target (amax -> target); fp8_e4m3: amax -> 448")
    print(f"{'target':>8} " + " ".join(f"{n:>11}" for n in names))
    rows = [(f"2^{k}", hif8(k)) for k in TARGETS] + [("e4m3", "fp8_e4m3")]
    for label, fmt in rows:
        cells = []
        for n in names:
            s = e = 0.0
            for t in tensors[n]:
                ds, de, _ = sqnr_parts(t, fmt)
                s, e = s + ds, e + de
            cells.append(f"{db(s, e):11.2f}")
        print(f"{label:>8} " + " ".join(cells))
    x = tensors["gaussian"][0]
    amax = float(x.abs().max())
    print("\nGaussian, amax jumps J-fold after the scale was set: clipped fraction / SQNR (dB)")
    print(f"{'J':>6} " + " ".join(f"{'2^' + str(k):>20}" for k in (3, 4, 5, 15)))
    for jump in JUMPS:
        cells = []
        for k in (3, 4, 5, 15):
            s, e, c = sqnr_parts(x, hif8(k), amax=amax / jump)
            cells.append(f"{c / x.numel():>10.2e} / {db(s, e):6.2f}")
        print(f"{jump:>6} " + " ".join(f"{c:>20}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

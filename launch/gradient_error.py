"""How far each precision's weight gradient is from the exact one: noise that averages away, and
the bias that does not.

A precision's cost in training is not its per-step error alone. Adam averages the gradients of many
steps, so an error that is independent from batch to batch shrinks like the batch's own sampling
noise, while an error with a non-zero mean -- a bias -- stays. This tool measures both on a
checkpoint, for the whole model's gradient, the way a training step computes it::

    python launch/gradient_error.py --precisions bf16 fp8 mxfp4_fprop mxfp4 wgrad_hadamard \\
        --batches 32 -- --load CKPT --model-size tiny ...      # the checkpoint's pretrain flags

For ``--batches`` global batches from the checkpoint's data position (batches it has not trained
on), it computes the gradient ``g_i`` under ``--reference`` (default ``fp32``: operands not rounded)
and, on the same weights and tokens, ``g_i^P`` under each precision ``P``, with the pretrain loss
(per-token cross entropy over the global batch). With ``e_i = g_i^P - g_i`` and ``G`` the mean
gradient over the data (estimated without the bias of a finite sample: the mean of the products of
distinct group means), it reports, relative to ``|G|``:

- ``noise``: the root-mean-square deviation of one step's exact gradient from ``G`` (sampling noise);
- ``step error``: the root mean square of ``e_i`` (what one step sees);
- ``bias``: ``|E[e]|``, from groups of batches (mean of the inner products of distinct groups'
  mean errors, so the noise does not inflate it; may come out negative when there is none, and is
  then shown as its signed square root), with a jackknife standard error over the groups;
- ``break-even tokens``: the tokens per step at which one step's sampling noise falls to the bias
  (``tokens_per_step * noise**2 / bias**2``): beyond it the bias dominates what a single step sees
  (the study trains at ~4M tokens per step);
- ``<G, E[e]> / |G|^2``: the bias's projection on the mean gradient, the first-order effect of the
  bias on the loss (an SGD step moves the loss by ``-lr * <G, g + e>``; positive: the error points
  along the gradient, a slightly larger step; negative: it opposes descent). Estimated without the
  same-batch covariance of ``g_i`` and ``e_i`` (inner products of *distinct* groups' means only),
  with a jackknife standard error over the groups;
- ``break-even steps``: over S steps the bias's drift grows like ``S * bias`` and the sampling
  noise's like ``sqrt(S) * noise``, so they are equal after ``(noise / bias)**2`` steps (with the
  tokens that makes in total); ``drift ratio at N steps`` is ``bias * sqrt(N) / noise`` for the
  run's ``--train-iters`` N. This compares whole training runs, not one step's noise with the bias.
  Paired runs (same seed, same batches) cancel much of the sampling noise in a gap, so a gap
  shows the bias earlier than this.

Also per parameter kind (embedding, qkv, proj, fc1, fc2, output layer, norms), the bias, and each
precision's mean loss difference from the reference on the same batches. It measures at TP=1 and
never writes a checkpoint; a checkpoint saved at another TP size loads with ``--finetune`` (weights
only, so the batches then start at sample 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from pretrain.arguments import ConfigError
from pretrain.gradient_error import (  # noqa: F401 (public names)
    DataRanOut,
    bias_projection,
    break_even_steps,
    cross_group_square,
    figures,
    measure,
    report,
    setup,
)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="gradient_error.py", description=__doc__.split("\n\n")[0],
        usage="%(prog)s [--precisions P ...] [--batches N] [--groups G] -- PRETRAIN FLAGS (with --load)",
    )
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad",
                                                       "mxfp4", "wgrad_hadamard"],
                   help="presets or per-GEMM specs to compare (as --precision takes), each optionally followed "
                        "by its own ';'-separated --precision-rule values, e.g. 'mxfp4;kind:output=mxfp4'")
    p.add_argument("--reference", default="fp32", help="precision of the exact gradient (default fp32)")
    p.add_argument("--batches", type=int, default=32, help="global batches to average over (default 32)")
    p.add_argument("--groups", type=int, default=8,
                   help="groups the batches are split into for the bias and its standard error (default 8)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the whole-model figures (per precision: step error, bias, <G, E[e]>/|G|^2 with "
                        "standard errors) to PATH as JSON, e.g. to fit them against measured extra tokens")
    if "--" not in argv:
        p.error("give the checkpoint's pretrain flags after '--', including --load CKPT")
    i = argv.index("--")
    ours, pretrain_flags = p.parse_args(argv[:i]), argv[i + 1:]
    if ours.groups < 2 or ours.batches < ours.groups or ours.batches % ours.groups:
        p.error(f"--batches {ours.batches} must be a multiple of --groups {ours.groups}, and --groups >= 2")
    if "--load" not in pretrain_flags:
        p.error("the pretrain flags after '--' need --load CKPT (the weights whose gradients are measured)")
    return ours, pretrain_flags


def main(argv: list[str] | None = None) -> int:
    ours, flags = parse(sys.argv[1:] if argv is None else argv)
    try:
        run, trainer, plans = setup(flags, ours.reference, ours.precisions)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(run.checkpoint.load, "latest_checkpointed_iteration.txt")):
        print(f"warning: --load {run.checkpoint.load} holds no checkpoint: measuring an untrained model", file=sys.stderr)
    try:
        m = measure(run, trainer, plans, ours.reference, ours.precisions, ours.batches, ours.groups,
                    log=lambda line: print(line, flush=True))
    except DataRanOut as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in report(m):
        print(line)
    if ours.json:
        record = {"load": run.checkpoint.load, "iteration": trainer.iteration, "reference": ours.reference,
                  "batches": ours.batches, "groups": ours.groups, **figures(m)}
        with open(ours.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

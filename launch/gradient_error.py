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
import math
import os
import sys
import warnings

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch

KINDS = ("embedding", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer", "norm/bias")


def parameter_kind(name: str) -> str:
    """The ``KINDS`` entry of a parameter name of our megatron GPT."""
    for kind in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"):
        if f"{kind}.weight" in name:
            return kind
    if "embedding" in name:
        return "embedding"
    return "norm/bias"


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
    if "--" not in argv:
        p.error("give the checkpoint's pretrain flags after '--', including --load CKPT")
    i = argv.index("--")
    ours, pretrain_flags = p.parse_args(argv[:i]), argv[i + 1:]
    if ours.groups < 2 or ours.batches < ours.groups or ours.batches % ours.groups:
        p.error(f"--batches {ours.batches} must be a multiple of --groups {ours.groups}, and --groups >= 2")
    if "--load" not in pretrain_flags:
        p.error("the pretrain flags after '--' need --load CKPT (the weights whose gradients are measured)")
    return ours, pretrain_flags


class Moments:
    """Running sums for one precision's errors: group sums of ``e`` and per-step squared norms."""

    def __init__(self, groups: int, size: int):
        self.group_sum = torch.zeros(groups, size, dtype=torch.float64)
        self.sq = 0.0
        self.steps = 0

    def add(self, group: int, e: torch.Tensor) -> None:
        self.group_sum[group] += e
        self.sq += float(e.square().sum())
        self.steps += 1


def cross_group_square(group_sum: torch.Tensor, per_group: int, sl: slice = slice(None)) -> tuple[float, float]:
    """``|E[v]|**2`` estimated from group sums without the noise term (the mean inner product of
    distinct groups' means), and its jackknife standard error over groups."""
    m = group_sum[:, sl] / per_group
    g = m.shape[0]

    def estimate(rows: torch.Tensor) -> float:
        total = rows.sum(0)
        k = rows.shape[0]
        return float((total.square().sum() - rows.square().sum()) / (k * (k - 1)))

    full = estimate(m)
    if g < 3:
        return full, float("nan")
    loo = torch.tensor([estimate(torch.cat([m[:j], m[j + 1:]])) for j in range(g)], dtype=torch.float64)
    se = float(((g - 1) / g * (loo - loo.mean()).square().sum()).sqrt())
    return full, se


def bias_projection(ref_sums: torch.Tensor, err_sums: torch.Tensor, per_group: int) -> tuple[float, float]:
    """``<G, E[e]> / |G|**2`` from group sums of the exact gradients and of the errors, each inner
    product over distinct groups only (unbiased for both numerator and denominator), and its
    jackknife standard error over groups (NaN with fewer than 3 groups)."""
    g = ref_sums / per_group
    e = err_sums / per_group

    def ratio(a: torch.Tensor, b: torch.Tensor) -> float:
        k = a.shape[0]
        sa, sb = a.sum(0), b.sum(0)
        inner = float((sa @ sb - (a * b).sum()) / (k * (k - 1)))
        square = float((sa @ sa - (a * a).sum()) / (k * (k - 1)))
        return inner / square if square > 0 else float("nan")

    full = ratio(g, e)
    k = g.shape[0]
    if k < 3:
        return full, float("nan")
    loo = torch.tensor([ratio(torch.cat([g[:j], g[j + 1:]]), torch.cat([e[:j], e[j + 1:]])) for j in range(k)],
                       dtype=torch.float64)
    return full, float(((k - 1) / k * (loo - loo.mean()).square().sum()).sqrt())


def break_even_steps(noise: float, bias: float) -> float:
    """Steps after which a bias's drift (``S * bias``) equals accumulated sampling noise
    (``sqrt(S) * noise``): ``(noise / bias)**2``; inf without a bias."""
    return (noise / bias) ** 2 if bias > 0 else float("inf")


def signed_sqrt(v: float) -> float:
    return math.copysign(math.sqrt(abs(v)), v)


def main(argv: list[str] | None = None) -> int:
    ours, flags = parse(sys.argv[1:] if argv is None else argv)
    from model.gpt import apply_precision_plan, policy_linear_names, policy_linears
    from precision import PrecisionPolicy, SpecError
    from pretrain.arguments import ConfigError, parse_run_config
    from pretrain.data import batches
    from pretrain.engine import _to
    from pretrain.train import setup

    try:
        run = parse_run_config(flags + ["--precision", ours.reference], 1, False)
        if run.parallel.tensor_model_parallel_size != 1 or run.parallel.pipeline_model_parallel_size != 1:
            raise ConfigError("gradient_error.py measures at TP=1, PP=1: drop the parallelism flags")
        trainer = setup(run)
        model = trainer.model
        names = policy_linear_names(model)
        plans = {}
        for p in [ours.reference, *ours.precisions]:
            try:
                preset, *rules = p.split(";")
                policy = PrecisionPolicy.from_args(preset, [*rules, *run.precision.precision_rule])
                policy.check_rules(run.model.num_layers, names)
                plans[p] = policy.resolve(names, run.model.num_layers)
            except (SpecError, ValueError) as e:
                raise ConfigError(f"--precisions {p!r}: {e}") from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(run.checkpoint.load, "latest_checkpointed_iteration.txt")):
        print(f"warning: --load {run.checkpoint.load} holds no checkpoint: measuring an untrained model", file=sys.stderr)

    # Each precision keeps its own quantization state per layer (SR counters, delayed amaxes).
    from precision.state import LayerQuantState

    states = {p: {n: LayerQuantState(seed=run.training.seed, name=n) for n in names} for p in plans}
    params = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    size = sum(q.numel() for _, q in params)
    kind_slices: dict[str, list[slice]] = {k: [] for k in KINDS}
    off = 0
    for n, q in params:
        kind_slices[parameter_kind(n)].append(slice(off, off + q.numel()))
        off += q.numel()

    nmb = run.training.global_batch_size // run.training.micro_batch_size
    data = batches(trainer.train_ds, trainer.consumed_samples, run.training.micro_batch_size)
    per_group = ours.batches // ours.groups
    tokens_per_step = run.training.global_batch_size * run.model.seq_length

    def gradient(precision: str, micro: list) -> tuple[torch.Tensor, float]:
        apply_precision_plan(model, plans[precision])
        for n, module in policy_linears(model):
            module.quant_state = states[precision][n]
        model.zero_grad(set_to_none=True)
        tokens_total = sum(float(mb[3].sum()) for mb in micro)
        loss_sum = 0.0
        for tokens, labels, pos, mask in micro:
            per_token = model(tokens, pos, None, labels=labels).float()
            loss = (per_token * mask).sum() / tokens_total
            loss.backward()
            loss_sum += float(loss.detach())
        g = torch.cat([q.grad.reshape(-1).double() if q.grad is not None else torch.zeros(q.numel(), dtype=torch.float64)
                       for _, q in params])
        return g, loss_sum

    ref = Moments(ours.groups, size)
    err = {p: Moments(ours.groups, size) for p in ours.precisions}
    dloss = {p: [] for p in ours.precisions}
    print(f"gradient error at iteration {trainer.iteration} of --load {run.checkpoint.load}: {ours.batches} global batches "
          f"of {tokens_per_step:,} tokens from sample {trainer.consumed_samples:,}, reference {ours.reference}",
          flush=True)
    model.train()
    for i in range(ours.batches):
        try:
            micro = [_to(next(data), trainer.device) for _ in range(nmb)]
        except StopIteration:
            print(f"error: the training data ran out after {i} batches: lower --batches", file=sys.stderr)
            return 2
        g_ref, loss_ref = gradient(ours.reference, micro)
        ref.add(i // per_group, g_ref)
        for p in ours.precisions:
            g, loss = gradient(p, micro)
            err[p].add(i // per_group, g - g_ref)
            dloss[p].append(loss - loss_ref)
        print(f"  batch {i + 1}/{ours.batches}", flush=True)

    mean_sq, _ = cross_group_square(ref.group_sum, per_group)
    total = ref.group_sum.sum(0) / ours.batches
    noise_sq = (ref.sq - ours.batches * float(total.square().sum())) / (ours.batches - 1)
    g_norm = math.sqrt(max(mean_sq, 1e-300))
    noise = math.sqrt(max(noise_sq, 0.0)) / g_norm
    print(f"\nmean gradient |G| = {g_norm:.4g}; one step's sampling noise = {noise:.3f} |G| "
          f"({tokens_per_step:,} tokens per step)\n")
    steps = run.training.train_iters or 0
    print("| precision | loss - ref (s.e.) | step error / abs(G) | bias / abs(G) (s.e.) | break-even tokens/step "
          f"| <G, E[e]> / abs(G)^2 (s.e.) | break-even steps (tokens in total) | drift ratio at {steps} steps |")
    print("|---|---|---|---|---|---|---|---|")
    for p in ours.precisions:
        m = err[p]
        b_sq, b_se = cross_group_square(m.group_sum, per_group)
        step = math.sqrt(m.sq / m.steps) / g_norm
        bias = signed_sqrt(b_sq) / g_norm
        bias_se = b_se / (2 * math.sqrt(abs(b_sq)) * g_norm) if b_sq else float("nan")
        dl = torch.tensor(dloss[p], dtype=torch.float64)
        dl_se = float(dl.std() / math.sqrt(len(dl)))
        breakeven = f"{tokens_per_step * noise ** 2 / bias ** 2:,.0f}" if bias > 0 else "none (no bias)"
        proj, proj_se = bias_projection(ref.group_sum, m.group_sum, per_group)
        s_even = break_even_steps(noise, bias)
        even = f"{s_even:,.0f} ({s_even * tokens_per_step:,.0f})" if math.isfinite(s_even) else "none (no bias)"
        drift = f"{bias * math.sqrt(steps) / noise:.3f}" if bias > 0 and noise > 0 else "n/a"
        print(f"| {p} | {float(dl.mean()):+.5f} ({dl_se:.5f}) | {step:.4f} | {bias:.4f} ({bias_se:.4f}) | {breakeven} "
              f"| {proj:+.4f} ({proj_se:.4f}) | {even} | {drift} |")
    print("\nbias / abs(G) by parameter kind (each kind's bias over its own mean gradient):\n")
    present = [k for k in KINDS if kind_slices[k]]
    print("| precision | " + " | ".join(present) + " |")
    print("|---|" + "---|" * len(present))
    for p in [ours.reference, *ours.precisions]:
        if p == ours.reference:
            row = []
            for k in present:
                sq = sum(cross_group_square(ref.group_sum, per_group, sl)[0] for sl in kind_slices[k])
                row.append(f"|G| {signed_sqrt(sq):.3g}")
        else:
            row = []
            for k in present:
                g_sq = sum(cross_group_square(ref.group_sum, per_group, sl)[0] for sl in kind_slices[k])
                b_sq = sum(cross_group_square(err[p].group_sum, per_group, sl)[0] for sl in kind_slices[k])
                row.append(f"{signed_sqrt(b_sq) / math.sqrt(max(g_sq, 1e-300)):.4f}")
        print(f"| {p} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

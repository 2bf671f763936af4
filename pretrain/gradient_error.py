"""How far each precision's weight gradient is from the exact one: the sampling noise that averages
away and the bias that does not (``launch/gradient_error.py``, whose docstring defines each figure).

``setup(flags, reference, precisions)`` builds the checkpoint's model at TP=1 and resolves each
precision's plan; ``measure`` computes, for ``batches`` global batches, the reference gradient and
each precision's error on the same weights and tokens (each precision keeps its own quantization
state per layer); ``report`` gives the two Markdown tables. The estimators (``cross_group_square``,
``bias_projection``) use inner products of distinct groups only, so the noise does not inflate them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from model.gpt import apply_precision_plan, policy_linear_names, policy_linears
from precision import PrecisionPolicy, SpecError
from precision.state import LayerQuantState
from pretrain.arguments import ConfigError, parse_run_config
from pretrain.data import batches as data_batches
from pretrain.engine import batch_to_device
from pretrain.train import setup as setup_trainer

KINDS = ("embedding", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer", "norm/bias")


def parameter_kind(name: str) -> str:
    """The ``KINDS`` entry of a parameter name of our megatron GPT."""
    for kind in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"):
        if f"{kind}.weight" in name:
            return kind
    if "embedding" in name:
        return "embedding"
    return "norm/bias"


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


def setup(flags: list[str], reference: str, precisions: list[str]):
    """The run config of the pretrain ``flags`` (under the ``reference`` precision), its trainer (the
    checkpoint loaded) and each precision's resolved plan; ``ConfigError`` with one line otherwise."""
    run = parse_run_config(flags + ["--precision", reference], 1, False)
    if run.parallel.tensor_model_parallel_size != 1 or run.parallel.pipeline_model_parallel_size != 1:
        raise ConfigError("gradient_error.py measures at TP=1, PP=1: drop the parallelism flags")
    trainer = setup_trainer(run)
    names = policy_linear_names(trainer.model)
    plans = {}
    for p in [reference, *precisions]:
        try:
            preset, *rules = p.split(";")
            policy = PrecisionPolicy.from_args(preset, [*rules, *run.precision.precision_rule])
            policy.check_rules(run.model.num_layers, names)
            plans[p] = policy.resolve(names, run.model.num_layers)
        except (SpecError, ValueError) as e:
            raise ConfigError(f"--precisions {p!r}: {e}") from None
    return run, trainer, plans


class DataRanOut(ValueError):
    """The training data ended before ``--batches`` global batches."""


@dataclasses.dataclass
class Measurement:
    """What ``measure`` accumulated: the reference gradients' and each precision's error moments, the
    loss differences, and the parameter slices of each kind."""

    reference: str
    precisions: list[str]
    batches: int
    per_group: int
    tokens_per_step: int
    train_iters: int
    ref: Moments
    err: dict[str, Moments]
    dloss: dict[str, list[float]]
    kind_slices: dict[str, list[slice]]


def measure(run, trainer, plans: dict, reference: str, precisions: list[str], n_batches: int, groups: int,
            log: Callable[[str], None] = print) -> Measurement:
    """The gradient of ``n_batches`` global batches from the checkpoint's data position under the
    reference and each precision, on the same weights and tokens (``log``: the progress lines)."""
    model = trainer.model
    names = policy_linear_names(model)
    # Each precision keeps its own quantization state per layer (SR counters, delayed amaxes).
    states = {p: {n: LayerQuantState(seed=run.training.seed, name=n) for n in names} for p in plans}
    params = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    size = sum(q.numel() for _, q in params)
    kind_slices: dict[str, list[slice]] = {k: [] for k in KINDS}
    off = 0
    for n, q in params:
        kind_slices[parameter_kind(n)].append(slice(off, off + q.numel()))
        off += q.numel()

    nmb = run.training.global_batch_size // run.training.micro_batch_size
    data = data_batches(trainer.train_ds, trainer.consumed_samples, run.training.micro_batch_size)
    per_group = n_batches // groups
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

    m = Measurement(reference, list(precisions), n_batches, per_group, tokens_per_step, run.training.train_iters or 0,
                    Moments(groups, size), {p: Moments(groups, size) for p in precisions},
                    {p: [] for p in precisions}, kind_slices)
    log(f"gradient error at iteration {trainer.iteration} of --load {run.checkpoint.load}: {n_batches} global batches "
        f"of {tokens_per_step:,} tokens from sample {trainer.consumed_samples:,}, reference {reference}")
    model.train()
    for i in range(n_batches):
        try:
            micro = [batch_to_device(next(data), trainer.device) for _ in range(nmb)]
        except StopIteration:
            raise DataRanOut(f"the training data ran out after {i} batches: lower --batches") from None
        g_ref, loss_ref = gradient(reference, micro)
        m.ref.add(i // per_group, g_ref)
        for p in precisions:
            g, loss = gradient(p, micro)
            m.err[p].add(i // per_group, g - g_ref)
            m.dloss[p].append(loss - loss_ref)
        log(f"  batch {i + 1}/{n_batches}")
    return m


def figures(m: Measurement) -> dict:
    """The numbers of the whole-model table: ``g_norm``, ``noise`` (one step's sampling noise / |G|),
    ``tokens_per_step``, ``steps``, and per precision ``step_error``, ``bias`` (signed, / |G|) and its
    ``bias_se``, ``projection`` (``<G, E[e]> / |G|^2``) and ``projection_se``, ``dloss`` and
    ``dloss_se`` (``launch/gradient_error.py --json`` writes them)."""
    per_group, ref = m.per_group, m.ref
    mean_sq, _ = cross_group_square(ref.group_sum, per_group)
    total = ref.group_sum.sum(0) / m.batches
    noise_sq = (ref.sq - m.batches * float(total.square().sum())) / (m.batches - 1)
    g_norm = math.sqrt(max(mean_sq, 1e-300))
    out = {"g_norm": g_norm, "noise": math.sqrt(max(noise_sq, 0.0)) / g_norm, "tokens_per_step": m.tokens_per_step,
           "steps": m.train_iters, "precisions": {}}
    for p in m.precisions:
        e = m.err[p]
        b_sq, b_se = cross_group_square(e.group_sum, per_group)
        dl = torch.tensor(m.dloss[p], dtype=torch.float64)
        proj, proj_se = bias_projection(ref.group_sum, e.group_sum, per_group)
        out["precisions"][p] = {
            "step_error": math.sqrt(e.sq / e.steps) / g_norm, "bias": signed_sqrt(b_sq) / g_norm,
            "bias_se": b_se / (2 * math.sqrt(abs(b_sq)) * g_norm) if b_sq else float("nan"),
            "projection": proj, "projection_se": proj_se,
            "dloss": float(dl.mean()), "dloss_se": float(dl.std() / math.sqrt(len(dl)))}
    return out


def report(m: Measurement) -> list[str]:
    """The summary line and the two Markdown tables (whole model; bias by parameter kind)."""
    f = figures(m)
    per_group, ref, g_norm, noise = m.per_group, m.ref, f["g_norm"], f["noise"]
    tokens_per_step, steps = m.tokens_per_step, m.train_iters
    lines = [(f"\nmean gradient |G| = {g_norm:.4g}; one step's sampling noise = {noise:.3f} |G| "
              f"({tokens_per_step:,} tokens per step)\n"),
             ("| precision | loss - ref (s.e.) | step error / abs(G) | bias / abs(G) (s.e.) | break-even tokens/step "
              f"| <G, E[e]> / abs(G)^2 (s.e.) | break-even steps (tokens in total) | drift ratio at {steps} steps |"),
             "|---|---|---|---|---|---|---|---|"]
    for p in m.precisions:
        q = f["precisions"][p]
        step, bias, bias_se, proj, proj_se = q["step_error"], q["bias"], q["bias_se"], q["projection"], q["projection_se"]
        breakeven = f"{tokens_per_step * noise ** 2 / bias ** 2:,.0f}" if bias > 0 else "none (no bias)"
        s_even = break_even_steps(noise, bias)
        even = f"{s_even:,.0f} ({s_even * tokens_per_step:,.0f})" if math.isfinite(s_even) else "none (no bias)"
        drift = f"{bias * math.sqrt(steps) / noise:.3f}" if bias > 0 and noise > 0 else "n/a"
        lines.append(f"| {p} | {q['dloss']:+.5f} ({q['dloss_se']:.5f}) | {step:.4f} | {bias:.4f} ({bias_se:.4f}) "
                     f"| {breakeven} | {proj:+.4f} ({proj_se:.4f}) | {even} | {drift} |")
    lines.append("\nbias / abs(G) by parameter kind (each kind's bias over its own mean gradient):\n")
    present = [k for k in KINDS if m.kind_slices[k]]
    lines += ["| precision | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]

    def kind_square(sums: torch.Tensor, kind: str) -> float:
        return sum(cross_group_square(sums, per_group, sl)[0] for sl in m.kind_slices[kind])

    for p in [m.reference, *m.precisions]:
        if p == m.reference:
            row = [f"|G| {signed_sqrt(kind_square(ref.group_sum, k)):.3g}" for k in present]
        else:
            row = [f"{signed_sqrt(kind_square(m.err[p].group_sum, k)) / math.sqrt(max(kind_square(ref.group_sum, k), 1e-300)):.4f}"
                   for k in present]
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    return lines

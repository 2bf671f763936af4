"""A trained model's own GEMM operands: every policy linear's ``x`` [tokens, in], ``w`` [out, in]
and ``dy`` [tokens, out] from training-mode forwards and backwards on the run's next batches, nothing
rounded beyond the run's own ``--precision`` (what ``python -m precision.controls_report
--checkpoint`` and ``launch/scale_target.py`` measure formats on)."""

from __future__ import annotations

import torch

__all__ = ["capture_operands"]


def capture_operands(trainer, micro_batches: int) -> tuple[dict[str, list[tuple[str, torch.Tensor]]], int, float]:
    """``({"x"|"w"|"dy": [(linear, tensor)]}, tokens, mean loss)`` over ``micro_batches`` micro-batches
    of ``trainer`` (``pretrain.train.setup``): one entry per linear (the output layer excluded: its
    logits are edited in place by the vocab-parallel loss), the micro-batches' rows stacked."""
    from model.gpt import policy_linears  # megatron-core: imported by the caller's setup already
    from pretrain.data import batches
    from pretrain.engine import batch_to_device

    model = trainer.model
    got: dict[str, list[tuple[str, torch.Tensor]]] = {"x": [], "w": [], "dy": []}
    hooks = []

    def capture(name):
        def hook(mod, inp, out):
            x = inp[0].detach().float()
            got["x"].append((name, x.reshape(-1, x.shape[-1]).clone()))
            y = out[0] if isinstance(out, tuple) else out
            y.register_hook(lambda dy: got["dy"].append((name, dy.detach().float().reshape(-1, dy.shape[-1]).clone())))
        return hook

    for name, m in policy_linears(model):
        if name == "output_layer":
            continue
        got["w"].append((name, m.weight.detach().float().clone()))
        hooks.append(m.register_forward_hook(capture(name)))
    model.train()
    stream = batches(trainer.train_ds, trainer.consumed_samples, trainer.run.training.micro_batch_size)
    tokens_seen, losses = 0, []
    try:
        for _ in range(micro_batches):
            tokens, labels, pos, mask = batch_to_device(next(stream), trainer.device)
            per_token = model(tokens, pos, None, labels=labels).float()
            ((per_token * mask).sum() / mask.sum()).backward()
            tokens_seen += int(tokens.numel())
            losses.append(float((per_token.detach() * mask).sum() / mask.sum()))
    finally:
        for h in hooks:
            h.remove()
    for k in ("x", "dy"):
        by: dict[str, list[torch.Tensor]] = {}
        for name, t in got[k]:
            by.setdefault(name, []).append(t)
        got[k] = [(name, torch.cat(ts)) for name, ts in by.items()]
    return got, tokens_seen, sum(losses) / len(losses)

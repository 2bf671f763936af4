"""The router's part of the trainer/rollout mismatch of a mixture-of-experts policy, and routing replay.

A quantized rollout engine can route a token to other experts than the trainer would (a discrete
mismatch). The engine records, per sequence and MoE layer, the experts each position chose and the
router's probabilities (``model.moe_replay.RoutedTokens``, ``RolloutBatch.routes``). The trainer then

  * routes afresh (default), or **replays** the rollout's choices (``--routing-replay``): its
    recompute, the reference's and every update forward take the rollout's top-k set at every
    position the rollout ran (each row's last token and padding route afresh; nothing reads them);
  * logs, every iteration, beside ``mismatch/*`` (``pretrain.rl.score``)::

      routing/topk_mismatch_fraction           positions (x MoE layers) whose top-k expert SET differs between
                                               the rollout and the trainer routing afresh (own numerics)
      routing/layer_L/topk_mismatch_fraction   the same in transformer layer L
      routing/router_prob_gap                  mean |p_rollout(e) - p_trainer(e)| over the rollout's chosen
                                               experts e (p: the router's probability of e, softmax over all
                                               experts; the trainer routing afresh)
      routing/k3_kl_replay, routing/k3_kl_no_replay           verl's k3 KL of the rollout's log-probs against
      routing/logprob_gap_replay, routing/logprob_gap_no_replay   the trainer's own numerics with / without
                                               replay, and the mean |log-prob gap| per response token

    Positions counted: every recorded position (prompt and response but the last token) of every
    response in the global batch (all data-parallel ranks). The mismatch metrics with / without replay
    cost one extra no-grad forward per iteration (the routing the run does not use).

    with replaying(t, routes, rows) as tap:       # routes: RolloutBatch.routes; None: route afresh
        model(...)
"""

from __future__ import annotations

import contextlib
import re

import torch

from model.moe_replay import RoutedTokens, RoutingTap, routing_targets

__all__ = ["replaying", "routing_counts", "routing_scalars"]

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


@contextlib.contextmanager
def replaying(tap: RoutingTap | None, routes: list[RoutedTokens] | None, width: int, device, on: bool = True):
    """Inside: ``tap``'s routers record what they choose and, with ``on`` and ``routes``, replay
    ``routes`` for a forward of those sequences right-padded to ``width`` slots. No-op without a tap."""
    if tap is None or routes is None:
        yield tap
        return
    targets = routing_targets(routes, width, device) if on else None
    with tap.attached(replay=targets):
        yield tap


def routing_counts(routes: list[RoutedTokens], trainer: list[tuple[torch.Tensor, torch.Tensor]], width: int
                   ) -> torch.Tensor:
    """Per MoE layer ``[positions, positions whose top-k set differs, sum of |p_rollout - p_trainer| over the
    rollout's chosen experts, chosen experts counted]`` (float64 ``[layers, 4]``) of this rank's sequences,
    ``trainer``: per layer what the trainer's forward chose (``RoutingTap.last``) for them, right-padded to
    ``width`` slots in megatron's ``[s, b]`` token order."""
    b = len(routes)
    out = torch.zeros(len(trainer), 4, dtype=torch.float64)
    for layer, (experts, probs) in enumerate(trainer):
        e = experts.cpu().view(width, b, -1).transpose(0, 1)  # [b, s, k]
        p = probs.cpu().view(width, b, -1).transpose(0, 1)  # [b, s, E]
        for i, r in enumerate(routes):
            n = min(r.tokens, width)
            roll_e = r.experts[layer, :n].long()
            differ = (roll_e.sort(-1).values != e[i, :n].long().sort(-1).values).any(-1)
            gap = (r.probs[layer, :n].gather(-1, roll_e) - p[i, :n].gather(-1, roll_e)).abs()
            out[layer] += torch.tensor([n, float(differ.sum()), float(gap.double().sum()), gap.numel()],
                                       dtype=torch.float64)
    return out


def routing_scalars(counts: torch.Tensor, layer_names: list[str]) -> dict[str, float]:
    """The ``routing/*`` top-k and probability scalars from (globally summed) :func:`routing_counts`."""
    total = counts.sum(0)
    out = {"routing/topk_mismatch_fraction": float(total[1] / total[0].clamp(min=1)),
           "routing/router_prob_gap": float(total[2] / total[3].clamp(min=1))}
    for name, row in zip(layer_names, counts):
        m = _LAYER.search(name)
        layer = m.group(1) if m else name
        out[f"routing/layer_{layer}/topk_mismatch_fraction"] = float(row[1] / row[0].clamp(min=1))
    return out

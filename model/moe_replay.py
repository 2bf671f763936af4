"""Routing records and routing replay of mixture-of-experts policies (megatron-core's ``RouterReplay``).

A MoE layer's router picks each token's top-k experts from its scores. A quantized rollout engine
can pick a different set than the trainer for the same token -- a discrete mismatch that token
log-probs only partly show. This module lets the engine **record** each token's chosen experts per
layer, and the trainer **replay** them (verl's and slime's "routing replay")::

    tap = RoutingTap(model)                        # one megatron RouterReplay per PolicyRouter
    with tap.attached():                            # every router forward: (experts [T, k], probs [T, E])
        model(...)
    tap.last                                        # per MoE layer, what the last forward chose
    with tap.attached(replay=targets):              # targets: per MoE layer (experts [T, k], mask [T])
        model(...)                                  # masked tokens use the given experts

It plugs into megatron-core 0.16's own seam: ``TopKRouter.routing`` passes ``self.router_replay``
(a ``megatron.core.transformer.moe.router_replay.RouterReplay``) to ``topk_routing_with_score_function``,
which asks it for the top-k. :class:`_LayerReplay` is such a ``RouterReplay``, with two differences
from megatron's: it is not registered in megatron's process-wide instance list (several models
live in one process: trainer, tests), and replay may be **partial** -- tokens outside the mask
(padding, a response's last token, which the rollout never fed back) route afresh. A replayed
token's combine weights are megatron's replay rule: the router's own scores gathered at the replayed
experts (softmax over them for a softmax router), so the gradient still reaches the router.

Token order inside a router: its input is ``[s, b, h]`` and megatron flattens it to ``[s * b]``,
token ``(slot j, row i)`` at ``j * b + i``. :func:`routing_targets` builds targets in that order.

``probs [T, E]`` is the router's probability of every expert: ``softmax(logits)`` for a softmax
router (pre-softmax or not), ``sigmoid(logits)`` for a sigmoid one -- what the metrics compare
(``pretrain.rl.routing``). Sinkhorn routing bypasses megatron's replay hook: refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from model.moe import PolicyRouter

__all__ = ["RoutedTokens", "RoutingRecorder", "RoutingTap", "moe_routers", "routing_targets"]


def moe_routers(model: torch.nn.Module) -> list[tuple[str, PolicyRouter]]:
    """``(name, router)`` of every MoE layer's router, in layer order (empty for a dense model)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PolicyRouter)]


class _LayerReplay(RouterReplay):
    """One router's record / replay hook (see the module docstring)."""

    def __init__(self, router: PolicyRouter, on_route: Callable[[int, torch.Tensor, torch.Tensor], None], layer: int):
        # megatron's __init__ appends to its global list; this instance stays private to its tap
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []
        self.target_mask: torch.Tensor | None = None
        self.router, self.on_route, self.layer = router, on_route, layer

    def _probs(self, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.router.config
        if cfg.moe_router_score_function == "sigmoid" or cfg.moe_router_pre_softmax:
            return scores.detach().float()  # already sigmoid / softmax scores
        return torch.softmax(scores.detach().float(), dim=-1)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target_topk_idx is not None:
            target = self.target_topk_idx.to(scores.device)
            if target.shape != idx.shape:
                raise ValueError(f"routing replay of {self.router.layer_name}: {tuple(target.shape)} expert "
                                 f"choices for a forward of {tuple(idx.shape)} (tokens x top-k)")
            if self.target_mask is not None:
                target = torch.where(self.target_mask.to(scores.device)[:, None], target, idx)
            idx = target
            values = scores.gather(1, idx)  # megatron's replay: the router's own scores at the replayed experts
        self.on_route(self.layer, idx.detach(), self._probs(scores))
        return values, idx


class RoutingTap:
    """Record / replay hooks on every router of ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        for name, r in self.routers:
            if r.routing_type == "sinkhorn":
                raise ValueError(f"routing replay/record: {name} routes with sinkhorn, which megatron-core's replay "
                                 "hook does not see; use --moe-router-load-balancing-type aux_loss, seq_aux_loss or none")
        self.last: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.routers)
        self.listeners: list[Callable[[int, torch.Tensor, torch.Tensor], None]] = []

    def __len__(self) -> int:
        return len(self.routers)

    def _on_route(self, layer: int, experts: torch.Tensor, probs: torch.Tensor) -> None:
        self.last[layer] = (experts, probs)
        for fn in self.listeners:
            fn(layer, experts, probs)

    @contextlib.contextmanager
    def attached(self, replay: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None):
        """Inside: every router reports what it chose (``last``, ``listeners``); with ``replay`` (per
        MoE layer ``(experts [T, k], mask [T] or None)``) the masked tokens take the given experts."""
        if replay is not None and len(replay) != len(self.routers):
            raise ValueError(f"routing replay: choices for {len(replay)} MoE layers, the model has {len(self.routers)}")
        saved = [r.router_replay for _, r in self.routers]
        try:
            for i, (_, r) in enumerate(self.routers):
                hook = _LayerReplay(r, self._on_route, i)
                if replay is not None:
                    hook.target_topk_idx, hook.target_mask = replay[i]
                r.router_replay = hook
            yield self
        finally:
            for (_, r), s in zip(self.routers, saved):
                r.router_replay = s


@dataclass
class RoutedTokens:
    """One sequence's routing: ``experts [layers, n, k]`` (global expert ids) and ``probs [layers, n, E]``
    (the router's probability of every expert), for its first ``n`` positions (prompt, then every
    generated token the engine fed back -- all but the last)."""

    experts: torch.Tensor
    probs: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.experts.shape[1]


class RoutingRecorder:
    """Per-row routing of a generation: the engine says which slots of the next forward are new for
    which rows (:meth:`expect`, the ``RoundingRecorder`` protocol), every router forward appends them."""

    def __init__(self, model: torch.nn.Module, n_rows: int):
        self.tap = RoutingTap(model)
        self.rows: list[int] = []
        self.mask: torch.Tensor | None = None
        self.experts = [[[] for _ in range(len(self.tap))] for _ in range(n_rows)]
        self.probs = [[[] for _ in range(len(self.tap))] for _ in range(n_rows)]

    def expect(self, rows: list[int], fresh: torch.Tensor) -> None:
        """The next forward's batch rows are prompts ``rows``; ``fresh [b, s]`` marks the slots to keep."""
        self.rows, self.mask = list(rows), fresh.cpu()

    def _take(self, layer: int, experts: torch.Tensor, probs: torch.Tensor) -> None:
        b, s = self.mask.shape
        e = experts.cpu().view(s, b, -1).transpose(0, 1)  # [b, s, k]: megatron's token order is [s, b]
        p = probs.cpu().view(s, b, -1).transpose(0, 1)
        for i, r in enumerate(self.rows):
            self.experts[r][layer].append(e[i][self.mask[i]])
            self.probs[r][layer].append(p[i][self.mask[i]])

    @contextlib.contextmanager
    def attached(self):
        self.tap.listeners.append(self._take)
        try:
            with self.tap.attached():
                yield self
        finally:
            self.tap.listeners.remove(self._take)

    def records(self) -> list[RoutedTokens]:
        out = []
        for ex, pr in zip(self.experts, self.probs):
            out.append(RoutedTokens(torch.stack([torch.cat(x) for x in ex]).to(torch.int16),
                                    torch.stack([torch.cat(x) for x in pr])))
        return out


def routing_targets(routes: Sequence[RoutedTokens], width: int,
                    device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replay targets, per MoE layer ``(experts [width * b, k], mask [width * b])``, for a forward of the
    ``b`` sequences of ``routes`` right-padded to ``width`` slots (sequence i's position j at slot j):
    megatron's ``[s, b]`` token order; slots beyond a sequence's recorded positions route afresh."""
    b = len(routes)
    layers, _, k = routes[0].experts.shape
    experts = torch.zeros(width, b, layers, k, dtype=torch.long)
    mask = torch.zeros(width, b, dtype=torch.bool)
    for i, r in enumerate(routes):
        n = min(r.tokens, width)
        experts[:n, i] = r.experts[:, :n].long().permute(1, 0, 2)
        mask[:n, i] = True
    flat_e, flat_m = experts.reshape(width * b, layers, k).to(device), mask.reshape(-1).to(device)
    return [(flat_e[:, layer].contiguous(), flat_m) for layer in range(layers)]

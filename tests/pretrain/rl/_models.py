"""Small policies the RL tests share."""

from __future__ import annotations

import torch

from model.gpt import ModelConfig, build_gpt


def sharp_gpt(cfg: ModelConfig, scale: float = 3.0) -> torch.nn.Module:
    """A tiny GPT (seed 0) with every weight but the norms scaled up: sharper than the init, so FP4
    visibly moves its log-probs."""
    torch.manual_seed(0)
    gpt = build_gpt(cfg).eval()
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return gpt

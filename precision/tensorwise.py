"""Per-tensor scaling (FP8, HiF8): current scaling, and delayed scaling from an amax history.

``scale = max_normal / amax`` maps the tensor's amax onto the element format's largest value.
With *current* scaling ``amax`` is the tensor's own; with *delayed* scaling it comes from an
:class:`AmaxHistory` of previous steps, so a sudden jump in amax overflows the range: those values
saturate and are **counted** (``QuantizedTensor.num_clipped``), which is how the HiF8 QAT study's
"hidden" clipping failure becomes visible.

Amax algorithms (Megatron-LM / TransformerEngine names):
  * ``most_recent`` -- the previous step's amax;
  * ``max``         -- the maximum over the last ``history_len`` steps (64 in the HiF8 QAT study);
  * ``ema``         -- exponential moving average with factor ``ema_decay``;
  * ``current``     -- no history, this tensor's own amax.
"""

from __future__ import annotations

import torch

from precision.elements import fdiv
from precision.enums import AmaxAlgo

__all__ = ["AMAX_ALGOS", "AmaxHistory", "scale_from_amax", "tensor_amax"]

AMAX_ALGOS = AmaxAlgo.values()


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """amax over the finite values of ``x`` (float32 scalar tensor). NaN/Inf never set the scale."""
    if not x.numel():
        return torch.zeros((), device=x.device)
    # branch-free (no host read of the device value): one pass over |x| with non-finite values as 0
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax().float()


def scale_from_amax(amax: torch.Tensor, max_normal: float, pow2_scale: bool = False) -> torch.Tensor:
    """Encode scale ``max_normal / amax`` (one FP32 division; 1 for amax = 0), optionally rounded
    down to a power of two."""
    amax = amax.float()
    s = torch.where(amax > 0, fdiv(max_normal, amax), torch.ones_like(amax))
    s = torch.clamp(s, max=torch.finfo(torch.float32).max)
    if pow2_scale:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


class AmaxHistory:
    """A rolling window of per-step amax values for one GEMM operand of one layer.

    ``amax()`` is the value the *next* quantization uses (before this step's amax is known);
    ``update(a)`` records this step's amax. ``state_dict`` / ``load_state_dict`` make it part of
    checkpoints.
    """

    def __init__(self, algo: str = "max", history_len: int = 64, ema_decay: float = 0.9):
        algo = str(AmaxAlgo.parse(algo, "amax algorithm"))
        if history_len < 1:
            raise ValueError(f"amax history length: must be >= 1, got {history_len}")
        self.algo, self.history_len, self.ema_decay = algo, history_len, ema_decay
        self.history: list[float] = []
        self.ema: float | None = None

    @property
    def empty(self) -> bool:
        return not self.history

    def amax(self) -> float | None:
        """The amax for the next quantization, or None when there is no history yet."""
        if self.algo == "current" or not self.history:
            return None
        if self.algo == "most_recent":
            return self.history[-1]
        if self.algo == "max":
            return max(self.history[-self.history_len:])
        return self.ema

    def update(self, amax: float) -> None:
        amax = float(amax)
        self.history.append(amax)
        del self.history[: -self.history_len]
        self.ema = amax if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * amax

    def state_dict(self) -> dict:
        return {"algo": self.algo, "history_len": self.history_len, "ema_decay": self.ema_decay,
                "history": list(self.history), "ema": self.ema}

    def load_state_dict(self, sd: dict) -> None:
        self.algo, self.history_len, self.ema_decay = sd["algo"], sd["history_len"], sd["ema_decay"]
        self.history, self.ema = list(sd["history"]), sd["ema"]

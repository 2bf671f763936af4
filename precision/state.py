"""Per-layer quantization state: random streams, fixed rotation signs, amax histories, statistics.

Each policy-routed linear layer owns one :class:`LayerQuantState`. Everything random is derived
from ``(seed, GEMM, operand, call index)``, so that

* a fixed seed gives bit-identical results (stochastic rounding included), also after resuming
  from a checkpoint (``state_dict`` holds the call counters and amax histories);
* each GEMM's stream is independent of the others: changing one GEMM's recipe never changes the
  random numbers another GEMM sees (the GEMM-isolation property).
"""

from __future__ import annotations

import hashlib

import torch

from precision.recipe import Gemm, OperandFormat
from precision.rotation import random_signs
from precision.tensorwise import AmaxHistory

__all__ = ["LayerQuantState", "derive_seed"]


def derive_seed(*parts) -> int:
    """A 63-bit seed from any printable parts (stable across processes and Python versions)."""
    h = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class LayerQuantState:
    def __init__(self, seed: int = 0, name: str = ""):
        self.seed = seed
        self.name = name
        self.calls: dict[str, int] = {g.value: 0 for g in Gemm}
        self.amax: dict[str, AmaxHistory] = {}
        self.stats: dict[str, dict[str, float]] = {}  # "gemm/operand" -> last numbers (telemetry)
        self.collect_stats = False  # set by the training loop on telemetry steps
        # QAT warm-up: GEMMs run in BF16 while per-tensor delayed-scaling histories fill.
        self.observe_only = False
        # Tensor parallelism: the process group whose ranks hold shards of this layer's operands.
        # Per-tensor scales then come from the amax of the whole tensor (the maximum over the
        # group, as TransformerEngine reduces amaxes), so TP=n quantizes as TP=1 does. Not saved.
        self.amax_group = None

    # ---------------------------------------------------------------- randomness
    def next_call(self, gemm: Gemm) -> int:
        i = self.calls[gemm.value]
        self.calls[gemm.value] = i + 1
        return i

    def generator(self, gemm: Gemm, operand: str, call: int, device=None) -> torch.Generator:
        g = torch.Generator(device=device if device is not None and torch.device(device).type == "cuda" else "cpu")
        g.manual_seed(derive_seed(self.seed, self.name, gemm.value, operand, call))
        return g

    def rotation_signs(self, gemm: Gemm, n: int, call: int | None) -> torch.Tensor:
        """Random +-1 signs: fixed per layer and GEMM (``call=None``) or per call."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.name, gemm.value, "signs", n,
                                                      "fixed" if call is None else call))
        return random_signs(n, g)

    # ---------------------------------------------------------------- delayed scaling
    def amax_history(self, gemm: Gemm, operand: str, fmt: OperandFormat) -> AmaxHistory:
        key = f"{gemm.value}/{operand}"
        h = self.amax.get(key)
        if h is None or h.algo != fmt.amax_algo or h.history_len != fmt.amax_history_len:
            old = h.history if h is not None else []
            h = AmaxHistory(fmt.amax_algo, fmt.amax_history_len)
            for a in old[-fmt.amax_history_len:]:
                h.update(a)
            self.amax[key] = h
        return h

    def record(self, gemm: Gemm, operand: str, **numbers: float) -> None:
        self.stats.setdefault(f"{gemm.value}/{operand}", {}).update(numbers)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"seed": self.seed, "name": self.name, "calls": dict(self.calls),
                "amax": {k: h.state_dict() for k, h in self.amax.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.name, self.calls = sd["seed"], sd["name"], dict(sd["calls"])
        self.amax = {}
        for k, hsd in sd["amax"].items():
            h = AmaxHistory()
            h.load_state_dict(hsd)
            self.amax[k] = h

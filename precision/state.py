"""Per-layer quantization state: random streams, fixed rotation signs, amax histories, statistics.

Each policy-routed linear layer owns one :class:`LayerQuantState`. What it holds, and when it changes:

=====================  ===================================================  ==========================
state                  what                                                 changes
=====================  ===================================================  ==========================
``calls``              per-GEMM call counters: the ``call`` of every SR      every *training* GEMM call
                       stream and of resampled rotation signs
``amax``               delayed-scaling histories (:class:`StepAmaxHistory`)  one entry per optimizer
                       per ``gemm/operand``, device tensors                  step (:meth:`end_step`)
``stats``              telemetry: amax, clipped count (device tensors),      every training GEMM call;
                       numerics on telemetry steps (``collect_stats``)       read at log intervals
``seed``, ``name``     where every random stream starts                      never (set by the layer)
``tp``                 where this rank's shard sits in the whole weight      never (set by the layer)
=====================  ===================================================  ==========================

Semantics:

* **Randomness** is a function of ``(seed, layer name, GEMM, operand, call)`` (:func:`derive_seed`),
  and stochastic rounding draws each element's uniform from that seed and the element's index in
  the *whole* (TP=1) tensor (``kernels.operand``), so a TP shard rounds exactly as TP=1 does. A fixed
  seed gives bit-identical results, also after resuming (``state_dict`` holds counters and
  histories); one GEMM's stream never depends on another's recipe (the GEMM-isolation property).
* **Delayed scaling** records one amax per optimizer step: the maximum over that step's
  micro-batches (and over the TP group for sharded operands). Quantization inside a step uses the
  history of the *previous* steps, so ``max`` over 64 means 64 steps at any gradient-accumulation
  count. The training loop calls :meth:`end_step` after every optimizer step; until the first
  ``end_step`` a history is empty and the operand is scaled by its own (current) amax.
* **Reading is not training.** While ``frozen`` (evaluation, generation; ``model.linear`` sets it
  for every forward run without autograd) the GEMMs read the state -- histories, call counters,
  signs -- and change nothing: no counter advances, no amax is recorded, no statistics are written.
  Running evaluation between training steps therefore leaves training bit-identical.
* **No host reads on the GEMM path.** Histories and the telemetry numbers are tensors on the
  operand's device; nothing here calls ``.item()``/``float()`` except :attr:`StepAmaxHistory.history`
  and ``state_dict`` (checkpoints, tests), which the per-GEMM path never calls.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from precision.recipe import Gemm, OperandFormat
from precision.rotation import random_signs

__all__ = ["LayerQuantState", "StepAmaxHistory", "TPLayout", "derive_seed"]


def derive_seed(*parts) -> int:
    """A 63-bit seed from any printable parts (stable across processes and Python versions)."""
    h = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class TPLayout:
    """Where this rank's shard of a tensor-parallel linear sits in the whole (TP=1) layer.

    ``split``: ``"column"`` (megatron's ColumnParallelLinear: ``w`` rows and ``dy`` columns, the
    out-features, are sharded; ``x`` is replicated) or ``"row"`` (RowParallelLinear: ``w`` and ``x``
    columns, the in-features, are sharded; ``dy`` is replicated), None without TP. ``stride``:
    megatron's ``partition_stride`` -- the sharded axis is cut into ``stride`` equal chunks, rank
    ``r`` holding whole-tensor chunks ``r, size + r, ...`` (SwiGLU's fused gate/up ``linear_fc1``).
    """

    rank: int = 0
    size: int = 1
    split: str | None = None
    stride: int = 1

    def __post_init__(self):
        if self.split not in (None, "column", "row"):
            raise ValueError(f"TPLayout.split: unknown {self.split!r}; valid: column, row (or None)")

    def shard_axis(self, operand: str) -> int | None:
        """The axis of operand ``x``/``w``/``dy`` (natural layout) sharded over TP, or None (replicated)."""
        if self.size == 1:
            return None
        return {("column", "w"): 0, ("column", "dy"): 1, ("row", "w"): 1, ("row", "x"): 1}.get((self.split, operand))

    def pieces(self, operand: str, shape) -> tuple[int | None, list[tuple[int, int, int]], int]:
        """``(axis, [(local start, length, whole-tensor start)], whole-tensor columns)`` of a 2-D
        operand's shard: the contiguous runs of the sharded axis and where each run begins in the
        TP=1 tensor. Replicated operands: one run at 0 along no axis."""
        axis = self.shard_axis(operand)
        rows, cols = shape
        if axis is None:
            return None, [(0, rows, 0)], cols
        n = shape[axis]
        run = n // self.stride
        pieces = [(j * run, run, (j * self.size + self.rank) * run) for j in range(self.stride)]
        return axis, pieces, cols * self.size if axis == 1 else cols


class StepAmaxHistory:
    """A window of per-optimizer-step amax values of one GEMM operand, on the operand's device.

    ``observe(amax)`` takes the maximum into this step's pending value (device ops only);
    ``end_step()`` appends it to the window; ``amax()`` is the value the next quantization scales by
    (a 0-d tensor; None before the first step ends). Algorithms (TransformerEngine's names):
    ``most_recent`` (the last step), ``max`` (over the last ``history_len`` steps), ``ema``
    (``decay * ema + (1 - decay) * amax`` per step).
    """

    def __init__(self, algo: str = "max", history_len: int = 64, ema_decay: float = 0.9):
        algo = str(getattr(algo, "value", algo))  # a plain str in checkpoints (AmaxAlgo is a str enum)
        if algo not in ("most_recent", "max", "ema"):
            raise ValueError(f"amax algorithm: unknown {algo!r}; valid: most_recent, max, ema")
        if history_len < 1:
            raise ValueError(f"amax history length: must be >= 1, got {history_len}")
        self.algo, self.history_len, self.ema_decay = algo, history_len, ema_decay
        self.values: torch.Tensor | None = None  # float32 [n <= history_len], oldest first
        self.ema: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self._next: torch.Tensor | None = None  # amax() of the window, computed at end_step

    @property
    def empty(self) -> bool:
        return self.values is None

    def amax(self, device=None) -> torch.Tensor | None:
        """The amax for the next quantization (0-d float32 tensor), None while no step has ended."""
        if self._next is not None and device is not None and self._next.device != torch.device(device):
            self._move(device)
        return self._next

    def observe(self, amax: torch.Tensor) -> None:
        a = torch.as_tensor(amax, dtype=torch.float32).detach().reshape(())
        self.pending = a if self.pending is None else torch.maximum(self.pending, a.to(self.pending.device))

    def end_step(self) -> None:
        """Append this step's maximum (if any operand was observed) to the window."""
        if self.pending is None:
            return
        a, self.pending = self.pending, None
        if self.values is not None and self.values.device != a.device:
            self._move(a.device)
        v = a.reshape(1) if self.values is None else torch.cat([self.values, a.reshape(1)])
        self.values = v[-self.history_len:]
        self.ema = a if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * a
        self._refresh()

    def _refresh(self) -> None:
        if self.values is None:
            self._next = None
        elif self.algo == "most_recent":
            self._next = self.values[-1]
        elif self.algo == "max":
            self._next = self.values.amax()
        else:
            self._next = self.ema

    def _move(self, device) -> None:
        self.values = self.values.to(device) if self.values is not None else None
        self.ema = self.ema.to(device) if self.ema is not None else None
        self._refresh()

    @property
    def history(self) -> list[float]:
        """The window as Python floats (reads the device: checkpoints, logs and tests only)."""
        return [] if self.values is None else [float(v) for v in self.values.cpu()]

    def state_dict(self) -> dict:
        return {"algo": self.algo, "history_len": self.history_len, "ema_decay": self.ema_decay,
                "history": torch.zeros(0) if self.values is None else self.values.detach().cpu().clone(),
                "ema": None if self.ema is None else self.ema.detach().cpu().clone()}

    def load_state_dict(self, sd: dict) -> None:
        """Histories saved as tensors, or (older checkpoints) as lists of floats."""
        self.algo = str(getattr(sd["algo"], "value", sd["algo"]))
        self.history_len, self.ema_decay = int(sd["history_len"]), float(sd["ema_decay"])
        hist = sd["history"]
        values = (hist.detach().float().reshape(-1).clone() if isinstance(hist, torch.Tensor)
                  else torch.tensor([float(v) for v in hist], dtype=torch.float32))
        self.values = values[-self.history_len:] if values.numel() else None
        ema = sd.get("ema")
        self.ema = None if ema is None else torch.as_tensor(ema, dtype=torch.float32).detach().reshape(()).clone()
        if self.ema is None and self.values is not None:
            self.ema = self.values[-1].clone()
        self.pending = None
        self._refresh()


class LayerQuantState:
    def __init__(self, seed: int = 0, name: str = ""):
        self.seed = seed
        self.name = name
        self.calls: dict[str, int] = {g.value: 0 for g in Gemm}
        # What the GEMMs derived from a weight and serve again within one optimizer step (the weight
        # quantized once per step: ``kernels.operand``). Keyed on the tensor's identity, so it ends
        # with the step: optimizers write parameters with ``p.data.copy_``, which leaves ``p._version``
        # unchanged. Not saved.
        self.step_cache: dict = {}
        self.amax: dict[str, StepAmaxHistory] = {}
        self.stats: dict[str, dict] = {}  # "gemm/operand" -> last numbers (telemetry; tensors or floats)
        self.collect_stats = False  # set by the training loop on telemetry steps
        # QAT warm-up: GEMMs run in BF16 while per-tensor delayed-scaling histories fill.
        self.observe_only = False
        # Evaluation / generation: read the state, change nothing (see the module docstring).
        self.frozen = False
        # Tensor parallelism: the process group whose ranks hold shards of this layer's operands.
        # Per-tensor scales then come from the amax of the whole tensor (the maximum over the
        # group, as TransformerEngine reduces amaxes), so TP=n quantizes as TP=1 does. Not saved.
        self.amax_group = None
        self.tp = TPLayout()  # where this rank's shard sits (set by the layer). Not saved.

    # ---------------------------------------------------------------- randomness
    def next_call(self, gemm: Gemm) -> int:
        """This call's index for ``gemm``; advances the counter unless ``frozen``."""
        i = self.calls[gemm.value]
        if not self.frozen:
            self.calls[gemm.value] = i + 1
        return i

    def sr_seed(self, gemm: Gemm, operand: str, call: int) -> int:
        """The seed of one operand's stochastic rounding in one call (element index comes on top)."""
        return derive_seed(self.seed, self.name, gemm.value, operand, call)

    def rotation_signs(self, gemm: Gemm, n: int, call: int | None) -> torch.Tensor:
        """Random +-1 signs: fixed per layer and GEMM (``call=None``) or per call."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.name, gemm.value, "signs", n,
                                                      "fixed" if call is None else call))
        return random_signs(n, g)

    @contextlib.contextmanager
    def read_only(self):
        """Within: GEMMs read this state and change nothing (evaluation, generation)."""
        before, self.frozen = self.frozen, True
        try:
            yield self
        finally:
            self.frozen = before

    # ---------------------------------------------------------------- delayed scaling
    def amax_history(self, gemm: Gemm, operand: str, fmt: OperandFormat) -> StepAmaxHistory:
        key = f"{gemm.value}/{operand}"
        h = self.amax.get(key)
        if h is None or h.algo != fmt.amax_algo or h.history_len != fmt.amax_history_len:
            new = StepAmaxHistory(fmt.amax_algo, fmt.amax_history_len)
            if h is not None and h.values is not None:  # a changed recipe keeps the recorded steps
                new.load_state_dict({**h.state_dict(), "algo": new.algo, "history_len": new.history_len})
            self.amax[key] = h = new
        return h

    def observe_amax(self, gemm: Gemm, operand: str, fmt: OperandFormat, amax: torch.Tensor) -> None:
        """This call's amax of a delayed-scaling operand (ignored while frozen)."""
        if not self.frozen:
            self.amax_history(gemm, operand, fmt).observe(amax)

    def end_step(self) -> None:
        """An optimizer step ended: each history appends the maximum over the step's calls, and what
        was derived from this step's weights (``step_cache``) is dropped."""
        self.step_cache.clear()
        for h in self.amax.values():
            h.end_step()

    def record(self, gemm: Gemm, operand: str, **numbers) -> None:
        if not self.frozen:
            self.stats.setdefault(f"{gemm.value}/{operand}", {}).update(numbers)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"seed": self.seed, "name": self.name, "calls": dict(self.calls),
                "amax": {k: h.state_dict() for k, h in self.amax.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.name, self.calls = sd["seed"], sd["name"], dict(sd["calls"])
        self.step_cache.clear()
        self.amax = {}
        for k, hsd in sd["amax"].items():
            h = StepAmaxHistory(hsd["algo"], hsd["history_len"], hsd["ema_decay"])
            h.load_state_dict(hsd)
            self.amax[k] = h

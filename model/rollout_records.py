"""Rounding records taken while the engine generates (TRACE; ``precision.rounding_record``).

For the chosen linears (``--precision-rule`` selectors: ``kind:fc1``, ``layers:0-3``, globs, or
plain names) the engine records, during prefill and every decode step, the block scales and the
rounding direction of each token's Fprop activation ``x`` -- the operand the rollout quantizes
(``model.rollout.PackedWeight.fprop``) -- and assembles one record per sequence and linear, row
``t`` being the token at position ``t`` of prompt + response::

    === FPROP: y = x · wᵀ ===     x [s, b, in] per call  ->  new tokens' rows  ->  record_rounding
    engine = Engine(model, vocab_size=V, rollout=rollout, record_layers=["kind:fc1"])
    out = engine.generate(prompts, params)
    rec = out.records[i]["decoder.layers.0.mlp.linear_fc1"]   # RoundingRecord, [P + R - 1, in]
    x_fq = replay_fake_quantize(x_train[: rec.shape[0]], rec)     # the trainer replays it

``R - 1``: a sequence's last sampled token is never run through the model (nothing follows it), so
its activations do not exist. Padding slots are never recorded; in ``use_cache=False`` mode only
each step's newest slot is (the earlier ones were recorded when they were new).

Which calls a token's row comes from: the prefill for prompt tokens, the decode step that ran it
for generated ones -- each recorded by ``precision.rounding_record.record_rounding`` with the
linear's rollout activation format, on exactly the rows the rollout quantized. Recordable: a
nearest-rounded block format with a finite grid and no tensor-level scale (``mxfp4``,
``mxfp6_*``), without a rotation -- blocks then lie within one token's row, so a token's record
does not depend on the call (prefill, decode step or a teacher-forced pass) that ran it. NVFP4's
FP32 tensor scale is per call (a decode step's amax vs the whole prefix's), and a per-sequence
record has room for one; it is refused, as is the output layer (it runs on one slot per row).
Records are of this rank's shard of ``x`` under TP (a row-parallel linear's input is sharded).

Measured (``tests/model/test_rollout_records.py``'s tiny 2-layer GPT, 4 prompts, 5 greedy tokens,
MXFP4 rollout incl. KV-cache, ``pretrain.rl.alignment.engine_alignment``): against a BF16 trainer
19-52 % of the codes agree by the trainer's own rounding, 22-59 % replaying the engine's records
(layer 0's ``linear_qkv``, embeddings + norm only: 100 %); against a trainer with the rollout's
Fprop recipes and ``--kv-quant mxfp4``, 100 % either way. The record costs 1.25 bits per element.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from model.gpt import policy_linears
from precision.formats import QuantizedTensor, get_format
from precision.policy import Rule
from precision.recipe import LinearPrecision, SpecError
from precision.rounding_record import RoundingRecord, record_rounding, recordable_formats

__all__ = ["RoundingRecorder", "select_recorded_linears"]


ROUTED = ".mlp.experts."  # a routed expert's linears (model.moe): not recordable per position


def select_recorded_linears(model, plan, selectors: Sequence[str], flag: str = "record_layers") -> dict[str, object]:
    """``{name: activation OperandFormat}`` of the linears ``selectors`` choose (anchored, as
    ``--precision-rule``'s); a selector that chooses nothing, or a linear whose rollout activation
    format cannot be recorded, is refused in one line naming ``flag``."""
    names = [n for n, _ in policy_linears(model)]
    num_layers = model.config.num_layers
    chosen: dict[str, object] = {}
    for sel in selectors:
        rule = Rule(sel, LinearPrecision(), f"{flag} {sel}")
        hits = [n for n in names if n == sel or rule.matches(n, num_layers)]
        if not hits:
            raise SpecError(f"{flag} {sel!r}: selects no linear; linears: {', '.join(names)}")
        for n in hits:
            if ROUTED in n:
                raise SpecError(f"{flag} {sel!r}: {n} is a routed expert, which runs on the tokens routed to it "
                                "(permuted, padded), not on every position: its rounding is not recorded; select "
                                "other linears (e.g. kind:attention, kind:shared_expert)")
            recipe = plan.fprop(n)
            ok = (recipe.a.fmt in recordable_formats() and not get_format(recipe.a.fmt).tensor_scaled
                  and recipe.rotation == "none" and n != "output_layer")
            if not ok:
                valid = ", ".join(f for f in recordable_formats() if not get_format(f).tensor_scaled)
                raise SpecError(f"{flag} {sel!r}: {n} runs x as {recipe.spec()} under the rollout plan "
                                f"{plan.label}; recordable during generation: decoder linears whose x is "
                                f"{valid} without a rotation")
            chosen[n] = recipe.a
    return chosen


class RoundingRecorder:
    """Collects the chosen linears' records over one :meth:`Engine.generate` call.

    The engine calls :meth:`expect` before each forward with the batch rows' prompt indices and the
    ``[b, s]`` mask of slots whose tokens are new in that call; every chosen linear's forward
    pre-hook then records those rows of its ``x`` (``[s, b, in]``); :meth:`records` assembles them.
    ``keep_codes``: also keep the rollout's own codes (:meth:`codes`), to measure how many of them a
    trainer reproduces -- a measurement, not part of the record (4 more bits per FP4 element)."""

    def __init__(self, model, formats: dict[str, object], n_sequences: int, keep_codes: bool = False):
        self.model = model
        self.formats = formats
        self.keep_codes = keep_codes
        self._parts = [{n: [] for n in formats} for _ in range(n_sequences)]
        self._rows: list[int] = []
        self._new: torch.Tensor | None = None

    def expect(self, rows: list[int], new: torch.Tensor) -> None:
        """Next forward: batch row ``k`` is sequence ``rows[k]``; ``new [b, s]`` marks the slots to record."""
        self._rows, self._new = list(rows), new

    def _record(self, name: str, x: torch.Tensor) -> None:
        new = self._new
        if x.dim() != 3 or tuple(x.shape[:2]) != (new.shape[1], new.shape[0]):
            raise RuntimeError(f"rounding records: {name}'s input is {tuple(x.shape)}, expected [s, b, in] = "
                               f"[{new.shape[1]}, {new.shape[0]}, in]")
        x_new = x.detach().transpose(0, 1)[new]  # [n, in]: rows in (batch row, slot) order
        q, rec = record_rounding(x_new, self.formats[name], axis=1)
        columns = (rec.scales, rec.directions()) + ((q.codes,) if self.keep_codes else ())
        start = 0
        for k, count in enumerate(new.sum(1).tolist()):
            self._parts[self._rows[k]][name].append(tuple(c[start : start + count] for c in columns))
            start += count

    @contextlib.contextmanager
    def attached(self):
        """Inside: each chosen linear records its new rows at every forward."""
        modules = dict(policy_linears(self.model))
        handles = [modules[n].register_forward_pre_hook(lambda _m, args, n=n: self._record(n, args[0]))
                   for n in self.formats]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _cat(self, column: int) -> list[dict[str, torch.Tensor]]:
        return [{n: torch.cat([c[column] for c in chunks]).cpu() for n, chunks in parts.items() if chunks}
                for parts in self._parts]

    def records(self) -> list[dict[str, RoundingRecord]]:
        """Per sequence: ``{linear: RoundingRecord}`` of ``[tokens run, in]`` (module docstring), on
        the CPU like ``RolloutBatch``'s tensors."""
        return [{n: RoundingRecord.from_directions(self.formats[n].fmt, 1, scales[n], up[n]) for n in scales}
                for scales, up in zip(self._cat(0), self._cat(1))]

    def codes(self) -> list[dict[str, QuantizedTensor]] | None:
        """Per sequence: ``{linear: the rollout's quantized x}``, rows as :meth:`records` (``keep_codes``)."""
        if not self.keep_codes:
            return None
        return [{n: QuantizedTensor(self.formats[n].fmt, codes[n], scales[n], 1) for n in scales}
                for scales, codes in zip(self._cat(0), self._cat(2))]

"""Rollout-guided QAT (TRACE): the trainer's forward computes with the rollout's numbers.

An RL step samples with the rollout engine (e.g. MXFP4 weights, activations and KV-cache) and
then recomputes the sampled tokens' log-probs with the trainer under ``--precision``. Where the
two forwards round differently, the policy gradient is taken on a model that did not produce the
samples (``pretrain.rl.mismatch``). ``--rollout-qat`` makes the trainer's forward the rollout's::

    === FPROP: y = x · wᵀ ===  per linear, in every training forward of the step
      none     the trainer's --precision Fprop recipe, as it is
      rtn      the rollout plan's Fprop recipe x@w[+rot]: weights and activations quantized as the
               rollout does, by the trainer's own round-to-nearest (the rollout's quantizers are the
               trainer's: model.rollout) -- plus K/V fake-quantized in the rollout's KV format (kv=True)
      replay   as rtn; for the chosen linears the x operand replays the rollout's recorded rounding
               (precision.rounding_record: its block scales and one direction bit per element,
               recorded by the engine while it generated, model.rollout_records)
    === DGRAD: dx = dy · w ===   the trainer's --precision Dgrad recipe, on the high-precision w
    === WGRAD: dw = dyᵀ · x ===  the trainer's --precision Wgrad recipe, on the high-precision x

A linear's backward never sees the Fprop operands' quantized copies -- each GEMM quantizes its
own operands from the high-precision originals (``model.linear``) -- so replacing the Fprop recipe
*is* fake quantization with a straight-through gradient: ``dL/dx`` and ``dL/dw`` are the trainer's
Dgrad and Wgrad of the upstream gradient (tested bit for bit). Replayed activations go through
``policy_linear``'s ``fprop_x`` hook (Fprop consumes the replayed values, exactly representable,
under an ``fp32`` x operand; Dgrad/Wgrad the input itself); K/V through ``SDPAttention.kv_format``
(``KVFormat.fake_quantize``, straight-through).

Why replay: rtn makes the trainer round *like* the rollout; the two still see slightly different
inputs (a KV-cache vs a recompute, another kernel's summation order, BF16 somewhere upstream, the
policy after a first mini-batch update), and an element near a rounding boundary rounds to the
other neighbour. Replaying the recorded direction gives the rollout's code wherever the trainer's
value is within a window of the rollout's (``precision.rounding_record``), so trainer and rollout
agree code for code instead of each being merely close to BF16.

Rows and positions: ``records[i]`` belongs to row ``i`` of every forward run inside
:meth:`RolloutQAT.trainer_forward` (the RolloutBatch's sequences, in order); a record's row ``t``
is the token at position ``t`` of prompt + response (the engine's prefill and decode steps,
``model.rollout_records``), and covers every token but the last sampled one (never run by the
engine). By default the trainer's slot ``t`` of row ``i`` holds that token (right padding, as
``pretrain.rl.attribution.sequences`` lays a batch out); ``valid`` (``[b, s]``, True on real
tokens) names another layout. Slots without a record (the last token, padding) round to nearest.

    qat = RolloutQAT(model, rollout.plan, "replay")            # --rollout-qat replay
    engine = Engine(model, vocab_size=V, rollout=rollout, record_layers=qat.record_layers)
    batch = engine.generate(prompts, params).rollout_batch()
    with qat.trainer_forward(batch.records, kv_amax=rollout.kv_amax):
        old_logprobs = ...                                     # the recompute
        loss.backward()                                        # the gradient pass(es)
    qat.update_plan(new_plan)                                  # after a rollout fallback

KV formats with a tensor-level scale (FP8, NVFP4): the rollout's cache uses per-head scales
calibrated on the prompts; pass them as ``kv_amax`` (``RolloutModel.kv_amax``) or the trainer
scales each head by the amax of its own call. Block KV formats (MX) need none.

Measured (the RL task's starting policy: 3 layers, hidden 128, head dim 32; 16 task prompts x 8
samples at temperature 1, 392 response tokens; mean ``k3_kl`` of the trainer's recompute against
the engine's log-probs, ``/tmp/exp/H3/measure.py`` of issue 15)::

    rollout                  trainer --precision   none     rtn   replay
    mxfp4 W4A4, BF16 KV      bf16                  0.127    0     0
                             wgrad_hadamard        0.047    0     0
    mxfp4 W4A4 + MXFP4 KV    bf16                  0.493    0     0
                             wgrad_hadamard        0.365    0     0

rtn and replay reproduce the engine's log-probs bit for bit (max |diff| 0: MX blocks lie within a
token, so a cached decode and a teacher-forced pass quantize the same numbers). They part once the
trainer's weights are not the rollout's -- the second mini-batch of a step, or a ppo epoch after
the first: every weight moved by a relative 1e-3 in a random direction changes a BF16 policy by
``k3`` 1.4e-4, the FP4 policy (rtn) by 0.050 (0.191 with the FP4 KV-cache; 95.1 / 93.7 % of the
activation codes still the rollout's); replay keeps 99.94 / 99.77 % of the codes and the gap at
2.2e-5 / 1.1e-3. So replay also pins the part of a genuine policy change that moves an
activation across a rounding boundary; whether that helps the RL update is what the sweep measures.

"Bit for bit" and rtn's residual. rtn reproduces the engine's log-probs only where the trainer's
input to each quantizer is the engine's bit for bit. On CPU the engine's decode GEMMs (one new
token against a KV-cache) and the trainer's teacher-forced GEMMs (the whole row at once) sum in
other orders, and an activation within a last bit of an FP4 rounding boundary then takes the other
code. Measured with the RL task's starting policy (MXFP4 rollout with the MXFP4 KV-cache, BF16
trainer, 32 prompts x 8 samples, the shared 2-core CPU): at iteration 0, 6 of 818 response tokens
differ by more than 1e-4 in log-prob under rtn (at most 0.059; ``k3`` 3.9e-6), none under replay
(max 3.6e-7, ``k3`` 6.9e-15); at iteration 1 neither has one (``k3`` 5.5e-15). replay differs from
rtn only in the activations' rounding, so those tokens are activation codes on the other side of a
boundary. That is the sweep's rtn ``k3_kl`` of 6e-5 (a mean over 100 iterations, with a trained
policy whose activations sit near boundaries more often) against replay's 9e-15.

Replay outside its window (the failure mode). The record names a direction, not an interval: replay
takes the trainer's own interval ``[lo', hi']`` and applies the recorded direction to it wherever
the trainer's value is ``window`` steps inside it. Once the trainer's value has moved to *another*
interval (the two inputs differ by more than about ``window`` grid steps), the direction lands on
the wrong interval and the code is neither the rollout's nor the trainer's own nearest: measured on
256 x 256 N(0, 1) activations in MXFP4 with additive noise on the trainer's copy (seed 0), 0 such
codes of 65,536 at noise 1e-4 and 2e-3, 1,231 at 5e-2 and 8,502 at 2e-1 (the rollout's code
then survives on 95.3 % and 54.9 %). Replay is for the numerics' last-bit differences and small
policy moves (a later mini-batch), not for a trainer that has moved far from the rollout: there,
``rtn`` or the correction (``pretrain.rl.objective``) are the honest choice (``test_qat.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch

from model.attention import core_attentions
from model.gpt import policy_linears
from model.rollout_plan import RolloutPlan
from model.rollout_records import ROUTED, select_recorded_linears
from precision.formats import QuantizedTensor, get_format
from precision.recipe import OperandFormat
from precision.rounding_record import DEFAULT_WINDOW, RoundingRecord, recordable_formats, replay_quantize

__all__ = ["QAT_MODES", "RolloutQAT"]

QAT_MODES = ("none", "rtn", "replay")
_FP32 = OperandFormat("fp32")


def _recordable(plan: RolloutPlan, name: str) -> bool:
    r = plan.fprop(name)
    return (r.a.fmt in recordable_formats() and not get_format(r.a.fmt).tensor_scaled and r.rotation == "none"
            and name != "output_layer")


class _Replay:
    """One linear's ``fprop_x`` inside a replay context: the recorded rows replayed, the rest
    rounded to nearest in the rollout's activation format."""

    def __init__(self, fmt: OperandFormat, records: list[RoundingRecord], valid: torch.Tensor | None,
                 window: float, keep_codes: bool):
        self.fmt, self.window, self.keep_codes = fmt, window, keep_codes
        self.counts = [r.shape[0] for r in records]
        self.valid = valid
        self.record = RoundingRecord.from_directions(  # all sequences' rows, one record
            records[0].fmt, 1, torch.cat([r.scales for r in records]), torch.cat([r.directions() for r in records]))
        self.codes: QuantizedTensor | None = None
        self._index: tuple | None = None

    def _slots(self, s: int, b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._index is not None and self._index[0] == (s, b, device):
            return self._index[1]
        if b != len(self.counts):
            raise RuntimeError(f"--rollout-qat replay: the forward has {b} rows, the records {len(self.counts)} "
                               "sequences; run one forward per batch of records (records[i] = row i)")
        slots, rows = [], []
        for i, n in enumerate(self.counts):
            if self.valid is None:
                where = torch.arange(n)
            else:
                where = torch.nonzero(self.valid[i].cpu())[:, 0][:n]
            if where.numel() < n or (n and int(where[-1]) >= s):
                raise RuntimeError(f"--rollout-qat replay: row {i} has a {n}-token record but the forward "
                                   f"runs {s} slots ({int(self.valid[i].sum()) if self.valid is not None else s} "
                                   "real tokens); records must come from this batch's generation")
            slots.append(where)
            rows.append(torch.full((n,), i, dtype=torch.long))
        index = (torch.cat(slots).to(device), torch.cat(rows).to(device))
        self._index = ((s, b, device), index)
        return index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise RuntimeError(f"--rollout-qat replay: a linear's input is {tuple(x.shape)}, expected [s, b, in]")
        s, b, _ = x.shape
        slot, row = self._slots(s, b, x.device)
        xf = x.detach().float()
        q_all = self.fmt.format.quantize(xf, OperandFormat(self.fmt.fmt, scale_rule=self.fmt.scale_rule), axis=-1)  # nearest
        out = q_all.dequantize(torch.float32)
        rec = self.record
        if rec.scales.device != x.device:
            rec = self.record = dataclasses.replace(rec, scales=rec.scales.to(x.device),
                                                    direction=rec.direction.to(x.device))
        q = replay_quantize(xf[slot, row], rec, window=self.window)
        out[slot, row] = q.dequantize(torch.float32)
        if self.keep_codes:
            self.codes = q
        return out.to(x.dtype)


class RolloutQAT:
    """Rollout-guided QAT over ``model`` for ``rollout_plan`` (module docstring).

    ``mode``: one of :data:`QAT_MODES` (``--rollout-qat``). ``replay_layers``: ``--precision-rule``
    selectors or names of the linears whose activations replay the rollout's rounding (``"all"``:
    every linear whose rollout activation format can be recorded: MXFP4/MXFP6, no rotation, not the
    output layer) (``--rollout-qat-layers``). ``kv``: fake-quantize K/V in the rollout's KV format.
    ``window``: replay's window in grid steps (``precision.rounding_record``; None: its default).
    ``keep_codes``: keep the replayed codes of the last forward (:meth:`replayed_codes`), a measurement.
    """

    def __init__(self, model, rollout_plan: RolloutPlan, mode: str, *, replay_layers: Sequence[str] = ("all",),
                 kv: bool = True, window: float | None = None, keep_codes: bool = False):
        if mode not in QAT_MODES:
            raise ValueError(f"--rollout-qat {mode!r}: unknown mode; valid: {', '.join(QAT_MODES)}")
        window = DEFAULT_WINDOW if window is None else float(window)
        if not 0.0 <= window < 0.5:
            raise ValueError(f"--rollout-qat-window {window}: must be in [0, 0.5) grid steps")
        if isinstance(replay_layers, str):
            replay_layers = [s.strip() for s in replay_layers.split(",") if s.strip()]
        if not replay_layers:
            raise ValueError("--rollout-qat-layers: empty; give 'all' or --precision-rule selectors (kind:fc1, "
                             "layers:0-3, globs)")
        self.model = model
        self.mode = mode
        self.replay_layers = tuple(replay_layers)
        self.kv = bool(kv)
        self.window = window
        self.keep_codes = keep_codes
        self.linears = policy_linears(model)
        self.attentions = core_attentions(model)
        self._replays: dict[str, _Replay] = {}
        self._selected: list[str] = []
        if mode == "replay":
            self._selected = self._select(rollout_plan)
        self.update_plan(rollout_plan)

    def _select(self, plan: RolloutPlan) -> list[str]:
        """The linears ``replay_layers`` chooses under the first plan (one-line errors)."""
        if self.replay_layers == ("all",):
            # routed experts run on a permuted, padded subset of the tokens: no per-position record (rtn)
            names = [n for n, _ in self.linears if n in plan.linears and _recordable(plan, n) and ROUTED not in n]
            if not names:
                raise ValueError(f"--rollout-qat replay: the rollout plan {plan.label} quantizes no linear's "
                                 "activations in a recordable format (mxfp4, mxfp6_*, no rotation); use "
                                 "--rollout-qat rtn")
            return names
        return list(select_recorded_linears(self.model, plan, self.replay_layers, "--rollout-qat-layers"))

    # ------------------------------------------------------------------------------------------
    def update_plan(self, rollout_plan: RolloutPlan) -> None:
        """Use ``rollout_plan`` from now on (e.g. after a rollout fallback moved layers to BF16);
        a chosen linear whose activations the new plan no longer quantizes recordably drops out of
        the replay (rtn for it: the new plan's Fprop)."""
        missing = [n for n, _ in self.linears if n not in rollout_plan.linears]
        if missing:
            raise ValueError(f"--rollout-qat: the rollout plan {rollout_plan.label} has no recipe for "
                             f"{', '.join(missing)}")
        if self.kv and self.attentions:
            rollout_plan.kv.check_head_dim(self.attentions[0].config.kv_channels, "--rollout-precision kv")
        self.plan = rollout_plan
        self.replayed: dict[str, OperandFormat] = {n: rollout_plan.fprop(n).a for n in self._selected
                                                   if _recordable(rollout_plan, n)}

    @property
    def record_layers(self) -> list[str] | None:
        """The linears ``Engine(record_layers=...)`` must record (None unless mode ``replay``)."""
        return list(self.replayed) if self.mode == "replay" else None

    # ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def trainer_forward(self, records: list[dict[str, RoundingRecord]] | None = None, *,
                        valid: torch.Tensor | None = None, kv_amax: Sequence[torch.Tensor | None] | None = None):
        """Inside: every forward of the model is the QAT forward of this mode (module docstring).
        ``records``: per row of the batch, ``{linear: RoundingRecord}`` as the engine returned them
        (``RolloutBatch.records``; mode ``replay`` only). ``valid``: ``[b, s]`` real-token slots of
        the trainer's layout (default: each row's tokens at slots ``0..``). ``kv_amax``: the
        rollout's calibrated per-head K/V amaxes per layer (``RolloutModel.kv_amax``). Everything
        (precision, hooks, KV settings) is restored on exit, also after an exception."""
        if self.mode == "none":
            yield self
            return
        replays = {}
        if self.mode == "replay" and self.replayed:  # (a fallback may have left nothing to replay: rtn)
            if not records:
                raise ValueError("--rollout-qat replay: no rounding records for this batch; generate with "
                                 "Engine(record_layers=qat.record_layers)")
            for n, fmt in self.replayed.items():
                rows = [r.get(n) for r in records]
                if any(r is None for r in rows):
                    raise ValueError(f"--rollout-qat replay: the batch's records lack {n}; generate with "
                                     "Engine(record_layers=qat.record_layers) after the last update_plan")
                replays[n] = _Replay(fmt, rows, valid, self.window, self.keep_codes)
        saved = [(m, m.precision, m.fprop_x) for _, m in self.linears]
        saved_kv = [(a, a.kv_format, a.kv_amax) for a in self.attentions]
        try:
            for name, m in self.linears:
                if m.precision is None:
                    raise RuntimeError(f"--rollout-qat: linear {name} has no precision recipe (apply the "
                                       "trainer's --precision plan first)")
                fprop = self.plan.fprop(name)
                if name in replays:
                    fprop = dataclasses.replace(fprop, a=_FP32)  # x arrives replayed, exactly representable
                    m.fprop_x = replays[name]
                m.precision = dataclasses.replace(m.precision, fprop=fprop)
            if self.kv:
                amax = list(kv_amax) if kv_amax is not None else [None] * len(self.attentions)
                for attn, fmt, a in zip(self.attentions, self.plan.kv_formats(len(self.attentions)), amax):
                    attn.kv_format, attn.kv_amax = fmt, a  # each layer's own KV format (the plan's KV rules)
            self._replays = replays
            yield self
        finally:
            for m, p, f in saved:
                m.precision, m.fprop_x = p, f
            for a, fmt, amax in saved_kv:
                a.kv_format, a.kv_amax = fmt, amax

    def replayed_codes(self) -> list[dict[str, QuantizedTensor]]:
        """Per sequence ``{linear: codes}`` the last replay forward gave the recorded rows (needs
        ``keep_codes``), laid out as ``Generation.record_codes`` -- to count agreeing codes."""
        if not self._replays or any(r.codes is None for r in self._replays.values()):
            raise ValueError("replayed codes: construct RolloutQAT(..., keep_codes=True) and run a replay forward")
        out = [{} for _ in next(iter(self._replays.values())).counts]
        for n, r in self._replays.items():
            start = 0
            for i, c in enumerate(r.counts):
                out[i][n] = QuantizedTensor(r.codes.fmt, r.codes.codes[start : start + c],
                                            r.codes.scales[start : start + c], 1)
                start += c
        return out


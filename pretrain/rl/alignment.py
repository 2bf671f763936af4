"""Rounding alignment on a real batch: the rollout records its FP4 activation roundings, the
trainer replays them (``precision.rounding_record``), and we count the codes that agree.

For the chosen linears (names or globs over ``model.gpt.policy_linear_names``) the rollout's
re-score of a batch (``pretrain.rl.attribution.score_logprobs`` under the rollout plan) captures
each linear's Fprop input ``x`` and records it in the rollout's activation format (block scales +
one direction bit per element). The trainer's forward on the same tokens (its own ``--precision``,
``--kv-quant``) captures its ``x'`` for the same linears; then, per linear::

    own     = code_agreement(quantize(x', fmt), q_rollout)      trainer's own scale and rounding
    replay  = code_agreement(replay_quantize(x', record), q_rollout)

with the record's size in bits per element. The inputs differ because everything upstream of the
linear differs (quantized weights and activations of earlier layers, the KV-cache); the first
linear of the first layer sees the same ``x`` in both (embeddings and a norm only) and agrees
100 % either way. Captured inputs include padding slots (both sides hold the same layout).

Measured (tests' tiny GPT, weights x3, 4 rows x 14 slots, MXFP4 rollout incl. MXFP4 KV-cache):
against a BF16 trainer 33-58 % of the codes agree, 42-65 % with replay; against a trainer with
the rollout's linear plan but FP32 K/V 49-72 % / 57-82 %; with ``--kv-quant mxfp4`` too, 100 %.
Far from the small-perturbation regime where replay restores every code (the pure tests), because
FP4 upstream moves these inputs by whole grid steps.

    rows = rounding_alignment(model, batch, vocab_size=V, rollout="mxfp4", layers=["*.linear_fc1"])
    print(alignment_table(rows))

With records the engine took while it generated (``Engine(record_layers=..., record_codes=True)``,
``model.rollout_records``) nothing is re-scored under the rollout: :func:`engine_alignment` runs the
trainer's forward on the batch and compares with the rollout's own codes, replaying its records.

    rows = engine_alignment(model, gen.rollout_batch(), gen.record_codes, engine.recorded, vocab_size=V,
                            trainer="bf16")
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Sequence

import torch

from model.gpt import policy_linears
from model.rollout import RolloutModel
from precision.quantize import quantize
from precision.rounding_record import code_agreement, record_rounding, recordable_formats, replay_quantize
from pretrain.rl.attribution import _plan, score_logprobs, sequences
from pretrain.rl.report import trainer_precision

__all__ = ["alignment_table", "capture_inputs", "engine_alignment", "rounding_alignment"]


@contextlib.contextmanager
def capture_inputs(model, names: Sequence[str]):
    """Inside: ``captured[name]`` is the last Fprop input ``[tokens, in]`` (float32) of each linear."""
    captured: dict[str, torch.Tensor] = {}
    modules = dict(policy_linears(model))
    handles = []
    for name in names:
        def hook(_module, args, name=name):
            x = args[0]
            captured[name] = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        handles.append(modules[name].register_forward_pre_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _select(model, layers: Sequence[str]) -> list[str]:
    names = [n for n, _ in policy_linears(model)]
    chosen = [n for n in names if any(n == p or fnmatch.fnmatchcase(n, p) for p in layers)]
    if not chosen:
        raise ValueError(f"rounding alignment: layers {list(layers)} match no linear; linears: {', '.join(names)}")
    return chosen


@torch.no_grad()
def rounding_alignment(model, batch, *, vocab_size: int, rollout: str, layers: Sequence[str],
                       rollout_rules: Sequence[str] = (), trainer: str = "bf16", trainer_rules: Sequence[str] = (),
                       kv_quant: str | None = None, window: float = 0.25) -> list[dict]:
    """Per chosen linear: ``{"layer", "format", "elements", "own", "replay", "bits_per_element"}``
    (module docstring). The linears' rollout activation format must be recordable
    (``precision.rounding_record.recordable_formats``) and unrotated."""
    plan = _plan(model, rollout, rollout_rules)
    names = _select(model, layers)
    fmts = {}
    for n in names:
        recipe = plan.fprop(n)
        if recipe.a.fmt not in recordable_formats() or recipe.rotation != "none":
            raise ValueError(f"rounding alignment: {n} runs x as {recipe.spec()} under --rollout-precision {rollout}; "
                             f"recordable: {', '.join(recordable_formats())} without a rotation")
        fmts[n] = recipe.a
    with capture_inputs(model, names) as x_roll:
        score_logprobs(model, batch, vocab_size=vocab_size, rollout=RolloutModel(model, plan))
    with trainer_precision(model, trainer, trainer_rules, kv_quant), capture_inputs(model, names) as x_train:
        score_logprobs(model, batch, vocab_size=vocab_size)
    rows = []
    for n in names:
        q_roll, rec = record_rounding(x_roll[n], fmts[n], axis=1)
        own = quantize(x_train[n], fmts[n], axis=1)
        rows.append({"layer": n, "format": str(fmts[n]), "elements": rec.numel,
                     "own": code_agreement(own, q_roll),
                     "replay": code_agreement(replay_quantize(x_train[n], rec, window=window), q_roll),
                     "bits_per_element": rec.bits_per_element})
    return rows


@torch.no_grad()
def engine_alignment(model, batch, codes: Sequence[dict] | None, formats: dict, *, vocab_size: int,
                     trainer: str | None = "bf16", trainer_rules: Sequence[str] = (), kv_quant: str | None = None,
                     window: float = 0.25) -> list[dict]:
    """:func:`rounding_alignment`'s rows for records taken by the engine while generating:
    ``batch.records`` (the replayed records), ``codes`` (``Generation.record_codes``, the rollout's
    own codes) per sequence and linear, ``formats`` the linears' activation formats
    (``Engine.recorded``: the trainer's own rounding uses them); the trainer (``trainer`` None: the
    model's own plan) runs one forward on the batch. Agreements are over all sequences' elements."""
    if not batch.records or codes is None:
        raise ValueError("engine alignment: the batch has no rounding records; generate with "
                         "Engine(record_layers=..., record_codes=True)")
    names = list(formats)
    tokens, valid, _ = sequences(batch)
    with trainer_precision(model, trainer, trainer_rules, kv_quant), capture_inputs(model, names) as x_train:
        score_logprobs(model, batch, vocab_size=vocab_size)
    rows = []
    for n in names:
        x = x_train[n].reshape(tokens.shape[1], tokens.shape[0], -1)  # [slots, b, in], as the forward ran
        own = replay = elements = bits = 0.0
        for i, (rec, q_roll) in enumerate(zip((r[n] for r in batch.records), (c[n] for c in codes))):
            x_i = x[:, i][valid[i]][: rec.shape[0]]  # prompt + response tokens the rollout ran
            m = rec.numel
            own += m * code_agreement(quantize(x_i, formats[n], axis=1), q_roll)
            replay += m * code_agreement(replay_quantize(x_i, rec, window=window), q_roll)
            elements += m
            bits += m * rec.bits_per_element
        rows.append({"layer": n, "format": str(formats[n]), "elements": int(elements),
                     "own": own / elements, "replay": replay / elements, "bits_per_element": bits / elements})
    return rows


def alignment_table(rows: list[dict]) -> str:
    lines = ["| linear | x format | elements | codes agreeing, own rounding | with replay | record bits/element |",
             "|---|---|---|---|---|---|"]
    lines += [f"| `{r['layer']}` | {r['format']} | {r['elements']} | {r['own']:.2%} | {r['replay']:.2%} "
              f"| {r['bits_per_element']:.3f} |" for r in rows]
    return "\n".join(lines)

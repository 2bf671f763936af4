"""Rollout weights: each linear's weight quantized once per policy update into packed storage.

A rollout plan (``model.rollout_plan``) gives every linear a Fprop recipe ``x@w[+rot]``. The
trainer quantizes ``w`` for Fprop at every call; a rollout engine quantizes it once, when the
policy's weights change, and keeps only the packed form::

    === FPROP: y = x · wᵀ ===            x [T, in] (each call)    w [out, in] (once per update)
        w  -> pad in to whole blocks/rotation groups -> rotate -> quantize -> PackedWeight
              codes  uint8 [out, in/2] for FP4 (two per byte, low nibble = even index), [out, in] else
              scales uint8 [out, in/block] (E8M0 for MX, E4M3 for NVFP4), FP32 per tensor for FP8;
                     2-D tiles (w ``/2d``): [out/tile, in/tile], one byte per square
              tensor_scale  NVFP4's FP32 g_enc
        x  -> the trainer's operand pipeline (kernels.operand.quantize_operand), every call
        y  =  FP32-accumulated GEMM of the dequantized operands (the emulated backend)

**Same bits as the trainer**: the weight is quantized by ``kernels.operand.quantize_operand`` --
the function the trainer's Fprop calls -- with the layer's own ``LayerQuantState`` (its TP layout,
so per-tensor scales come from the whole tensor's amax over the TP group), so the rollout's codes
and scales are the trainer's Fprop weight codes and scales in that format, bit for bit
(``tests/model/test_rollout.py``). Packing is ``precision.formats.Format.pack``.

    rollout = RolloutModel(model, plan)          # plan: model.rollout_plan.RolloutPlan
    rollout.update()                             # after each optimizer step: requantize, repack
    rollout.calibrate_kv(prompt_tokens)          # FP8 / NVFP4 KV-caches: per-head scales
    with rollout.active():                       # linears read packed weights, attention the KV format
        ...                                      # (model.generate.Engine does this itself)
    rollout.weight_bytes()                       # {"packed_linears": ..., "other": ...}
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kernels.gemm import fp32_gemm
from kernels.operand import pad_and_rotation, quantize_operand
from model.attention import core_attentions
from model.gpt import policy_linear_names, policy_linears
from model.rollout_plan import RolloutPlan, resolve_rollout_plan
from precision.formats import QuantizedTensor, get_format
from precision.recipe import Gemm, GemmRecipe
from precision.state import LayerQuantState

__all__ = ["PackedWeight", "RolloutModel", "pack_weight", "packed_rollout"]


def _no_weight(x2d: torch.Tensor) -> torch.Tensor:
    """A ``[0, in]`` stand-in for the other operand when only one of Fprop's is padded."""
    return x2d.new_empty(0, x2d.shape[1])


@dataclass
class PackedWeight:
    """One linear's Fprop weight in packed storage (see the module docstring)."""

    recipe: GemmRecipe  # Fprop: a = x (activations), b = w (weights), rotation
    codes: torch.Tensor
    scales: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    in_features: int  # before padding to whole blocks / rotation groups

    @property
    def fmt(self) -> str:
        return self.recipe.b.fmt

    def unpacked_codes(self) -> torch.Tensor:
        f = get_format(self.fmt)
        return f.unpack(self.codes) if f.packable else self.codes

    def values(self) -> torch.Tensor:
        """The dequantized weight, float32 ``[out, padded in]`` (what the emulated GEMM multiplies)."""
        codes, scales = self.unpacked_codes(), self.scales
        if self.recipe.b.block2d:  # one scale byte per square, repeated on the square's rows
            scales = scales.repeat_interleave(get_format(self.fmt).tile, dim=0)[: codes.shape[0]]
        q = QuantizedTensor(self.fmt, codes, scales, 1, tensor_scale=self.tensor_scale)
        return q.dequantize(torch.float32)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.tensor_scale)
                   if t is not None)

    def fprop(self, x: torch.Tensor, bias: torch.Tensor | None, state: LayerQuantState,
              backend: str = "emulated") -> torch.Tensor:
        """``y = x · wᵀ + bias`` with ``x`` through the trainer's operand pipeline (``x``'s dtype)."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("packed rollout weights run generation only (no autograd); detach the "
                               "rollout (RolloutModel.active) before training")
        x2d = x.reshape(-1, x.shape[-1])
        impl = "reference" if backend == "reference" else "auto"
        with state.read_only():
            call = state.next_call(Gemm.FPROP)
            xp, _, signs = pad_and_rotation(Gemm.FPROP, x2d, _no_weight(x2d), self.recipe, state, call)
            qx = quantize_operand(xp, 1, self.recipe.a, Gemm.FPROP, "x", state, call, impl=impl,
                                  rotation=self.recipe.rotation, signs=signs)
        # === FPROP: y = x @ w.T ===  [T, in] x [out, in] -> [T, out], FP32 accumulation
        y = fp32_gemm(Gemm.FPROP, qx.values, self.values())
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def pack_weight(w: torch.Tensor, recipe: GemmRecipe, state: LayerQuantState) -> PackedWeight:
    """Quantize ``w`` ``[out, in]`` once for Fprop under ``recipe`` -- the trainer's Fprop weight
    quantization (``quantize_operand(.., Gemm.FPROP, "w", ..)``), codes and scales -- and pack it.
    Under TP every rank calls it for the same layers in the same order (per-tensor amax collectives)."""
    w = w.detach()
    with state.read_only():
        call = state.next_call(Gemm.FPROP)
        _, wp, signs = pad_and_rotation(Gemm.FPROP, _no_weight(w), w, recipe, state, call)
        q = quantize_operand(wp, 1, recipe.b, Gemm.FPROP, "w", state, call, impl="reference",
                             rotation=recipe.rotation, signs=signs, codes=True)
    f = get_format(recipe.b.fmt)
    codes = f.pack(q.codes) if f.packable else q.codes
    scales = q.scales[:: f.tile].contiguous() if recipe.b.block2d else q.scales  # 2-D: one byte per square
    return PackedWeight(recipe, codes.contiguous(), scales, q.tensor_scale, w.shape[1])


class RolloutModel:
    """A policy GPT under a rollout plan: packed weights (requantized by :meth:`update`), the KV
    format and its calibrated per-head scales; :meth:`active` puts them into the model."""

    def __init__(self, model: torch.nn.Module, plan: RolloutPlan):
        self.model = model
        self.plan = plan
        self.linears = policy_linears(model)
        missing = [n for n, _ in self.linears if n not in plan.linears]
        if missing:
            raise ValueError(f"rollout plan has no recipe for linear layer(s): {', '.join(missing)}")
        self.attentions = core_attentions(model)
        head_dim = self.attentions[0].config.kv_channels if self.attentions else 0
        plan.kv.check_head_dim(head_dim, "--rollout-precision kv")
        self.kv_formats = plan.kv_formats(len(self.attentions))  # one per layer (KV rules: model.rollout_plan)
        for layer, fmt in enumerate(self.kv_formats):
            fmt.check_head_dim(head_dim, f"--rollout-precision kv (layer {layer})")
        self.packed: dict[str, PackedWeight] = {}
        self.kv_amax: list[torch.Tensor | None] = [None] * len(self.attentions)
        self.version = 0

    def _weight(self, name: str, module) -> torch.Tensor:
        if module.weight is not None:
            return module.weight
        return self.model.shared_embedding_or_output_weight()  # tied output layer

    @torch.no_grad()
    def update(self) -> None:
        """Quantize every linear's current weight into packed storage (once per policy update)."""
        self.packed = {name: pack_weight(self._weight(name, m), self.plan.fprop(name), m.quant_state)
                       for name, m in self.linears}
        for name, m in self.linears:  # inside active(): the linears read the new packed weights
            if m.rollout_weight is not None:
                m.rollout_weight = self.packed[name]
        self.kv_amax = [None] * len(self.attentions)  # per-head KV scales: recalibrate for the new weights
        self.version += 1

    @torch.no_grad()
    def calibrate_kv(self, forward) -> None:
        """Per-head K/V amaxes for a KV format with a tensor-level scale: ``forward()`` runs the model
        (e.g. a prefill of the prompts) while every core attention records the max |K|, |V| per head it
        sees; those become the per-head scales of the cache until the next calibration."""
        device = next(self.model.parameters()).device
        for attn in self.attentions:
            ng = attn.config.num_query_groups // attn.config.tensor_model_parallel_size
            attn.kv_observed = torch.zeros(2, ng, device=device)
        try:
            with self.active(kv_calibrated=False):
                forward()
        finally:
            observed = [attn.kv_observed for attn in self.attentions]
            for attn in self.attentions:
                attn.kv_observed = None
        self.kv_amax = observed

    @property
    def needs_kv_calibration(self) -> bool:
        return any(f.per_head_scale and a is None for f, a in zip(self.kv_formats, self.kv_amax))

    @contextlib.contextmanager
    def active(self, *, kv_calibrated: bool = True):
        """Inside: every linear reads its packed weight and every core attention quantizes keys and
        values in its layer's KV format of the plan (with the calibrated per-head scales). Restored after."""
        if not self.packed:
            self.update()
        saved = [(m, m.rollout_weight) for _, m in self.linears]
        saved_kv = [(a, a.kv_format, a.kv_amax) for a in self.attentions]
        try:
            for name, m in self.linears:
                m.rollout_weight = self.packed[name]
            for attn, fmt, amax in zip(self.attentions, self.kv_formats, self.kv_amax):
                attn.kv_format = fmt
                attn.kv_amax = amax if kv_calibrated else None
            yield self
        finally:
            for m, w in saved:
                m.rollout_weight = w
            for a, fmt, amax in saved_kv:
                a.kv_format, a.kv_amax = fmt, amax

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the packed linear weights, and of every other parameter (embeddings, norms,
        biases) at its own dtype -- a tied output layer's table counted once, under ``other``."""
        if not self.packed:
            self.update()
        packed = sum(p.nbytes for p in self.packed.values())
        linear_params = {id(m.weight) for _, m in self.linears if m.weight is not None}
        other = sum(p.numel() * p.element_size() for p in self.model.parameters() if id(p) not in linear_params)
        return {"packed_linears": packed, "other": other}


def packed_rollout(model: torch.nn.Module, cfg, value: str, rules=()) -> RolloutModel:
    """``model``'s rollout under ``--rollout-precision value`` and ``--rollout-precision-rule``
    ``rules`` (``cfg``: its ``ModelConfig``), weights packed -- what a generation tool starts with."""
    plan = resolve_rollout_plan(value, rules, policy_linear_names(model), cfg.num_layers,
                                cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads)
    rollout = RolloutModel(model, plan)
    rollout.update()
    return rollout

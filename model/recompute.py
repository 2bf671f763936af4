"""Activation recomputation through megatron-core's ``TransformerBlock``, on CPU and GPU.

    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    cfg = RecomputeConfig("full", "uniform", 1)       # -> TransformerConfig.recompute_* fields
    model = build_gpt(model_cfg, recompute=cfg)

``full`` recomputes whole transformer layers in the backward pass: ``uniform`` every layer, in
chunks of ``num_layers`` (one saved input per chunk); ``block`` only the first ``num_layers``
layers of each pipeline stage. ``selective`` recomputes core attention only (megatron's default
``recompute_modules = ["core_attn"]``), which holds no policy linear.

What megatron-core 0.16.1 does, and what we change
--------------------------------------------------
Megatron checkpoints with ``tensor_parallel.checkpoint``, a *reentrant* checkpoint: the first pass
runs without autograd, the backward pass restores the RNG states and runs the forward again with
autograd, then backpropagates through that recomputation. It saves and restores the CUDA RNG state
and megatron's CUDA RNG tracker, so it fails on CPU (``torch.cuda.get_rng_state``).
:func:`checkpoint` is megatron's function when the activations are on CUDA, and torch's reentrant
``torch.utils.checkpoint.checkpoint`` (CPU RNG state saved and restored, the same two passes)
otherwise. ``RecomputeTransformerBlock`` and ``model.spec``'s attention send megatron's two
checkpointed paths (``_checkpointed_forward``, ``_checkpointed_attention_forward``) through it.

Quantization: the same random numbers, one amax record
------------------------------------------------------
A checkpointed forward runs every policy linear's Fprop twice. The two passes must quantize
identically (stochastic rounding and resampled Hadamard signs are keyed by the Fprop *call index*,
``precision.state``) and the step must record each delayed-scaling amax and telemetry number once.
The reentrant scheme gives exactly that with the state's own rules:

* the first pass runs without autograd, so ``model.linear`` runs it **read-only**: it quantizes at
  the current call index and advances nothing, records nothing (as evaluation does);
* the recomputation runs with autograd inside the backward pass: an ordinary training call at the
  same index, which advances the counter and records the amax and statistics once.

With pipelining several micro-batches are in flight: their first passes all run before the first
recomputation. ``model.layers`` then gives the k-th outstanding first pass of a layer the call
index ``calls + k`` -- the one its recomputation will find, since backward passes run in forward
order -- so a recomputed run draws the numbers of the run without recomputation, call by call.
:func:`phase` tells a layer which pass it is in; the test is bit-identical losses and gradients
with and without recomputation (``tests/pretrain/test_recompute.py``, ``mxfp4_sr`` and
``hif8_w8a8``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Literal

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock

__all__ = ["RecomputeConfig", "RecomputeTransformerBlock", "checkpoint", "phase"]


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """Megatron-LM's ``--recompute-granularity`` / ``--recompute-method`` / ``--recompute-num-layers``."""

    granularity: Literal["full", "selective"]
    """``full``: whole transformer layers; ``selective``: core attention only."""
    method: Literal["uniform", "block"] | None = None
    """``full`` only. ``uniform``: every layer, in chunks; ``block``: the first layers of a stage."""
    num_layers: int | None = None
    """``full`` only. Layers per chunk (``uniform``) or recomputed layers per stage (``block``)."""

    def __post_init__(self):
        if self.granularity not in ("full", "selective"):
            raise ValueError(f"--recompute-granularity {self.granularity!r}: valid: full, selective")
        if self.granularity == "selective":
            if self.method is not None or self.num_layers is not None:
                raise ValueError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
            return
        if self.method not in ("uniform", "block"):
            raise ValueError(f"--recompute-method {self.method!r}: valid: uniform, block")
        if self.num_layers is None or self.num_layers < 1:
            raise ValueError(f"--recompute-num-layers {self.num_layers}: must be >= 1")

    def check(self, layers_per_stage: int) -> None:
        """Raise ValueError (one line, naming the flags) if this does not fit a stage of that many layers."""
        if self.granularity != "full":
            return
        n = self.num_layers
        if self.method == "uniform" and layers_per_stage % n:
            raise ValueError(f"--recompute-num-layers {n} does not divide the {layers_per_stage} layers per "
                             f"pipeline stage (--recompute-method uniform recomputes chunks of {n} layers)")
        if self.method == "block" and n > layers_per_stage:
            raise ValueError(f"--recompute-num-layers {n} exceeds the {layers_per_stage} layers per pipeline "
                             f"stage (--recompute-method block)")

    def transformer_config_fields(self) -> dict:
        """The ``TransformerConfig`` fields (megatron's names)."""
        fields = {"recompute_granularity": self.granularity, "recompute_method": self.method,
                  "recompute_num_layers": self.num_layers}
        if self.granularity == "selective":
            fields["recompute_modules"] = ["core_attn"]
        return fields


# ============================================================================================
# The checkpoint function, and which pass a layer is in
# ============================================================================================

_active = 0  # > 0 while a checkpointed function runs (its first pass or its recomputation)


@contextlib.contextmanager
def _running():
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def phase() -> Literal["first", "recompute"] | None:
    """Inside a checkpointed function: ``"first"`` (the pass without autograd) or ``"recompute"``
    (the pass in backward); None elsewhere."""
    if not _active:
        return None
    return "recompute" if torch.is_grad_enabled() else "first"


def checkpoint(function, *args):
    """Reentrant activation checkpoint of ``function(*args)`` (see the module docstring):
    megatron's ``tensor_parallel.checkpoint`` on CUDA, ``torch.utils.checkpoint`` otherwise."""

    def run(*inputs):
        with _running():
            return function(*inputs)

    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and first.is_cuda:
        return tensor_parallel.checkpoint(run, False, *args)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True, preserve_rng_state=True)


class RecomputeTransformerBlock(TransformerBlock):
    """megatron's ``TransformerBlock`` whose ``_checkpointed_forward`` (``recompute_granularity
    = "full"``) checkpoints through :func:`checkpoint`. ``uniform`` and ``block`` group layers as
    megatron does; megatron's FP8/FP4 contexts are not used (our linears quantize themselves).
    ``PolicyGPTModel`` gives its decoder this class (it adds no state)."""

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias, packed_seq_params, use_inner_quantization_context,
                              padding_mask=None):
        def chunk(start: int, end: int):
            def forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask):
                for index in range(start, end):
                    hidden_states, context = self._get_layer(index)(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                        inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask,
                    )  # fmt: skip
                return hidden_states, context

            return forward

        n, layers = self.config.recompute_num_layers, self.num_layers_per_pipeline_rank

        def inputs(hidden_states, context):
            return hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask

        if self.config.recompute_method == "uniform":
            for start in range(0, layers, n):
                hidden_states, context = checkpoint(chunk(start, min(start + n, layers)), *inputs(hidden_states, context))
        elif self.config.recompute_method == "block":
            for index in range(layers):
                run = chunk(index, index + 1)
                args = inputs(hidden_states, context)
                hidden_states, context = checkpoint(run, *args) if index < n else run(*args)
        else:
            raise ValueError(f"--recompute-method {self.config.recompute_method!r}: valid: uniform, block")
        return hidden_states

"""Tensor-parallel resharding of model state dicts: TP=n shards <-> the TP=1 state dict.

    full = merge_tp_shards([sd_rank0, sd_rank1], cfg)        # a TP=2 model's shards -> TP=1
    sd = split_tp(full, cfg, tp_size=4, tp_rank=1)           # TP=1 -> rank 1 of TP=4
    sds = reshard([sd_rank0, sd_rank1], cfg, new_tp=4)       # both: one state dict per new rank

A state dict here is an unwrapped ``PolicyGPTModel``'s ``state_dict()`` (the ``model`` entry of a
training checkpoint, ``_extra_state`` entries included). Megatron's ``parallel_state`` must be
initialized (any TP size): the layout is read off a small model.

Where each tensor is cut comes from megatron, not from names: ``tp_layout(cfg)`` builds a narrow
proxy of ``cfg`` (the same layers, norms, biases and embeddings, 32 wide per rank) and reads each
parameter's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` and the module
types (``model_layout``; ``pretrain.hf_convert`` applies the same to the real model). In
megatron-core 0.16.1 that gives:

    entry                                 cut along        TP rank r of n holds
    embedding.word_embeddings.weight      dim 0            vocabulary rows (padded for n)
    output_layer.weight (untied)          dim 0            vocabulary rows (padded for n)
    linear_qkv.weight, .bias              dim 0            query groups r*G/n, ... (G = num_query_groups)
    linear_fc1.weight, .bias (SwiGLU)     dim 0, stride 2  [gate_r; up_r]
    linear_fc1.weight, .bias (GeLU)       dim 0            output rows
    linear_proj.weight, linear_fc2.weight dim 1            input columns
    norms, row-parallel biases (linear_proj, linear_fc2), position table: whole on every rank

Layouts that are not a plain concatenation of shards:
  - fused QKV. Megatron orders ``linear_qkv`` rows by query group: [q heads of g; k_g; v_g]
    (``SelfAttention.get_query_key_value_tensors`` views the output as [G, (heads/G + 2) * hn]),
    and TP rank r holds G/n whole groups. Contiguous shards of the TP=1 tensor are whole groups, so
    dim 0 concatenation *is* right, GQA included (stride 1; tests/pretrain/test_reshard.py checks
    it against a real TP=2 run).
  - SwiGLU ``linear_fc1``. TP=1 is [gate; up]; each rank computes ``silu(chunk 0) * chunk 1`` of
    its own output, so rank r holds [gate_r; up_r]: the TP=1 tensor cut into 2n chunks of which
    rank r holds chunks r and n + r (megatron's ``partition_stride`` 2). Merging regroups them.
  - vocabulary. Megatron pads it to ``padded_vocab_size(cfg, n)`` rows, which depends on n. Rows
    past ``cfg.vocab_size`` are no token (evaluation drops their logits): resharding keeps them as
    far as the target's padded size reaches and zero-fills the rest, so TP=1 -> n -> 1 is exact.

Quantization state (each policy linear's ``_extra_state``: ``LayerQuantState.state_dict()``):
  - merge: ``seed``, ``name`` and the GEMM call counters ``calls`` are rank 0's (every rank runs the
    same GEMMs under the same seed and name, so they agree; stochastic-rounding draws depend on the
    operand's shape, so a resharded model does not replay the saved run's draws anyway). Amax
    histories (delayed scaling) become the elementwise maximum over shards (aligned at the newest
    entry; ``ema`` the maximum too), so that a per-tensor scale of the merged tensor covers every
    shard's part of it. Under TP every rank records the whole tensor's amax (the maximum over the
    TP group, ``LayerQuantState.amax_group``), so the histories agree across shards and the
    maximum changes nothing; checkpoints written before that recorded per-shard amaxes (then
    column-parallel linears agree on ``x``, row-parallel ones on ``dy``), and the maximum is what
    the merged tensor needs.
  - split: every rank gets a copy of the full state: the whole tensor's history, which is what
    every TP rank records.
Replicated parameters and any other entry are rank 0's on merge and the same on every rank on split.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import VocabParallelEmbedding

from model.gpt import MX_BLOCK, POLICY_LINEARS, ModelConfig, build_gpt, padded_vocab_size, validate_config

__all__ = [
    "ReshardError",
    "TensorLayout",
    "merge_quant_states",
    "merge_tp_shards",
    "model_layout",
    "reshard",
    "shard_tensor",
    "split_tp",
    "tp_layout",
]


class ReshardError(ValueError):
    """State dicts that cannot be resharded; the message names the entry and what did not fit."""


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one state-dict entry is distributed over tensor-parallel ranks."""

    dim: int | None = None  # megatron's partition_dim; None: the same on every rank
    stride: int = 1  # partition_stride: of n * stride chunks along dim, rank r holds r, n + r, ...
    vocab: bool = False  # dim 0 is the (padded) vocabulary
    quant: bool = False  # a policy linear's LayerQuantState (``_extra_state``)


# ================================================================================================
# Layout, from megatron's attributes
# ================================================================================================


def model_layout(model: torch.nn.Module) -> dict[str, TensorLayout]:
    """``{state-dict key: TensorLayout}`` of an unwrapped ``PolicyGPTModel`` (any TP size)."""
    vocab = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None and getattr(output_layer, "weight", None) is not None:
        vocab.add(id(output_layer.weight))  # GPTModel's logits layer: one output row per token
    quant = {f"{name}._extra_state" for name, m in model.named_modules() if isinstance(m, POLICY_LINEARS)}
    layout = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter) and getattr(value, "tensor_model_parallel", False):
            stride = getattr(value, "partition_stride", 1)
            layout[key] = TensorLayout(value.partition_dim, stride, vocab=id(value) in vocab)
        else:
            layout[key] = TensorLayout(quant=key in quant)
    return layout


def tp_layout(cfg: ModelConfig) -> dict[str, TensorLayout]:
    """``model_layout`` of ``cfg``'s model, read off a narrow proxy built at the current TP size.

    The proxy keeps every architecture switch of ``cfg`` (layers, norms, activation, positions,
    biases, tied embeddings) and shrinks the widths, heads and vocabulary; building it does not
    touch the caller's random number streams.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise ReshardError("resharding needs megatron's parallel_state initialized "
                           "(pretrain.evaluation.loading.init_single_process() in one process)")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ReshardError("resharding pipeline-parallel models is not supported (a stage holds some layers)")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    proxy_cfg = dataclasses.replace(
        cfg, hidden_size=MX_BLOCK * tp, ffn_hidden_size=MX_BLOCK * tp, num_attention_heads=tp,
        num_query_groups=tp, seq_length=2, vocab_size=tp, make_vocab_size_divisible_by=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        proxy = build_gpt(proxy_cfg)
    return model_layout(proxy)


def _check_keys(state_dicts: Sequence[dict], layout: dict[str, TensorLayout], what: str) -> None:
    for i, sd in enumerate(state_dicts):
        missing, unknown = sorted(set(layout) - set(sd)), sorted(set(sd) - set(layout))
        if missing or unknown:
            where = f"{what} {i}" if len(state_dicts) > 1 else what
            raise ReshardError(f"{where} does not fit the model config: missing {missing[:3]}, "
                               f"unexpected {unknown[:3]}")


# ================================================================================================
# Tensors
# ================================================================================================


def _repad_vocab(name: str, t: torch.Tensor, cfg: ModelConfig, rows: int) -> torch.Tensor:
    """``t`` with ``rows`` rows: its first ``rows`` (all real tokens among them), zeros past its end."""
    if t.shape[0] < cfg.vocab_size:
        raise ReshardError(f"{name} has {t.shape[0]} rows, fewer than the vocabulary's {cfg.vocab_size}")
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def shard_tensor(name: str, full: torch.Tensor, layout: TensorLayout, cfg: ModelConfig,
                 tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of the TP=1 tensor ``full`` (vocabulary padded or not).

    Vocabulary tables are first brought to ``padded_vocab_size(cfg, tp_size)`` rows. A
    tensor-parallel entry is cut along ``layout.dim`` into ``tp_size * layout.stride`` equal chunks
    of which the rank holds chunks ``tp_rank, tp_rank + tp_size, ...``; others are returned whole.
    """
    if layout.vocab:
        full = _repad_vocab(name, full, cfg, padded_vocab_size(cfg, tp_size))
    if layout.dim is None or tp_size == 1:
        return full
    pieces = tp_size * layout.stride
    if full.shape[layout.dim] % pieces:
        raise ReshardError(f"{name}: size {full.shape[layout.dim]} along dim {layout.dim} does not split "
                           f"into {pieces} equal chunks (TP {tp_size} x partition stride {layout.stride})")
    return torch.cat(full.chunk(pieces, dim=layout.dim)[tp_rank::tp_size], dim=layout.dim)


def _gather(name: str, shards: Sequence[torch.Tensor], layout: TensorLayout) -> torch.Tensor:
    """The inverse of ``shard_tensor`` over all ranks (vocabulary left padded for len(shards))."""
    n, dim, stride = len(shards), layout.dim, layout.stride
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ReshardError(f"{name}: shards have different shapes {sorted(shapes)}")
    if shards[0].shape[dim] % stride:
        raise ReshardError(f"{name}: shard size {shards[0].shape[dim]} along dim {dim} is not a multiple of "
                           f"its partition stride {stride}")
    chunks = [s.chunk(stride, dim=dim) for s in shards]  # rank r holds TP=1 chunks r, n + r, ...
    return torch.cat([chunks[k % n][k // n] for k in range(n * stride)], dim=dim)


# ================================================================================================
# Quantization state
# ================================================================================================


def merge_quant_states(states: Sequence[dict | None]) -> dict | None:
    """One ``LayerQuantState.state_dict()`` for the merged layer (rules in the module docstring)."""
    first = states[0]
    if first is None or any(s is None for s in states):  # saved before quantization state existed
        return copy.deepcopy(first)
    merged = copy.deepcopy({k: v for k, v in first.items() if k != "amax"})
    merged["amax"] = {}
    keys = dict.fromkeys(k for s in states for k in s.get("amax", {}))
    for key in keys:
        # histories: lists of floats (older checkpoints) or tensors (precision.state); merged as floats
        hists = [{**x, "history": [float(v) for v in x["history"]]}
                 for x in (s["amax"][key] for s in states if key in s.get("amax", {}))]
        h = copy.deepcopy(hists[0])
        longest = max(len(x["history"]) for x in hists)
        h["history"] = [max(x["history"][-back] for x in hists if len(x["history"]) >= back)
                        for back in range(longest, 0, -1)]
        emas = [float(x["ema"]) for x in hists if x.get("ema") is not None]
        h["ema"] = max(emas) if emas else None
        merged["amax"][key] = h
    return merged


# ================================================================================================
# State dicts
# ================================================================================================


def _merge_entry(name: str, lay: TensorLayout, parts: list, cfg: ModelConfig):
    n = len(parts)
    if lay.quant:
        return merge_quant_states(parts)
    if lay.dim is None:
        return parts[0]
    t = _gather(name, parts, lay) if n > 1 else parts[0]
    if lay.vocab:
        if t.shape[0] != padded_vocab_size(cfg, n):
            raise ReshardError(f"{name}: {n} shards hold {t.shape[0]} vocabulary rows, the config "
                               f"pads {cfg.vocab_size} to {padded_vocab_size(cfg, n)} at TP {n}")
        t = _repad_vocab(name, t, cfg, padded_vocab_size(cfg, 1))
    return t


def _split_entry(name: str, lay: TensorLayout, value, cfg: ModelConfig, tp_size: int, tp_rank: int):
    if lay.dim is not None:
        return shard_tensor(name, value, lay, cfg, tp_rank, tp_size)
    if lay.quant or not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    return value


def _merge(state_dicts: Sequence[dict], cfg: ModelConfig, layout: dict[str, TensorLayout]) -> dict:
    if not state_dicts:
        raise ReshardError("no state dicts to merge")
    _check_keys(state_dicts, layout, "TP shard")
    return {name: _merge_entry(name, lay, [sd[name] for sd in state_dicts], cfg)
            for name, lay in layout.items()}


def merge_tp_shards(state_dicts: Sequence[dict], cfg: ModelConfig) -> dict:
    """The TP=1 state dict of a model whose TP ranks' state dicts are ``state_dicts`` (in rank
    order); vocabulary tables padded for TP=1, ready for a TP=1 model's ``load_state_dict``."""
    return _merge(list(state_dicts), cfg, tp_layout(cfg))


def split_tp(full: dict, cfg: ModelConfig, tp_size: int, tp_rank: int) -> dict:
    """TP rank ``tp_rank`` of ``tp_size``'s state dict, from the TP=1 state dict ``full`` (its
    vocabulary tables padded for TP=1 or not padded at all)."""
    validate_config(cfg, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ReshardError(f"TP rank {tp_rank} is not in 0..{tp_size - 1}")
    layout = tp_layout(cfg)
    _check_keys([full], layout, "the TP=1 state dict")
    return {name: _split_entry(name, lay, full[name], cfg, tp_size, tp_rank) for name, lay in layout.items()}


def reshard(state_dicts: Sequence[dict], cfg: ModelConfig, new_tp: int,
            ranks: Iterable[int] | None = None) -> list[dict]:
    """The state dicts of a ``new_tp``-way model from those of its ``len(state_dicts)``-way shards;
    ``ranks`` (default all) picks which new ranks to build, in that order. Goes entry by entry, so
    besides the inputs and the results at most one merged (TP=1) tensor is held at a time."""
    validate_config(cfg, new_tp)
    ranks = list(range(new_tp)) if ranks is None else list(ranks)
    if any(not 0 <= r < new_tp for r in ranks):
        raise ReshardError(f"TP ranks {ranks} are not all in 0..{new_tp - 1}")
    if not state_dicts:
        raise ReshardError("no state dicts to reshard")
    layout = tp_layout(cfg)
    _check_keys(state_dicts, layout, "TP shard")
    out: list[dict] = [{} for _ in ranks]
    for name, lay in layout.items():
        full = _merge_entry(name, lay, [sd[name] for sd in state_dicts], cfg)
        for sd, r in zip(out, ranks):
            sd[name] = _split_entry(name, lay, full, cfg, new_tp, r)
    return out

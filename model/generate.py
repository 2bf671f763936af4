"""The generation engine: batched prefill + incremental decode over our megatron GPT, one for all.

lm-eval's ``generate_until`` (``pretrain.evaluation.lm_eval_adapter``), ``launch/generate.py`` and
RL rollouts all generate through :class:`Engine`::

    engine = Engine(model, vocab_size=tok.vocab_size)                   # the model's own linears
    engine = Engine(model, vocab_size=V, rollout=RolloutModel(model, plan))  # under a rollout plan
    out = engine.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=64,
                                                  stop_tokens=(tok.eod,), seed=1))
    out.tokens[i], out.logprobs[i]           # sampled ids and the log-prob of each under the
                                             # distribution actually sampled from
    batch = out.rollout_batch()              # padded tensors: prompt ids, response ids, log-probs, masks
    Engine(model, vocab_size=V).score(out.prompts, out.tokens)   # the trainer's log-probs of those tokens
    Engine(model, vocab_size=V, rollout=r, record_layers=["kind:fc1"]).generate(...).records  # TRACE
                                             # rounding records per prompt (``model.rollout_records``)

How a batch runs (TP >= 1, GQA, RoPE or learned absolute positions)::

    slots      0   1   2   3 | 4   5  ...       one column per step; every row writes the same slot
    row 0      p   p   p   p | g   g            (left padding, the default)
    row 1      .   .   p   p | g   g            '.' = padding: never attended to, no position
    positions  each row counts its own real tokens: row 1's prompt sits at 0, 1 and its first
               generated token at 2 -- RoPE rotates by these (per row), learned embeddings look them up
    prefill    one forward of all prompt slots; causal in slot order, padding keys masked, and a
               padding query attends to itself only (so nothing is fully masked)
    decode     one slot per step: the active rows' newest tokens; the KV-cache (``model.kv_cache``)
               holds every slot so far; finished rows leave the batch (and the cache)

Right padding (``padding="right"``) puts each prompt at slots ``0..n-1``; the first token is then
predicted at the row's own last prompt slot and generated tokens follow at the shared slots after
the longest prompt -- the gap is padding. Both layouts give every token the same position and the
same visible tokens, hence the same logits up to float rounding.

Emulated GEMMs on CPU run the eager reference quantizers while the engine generates (the same
bits as the fused ``torch.compile`` ones; decode shapes change at every step and every new shape
would be a recompile).

``use_cache=False`` recomputes every slot at every step (the oracle of the cached path): the same
masks, positions and KV quantization (``SDPAttention.kv_format`` fake-quantizes keys and values
as the cache stores them). Where the two can differ beyond float rounding, by design:

  * a per-tensor activation scale (``fp8`` and ``nvfp4`` rollout presets; FP8 / NVFP4 / HiF8
    Fprop recipes of the model's own plan): a decode step scales its activations by the amax of that
    step's tokens only, a recomputation by the amax of the whole prefix -- different codes;
  * otherwise (BF16, MX formats blocked per token along the in-features, weights quantized once,
    KV formats blocked per token or scaled per head from a calibration) every token's numbers are
    the same in both; CPU GEMMs of different shapes may still round differently in the last bit,
    which a rounding boundary can amplify (tests allow a near-tie).

Sampling (:func:`sample`): greedy (``temperature=0``), or temperature, then top-k, then top-p
(nucleus: the smallest set of most likely tokens whose probability reaches ``top_p``), drawn with a
``torch.Generator`` seeded from ``SamplingParams.seed``: the same seed gives the same tokens, on
every TP rank (each rank holds the all-gathered logits). A sampled token's log-prob is under the
distribution it was drawn from (after temperature, top-k and top-p); a greedy token's under the
model's own distribution (temperature 1, nothing filtered). Logits beyond ``vocab_size``
(megatron's vocabulary padding) never take part.

A row ends at a stop token (kept, with its log-prob), at ``max_new_tokens``, at the model's
``max_length`` (positions it was built for), or when ``stop_criteria(row, tokens)`` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model.attention import core_attentions
from model.gpt import policy_linears
from model.kv_cache import KVCache
from model.moe_replay import RoutedTokens, RoutingRecorder, moe_routers
from model.rollout_records import RoundingRecorder, select_recorded_linears

__all__ = ["Engine", "Generation", "RolloutBatch", "SamplingParams", "attention_mask", "forward_logits", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when a row stops."""

    temperature: float = 0.0
    """0: greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest most-likely set whose probability reaches top_p (1: all)."""
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    """A row ends after sampling one of these (the stop token is kept)."""
    seed: int = 0
    """Seeds the sampling generator; the same seed reproduces the same tokens."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@dataclass
class RolloutBatch:
    """Padded tensors of one generation, what a trainer re-scores (right-padded, ``[b, ...]``)."""

    prompt_ids: torch.Tensor  # [b, P] long, right-padded with 0
    prompt_mask: torch.Tensor  # [b, P] bool
    response_ids: torch.Tensor  # [b, R] long, right-padded with 0
    response_mask: torch.Tensor  # [b, R] bool
    rollout_logprobs: torch.Tensor  # [b, R] float32, 0 where masked
    records: list[dict] | None = None  # per row {linear: RoundingRecord} (Engine record_layers), else None
    routes: list[RoutedTokens] | None = None  # MoE policies: per row, each position's experts per layer


@dataclass
class Generation:
    """What :meth:`Engine.generate` returns, per prompt in the order given."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # generated ids (a final stop token included)
    logprobs: list[list[float]]  # log-prob of each generated id under the distribution sampled from
    finish_reasons: list[str]  # "stop" (a stop token), "length" (max_new_tokens / max_length), "criteria"
    last_logits: list[torch.Tensor | None] = field(default_factory=list)  # [vocab] float32 of each row's last step
    records: list[dict] | None = None  # Engine(record_layers=...): per prompt {linear: RoundingRecord}
    record_codes: list[dict] | None = None  # Engine(record_codes=True): per prompt {linear: QuantizedTensor}
    routes: list[RoutedTokens] | None = None  # MoE policies: per prompt, the experts each position chose

    def rollout_batch(self) -> RolloutBatch:
        def pad(rows, dtype):
            width = max([len(r) for r in rows] + [1])
            out = torch.zeros(len(rows), width, dtype=dtype)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for i, r in enumerate(rows):
                out[i, : len(r)] = torch.tensor(r, dtype=dtype)
                mask[i, : len(r)] = True
            return out, mask

        prompt_ids, prompt_mask = pad(self.prompts, torch.long)
        response_ids, response_mask = pad(self.tokens, torch.long)
        logprobs, _ = pad(self.logprobs, torch.float32)
        return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, self.records, self.routes)


# ================================================================================================
# Sampling
# ================================================================================================


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [b], logprobs [b])`` from float32 ``logits [b, vocab]`` (see the module docstring)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    z = logits / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.topk(params.top_k, -1).indices, True)
        z = z.masked_fill(~keep, float("-inf"))
    if params.top_p < 1:
        sorted_z, order = z.sort(-1, descending=True)
        probs = sorted_z.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= params.top_p
        drop_sorted[:, 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    logp = F.log_softmax(z, -1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


# ================================================================================================
# One forward over some slots
# ================================================================================================


def _rope(model, positions: torch.Tensor) -> torch.Tensor | None:
    """Per-row RoPE angles ``[s, b, 1, dim]`` for ``positions [b, s]`` (None: no RoPE)."""
    if getattr(model, "position_embedding_type", None) != "rope":
        return None
    table = model.rotary_pos_emb(int(positions.max()) + 1)  # [max_pos, 1, 1, dim]
    return table[:, 0, 0, :][positions.t()].unsqueeze(2)


def forward_logits(model, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                   pick: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits (all-gathered over TP, full padded vocabulary) of ``tokens [b, s]`` at
    ``positions [b, s]`` under ``attention_mask [b, 1, s, sk]`` (True = masked): ``[b, s, V]``, or
    ``[b, V]`` at slot ``pick[b]`` of each row. Megatron's own modules (embedding, decoder block,
    output layer) run; only the RoPE angles are per row (megatron's GPTModel rotates by ``0..s-1``).
    With KV-caches attached to the core attentions, ``sk`` counts the cached slots too."""
    hidden = model.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
    hidden = model.decoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=_rope(model, positions))
    if pick is not None:
        hidden = hidden[pick, torch.arange(hidden.shape[1], device=hidden.device)][None]  # [1, b, h]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=False)  # this rank's vocab shard
    group = model.output_layer.tp_group
    if group is not None and group.size() > 1:  # megatron's gather allocates on CUDA: gather here
        parts = [torch.empty_like(logits) for _ in range(group.size())]
        torch.distributed.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    logits = logits.transpose(0, 1).float()  # [b, s, V]
    return logits[:, 0] if pick is not None else logits


def attention_mask(key_valid: torch.Tensor, sq: int) -> torch.Tensor:
    """``[b, 1, sq, sk]`` bool, True = masked, for the last ``sq`` of ``sk`` slots as queries:
    padding keys masked, except that a padding query sees itself (never a fully masked row).
    Causality (slot order) is added by the core attention."""
    b, sk = key_valid.shape
    masked = ~key_valid[:, None, None, :].expand(b, 1, sq, sk).clone()
    q_pad = ~key_valid[:, sk - sq:]  # [b, sq]
    diag = torch.arange(sq, device=key_valid.device)
    masked[:, 0, diag, sk - sq + diag] &= ~q_pad
    return masked


# ================================================================================================
# The engine
# ================================================================================================


class Engine:
    """Generation over ``model`` (an unwrapped ``PolicyGPTModel``, this rank's TP shard).

    ``vocab_size``: the tokenizer's (logits beyond it are dropped). ``rollout``: a
    ``model.rollout.RolloutModel`` -- generation then runs its packed weights and KV format (FP8 /
    NVFP4 KV-caches are calibrated on the first batch's prompts if they have not been since the
    last ``update``); None runs the model's own precision plan with an unquantized cache.
    ``max_length``: positions the model supports (default: its ``max_sequence_length``).
    ``padding``: ``"left"`` or ``"right"`` (see the module docstring). ``pad_id``: the id padding
    slots hold (never attended to). ``use_cache=False``: recompute every step (the oracle).
    ``record_layers``: ``--precision-rule`` selectors or names of linears whose Fprop activation
    rounding is recorded while generating (needs ``rollout``; ``model.rollout_records``):
    ``Generation.records`` / ``RolloutBatch.records``, per prompt ``{linear: RoundingRecord}``;
    ``record_codes``: also ``Generation.record_codes``, the rollout's own codes (to measure agreement).
    A mixture-of-experts policy's generation also records, per prompt, the experts every MoE layer's
    router chose for each position it ran and the router's probabilities (``Generation.routes``,
    ``model.moe_replay.RoutedTokens``: the prompt, then every generated token but the last) -- what
    the trainer replays (``--routing-replay``) and compares with its own routing.
    """

    def __init__(self, model, *, vocab_size: int, rollout=None, max_length: int | None = None,
                 padding: str = "left", pad_id: int = 0, use_cache: bool = True,
                 record_layers: Sequence[str] = (), record_codes: bool = False):
        if padding not in ("left", "right"):
            raise ValueError(f"padding: unknown {padding!r}; valid: left, right")
        if not (model.pre_process and model.post_process):
            raise ValueError("generation needs the whole model on each rank: --pipeline-model-parallel-size 1 "
                             "(tensor parallelism is supported)")
        if model.config.sequence_parallel:
            raise ValueError("generation does not support --sequence-parallel (build the model without it)")
        self.model = model
        self.vocab_size = vocab_size
        self.rollout = rollout
        self.max_length = max_length or model.max_sequence_length
        self.padding = padding
        self.pad_id = pad_id
        self.use_cache = use_cache
        self.attentions = core_attentions(model)
        self.device = next(model.parameters()).device
        self.recorded = {}  # linear -> activation OperandFormat (record_layers)
        if record_layers:
            if rollout is None:
                raise ValueError("record_layers: rounding records are taken under a rollout plan; pass rollout=")
            self.recorded = select_recorded_linears(model, rollout.plan, record_layers)
        self.record_codes = record_codes
        self.moe = bool(moe_routers(model))  # MoE policy: Generation.routes records each position's experts

    # ---------------------------------------------------------------- context
    @contextlib.contextmanager
    def _running(self, with_rollout: bool = True):
        was_training = self.model.training
        self.model.eval()
        use = with_rollout and self.rollout is not None
        ctx = self.rollout.active() if use else contextlib.nullcontext()
        # Emulated GEMMs on CPU: the eager reference quantizers (the same bits). Decode shapes change
        # at every step, and each new shape would be a torch.compile recompile of the fused quantizer.
        swapped = [m for _, m in policy_linears(self.model) if m.gemm_backend == "emulated"]
        if self.device.type != "cpu":
            swapped = []
        for m in swapped:
            m.gemm_backend = "reference"
        try:
            with torch.no_grad(), ctx:
                yield
        finally:
            for attn in self.attentions:
                attn.kv_cache = None
            for m in swapped:
                m.gemm_backend = "emulated"
            self.model.train(was_training)

    def _new_cache(self) -> KVCache:
        cfg = self.attentions[0].config
        groups = cfg.num_query_groups // cfg.tensor_model_parallel_size
        # the format the core attentions quantize K/V in: the rollout plan's (set by RolloutModel.active),
        # or the model's own --kv-quant, or none
        fmt = [attn.kv_format for attn in self.attentions]  # per layer (a rollout plan's KV rules)
        amax = [attn.kv_amax for attn in self.attentions]
        act_bytes = next(self.model.parameters()).element_size()
        cache = KVCache(len(self.attentions), groups, cfg.kv_channels, fmt, amax, act_bytes)
        for attn, layer in zip(self.attentions, cache.layers):
            attn.kv_cache = layer
        return cache

    # ---------------------------------------------------------------- layout
    def _layout(self, prompts: list[list[int]]):
        """Padded ``tokens``, ``valid`` (real-token slots) ``[b, L]`` and each row's last prompt slot."""
        width = max(len(p) for p in prompts)
        tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        last = []
        for i, p in enumerate(prompts):
            start = width - len(p) if self.padding == "left" else 0
            tokens[i, start : start + len(p)] = torch.tensor(p, dtype=torch.long)
            valid[i, start : start + len(p)] = True
            last.append(start + len(p) - 1)
        return tokens.to(self.device), valid.to(self.device), torch.tensor(last, device=self.device)

    @staticmethod
    def _positions(valid: torch.Tensor) -> torch.Tensor:
        return (valid.long().cumsum(-1) - 1).clamp(min=0)

    def check_prompts(self, prompts: Sequence[Sequence[int]], what: str = "prompt") -> list[list[int]]:
        """Prompts as lists of ints; refuses an empty prompt or an id outside the vocabulary."""
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"{what} {i} is empty; generation needs at least one token")
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{what} {i}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
            if len(p) >= self.max_length:
                raise ValueError(f"{what} {i} has {len(p)} tokens; the model's positions end at {self.max_length}")
            out.append(p)
        return out

    # ---------------------------------------------------------------- calibration
    def calibrate_kv(self, prompts: list[list[int]]) -> None:
        """Per-head KV scales of the rollout's FP8 / NVFP4 cache from one uncached prefill of ``prompts``
        (at each policy update: ``RolloutModel.update`` clears them). The amax of each head is taken over
        every slot of the left/right-padded batch, padding slots included (they hold ``pad_id``)."""
        tokens, valid, last = self._layout(self.check_prompts(prompts))
        mask = attention_mask(valid, tokens.shape[1])
        with self._running(with_rollout=False):  # RolloutModel.calibrate_kv activates the rollout itself
            self.rollout.calibrate_kv(lambda: forward_logits(self.model, tokens, self._positions(valid), mask, last))

    # ---------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), *,
                 stop_criteria: Callable[[int, list[int]], bool] | None = None) -> Generation:
        """Generate after every prompt of one batch (see the module docstring); ``stop_criteria(row,
        tokens)`` may end a row early (after its newest token)."""
        prompts = self.check_prompts(prompts)
        if self.rollout is not None and self.rollout.needs_kv_calibration:
            self.calibrate_kv(prompts)
        n = len(prompts)
        out = Generation(prompts, [[] for _ in prompts], [[] for _ in prompts], ["length"] * n, [None] * n)
        recorder = RoundingRecorder(self.model, self.recorded, n, self.record_codes) if self.recorded else None
        router = RoutingRecorder(self.model, n) if self.moe else None
        recorders = [r for r in (recorder, router) if r is not None]
        if params.max_new_tokens and prompts:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            with self._running(), contextlib.ExitStack() as stack:
                for r in recorders:
                    stack.enter_context(r.attached())
                self._loop(prompts, params, stop_criteria, generator, out, recorders)
        if recorder is not None:
            out.records, out.record_codes = recorder.records(), recorder.codes()
        if router is not None and params.max_new_tokens and prompts:
            out.routes = router.records()
        return out

    def _loop(self, prompts, params, stop_criteria, generator, out: Generation, recorders=()) -> None:
        tokens, valid, last = self._layout(prompts)
        rows = list(range(len(prompts)))  # batch row -> prompt index
        cache = self._new_cache() if self.use_cache else None
        positions = self._positions(valid)
        for recorder in recorders:  # the prefill runs every prompt token
            recorder.expect(rows, valid)
        logits = forward_logits(self.model, tokens, positions, attention_mask(valid, tokens.shape[1]), last)
        if cache is not None:
            cache.advance(tokens.shape[1])
        next_pos = positions.gather(1, last[:, None])[:, 0] + 1
        while True:
            logits = logits[:, : self.vocab_size]
            new, logp = sample(logits, params, generator)
            keep = []
            for row, r in enumerate(rows):
                tok = int(new[row])
                out.tokens[r].append(tok)
                out.logprobs[r].append(float(logp[row]))
                out.last_logits[r] = logits[row]
                if tok in params.stop_tokens:
                    out.finish_reasons[r] = "stop"
                elif stop_criteria is not None and stop_criteria(r, out.tokens[r]):
                    out.finish_reasons[r] = "criteria"
                elif len(out.tokens[r]) < params.max_new_tokens and int(next_pos[row]) + 1 < self.max_length:
                    keep.append(row)
            if not keep:
                return
            index = torch.tensor(keep, device=self.device)
            rows = [rows[k] for k in keep]
            new, next_pos = new[index], next_pos[index]
            if len(keep) < valid.shape[0]:
                tokens, valid = tokens[index], valid[index]
                if cache is not None:
                    cache.keep_rows(keep)
            tokens = torch.cat([tokens, new[:, None]], 1)
            valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
            if recorders:  # each row's newest slot is new (cached decode runs only it)
                fresh = torch.zeros_like(valid[:, -1:] if cache is not None else valid)
                fresh[:, -1] = True
                for recorder in recorders:
                    recorder.expect(rows, fresh)
            if cache is not None:  # decode: one slot, the cache holds the rest
                mask = attention_mask(valid, 1)
                logits = forward_logits(self.model, new[:, None], next_pos[:, None], mask,
                                        torch.zeros_like(next_pos))
                cache.advance(1)
            else:  # recompute every slot
                width = tokens.shape[1]
                logits = forward_logits(self.model, tokens, self._positions(valid), attention_mask(valid, width),
                                        torch.full_like(next_pos, width - 1))
            next_pos = next_pos + 1

    # ---------------------------------------------------------------- re-scoring
    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              temperature: float = 1.0) -> list[list[float]]:
        """Log-prob of every response token after its prompt, ``log_softmax(logits / temperature)``,
        from one uncached forward of the padded batch (the same masks and positions as generation).
        With ``rollout=None`` that is the trainer's forward under the model's own plan -- what a
        trainer recomputes for the mismatch against the rollout's log-probs; with a rollout, its plan."""
        if temperature <= 0:
            raise ValueError(f"score: temperature must be > 0, got {temperature}")
        seqs = self.check_prompts([list(p) + list(r) for p, r in zip(prompts, responses)])
        tokens, valid, last = self._layout(seqs)
        with self._running():
            logits = forward_logits(self.model, tokens, self._positions(valid), attention_mask(valid, tokens.shape[1]))
        logp = F.log_softmax(logits[..., : self.vocab_size] / temperature, -1)
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            slots = torch.arange(len(r), device=logp.device) + int(last[i]) - len(r) + 1  # the response's slots
            out.append(logp[i, slots - 1].gather(-1, tokens[i, slots][:, None])[:, 0].tolist())
        return out

    def kv_bytes_per_token(self) -> float:
        """Stored KV-cache bytes of one token on this rank (every layer, K and V, block scales included)."""
        cfg = self.attentions[0].config
        fmt = (self.rollout.kv_formats if self.rollout is not None
               else [attn.kv_format for attn in self.attentions])  # per layer
        cache = KVCache(len(self.attentions), cfg.num_query_groups // cfg.tensor_model_parallel_size,
                        cfg.kv_channels, fmt, act_bytes=next(self.model.parameters()).element_size())
        return cache.bytes_per_token

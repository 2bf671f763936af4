"""Our GPT as an EleutherAI lm-evaluation-harness model (``lm_eval.api.model.LM``).

    lm = MegatronLM(model, tokenizer, seq_length=2048, batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=[...])

``model`` is an unwrapped TP=1 ``PolicyGPTModel`` with its precision plan applied (only the Fprop
recipes matter here); ``tokenizer`` has ``tokenize``, ``detokenize``, ``eod`` and ``vocab_size``
(``pretrain.data.Tokenizer`` or ``pretrain.evaluation.hf_tokenizer.HFTokenizer``).

Semantics follow lm-eval's ``HFLM`` so scores are comparable:
  - loglikelihood(context, continuation): trailing spaces of the context move to the
    continuation; the continuation's tokens are ``tokenize(context + continuation)`` minus the
    context's tokens; an empty context becomes ``[prefix_token_id]``. The input is the last
    ``seq_length + 1`` tokens of context + continuation minus the final one (truncation from the
    left); the result is the summed log-probability of the continuation tokens and whether each is
    the argmax.
  - loglikelihood_rolling(text): lm-eval's disjoint rolling windows of ``seq_length`` tokens, the
    first conditioned on ``prefix_token_id``; every token is scored exactly once.
  - generate_until(context, gen_kwargs): greedy, ``max_gen_toks`` new tokens at most (the context
    keeps its last ``seq_length - max_gen_toks`` tokens), stopping at the end-of-document token or
    at the first ``until`` string, which is cut off; an empty context becomes ``[prefix_token_id]``.
    Sampling is refused.
Logits beyond ``vocab_size`` (megatron's vocabulary padding) are dropped before the softmax.
Scoring batches are right-padded (causal attention: padding never reaches earlier positions) and
formed longest-first; so are generation batches.

Generation with a KV cache (``use_cache=True``, the default) is megatron-core's static-batch
inference: a ``StaticInferenceContext(batch, longest prompt + max_gen)`` passed to
``GPTModel.forward`` as ``inference_context``. megatron's ``Attention`` writes the new keys and
values into the context's ``[max_seq, batch, groups, head_dim]`` buffers (one pair per layer;
grouped-query: ``num_query_groups`` heads, not ``num_attention_heads``) and hands our core
attention (``model.attention.SDPAttention``) the keys and values of every position so far; with
``materialize_only_last_token_logits`` only the last position reaches the output layer. The one
CUDA-only piece on this path, megatron allocating those buffers on ``torch.cuda.current_device()``,
is replaced by ``model.attention.PortableSelfAttention``. megatron's ``TextGenerationController``
itself is not used (its constructor makes a CUDA generator, and it knows no ``until`` strings);
the adapter drives the loop the way that controller does for a static batch of prompts of
different lengths:

  - prefill: one causal forward of every row's first ``min(prompt lengths)`` tokens, positions
    ``0..n-1``; the context's ``sequence_len_offset`` then advances by ``n``;
  - decode: one token per row and step, all rows at the same position ``p``: rows whose prompt is
    longer than ``p`` feed their own next prompt token (its prediction is ignored), the others
    their greedy token. Once every row is past its prompt the context is put in decode mode.

So the cache never holds padding, every row's position ``t`` is its token ``t``, and no attention
mask is needed: prefill is plain causal attention, and in a decode step megatron passes
``no_mask`` (one query, the newest position, sees all cached keys). RoPE is applied at those
shared positions: megatron builds the rotary table for ``max_sequence_length`` and, with ``o`` =
``sequence_len_offset``, rotates the new queries by rows ``o..o+s-1`` and the cached keys (stored
un-rotated) by rows ``0..o+s-1``; learned absolute positions come from ``position_ids``. The cost
of this layout is that prompt tokens past the shortest prompt are read one step at a time;
batches are formed longest-first, so prompts in a batch have similar lengths. (Left padding would
need a padding mask, per-row RoPE offsets and care for fully masked padding queries; per-row
generation gives up batching.) A row that stops (end of document, an ``until`` string,
``max_gen_toks``) leaves the batch and the cache.

Numerics: cached and uncached generation run the same per-position computations in different
shapes (one prefill GEMM plus one-token GEMMs instead of the full prefix each step), so logits
agree to float rounding and greedy tokens agree except at near-ties. Under the precision policy
only Fprop runs: formats blocked along the contraction axis (MXFP4, MXFP8: blocks of 32
in-features within one token's row) quantize each token exactly as the full recomputation does.
Formats with a per-tensor scale (FP8 current scaling, NVFP4's global scale, HiF8 delayed scaling)
scale a decode step by that step's tokens only, or by an amax history that generation itself
updates, so there the cache legitimately changes the quantized numbers (recomputation already
depends on the batch's other rows the same way). ``use_cache=False`` (``launch/evaluate.py
--no-use-cache``) recomputes the whole prefix at every step: the oracle for the cached path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from megatron.core.inference.contexts.static_context import StaticInferenceContext


class MegatronLM(LM):
    """lm-eval ``LM`` over a TP=1 policy GPT and a Megatron-style tokenizer (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        seq_length: int,
        batch_size: int = 8,
        vocab_size: int | None = None,
        prefix_token_id: int | None = None,
        add_bos_token: bool = False,
        max_gen_toks: int = 256,
        use_cache: bool = True,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.batch_size = batch_size
        self.vocab_size = vocab_size or tokenizer.vocab_size
        bos = getattr(tokenizer, "bos", None)
        self.prefix_token_id = prefix_token_id if prefix_token_id is not None else (
            bos if bos is not None else tokenizer.eod)
        self.add_bos_token = add_bos_token
        self.max_gen_toks = max_gen_toks
        self.use_cache = use_cache
        self._device = torch.device(device) if device is not None else next(model.parameters()).device

    # ============================================================================================
    # Tokens and the model
    # ============================================================================================

    def tok_encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.tokenize(text))
        return [self.prefix_token_id] + ids if self.add_bos_token else ids

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """[b, max_len, vocab_size] float32 logits of right-padded ``rows``."""
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        tokens = tokens.to(self._device)
        position_ids = torch.arange(width, device=self._device).expand_as(tokens)
        logits = self.model(tokens, position_ids, None)  # [b, s, padded vocab]
        return logits[..., : self.vocab_size].float()

    def _batches(self, n: int, length) -> list[list[int]]:
        """Indices 0..n-1 longest first (``length(i)``), in chunks of ``batch_size``."""
        order = sorted(range(n), key=lambda i: -length(i))
        return [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), all greedy) for token pairs (context, continuation)."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # empty continuations stay so
        inputs, conts = [], []
        for ctx, cont in pairs:
            inp = (ctx + cont)[-(self.seq_length + 1) :][:-1]
            inputs.append(inp)
            conts.append(cont[-len(inp) :] if cont else [])  # a continuation longer than seq_length loses its head
        todo = [i for i in range(len(pairs)) if conts[i]]
        for batch in self._batches(len(todo), lambda k: len(inputs[todo[k]])):
            batch = [todo[k] for k in batch]
            logits = self._logits([inputs[i] for i in batch])
            for row, i in enumerate(batch):
                cont, n = conts[i], len(inputs[i])
                logp = F.log_softmax(logits[row, n - len(cont) : n], dim=-1)
                target = torch.tensor(cont, device=logp.device)
                ll = logp.gather(-1, target[:, None]).sum().item()
                results[i] = (ll, bool((logp.argmax(-1) == target).all()))
        return results

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context == "":
            return [self.prefix_token_id], list(self.tokenizer.tokenize(continuation))
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        if not ctx:  # a whitespace-only context
            return [self.prefix_token_id], whole
        return ctx, whole[len(ctx) :]

    # ============================================================================================
    # lm-eval's three request types
    # ============================================================================================

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self._score(pairs)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            rolling = lm_utils.get_rolling_token_windows(
                token_list=list(self.tokenizer.tokenize(text)),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.seq_length,
                context_len=1,
            )
            for window in map(lm_utils.make_disjoint_window, rolling):
                windows.append(window)
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, self._score(windows)):
            totals[k] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for indices in by_kwargs.values():
            gen_kwargs = dict(requests[indices[0]].args[1])
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = min(int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks)), self.seq_length - 1)
            if gen_kwargs.pop("do_sample", False) and float(gen_kwargs.get("temperature", 1.0)) > 0:
                raise ValueError("MegatronLM.generate_until is greedy only: the task asks for do_sample=True")
            keep = self.seq_length - max_gen  # context tokens kept (from the right)
            contexts = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in indices}
            contexts = {i: ids or [self.prefix_token_id] for i, ids in contexts.items()}
            for i, text in self._greedy(contexts, until, max_gen).items():
                outputs[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs  # type: ignore[return-value]

    def _greedy(self, contexts: dict[int, list[int]], until: list[str], max_gen: int) -> dict[int, str]:
        """Greedy continuations of ``contexts`` (by request index), cut at the first ``until`` string."""
        out: dict[int, str] = {}
        order = list(contexts)
        for batch in self._batches(len(order), lambda k: len(contexts[order[k]])):
            keys = [order[k] for k in batch]
            gens, _ = self._generate([contexts[i] for i in keys], until, max_gen)
            for i, gen in zip(keys, gens):
                text = self.tokenizer.detokenize(gen)
                cuts = [text.index(s) for s in until if s and s in text]
                out[i] = text[: min(cuts)] if cuts else text
        return out

    # ============================================================================================
    # Greedy generation: with megatron's static KV cache, or recomputing every prefix
    # ============================================================================================

    def _generate(
        self, prompts: list[list[int]], until: list[str], max_gen: int
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Greedy tokens generated after each (non-empty) prompt of one batch, and for each prompt the
        [vocab_size] float32 logits of its last greedy step (None if no step ran)."""
        if max_gen <= 0:
            return [[] for _ in prompts], [None] * len(prompts)
        if not all(prompts):
            raise ValueError("MegatronLM: generation needs a non-empty prompt (use [prefix_token_id])")
        generate = self._generate_cached if self.use_cache else self._generate_recompute
        return generate(prompts, until, max_gen)

    def _take(self, gen: list[int], tok: int, until: list[str], max_gen: int) -> bool:
        """Append the greedy token ``tok`` to ``gen`` unless it ends the document; False once done."""
        if tok == self.tokenizer.eod:
            return False
        gen.append(tok)
        if len(gen) >= max_gen:
            return False
        text = self.tokenizer.detokenize(gen)
        return not any(s and s in text for s in until)

    @torch.no_grad()
    def _generate_recompute(self, prompts, until, max_gen):
        """``_generate`` running the whole right-padded prefix through the model at every step."""
        gens: list[list[int]] = [[] for _ in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        active = list(range(len(prompts)))
        while active:
            logits = self._logits([prompts[r] + gens[r] for r in active])
            ends = torch.tensor([len(prompts[r]) + len(gens[r]) - 1 for r in active], device=logits.device)
            logits = logits[torch.arange(len(active), device=logits.device), ends]  # [b, vocab]
            greedy = logits.argmax(-1).tolist()
            still = []
            for row, r in enumerate(active):
                last[r] = logits[row]
                if self._take(gens[r], greedy[row], until, max_gen):
                    still.append(r)
            active = still
        return gens, last

    @torch.no_grad()
    def _generate_cached(self, prompts, until, max_gen):
        """``_generate`` with megatron's static KV cache: prefill to the shortest prompt, then one
        position per step for the whole batch (see the module docstring)."""
        lengths = [len(p) for p in prompts]
        context = StaticInferenceContext(len(prompts), max_sequence_length=max(lengths) + max_gen)
        gens: list[list[int]] = [[] for _ in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        rows = list(range(len(prompts)))  # batch row -> prompt
        inputs = [p[: min(lengths)] for p in prompts]  # prefill: the part every prompt has
        while True:
            logits = self._last_logits(inputs, context)  # [b, vocab]: predicts position `pos`
            greedy = logits.argmax(-1).tolist()
            pos = context.sequence_len_offset
            keep, inputs = [], []
            for row, r in enumerate(rows):
                if pos < lengths[r]:  # still reading its prompt: feed the prompt's own next token
                    keep.append(row)
                    inputs.append([prompts[r][pos]])
                    continue
                last[r] = logits[row]
                if self._take(gens[r], greedy[row], until, max_gen):
                    keep.append(row)
                    inputs.append([gens[r][-1]])
            if not keep:
                return gens, last
            if len(keep) < len(rows):
                rows = [rows[k] for k in keep]
                _keep_cache_rows(context, keep)
            if all(pos >= lengths[r] for r in rows):
                context.enable_decode_mode()  # megatron's flag: every row is generating

    def _last_logits(self, rows: list[list[int]], context: StaticInferenceContext) -> torch.Tensor:
        """[b, vocab_size] float32 logits at the last position of the equal-length ``rows``, which
        continue the positions cached in ``context``; advances ``context`` past them."""
        tokens = torch.tensor(rows, dtype=torch.long, device=self._device)
        offset = context.sequence_len_offset
        position_ids = torch.arange(offset, offset + tokens.shape[1], device=self._device).expand_as(tokens)
        # materialize_only_last_token_logits: the output layer sees the last position only
        logits = self.model(tokens, position_ids, None, inference_context=context, runtime_gather_output=True)
        context.increment_sequence_len_offset(tokens.shape[1])
        return logits[:, -1, : self.vocab_size].float()


def _keep_cache_rows(context: StaticInferenceContext, rows: list[int]) -> None:
    """Keep only batch ``rows`` of every layer's cached keys and values, in that order.

    megatron's ``StaticInferenceContext.swap_key_value_dict`` does this for a reordering but
    asserts the batch size is unchanged; here finished rows leave the batch.
    """
    for layer, (keys, values) in context.key_value_memory_dict.items():
        index = torch.tensor(rows, dtype=torch.long, device=keys.device)
        context.key_value_memory_dict[layer] = (keys[:, index], values[:, index])

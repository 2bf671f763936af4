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

Generation runs on the one generation engine, ``model.generate.Engine`` (greedy, the end-of-document
token as stop token, ``until`` strings as a stop criterion): batched prefill of the left-padded
prompts, then one token per step with the engine's KV-cache; each row's positions count its own
tokens, padding is masked, and a row that stops leaves the batch and the cache. ``use_cache=False``
(``launch/evaluate.py --no-use-cache``) recomputes the whole prefix at every step: the oracle for
the cached path.

Numerics: cached and uncached generation run the same per-position computations in different
shapes, so logits agree to float rounding and greedy tokens agree except at near-ties. Under the
precision policy only Fprop runs: formats blocked along the contraction axis (MXFP4, MXFP8: blocks
of 32 in-features within one token's row) quantize each token exactly as the full recomputation
does. Formats whose per-tensor scale comes from the tensor itself (FP8 current scaling, NVFP4's
global scale) scale a decode step by that step's tokens only, so there the cache legitimately
changes the quantized numbers (recomputation already depends on the batch's other rows the same
way). Delayed scaling (HiF8 QAT's ``max`` over 64 steps) is different: once the checkpoint holds an
amax history, the history sets the scale -- evaluation reads it and never changes it
(``precision.state``) -- so cached and recomputed steps quantize with the same scale, and only a
layer whose history is still empty falls back to the step's own amax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM

from model.generate import Engine, SamplingParams


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
    # Greedy generation on the engine (model.generate)
    # ============================================================================================

    def _generate(
        self, prompts: list[list[int]], until: list[str], max_gen: int
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Greedy tokens generated after each (non-empty) prompt of one batch (the end-of-document
        token not included), and for each prompt the [vocab_size] float32 logits of its last greedy
        step (None if no step ran)."""
        if max_gen <= 0:
            return [[] for _ in prompts], [None] * len(prompts)
        if not all(prompts):
            raise ValueError("MegatronLM: generation needs a non-empty prompt (use [prefix_token_id])")
        engine = Engine(self.model, vocab_size=self.vocab_size, use_cache=self.use_cache)
        stop = [s for s in until if s]

        def stop_at_until(_row: int, tokens: list[int]) -> bool:
            text = self.tokenizer.detokenize(tokens)
            return any(s in text for s in stop)

        out = engine.generate(prompts, SamplingParams(max_new_tokens=max_gen, stop_tokens=(self.tokenizer.eod,)),
                              stop_criteria=stop_at_until if stop else None)
        gens = [t[:-1] if reason == "stop" else t for t, reason in zip(out.tokens, out.finish_reasons)]
        return gens, out.last_logits

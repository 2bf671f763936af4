"""KV-cache greedy generation in the lm-eval adapter against full recomputation.

``MegatronLM(use_cache=True)`` generates on the engine (``model.generate``: left-padded batched
prefill, then one position per step with the KV-cache); ``use_cache=False`` recomputes every prefix
and is the oracle. Two tiny models, both from test_evaluate.py's fixtures (tokenizer, large init std):
Llama style (RoPE, RMSNorm, SwiGLU, 4 heads in 2 query groups) and GPT-2 style (learned absolute
positions, LayerNorm, GeLU, tied embeddings, biases). Prompts of different lengths share a batch.

Cached and recomputed logits differ by float rounding only (different GEMM shapes; CPU BLAS is
not row-invariant), so with exact ``F.linear`` GEMMs tokens must agree exactly. Under a quantized
plan operand rounding can amplify that noise, so there a row may legitimately diverge at a
near-tie: the first differing token must be within the logit tolerance of the greedy one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from precision import PrecisionPolicy
from pretrain.evaluation.lm_eval_adapter import MegatronLM
from tests.pretrain.test_evaluate import CFG, SEQ, _req, exact, tok  # noqa: F401 (fixtures)

STYLES = {
    "llama": {},
    "gpt2": {"num_query_groups": CFG["num_attention_heads"], "normalization": "LayerNorm",
             "activation": "gelu", "position_embedding": "learned_absolute", "untie_embeddings": False,
             "add_bias_linear": True},
}
TEXTS = ["import functools\n\ndef total_ordering(cls):\n    roots = {",  # longest first: one batch
         "class OrderedDict(dict):\n    def __init__(self",
         "from collections import deque",
         "def f(x):",
         "x",
         "("]
MAX_GEN = 12
# Allowed |cached - recomputed| logit error, relative to the largest logit: float rounding for exact
# GEMMs; a flipped BF16 / FP4 operand rounding (BF16 ulp: 2^-8) under a quantized plan.
REL_TOL = {"exact": 1e-5, "bf16": 5e-3, "mxfp4": 5e-3}


@pytest.fixture(scope="module", params=sorted(STYLES))
def styled(request, tok):  # noqa: F811 (fixture)
    request.getfixturevalue("world_of_one")
    cfg = ModelConfig(vocab_size=tok.vocab_size, **{**CFG, **STYLES[request.param]})
    torch.manual_seed(3)
    return build_gpt(cfg).eval(), cfg


def _with_plan(model, cfg, plan: str):
    names = policy_linear_names(model)
    apply_precision_plan(model, PrecisionPolicy.from_args(plan).resolve(names, cfg.num_layers))
    return model


@torch.no_grad()
def _direct_last(model, vocab: int, ids: list[int]) -> torch.Tensor:
    """Logits after the last of ``ids``: one unpadded sequence through the whole model."""
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, -1, :vocab].float()


def _prompts(tok) -> list[list[int]]:  # noqa: F811
    prompts = [tok.tokenize(t) for t in TEXTS]
    lengths = [len(p) for p in prompts]
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] == 1 and len(set(lengths)) > 3
    return prompts


def _generate(model, tok, use_cache: bool):  # noqa: F811
    lm = MegatronLM(model, tok, seq_length=SEQ, batch_size=len(TEXTS), use_cache=use_cache)
    return lm._generate(_prompts(tok), [], MAX_GEN)


def _check(model, cfg, tok, numerics: str) -> int:  # noqa: F811
    """Cached vs recomputed greedy tokens and last-step logits; returns the number of rows that
    diverged at a near-tie."""
    prompts = _prompts(tok)
    (gen_c, last_c), (gen_r, last_r) = _generate(model, tok, True), _generate(model, tok, False)
    near_ties = 0
    for p, a, b, la in zip(prompts, gen_c, gen_r, last_c):
        # the last step, at the cached path's own prefix: cached vs direct full recomputation
        want = _direct_last(model, cfg.vocab_size, p + (a[:-1] if len(a) == MAX_GEN else a))
        tol = REL_TOL[numerics] * float(want.abs().max())
        torch.testing.assert_close(la, want, rtol=0, atol=tol)
        ended_a, ended_b = a + [tok.eod] * (len(a) < MAX_GEN), b + [tok.eod] * (len(b) < MAX_GEN)
        k = next((i for i, (x, y) in enumerate(zip(ended_a, ended_b)) if x != y), None)
        if k is None:
            assert a == b
            continue
        assert numerics != "exact", f"cached tokens {a} != recomputed {b} with exact GEMMs"
        logits = _direct_last(model, cfg.vocab_size, p + a[:k])
        gap = float(logits[[ended_a[k], ended_b[k]]].diff().abs())
        assert gap <= 2 * REL_TOL[numerics] * float(logits.abs().max()), (k, gap, a, b)
        near_ties += 1
    assert all(la is not None for la in last_r) and sum(map(len, gen_c)) > 3 * MAX_GEN
    return near_ties


# ================================================================================================
# Cached == recomputed
# ================================================================================================


def test_cached_generation_equals_recompute_exact_gemms(styled, tok, exact):  # noqa: F811
    model, cfg = styled
    _check(_with_plan(model, cfg, "bf16"), cfg, tok, "exact")  # plan unused: F.linear GEMMs


@pytest.mark.parametrize("plan", ["bf16", "mxfp4"])
def test_cached_generation_equals_recompute_quantized(styled, tok, plan):  # noqa: F811
    model, cfg = styled
    near_ties = _check(_with_plan(model, cfg, plan), cfg, tok, plan)
    assert near_ties <= 1  # measured: 0 for both styles and plans on this machine


def test_generate_until_same_text_with_and_without_cache(styled, tok, exact):  # noqa: F811
    """Through lm-eval's request API: several batches, rows leaving the batch at different steps
    (``until`` strings, end of document, the token budget), an empty context."""
    model, cfg = styled
    _with_plan(model, cfg, "bf16")
    cached = MegatronLM(model, tok, seq_length=SEQ, batch_size=3)
    oracle = MegatronLM(model, tok, seq_length=SEQ, batch_size=3, use_cache=False)
    assert cached.use_cache
    free = oracle.generate_until([_req("generate_until", t, {"until": [], "max_gen_toks": MAX_GEN})
                                  for t in TEXTS])
    # the first row of each batch (longest prompt) stops after a few tokens, the others go on
    stops = [free[0][1:3], free[3][1:3]]
    assert all(len(s) == 2 for s in stops), free
    reqs = [_req("generate_until", t, {"until": stops, "max_gen_toks": MAX_GEN}) for t in TEXTS + [""]]
    reqs.append(_req("generate_until", TEXTS[0], {"until": "never", "max_gen_toks": 3}))
    got = cached.generate_until(reqs)
    assert got == oracle.generate_until(reqs)
    assert any(len(t) < len(f) for t, f in zip(got, free))  # some rows stopped early

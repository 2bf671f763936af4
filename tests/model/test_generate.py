"""The generation engine (``model.generate``) against independent computations.

Two tiny models (head dim 32, so every KV format's block divides it): Llama style (RoPE, GQA 2 heads
in 1 group, SwiGLU, RMSNorm) and GPT-2 style (learned absolute positions, LayerNorm, GeLU, tied
embeddings, biases). A large init std makes next-token distributions far from uniform.

Oracles: megatron's own ``GPTModel.forward`` on one unpadded sequence (the trainer's forward), each
prompt generated alone (no padding at all), and the engine's recompute-everything mode. Under the
``fp32`` plan GEMMs are exact FP32, so tokens must agree exactly and log-probs to float rounding.

Cached vs uncached under each rollout preset: ``bf16`` and ``mxfp4_w4a16`` (BF16 activations: one
rounding may flip by one BF16 step with the CPU library's GEMM kernel, ``BF16_FLIP_TOL``), ``mxfp4``
(MX blocks lie within one token's row: equal to float rounding), ``mxfp4+had16`` (one FP4 flip). Documented exceptions,
``fp8`` and ``nvfp4``: their activations carry a per-tensor scale (FP8's, NVFP4's FP32 global
scale) from the amax of the tokens in *that call* -- one decode step vs the whole prefix -- so the
quantized numbers legitimately differ; the same presets with BF16 activations (weights and KV-cache
still FP8 / NVFP4) agree, which pins the exception to the activation scale.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import set_kv_quant
from model.generate import Engine, SamplingParams, attention_mask, forward_logits, sample
from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names, policy_linears
from model.rollout import RolloutModel
from model.rollout_plan import resolve_rollout_plan
from precision import PrecisionPolicy

VOCAB = 100
CFG = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 2,
       "num_query_groups": 1, "seq_length": 48, "vocab_size": VOCAB, "init_method_std": 0.3}
STYLES = {
    "llama": {},
    "gpt2": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute",
             "untie_embeddings": False, "add_bias_linear": True, "num_query_groups": 2},
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [11, 12, 13, 14], [42]]
GREEDY = SamplingParams(max_new_tokens=5)
FLOAT_TOL = 1e-4  # log-probs of the same computation in other shapes (FP32 rounding; logits reach ~10)


def build(style: str, plan: str = "fp32", **extra):
    cfg = ModelConfig(**{**CFG, **STYLES[style], **extra})
    torch.manual_seed(0)
    model = build_gpt(cfg).eval()
    for _, m in policy_linears(model):  # the eager spec: no torch.compile of each oracle shape (same bits)
        m.gemm_backend = "reference"
    apply_precision_plan(model, PrecisionPolicy.from_args(plan).resolve(policy_linear_names(model), cfg.num_layers))
    return model, cfg


@pytest.fixture(scope="module", params=sorted(STYLES))
def styled(request):
    request.getfixturevalue("world_of_one")
    return build(request.param)


@pytest.fixture(scope="module")
def llama(world_of_one):
    return build("llama")


@pytest.fixture(scope="module")
def alone(styled):
    """Each prompt generated on its own: no padding, no other rows."""
    model, _ = styled
    return [Engine(model, vocab_size=VOCAB).generate([p], GREEDY) for p in PROMPTS]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@torch.no_grad()
def _trainer_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` from megatron's forward of the unpadded sequence."""
    ids = torch.tensor([prompt + response])
    logp = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :VOCAB].float().log_softmax(-1)
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(response)[:, None])[:, 0]


# ================================================================================================
# The engine's forward is megatron's
# ================================================================================================


@torch.no_grad()
def test_forward_logits_equal_gpt_forward(styled):
    model, _ = styled
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1])[None]
    want = model(ids, pos, None)[0].float()  # [s, V]
    got = forward_logits(model, ids, pos, attention_mask(torch.ones_like(ids, dtype=torch.bool), ids.shape[1]))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_attention_mask_padding_and_self():
    valid = torch.tensor([[False, True, True], [True, True, False]])
    m = attention_mask(valid, 3)[:, 0]  # True = masked; causality is the core attention's
    assert m[0].tolist() == [[False, False, False], [True, False, False], [True, False, False]]
    assert m[1].tolist() == [[False, False, True], [False, False, True], [False, False, False]]
    assert attention_mask(valid, 1)[:, 0, 0].tolist() == [[True, False, False], [False, False, False]]


# ================================================================================================
# Ragged prompts: left / right padding and cached / uncached equal generating each prompt alone
# ================================================================================================


@pytest.mark.parametrize("padding,use_cache", [("left", True), ("right", True), ("left", False)],
                         ids=["left-cached", "right-cached", "left-uncached"])
def test_batched_generation_equals_each_prompt_alone(styled, alone, padding, use_cache):
    model, _ = styled
    got = Engine(model, vocab_size=VOCAB, padding=padding, use_cache=use_cache).generate(PROMPTS, GREEDY)
    assert got.tokens == [a.tokens[0] for a in alone]
    assert _max_diff(got.logprobs, [a.logprobs[0] for a in alone]) < FLOAT_TOL
    assert len({tuple(t) for t in got.tokens}) == len(PROMPTS)  # rows really differ


def test_logprobs_are_the_trainers_on_the_sampled_tokens(styled):
    """Re-scoring prompt + response with megatron's forward gives the engine's greedy log-probs."""
    model, _ = styled
    out = Engine(model, vocab_size=VOCAB).generate(PROMPTS, GREEDY)
    for prompt, resp, lp in zip(PROMPTS, out.tokens, out.logprobs):
        torch.testing.assert_close(torch.tensor(lp), _trainer_logprobs(model, prompt, resp), rtol=0, atol=FLOAT_TOL)


# ================================================================================================
# Rollout presets: cached == uncached where the math allows (see the module docstring)
# ================================================================================================

# Log-prob tolerance, from what may differ between the cached and the uncached forward:
# * FLOAT_TOL: only FP32 summation order (the same exact operands in other shapes);
# * BF16_FLIP_TOL: a value rounded to BF16 (BF16 activations, or the BF16 operands of a rotation) may
#   land one BF16 step away when the CPU library's GEMM kernel for that shape sums in another order --
#   which kernel it picks depends on the CPU and library (measured for mxfp4_w4a16: 5.1e-3 on an
#   AVX-512 x86-64 CPU, with ATen's AVX-512 and AVX2 kernels alike; 0 on others). One BF16 step is at most 2^-7 relative (8 significant bits); carried to
#   a logit of magnitude LOGIT_MAX it moves that logit by LOGIT_MAX * 2^-7, and log_softmax moves by at
#   most twice the largest logit change;
# * FP4_FLIP_TOL: that flip may cross an FP4 rounding boundary (an E2M1 step, up to 1/3 relative at
#   1.5 -> 2) of one element of one block, much larger than a BF16 step but diluted by the GEMM it
#   enters: measured 2.7e-2 on one token (mxfp4+had16); 5e-2 leaves room.
# Tokens must be equal in every case.
LOGIT_MAX = 10.0  # the logits of this tiny model reach ~10 (as FLOAT_TOL says)
BF16_STEP = 2.0 ** -7  # the largest relative distance between neighbouring BF16 values
BF16_FLIP_TOL = 2 * LOGIT_MAX * BF16_STEP  # 0.156
FP4_FLIP_TOL = 5e-2
AGREE = {"bf16": BF16_FLIP_TOL, "mxfp4": FLOAT_TOL, "mxfp4+had16": FP4_FLIP_TOL, "mxfp4_w4a16": BF16_FLIP_TOL,
         "linear=bf16@fp8_e4m3,kv=fp8": BF16_FLIP_TOL, "linear=bf16@nvfp4,kv=nvfp4": BF16_FLIP_TOL}


def _rollout(model, cfg, spec: str) -> RolloutModel:
    plan = resolve_rollout_plan(spec, [], policy_linear_names(model), cfg.num_layers, 32)
    return RolloutModel(model, plan)


@pytest.mark.parametrize("spec", sorted(AGREE))
def test_cached_equals_uncached_under_rollout_presets(llama, spec):
    model, cfg = llama
    rollout = _rollout(model, cfg, spec)
    cached = Engine(model, vocab_size=VOCAB, rollout=rollout).generate(PROMPTS, GREEDY)
    uncached = Engine(model, vocab_size=VOCAB, rollout=rollout, use_cache=False).generate(PROMPTS, GREEDY)
    assert cached.tokens == uncached.tokens
    assert _max_diff(cached.logprobs, uncached.logprobs) <= AGREE[spec]


@pytest.mark.parametrize("padding", ["left", "right"])
def test_score_is_the_trainers_logprobs(llama, padding):
    """``Engine.score``: the trainer's log-probs of given responses from one padded batch forward."""
    model, _ = llama
    out = Engine(model, vocab_size=VOCAB).generate(PROMPTS, GREEDY)
    got = Engine(model, vocab_size=VOCAB, padding=padding).score(PROMPTS, out.tokens)
    assert _max_diff(got, out.logprobs) < FLOAT_TOL  # greedy: the model's own distribution
    hot = Engine(model, vocab_size=VOCAB).score(PROMPTS[:1], out.tokens[:1], temperature=2.0)[0]
    want = (model(torch.tensor([PROMPTS[0] + out.tokens[0]]), torch.arange(12)[None], None)[0, 6:11, :VOCAB]
            .float().div(2.0).log_softmax(-1).gather(-1, torch.tensor(out.tokens[0])[:, None])[:, 0])
    torch.testing.assert_close(torch.tensor(hot), want.detach(), rtol=0, atol=FLOAT_TOL)


def test_rollout_equals_trainer_forward_with_kv_quant(styled):
    """The trainer's own forward under the rollout's Fprop recipes with ``--kv-quant mxfp4`` re-scores
    the rollout's tokens with the rollout's log-probs: weights, activations and KV-cache alike."""
    model, cfg = styled
    rollout = _rollout(model, cfg, "mxfp4")
    out = Engine(model, vocab_size=VOCAB, rollout=rollout).generate(PROMPTS, GREEDY)
    apply_precision_plan(model, rollout.plan.linears)
    set_kv_quant(model, "mxfp4")
    try:
        for prompt, resp, lp in zip(PROMPTS, out.tokens, out.logprobs):
            want = _trainer_logprobs(model, prompt, resp)
            torch.testing.assert_close(torch.tensor(lp), want, rtol=0, atol=FLOAT_TOL)
        set_kv_quant(model, None)  # without the KV emulation the trainer sees other numbers
        want = _trainer_logprobs(model, PROMPTS[0], out.tokens[0])
        assert (torch.tensor(out.logprobs[0]) - want).abs().max() > 10 * FLOAT_TOL
    finally:
        set_kv_quant(model, None)
        apply_precision_plan(model, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(model),
                                                                              cfg.num_layers))


def test_models_own_kv_quant_is_the_caches_format(llama):
    """A model trained with ``--kv-quant mxfp4`` generates with an MXFP4 cache (no rollout plan): cached
    equals uncached, which fake-quantizes K/V in the core attention, and differs from no KV quantization."""
    model, _ = llama
    plain = Engine(model, vocab_size=VOCAB).generate(PROMPTS, GREEDY)
    set_kv_quant(model, "mxfp4")
    try:
        cached = Engine(model, vocab_size=VOCAB).generate(PROMPTS, GREEDY)
        uncached = Engine(model, vocab_size=VOCAB, use_cache=False).generate(PROMPTS, GREEDY)
        assert Engine(model, vocab_size=VOCAB).kv_bytes_per_token() == 2 * 2 * 1 * 32 * 4.25 / 8
    finally:
        set_kv_quant(model, None)
    assert cached.tokens == uncached.tokens and _max_diff(cached.logprobs, uncached.logprobs) < FLOAT_TOL
    assert _max_diff(cached.logprobs, plain.logprobs) > 10 * FLOAT_TOL


def test_fp8_kv_cache_needs_and_gets_calibration(llama):
    model, cfg = llama
    rollout = _rollout(model, cfg, "base=mxfp4,kv=fp8")
    assert rollout.needs_kv_calibration
    Engine(model, vocab_size=VOCAB, rollout=rollout).generate(PROMPTS, GREEDY)  # calibrates on the prompts
    assert not rollout.needs_kv_calibration and rollout.kv_amax[0].shape == (2, cfg.num_query_groups)
    assert all(bool((a > 0).all()) for a in rollout.kv_amax)
    rollout.update()  # a policy update: requantize weights, recalibrate the KV scales
    assert rollout.needs_kv_calibration


# ================================================================================================
# Sampling
# ================================================================================================


def test_sample_filters_and_logprobs_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    # top-p 0.7: the most likely tokens until their mass reaches 0.7 -> {0, 1}, renormalised 5/8, 3/8
    draws = [sample(logits, SamplingParams(temperature=1.0, top_p=0.7), g) for _ in range(400)]
    toks = torch.stack([t for t, _ in draws])[:, 0]
    assert set(toks.tolist()) == {0, 1}
    for t, lp in draws[:20]:
        assert float(lp) == pytest.approx(math.log({0: 5 / 8, 1: 3 / 8}[int(t)]), abs=1e-6)
    assert abs(float((toks == 0).float().mean()) - 5 / 8) < 0.08
    # top-k 3 at temperature 0.5: p ~ p_i^2 over {0, 1, 2}
    sq = torch.tensor([0.25, 0.09, 0.0225])
    t, lp = sample(logits, SamplingParams(temperature=0.5, top_k=3), g)
    assert int(t) in (0, 1, 2) and float(lp) == pytest.approx(math.log(sq[int(t)] / sq.sum()), abs=1e-6)
    # greedy: the argmax, with its log-prob under the model's own distribution
    t, lp = sample(logits, SamplingParams(), g)
    assert int(t) == 0 and float(lp) == pytest.approx(math.log(0.5), abs=1e-6)
    t, lp = sample(logits, SamplingParams(temperature=2.0, top_k=1), g)  # top-k 1 is greedy, log-prob 0
    assert int(t) == 0 and float(lp) == pytest.approx(0.0, abs=1e-7)


def test_sampling_is_reproducible_from_the_seed(llama):
    model, _ = llama
    engine = Engine(model, vocab_size=VOCAB)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=8, seed=11)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    other = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=8, seed=12))
    assert other.tokens != a.tokens
    assert all(lp <= 0 for row in a.logprobs for lp in row)


def test_stop_tokens_and_length_limits(llama):
    model, _ = llama
    engine = Engine(model, vocab_size=VOCAB)
    free = engine.generate(PROMPTS, GREEDY)
    stop = free.tokens[0][2]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, stop_tokens=(stop,)))
    first = free.tokens[0].index(stop)
    assert out.tokens[0] == free.tokens[0][: first + 1] and out.finish_reasons[0] == "stop"
    for row, reason in zip(out.tokens, out.finish_reasons):
        assert (reason == "stop") == (stop in row) and len(row) <= 6
    short = Engine(model, vocab_size=VOCAB, max_length=10).generate(PROMPTS, SamplingParams(max_new_tokens=20))
    assert [len(p) + len(t) for p, t in zip(PROMPTS, short.tokens)] == [10] * len(PROMPTS)
    crit = engine.generate(PROMPTS, GREEDY, stop_criteria=lambda r, toks: len(toks) == 2)
    assert [len(t) for t in crit.tokens] == [2] * len(PROMPTS) and set(crit.finish_reasons) == {"criteria"}
    batch = out.rollout_batch()
    assert batch.response_ids.shape == batch.rollout_logprobs.shape == batch.response_mask.shape
    assert batch.response_mask.sum(1).tolist() == [len(t) for t in out.tokens]
    assert batch.prompt_mask.sum(1).tolist() == [len(p) for p in PROMPTS]


def test_bad_prompts_are_refused(llama):
    model, _ = llama
    engine = Engine(model, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []])
    with pytest.raises(ValueError, match=r"token id 100 is outside the vocabulary \(0..99\)"):
        engine.generate([[1, 100]])
    with pytest.raises(ValueError, match="padding: unknown 'middle'; valid: left, right"):
        Engine(model, vocab_size=VOCAB, padding="middle")
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)

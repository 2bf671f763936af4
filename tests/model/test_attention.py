"""SDPAttention against a plain softmax(QKᵀ)V reference, megatron's layout [s, b, heads, dim]."""

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from model.attention import SDPAttention
from model.gpt import ModelConfig, transformer_config

pytestmark = pytest.mark.usefixtures("world_of_one")


def reference(q, k, v, masked):
    """q [sq,b,np,hn], k/v [sk,b,ng,hn]; masked [b|1, 1, sq, sk] True = masked out."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("with_mask", [False, True])
def test_causal_gqa_matches_reference(with_mask):
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=8,
        vocab_size=256,
    )
    attn = SDPAttention(
        transformer_config(cfg), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    s, b, hn = 8, 2, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, h, hn, generator=gen) for h in (4, 2, 2))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    mask = None
    if with_mask:  # an end-of-document mask on top of causality: keys < 3 hidden from queries >= 3
        mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
        mask[:, :, 3:, :3] = True
    out = attn(q, k, v, mask)
    expected = reference(q, k, v, causal | (mask if mask is not None else False))
    assert out.shape == (s, b, 4 * hn)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sq", [1, 3])
def test_queries_shorter_than_keys_are_the_last_positions(sq):
    """KV-cache decoding: sq new queries against sk cached keys are positions sk-sq..sk-1, so the
    causal mask aligns bottom-right (SDPA's is_causal would align top-left); a one-token decode
    step under megatron's no_mask sees every key. Both equal the last rows of full attention."""
    cfg = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, seq_length=8, vocab_size=256)
    attn = SDPAttention(
        transformer_config(cfg), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    sk, b, hn = 8, 2, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sk, b, h, hn, generator=gen) for h in (4, 2, 2))
    full = reference(q, k, v, torch.ones(sk, sk, dtype=torch.bool).triu(1)[None, None])
    torch.testing.assert_close(attn(q[-sq:], k, v, None), full[-sq:], rtol=1e-5, atol=1e-6)
    if sq == 1:
        decode = attn(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
        torch.testing.assert_close(decode, full[-1:], rtol=1e-5, atol=1e-6)

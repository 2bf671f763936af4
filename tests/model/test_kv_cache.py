"""The KV-cache's stored form (``model.kv_cache``) and the trainer's ``--kv-quant`` emulation.

Round trip per format against the registry's reference quantizer applied head by head along the
head dimension (no packing, no stacking, no cache); NUMERICS.md's golden vectors through the cache;
storage size; incremental writes equal one write; the straight-through gradient; the flag.
"""

from __future__ import annotations

import pytest
import torch

from model.kv_cache import KVCache, KVFormat, per_head_amax
from precision.formats import FORMATS
from precision.quantize import fake_quantize
from pretrain.arguments import ConfigError, model_config, parse_args_or_raise, validate_args

FORMATS_UNDER_TEST = list(FORMATS)  # every registry format


def _kv(seed=0, shape=(2, 5, 3, 32)):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g)
    t[0, 1, 2, 5] = 7.0  # an outlier in head 2
    return t


@pytest.mark.parametrize("fmt", FORMATS_UNDER_TEST)
def test_round_trip_equals_reference_per_head(fmt):
    t = _kv()
    kv = KVFormat(fmt)
    amax = per_head_amax(t) * torch.tensor([1.0, 0.5, 2.0])  # calibrated scales: one head clips
    got = kv.dequantize(kv.quantize(t, amax))
    for h in range(t.shape[-2]):
        ref_amax = amax[h] if FORMATS[fmt].tensor_scaled else None
        want = fake_quantize(t[..., h, :], fmt, axis=-1, amax=ref_amax)
        assert torch.equal(got[..., h, :], want), (fmt, h)


def test_golden_vectors_through_the_cache():
    head = torch.zeros(32)
    head[:8] = torch.tensor([7, 3.3, -1.26, 0.24, 0.26, 5, -2.5, 0.75])
    kv = KVFormat("mxfp4")
    out = kv.dequantize(kv.quantize(head.reshape(1, 1, 1, 32)))[0, 0, 0]
    assert out[:8].tolist() == [6, 3, -1.5, 0, 0.5, 4, -2, 1]  # OCP FLOOR, scale 0x7F
    nv = torch.zeros(1, 1, 1, 16)
    nv[..., 0], nv[..., 1] = 10.0, -1.7
    kv = KVFormat("nvfp4")
    stored = kv.quantize(nv, torch.tensor([100.0]))  # per-head amax 100, block amax 10
    assert int(stored["scales"].flatten()[0]) == 0x63  # 44.0
    torch.testing.assert_close(kv.dequantize(stored)[0, 0, 0, :2], torch.tensor([9.8214, -1.6369]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt,bits", [("bf16", 16), ("fp8", 8), ("mxfp8_e4m3", 8.25), ("mxfp6_e2m3", 6.25),
                                      ("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_stored_bits_per_element(fmt, bits):
    t = _kv()
    stored = KVFormat(fmt).quantize(t, per_head_amax(t))
    per_tensor = {"fp8": 3 * 4, "nvfp4": 3 * 4}.get(fmt, 0)  # one FP32 scale per head
    nbytes = sum(v.numel() * v.element_size() for v in stored.values() if v is not None) - per_tensor
    assert nbytes * 8 / t.numel() == bits
    cache = KVCache(num_layers=3, groups=2, head_dim=64, fmt=KVFormat(fmt))
    assert cache.bytes_per_token == 2 * 3 * 2 * 64 * bits / 8


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8", "bf16", None])
def test_incremental_writes_equal_one_write(fmt):
    kv = KVFormat(fmt) if fmt else None
    k, v = _kv(1, (6, 2, 3, 32)), _kv(2, (6, 2, 3, 32))  # [s, b, ng, hn]
    amax = torch.stack([per_head_amax(k), per_head_amax(v)])
    whole = KVCache(1, 3, 32, kv, [amax])
    k_all, v_all = whole.layers[0].update(k, v)
    steps = KVCache(1, 3, 32, kv, [amax])
    for a, b in ((0, 3), (3, 4), (4, 6)):
        k_got, v_got = steps.layers[0].update(k[a:b], v[a:b])
        steps.advance(b - a)
    assert torch.equal(k_got, k_all) and torch.equal(v_got, v_all) and k_got.shape == k.shape
    if kv is not None:
        assert torch.equal(k_all[:, :, 1], kv.fake_quantize(k, amax[0])[:, :, 1])
    steps.keep_rows([1])  # row 0 finished: only row 1 stays
    assert steps.layers[0].k["codes"].shape[0] == 1
    k_next, _ = steps.layers[0].update(k[:1, 1:], v[:1, 1:])
    assert torch.equal(k_next[:6], k_all[:, 1:]) and k_next.shape == (7, 1, 3, 32)


def test_fake_quantize_has_a_straight_through_gradient():
    t = _kv().requires_grad_()
    out = KVFormat("mxfp4").fake_quantize(t)
    assert not torch.equal(out, t)
    out.sum().backward()
    assert torch.equal(t.grad, torch.ones_like(t))


def test_per_head_formats_need_calibration():
    cache = KVCache(1, 3, 32, KVFormat("fp8"))
    with pytest.raises(RuntimeError, match="fp8_e4m3 needs calibrated per-head scales"):
        cache.layers[0].update(_kv(shape=(2, 2, 3, 32)), _kv(shape=(2, 2, 3, 32)))


def test_kv_quant_flag(tmp_path):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--ffn-hidden-size", "128",
            "--seq-length", "16", "--train-iters", "1"]
    args = parse_args_or_raise(base + ["--kv-quant", "mxfp4"])
    args = validate_args(args, 1, False)
    assert model_config(args, 100).kv_quant == "mxfp4"
    with pytest.raises(ConfigError, match=r"--kv-quant 'int4': unknown KV-cache format; valid: .*mxfp4") as e:
        validate_args(parse_args_or_raise(base + ["--kv-quant", "int4"]), 1, False)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"--kv-quant mxfp4: its 32-element blocks do not divide the head "
                                          r"dimension 16"):
        validate_args(parse_args_or_raise(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                             "--ffn-hidden-size", "128", "--seq-length", "16", "--train-iters", "1", "--kv-quant", "mxfp4"]), 1, False)


def test_kv_quant_in_the_training_forward(world_of_one):
    """``ModelConfig.kv_quant``: the training forward sees quantized K and V, gradients flow (STE)."""
    from model.attention import core_attentions
    from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
    from precision import PrecisionPolicy

    losses, grads = {}, {}
    for kv in (None, "mxfp4"):
        cfg = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=64, num_attention_heads=2,
                          num_query_groups=1, seq_length=8, vocab_size=64, kv_quant=kv)
        torch.manual_seed(0)
        model = build_gpt(cfg)
        apply_precision_plan(model, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(model), 1))
        assert [a.kv_format for a in core_attentions(model)] == [KVFormat(kv) if kv else None]
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, torch.arange(8)[None], None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        losses[kv] = float(loss)
        grads[kv] = model.decoder.layers[0].self_attention.linear_qkv.weight.grad.clone()
    assert losses[None] != losses["mxfp4"] and abs(losses[None] - losses["mxfp4"]) < 0.05
    assert torch.isfinite(grads["mxfp4"]).all() and not torch.equal(grads[None], grads["mxfp4"])
    cos = torch.nn.functional.cosine_similarity(grads[None].flatten(), grads["mxfp4"].flatten(), dim=0)
    assert cos > 0.9  # straight-through: the same direction, slightly different numbers

"""validate_config / ModelConfig errors: one line, naming the Megatron-LM flag."""

import dataclasses

import pytest

from model.gpt import padded_vocab_size, validate_config

from ._fakes import TINY_LLAMA

CFG = TINY_LLAMA


def test_valid_configs_pass():
    validate_config(CFG, 1)
    validate_config(CFG, 2)


@pytest.mark.parametrize(
    "changes, tp, message",
    [
        (
            {"num_attention_heads": 6, "num_query_groups": 6, "hidden_size": 96},
            4,
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        ({"num_query_groups": 3}, 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
        (
            {"num_query_groups": 2},
            4,
            "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        ({"hidden_size": 66}, 1,
         "--hidden-size 66 is not divisible by --num-attention-heads 4 (give the head size with --kv-channels)"),
        ({"kv_channels": 12}, 1, ("--kv-channels 12 x --num-attention-heads 4 / --tensor-model-parallel-size 1 = 48 "
                                  "per rank must be a positive multiple of 32 (MX block size along linear_proj's "
                                  "contraction)")),
        ({"hidden_size": 48}, 1, "--hidden-size 48 must be a multiple of 32 (MX block size)"),
        ({"ffn_hidden_size": 100}, 1, "--ffn-hidden-size 100 must be a multiple of 32 (MX block size)"),
        (
            {"ffn_hidden_size": 96},
            2,
            "--ffn-hidden-size 96 / --tensor-model-parallel-size 2 = 48 per rank must be a multiple of 32 (MX block size)",
        ),
    ],
)
def test_validate_config_errors(changes, tp, message):
    with pytest.raises(ValueError) as err:
        validate_config(dataclasses.replace(CFG, **changes), tp)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("normalization", "L2Norm", "--normalization"),
        ("activation", "relu", "--activation"),
        ("position_embedding", "alibi", "--position-embedding-type"),
    ],
)
def test_model_config_rejects_unknown_choices(field, value, flag):
    with pytest.raises(ValueError, match=f"^{flag} '{value}' is not one of"):
        dataclasses.replace(CFG, **{field: value})


def test_vocab_padding_follows_megatron():
    assert padded_vocab_size(CFG, 1) == 256
    assert padded_vocab_size(CFG, 2) == 256
    assert padded_vocab_size(dataclasses.replace(CFG, vocab_size=300), 1) == 384
    assert padded_vocab_size(dataclasses.replace(CFG, vocab_size=300), 2) == 512


# linear_qkv's Dgrad contracts over its per-rank output features, (heads + 2 groups) / TP x head dim
QKV_CASES = [  # (hidden, heads, groups, tp): per-rank Q/K/V width
    (64, 8, 2, 2),  # head dim 8: (4 + 2) x 8 = 48
    (192, 8, 2, 2),  # head dim 24: (4 + 2) x 24 = 144
]


@pytest.mark.parametrize("hidden, heads, groups, tp", QKV_CASES)
def test_qkv_shard_cutting_an_mx_block_is_refused_for_block_plans_only(hidden, heads, groups, tp):
    from model.gpt import validate_plan_shapes
    from precision import presets

    cfg = dataclasses.replace(CFG, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups)
    validate_config(cfg, tp)  # hidden and FFN sizes are fine: only linear_qkv's shard edge is not
    name = "decoder.layers.1.self_attention.linear_qkv"
    head_dim, per_rank = hidden // heads, (heads + 2 * groups) // tp * hidden // heads
    with pytest.raises(ValueError) as e:
        validate_plan_shapes(cfg, tp, {name: presets.get("mxfp4")})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--hidden-size {hidden} / --num-attention-heads {heads} = head dim "
                                              f"{head_dim}: {name} has")
    assert f"--tensor-model-parallel-size {tp} = {per_rank} output features per rank" in msg
    assert "32-element mxfp4 blocks of its Dgrad" in msg and "--num-query-groups" in msg
    for ok in ("bf16", "fp8", "hif8_w8a8", "mxfp4_fprop"):  # no block format in linear_qkv's Dgrad
        validate_plan_shapes(cfg, tp, {name: presets.get(ok)})
    validate_plan_shapes(cfg, 1, {name: presets.get("mxfp4")})  # TP=1: no shard edge
    if per_rank % 16 == 0:  # NVFP4's 16-element blocks fit where MX's 32 do not
        validate_plan_shapes(cfg, tp, {name: presets.get("nvfp4")})


def test_a_head_size_of_its_own_validates():
    """``--kv-channels`` (Qwen3: 128 whatever hidden / heads is): 6 heads of 32 on a width of 64."""
    from model.gpt import head_size, training_flops_per_token

    cfg = dataclasses.replace(CFG, hidden_size=64, num_attention_heads=6, kv_channels=32)
    validate_config(cfg, 1)
    assert head_size(cfg) == 32 and head_size(dataclasses.replace(cfg, num_attention_heads=4, kv_channels=None)) == 16
    # the attention GEMMs count 6 x 32 = 192 query/output features, not the width 64
    narrow = dataclasses.replace(cfg, kv_channels=None, num_attention_heads=4)
    extra = training_flops_per_token(cfg, 16, 256) - training_flops_per_token(narrow, 16, 256)
    q, kv, h, s = 192, CFG.num_query_groups * 32, 64, 16
    want = 3 * cfg.num_layers * (2 * h * (q + 2 * kv) + 2 * q * h + 4 * s * q
                                 - (2 * h * (64 + 2 * CFG.num_query_groups * 16) + 2 * 64 * h + 4 * s * 64))
    assert extra == want

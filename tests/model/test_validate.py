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
        ({"hidden_size": 66}, 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
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

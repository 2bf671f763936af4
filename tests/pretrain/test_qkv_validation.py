"""``launch/pretrain.py`` refuses, before anything starts, a TP size at which linear_qkv's shard edge
cuts an MX block of its Dgrad -- for plans that run that GEMM in a block format only."""

import pytest

from pretrain.arguments import ConfigError, parse_args, validate_args

from ._launch import TINY

HEAD_DIM_8 = ["--train-iters", "2", *TINY, "--hidden-size", "64", "--num-attention-heads", "8",
              "--num-query-groups", "2", "--ffn-hidden-size", "128", "--tensor-model-parallel-size", "2"]


def test_block_plan_is_refused_in_one_line_naming_the_flags():
    with pytest.raises(ConfigError) as e:
        validate_args(parse_args([*HEAD_DIM_8, "--precision", "mxfp4"]), world_size=2, cuda=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--hidden-size 64 / --num-attention-heads 8 = head dim 8: "
                          "decoder.layers.0.self_attention.linear_qkv has (8 heads + 2 x 2 --num-query-groups) "
                          "x 8 / --tensor-model-parallel-size 2 = 48 output features per rank")


@pytest.mark.parametrize("precision, rules", [("bf16", []), ("fp8", []),
                                              ("mxfp4", ["--precision-rule", "*.linear_qkv=fp8"])])
def test_plans_without_block_formats_there_pass(precision, rules):
    validate_args(parse_args([*HEAD_DIM_8, "--precision", precision, *rules]), world_size=2, cuda=False)

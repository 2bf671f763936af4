"""Test doubles for the precision core, so these tests exercise the model wiring independently
of the numerics (``precision``/``kernels`` have their own tests).

``FakeRecipe`` stands in for ``precision.LinearPrecision`` (frozen, readable ``str``);
``ReferenceLinear`` replaces ``model.layers.policy_linear`` with ``F.linear`` and records which
recipe each call received. ``TINY_LLAMA`` is the small Llama-style shape these tests build.
"""

import dataclasses

import torch.nn.functional as F

from model.gpt import ModelConfig

# 2 layers, hidden 64, GQA 4 heads / 2 groups, SwiGLU 128, 32 tokens, vocabulary 256
TINY_LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=32,
    vocab_size=256,
)


@dataclasses.dataclass(frozen=True)
class FakeRecipe:
    name: str

    def __str__(self) -> str:
        return f"fake[{self.name}]"


class ReferenceLinear:
    """``policy_linear(x, w, precision, bias, *, state, backend)`` as ``F.linear``; records each precision."""

    def __init__(self):
        self.seen = []

    def __call__(self, x, w, precision, bias=None, **kwargs):
        self.seen.append(precision)
        return F.linear(x, w, bias)


def plan_for(model):
    """One distinct FakeRecipe per policy linear, named after the layer."""
    from model.gpt import policy_linear_names

    return {name: FakeRecipe(name) for name in policy_linear_names(model)}

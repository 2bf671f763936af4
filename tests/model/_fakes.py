"""Test doubles for the precision core, so these tests exercise the model wiring independently
of the numerics (``precision``/``kernels`` have their own tests).

``FakeRecipe`` stands in for ``precision.LinearPrecision`` (frozen, readable ``str``);
``ReferenceLinear`` replaces ``model.layers.policy_linear`` with ``F.linear`` and records which
recipe each call received.
"""

import dataclasses

import torch.nn.functional as F


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

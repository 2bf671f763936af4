import pytest

from tests._dist import free_port  # noqa: F401 (re-exported for the tests of this package)


@pytest.fixture
def reference_linear(monkeypatch):
    """Route every policy linear through F.linear (recording the recipes it is handed)."""
    import model.layers

    from ._fakes import ReferenceLinear

    ref = ReferenceLinear()
    monkeypatch.setattr(model.layers, "policy_linear", ref)
    return ref

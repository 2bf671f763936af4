"""Subprocess budgets of the multi-process tests grow with the machine's load, within a bound."""

import sys

import pytest

from tests import _dist


@pytest.mark.parametrize(("load", "cores", "factor"), [(0.3, 2, 1.0), (4.0, 2, 2.0), (100.0, 2, _dist.MAX_SCALE)])
def test_timeout_scales_with_load_and_is_bounded(monkeypatch, load, cores, factor):
    monkeypatch.setattr(_dist.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(_dist.os, "cpu_count", lambda: cores)
    assert _dist.scaled_timeout(240) == pytest.approx(240 * factor)


def test_a_timeout_says_its_budget_and_load(monkeypatch):
    monkeypatch.setattr(_dist.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    with pytest.raises(AssertionError, match=r"budget 0 s x load factor 1\.00, capped at 4x\): .*sleep"):
        _dist.run_scaled([sys.executable, "-c", "import time; time.sleep(30)"], 0.3, capture_output=True)

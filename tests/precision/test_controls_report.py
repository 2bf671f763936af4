"""``python -m precision.controls_report``: runs, and its numbers say what the controls promise."""

import pytest
import torch

from precision import controls_report as cr


def _by_name(dist: str, role_shape=(256, 256), axis=1, draws=4):
    x = cr.sample(dist, role_shape, 0)
    return {c.name: cr.measure(x, axis, c, draws) for c in cr.CONTROLS}


@pytest.mark.parametrize("dist", ["gaussian", "student_t3"])
def test_measurements_rank_the_controls(dist):
    m = _by_name(dist)
    assert m["nvfp4 4over6"]["sqnr_db"] > m["nvfp4 nearest"]["sqnr_db"]
    assert m["nvfp4 4over6"]["rel_block_max"] < m["nvfp4 nearest"]["rel_block_max"]
    assert m["nvfp4 eden rht16_resample"]["sqnr_db"] > m["nvfp4 sr rht16_resample"]["sqnr_db"] + 2.0
    assert m["nvfp4 sr"]["sqnr_db"] < m["nvfp4 nearest"]["sqnr_db"]
    for name, v in m.items():
        assert 0 < v["rel_p50"] <= v["rel_p90"] <= v["rel_p99"], name
        assert (v["bias_se"] > 0) == cr.CONTROLS[[c.name for c in cr.CONTROLS].index(name)].draws, name


def test_a_rotation_is_undone_exactly():
    x = cr.sample("gaussian", (64, 96), 1)
    ident = cr.Control("fp32 had32", cr.OperandFormat("fp32"), "had32")
    back, seen = cr.quantize_back(x, 0, ident, 0)
    assert torch.allclose(back, x, atol=1e-5) and not torch.allclose(seen, x)
    rht = cr.Control("fp32 rht16", cr.OperandFormat("fp32"), "rht16_resample")
    assert torch.allclose(cr.quantize_back(x, 1, rht, 3)[0], x, atol=1e-5)


def test_main_prints_the_table_and_names_the_machine(monkeypatch, capsys):
    monkeypatch.setattr(cr, "OPERANDS", {"x": ((64, 64), 1), "dy": ((64, 32), 0)})
    assert cr.main(["--dist", "gaussian", "--draws", "2"]) == 0
    out = capsys.readouterr().out
    assert "| x | nvfp4 4over6 |" in out and "| dy | mxfp4 quest had32 |" in out and "CPU cores" in out
    with pytest.raises(SystemExit):
        cr.main(["--draws", "1"])


def test_bias_is_the_projection_of_x_hat_minus_x():
    # QuEST clips at 1.5-2.9 sigma: a shrinkage, so its projection is negative; MS-EDEN's is ~0
    m = _by_name("gaussian", draws=8)
    assert m["mxfp4 quest had32"]["bias"] < -0.02
    eden = m["nvfp4 eden rht16_resample"]
    assert abs(eden["bias"]) < 4 * eden["bias_se"] + 1e-4

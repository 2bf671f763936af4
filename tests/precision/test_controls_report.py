"""``python -m precision.controls_report``: runs, and its numbers say what the controls promise."""

import math

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


def test_checkpoint_table_pools_the_tensors_a_control_divides():
    """A row pools its operand's tensors (SQNR: summed signal over summed noise, computed here from
    the quantizer directly) over those whose contraction length the block and rotation divide."""
    from precision.quantize import quantize

    a, b = cr.sample("student_t3", (32, 64), 5), cr.sample("gaussian", (32, 256), 6)
    out = cr.checkpoint_table({"x": [("a", a), ("b", b)], "w": [("a", a)], "dy": [("a", a.T.contiguous())]}, 2)
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in out.splitlines() if line.startswith("| ")}
    signal = noise = 0.0
    for t in (a, b):
        q = quantize(t, cr.OperandFormat("nvfp4"), axis=1).dequantize()
        signal, noise = signal + float(t.double().square().sum()), noise + float((t - q).double().square().sum())
    nearest = rows[("x", "nvfp4 nearest")].split("|")
    assert float(nearest[3]) == pytest.approx(10 * math.log10(signal / noise), abs=0.006)
    assert nearest[-2].strip() == "2 of 2"
    # eden128 needs 128 along the contraction: only b (256) for x, none of w's 64
    eden128 = rows[("x", "nvfp4 eden128 rht128_resample")].split("|")
    c = next(c for c in cr.CONTROLS if c.name == "nvfp4 eden128 rht128_resample")
    assert eden128[-2].strip() == "1 of 2" and float(eden128[3]) == pytest.approx(cr.measure(b, 1, c, 2)["sqnr_db"],
                                                                                 abs=0.006)
    assert rows[("w", "nvfp4 eden128 rht128_resample")].count("n/a") == 6 and "0 of 1" in out
    assert "| dy | nvfp4 4over6 |" in out  # dy along tokens (axis 0): a.T is [64, 32], 64 tokens


def test_a_bad_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    assert cr.main(["--dist", "none", "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --checkpoint {tmp_path / 'nope'}: no such directory") and "\n" not in err
    assert cr.main(["--dist", "none", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a training checkpoint directory (no latest_checkpointed_iteration.txt" in err and "\n" not in err
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    assert cr.main(["--dist", "none", "--checkpoint", str(tmp_path), "--", "--precision", "bf16"]) == 2
    assert "drop --precision" in capsys.readouterr().err
    for argv in (["--dist", "none"], ["--", "--seq-length", "64"]):
        with pytest.raises(SystemExit):
            cr.main(argv)


def test_the_histogram_counts_every_element_in_its_bin():
    # hand-made relative errors: one per bin, two exact (0), one flushed (1), one above 1
    rel = torch.tensor([0.0, 0.0, 0.01, 0.02, 0.1, 0.5, 1.0, 3.0], dtype=torch.float64)
    assert cr._histogram(rel) == pytest.approx([3 / 8, 1 / 8, 1 / 8, 1 / 8, 1 / 8, 1 / 8])
    x = cr.sample("gaussian", (64, 64), 2)
    m = cr.measure(x, 1, cr.CONTROLS[0], 2)
    assert sum(m["hist"]) == pytest.approx(1.0)
    # the median sits in the bin where the cumulative share passes one half
    cum = [sum(m["hist"][: i + 1]) for i in range(6)]
    edges = [0.0, *cr.HIST_EDGES]
    i = next(i for i, c in enumerate(cum) if c >= 0.5)
    assert edges[i] <= m["rel_p50"] <= (edges[i + 1] if i + 1 < len(edges) else math.inf)


def test_main_prints_a_histogram_per_table(monkeypatch, capsys):
    monkeypatch.setattr(cr, "OPERANDS", {"x": ((32, 64), 1)})
    monkeypatch.setattr(cr, "CONTROLS", cr.CONTROLS[:2])
    assert cr.main(["--dist", "student_t3", "--draws", "2", "--histogram"]) == 0
    out = capsys.readouterr().out
    assert cr.HIST_HEADER[0] in out
    rows = [line for line in out.splitlines() if line.startswith("| x | nvfp4 ")]
    assert len(rows) == 4  # the table and its histogram, two controls each
    assert sum(float(v) for v in rows[2].split("|")[3:9]) == pytest.approx(100.0, abs=0.05)

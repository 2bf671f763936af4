"""``launch/gradient_error.py``: the bias estimator against synthetic data with a known mean, and a
smoke run on a tiny checkpoint in which a real MXFP4 error is told from BF16's (and an FP4 error
control as a Wgrad recipe from both), and the FP4 controls report on that checkpoint's operands."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from precision.controls_report import CONTROLS, HIST_HEADER
from tests.pretrain._launch import REPO, TINY, env, run_pretrain

SCRIPT = str(REPO / "launch" / "gradient_error.py")


def _estimator():
    import importlib

    return importlib.import_module("launch.gradient_error")  # as a module of launch/: no script path setup


def test_cross_group_square_hand_computed():
    mod = _estimator()
    # group sums of 2 batches each -> means (1, 0), (3, 0), (2, 2): the mean inner product of distinct
    # pairs is (3 + 2 + 6) / 3 = 11/3 (not |overall mean|^2 = 4 + 4/9, which holds the noise term).
    sums = torch.tensor([[2.0, 0.0], [6.0, 0.0], [4.0, 4.0]], dtype=torch.float64)
    est, se = mod.cross_group_square(sums, per_group=2)
    assert est == pytest.approx(11 / 3)
    # jackknife: leave-one-out estimates 3, 2, 6 -> mean 11/3, se = sqrt(2/3 * sum of squared deviations)
    loo = torch.tensor([3.0, 2.0, 6.0], dtype=torch.float64)
    assert se == pytest.approx(math.sqrt(2 / 3 * float((loo - loo.mean()).square().sum())))
    # a slice selects coordinates: only the first -> (2*6 + 2*4 + 6*4)/... of means 1, 3, 2: (3 + 2 + 6) / 3
    assert mod.cross_group_square(sums, 2, slice(0, 1))[0] == pytest.approx(11 / 3)


def test_bias_estimate_separates_bias_from_noise():
    """Noise 10x the bias: the plain mean's square is dominated by noise; the cross-group estimate
    finds |b|^2 within its standard error, and finds ~0 when there is no bias."""
    mod = _estimator()
    gen = torch.Generator().manual_seed(0)
    dim, groups, per_group = 200, 16, 8
    bias = torch.full((dim,), 0.1, dtype=torch.float64)  # |b|^2 = 2
    noise = torch.randn(groups * per_group, dim, generator=gen, dtype=torch.float64)  # |noise| ~ sqrt(200) = 14
    for b, expected in ((bias, 2.0), (torch.zeros(dim, dtype=torch.float64), 0.0)):
        samples = b + noise
        sums = samples.view(groups, per_group, dim).sum(1)
        est, se = mod.cross_group_square(sums, per_group)
        naive = float(samples.mean(0).square().sum())
        assert abs(est - expected) < 3 * se, (est, se, expected)
        assert naive > expected + 1.0  # the noise term, 200 / 128, the estimator removes


def test_bias_projection_ignores_same_batch_covariance():
    """e_i = b + 0.5 (g_i - G): the error follows each batch's own noise. The naive mean of
    <g_i, e_i> picks up that covariance (0.5 * E|noise|^2, large); the distinct-group estimate finds
    <G, b> / |G|^2 = 0.3 within its standard error."""
    mod = _estimator()
    gen = torch.Generator().manual_seed(1)
    dim, groups, per_group = 100, 16, 4
    big_g = torch.ones(dim, dtype=torch.float64)  # |G|^2 = 100
    b = 0.3 * big_g + 0.2 * torch.tensor([(-1.0) ** k for k in range(dim)], dtype=torch.float64)  # <G, b> = 30
    noise = 3.0 * torch.randn(groups * per_group, dim, generator=gen, dtype=torch.float64)
    g, e = big_g + noise, b + 0.5 * noise
    proj, se = mod.bias_projection(g.view(groups, per_group, dim).sum(1), e.view(groups, per_group, dim).sum(1),
                                   per_group)
    assert abs(proj - 0.3) < 3 * se and se < 0.1, (proj, se)
    naive = float((g * e).sum(1).mean()) / float(g.mean(0).square().sum())
    assert naive > 1.5  # the covariance term 0.5 * 9 * 100 swamps <G, b> = 30


def test_break_even_steps_from_the_issue_figures():
    # bias 0.067 and noise 4.89 of |G| (configs/sweeps/mxfp4_study_cpu.md, section 3): their drifts are
    # equal after (4.89 / 0.067)^2 ~ 5,300 steps (11M tokens at 2,048 per step); at 500 steps 0.31
    mod = _estimator()
    s = mod.break_even_steps(4.89, 0.067)
    assert s == pytest.approx((4.89 / 0.067) ** 2) and 5000 < s < 5600
    assert s * 2048 == pytest.approx(10.9e6, rel=0.01)
    assert 0.067 * math.sqrt(500) / 4.89 == pytest.approx(0.306, abs=0.001)
    assert math.isinf(mod.break_even_steps(4.89, 0.0))


def test_gradient_error_smoke(tmp_path, data_cache):
    ckpt = tmp_path / "ckpt"
    common = [*TINY, "--data-cache-dir", str(data_cache), "--train-iters", "2"]
    run_pretrain([*common, "--precision", "fp32", "--save", str(ckpt), "--save-interval", "2"], nproc=0)
    eden = "base=bf16,wgrad=nvfp4+eden+rht16_resample"  # an FP4 error control as a Wgrad recipe
    out = run_pretrain(["--precisions", "bf16", "mxfp4", eden, "--batches", "4", "--groups", "2",
                        "--json", str(tmp_path / "f.json"), "--",
                        *common, "--load", str(ckpt)], nproc=0, script=SCRIPT).stdout
    assert "gradient error at iteration 2" in out
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^\| (\w+) \| [^|]+ \| ([0-9.]+) \|", out, re.MULTILINE)}
    assert set(rows) == {"bf16", "mxfp4"}
    # one step's error relative to the mean gradient: MXFP4 (2^-2 steps) far above BF16 (2^-9)
    assert 0 < rows["bf16"] < 0.05 < rows["mxfp4"], out
    # MS-EDEN on Wgrad only (Fprop, Dgrad BF16): an FP4 error, below plain MXFP4's on all three GEMMs
    eden_row = next(line for line in out.splitlines() if line.startswith(f"| {eden} |")).split(" | ")
    assert rows["bf16"] < float(eden_row[2]) < rows["mxfp4"], out
    assert "| precision | embedding |" in out
    assert "<G, E[e]> / abs(G)^2 (s.e.) | break-even steps (tokens in total) | drift ratio at 2 steps |" in out
    mx = next(line for line in out.splitlines() if line.startswith("| mxfp4 |")).split(" | ")
    assert re.fullmatch(r"[+-][0-9.]+ \([0-9.na]+\)", mx[5]) and re.fullmatch(r"[0-9.]+", mx[7].rstrip(" |")), mx
    fig = json.loads((tmp_path / "f.json").read_text())  # the same figures as the table, unrounded
    assert fig["iteration"] == 2 and set(fig["precisions"]) == {"bf16", "mxfp4", eden}
    assert f"{fig['precisions']['mxfp4']['step_error']:.4f}" == mx[2].strip()
    assert f"{fig['precisions']['mxfp4']['projection']:+.4f}" == mx[5].split(" (")[0]
    # the FP4 controls report on the same checkpoint's own x, w, dy (python -m precision.controls_report)
    rep = subprocess.run([sys.executable, "-m", "precision.controls_report", "--dist", "none", "--draws", "2",
                          "--histogram", "--checkpoint", str(ckpt), "--", "--data-cache-dir", str(data_cache),
                          "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"],
                         check=False, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert f"Checkpoint {ckpt} at iteration 2: 8 linears, 256 tokens" in rep.stdout
    table = rep.stdout.split("checkpoint: relative error")[0]  # the SQNR table, before its histogram
    sqnr = {(m[1], m[2]): float(m[3]) for m in re.finditer(r"^\| (x|w|dy) \| ([\w ]+) \| ([0-9.]+) \|", table,
                                                          re.MULTILINE)}
    assert "checkpoint: relative error" in rep.stdout and HIST_HEADER[0] in rep.stdout
    assert len(sqnr) == 3 * len(CONTROLS) and ("dy", "nvfp4 eden128 rht128_resample") in sqnr, rep.stdout
    for role in ("x", "w", "dy"):  # the ranks the synthetic tensors show hold on a model's own operands
        assert sqnr[(role, "nvfp4 4over6")] > sqnr[(role, "nvfp4 nearest")] > sqnr[(role, "nvfp4 sr")]
        assert sqnr[(role, "nvfp4 eden rht16_resample")] > sqnr[(role, "nvfp4 sr rht16_resample")] + 2.0


def test_gradient_error_needs_load(tmp_path):
    proc = run_pretrain(["--batches", "4", "--groups", "2", "--", *TINY], nproc=0, script=SCRIPT, check=False)
    assert proc.returncode == 2 and "--load CKPT" in proc.stderr

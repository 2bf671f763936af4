"""launch/scale_study.py: the slope table of a size sweep, and the per-block telemetry table of real runs."""

import csv
import math

import pytest
import yaml

from launch.scale_study import main
from pretrain.scale_study import non_embedding_params
from pretrain.sweep.spec import expand_runs, load_sweep
from tests.pretrain._launch import TINY, run_pretrain

SIZES = ["scale_w64_d2", "scale_w128_d2", "scale_w256_d2"]


def test_slopes_reads_a_size_sweep_and_recovers_its_slope(tmp_path, capsys):
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "s", "base": {"train-iters": 10}, "seeds": [0, 1, 2], "baseline": "fp8",
        "contrasts": [["wgrad_mxfp4", "wgrad_fp8"]],
        "grid": {"model-size": SIZES, "presets": [{"fp8": "fp8"},
                                                  {"wgrad_fp8": "fprop=mxfp4,dgrad=mxfp4,wgrad=fp8_e5m2@fp8_e4m3"},
                                                  {"wgrad_mxfp4": "fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4"}]}}))
    runs = expand_runs(load_sweep(str(sweep_file)), str(sweep_file))
    params = {s: non_embedding_params(yaml.safe_load(open(f"configs/models/{s}.yaml"))) for s in SIZES}
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "results.csv", "w", newline="") as f:  # log(1 + x) = 0.02 + 0.05 log10 N (+ seed offsets)
        w = csv.writer(f)
        w.writerow(["run", "seed", "extra_tokens_pct"])
        for r in runs:
            u = math.log10(params[r.point["model-size"]])
            y = {"fp8": 0.0, "wgrad_fp8": 0.02, "wgrad_mxfp4": 0.02 + 0.05 * u}[r.label] + 0.001 * r.seed
            w.writerow([r.name, r.seed, 100 * math.expm1(y) if r.label != "fp8" else 0.0])
    assert main(["slopes", str(sweep_file), "--out", str(out), "--boot", "200"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| wgrad_mxfp4 vs wgrad_fp8 |"))
    assert "| +0.0500 (+0.0500, +0.0500; +0.0500, +0.0500) | grows with size |" in row
    assert "| wgrad_fp8 vs fp8 | 3 | 3 |" in text and "no trend shown" in text


@pytest.mark.slow  # one 2-iteration training run
def test_telemetry_table_of_a_run(tmp_path, data_cache, capsys):
    tb = tmp_path / "run" / "tensorboard"
    run_pretrain([*TINY, "--eval-interval", "0", "--gemm-backend", "reference", "--train-iters", "2",
                  "--precision", "mxfp4", "--numerics-interval", "1", "--tensorboard-dir", str(tb),
                  "--data-cache-dir", str(data_cache)], nproc=1)
    table = tmp_path / "t.csv"
    assert main(["telemetry", str(tmp_path), "--csv", str(table)]) == 0
    rows = list(csv.DictReader(open(table)))
    got = {(r["gemm"], r["operand"], r["metric"]): r for r in rows}
    for gemm, operand in (("fprop", "x"), ("dgrad", "dy"), ("wgrad", "dy"), ("wgrad", "x")):
        for metric in ("flushed_nonzero", "had16_flushed_nonzero", "block_max_median", "block_top_share"):
            r = got[(gemm, operand, metric)]
            assert r["axis"] == ("tokens" if gemm == "wgrad" else r["axis"]) and int(r["layers"]) >= 8
            assert math.isfinite(float(r["mean"])) and float(r["max"]) >= float(r["mean"])
    assert got[("wgrad", "x", "block_top_share")]["axis"] == "tokens"
    assert got[("fprop", "x", "block_top_share")]["axis"] == "features (in)"
    assert "| wgrad | dy | tokens | flushed_nonzero |" in capsys.readouterr().out

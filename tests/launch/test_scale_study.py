"""launch/scale_study.py: the slope table of a size sweep, and the per-block telemetry table of real runs."""

import csv
import math
from pathlib import Path

import pytest
import yaml

from launch.scale_study import main
from pretrain.scale_study import non_embedding_params
from pretrain.sweep.spec import expand_runs, load_sweep
from tests.pretrain._launch import TINY, run_pretrain

SIZES = ["scale_w64_d2", "scale_w128_d2", "scale_w256_d2"]


def _size_sweep(tmp_path):
    """A sweep file over SIZES: fp8 (the baseline), wgrad_fp8, wgrad_mxfp4, seeds 0-2, one contrast."""
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "s", "base": {"train-iters": 10}, "seeds": [0, 1, 2], "baseline": "fp8",
        "contrasts": [["wgrad_mxfp4", "wgrad_fp8"]],
        "grid": {"model-size": SIZES, "presets": [{"fp8": "fp8"},
                                                  {"wgrad_fp8": "fprop=mxfp4,dgrad=mxfp4,wgrad=fp8_e5m2@fp8_e4m3"},
                                                  {"wgrad_mxfp4": "fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4"}]}}))
    return sweep_file


def test_slopes_reads_a_size_sweep_and_recovers_its_slope(tmp_path, capsys):
    sweep_file = _size_sweep(tmp_path)
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


def _per_seed_files(tmp_path):
    """Two per-seed CSVs in the two committed forms, log(1 + x) = 0.02 + 0.05 log10 N for wgrad_mxfp4
    against fp8 (0.02 for wgrad_fp8), plus rows the slope must not read: another baseline, a size
    outside the grid."""
    params = {s: non_embedding_params(yaml.safe_load(Path(f"configs/models/{s}.yaml").read_text())) for s in SIZES}

    def value(t, s, k):
        return {"fp8": 0.0, "wgrad_fp8": 0.02,
                "wgrad_mxfp4": 0.02 + 0.05 * math.log10(params.get(s, 1e9))}[t] + 0.001 * k
    legacy = tmp_path / "parts12_per_seed.csv"  # one row per treatment, size and seed, all against fp8
    with open(legacy, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["treatment", "model_size", "seed", "final_val_loss", "val_loss_gap_to_fp8", "extra_tokens_pct"])
        for s in SIZES[:2] + ["scale_w64_d2_h4"]:
            for t in ("fp8", "wgrad_fp8", "wgrad_mxfp4"):
                for k in range(3):
                    w.writerow([t, s, k, 4.0, 0.0, 100 * math.expm1(value(t, s, k)) if t != "fp8" else 0.0])
    report = tmp_path / "part3_per_seed.csv"  # the sweep report's form
    with open(report, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["design", "against", "treatment", "seed", "extra_tokens_pct", "log_ratio", "val_loss_gap",
                    "censored", "claim"])
        for k in range(3):
            for t in ("fp8", "wgrad_fp8", "wgrad_mxfp4"):
                x = 100 * math.expm1(value(t, SIZES[2], k)) if t != "fp8" else 0.0
                w.writerow([f"model-size={SIZES[2]}", "fp8", t, k, x, 0, 0, 0, ""])
            w.writerow([f"model-size={SIZES[2]}", "wgrad_fp8", "wgrad_mxfp4", k, 999.0, 0, 0, 0, ""])
    return legacy, report


def test_slopes_from_committed_per_seed_csvs_and_the_figure(tmp_path, capsys):
    """--per-seed reads the report's per_seed.csv and the one-row-per-size form alike (rows against
    another baseline, sizes outside the grid skipped), gives the slope --out gives, and draws the figure
    with the published figures of a write-up's 'study (...)' column."""
    sweep_file = _size_sweep(tmp_path)
    writeup = tmp_path / "s.md"
    writeup.write_text("| treatment | what | study (a paper, 8B) |\n|---|---|---|\n| `fp8` | baseline | baseline |\n"
                       "| `wgrad_mxfp4` | MXFP4 Wgrad | +26–27 % |\n")
    legacy, report = _per_seed_files(tmp_path)
    fig = tmp_path / "slopes.png"
    assert main(["slopes", str(sweep_file), "--per-seed", str(legacy), str(report), "--boot", "200",
                 "--figure", str(fig), "--published", str(writeup)]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| wgrad_mxfp4 vs wgrad_fp8 |"))
    assert "| 3 | 3 |" in row and "| +0.0500 (+0.0500, +0.0500; +0.0500, +0.0500) | grows with size |" in row
    assert "9 runs" not in text and "27 runs over 3 sizes" in text
    assert fig.is_file() and fig.stat().st_size > 10_000 and f"figure: {fig}" in text

    # one piece alone: fewer than 3 sizes is said, not fitted
    assert main(["slopes", str(sweep_file), "--per-seed", str(report), "--boot", "50"]) == 0
    assert "not yet measured (needs 3 sizes)" in capsys.readouterr().out


def test_per_seed_csvs_that_disagree_or_lack_a_size_are_one_line_errors(tmp_path, capsys):
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "s", "seeds": [0], "baseline": "fp8",
        "grid": {"model-size": SIZES, "presets": [{"fp8": "fp8"}, {"a": "mxfp4"}]}}))
    one = tmp_path / "one_per_seed.csv"
    one.write_text("design,against,treatment,seed,extra_tokens_pct\nmodel-size=scale_w64_d2,fp8,a,0,3.0\n")
    two = tmp_path / "two_per_seed.csv"
    two.write_text("design,against,treatment,seed,extra_tokens_pct\nmodel-size=scale_w64_d2,fp8,a,0,4.0\n")
    bare = tmp_path / "bare_per_seed.csv"
    bare.write_text("treatment,seed,extra_tokens_pct\na,0,1.0\n")
    for files, said in (([one, two], "a at scale_w64_d2, seed 0 is 4 here and 3 in an earlier file"),
                        ([bare], "needs extra_tokens_pct and a model_size column"),
                        ([tmp_path / "absent.csv"], "no such file")):
        assert main(["slopes", str(sweep_file), "--per-seed", *map(str, files)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --per-seed") and said in err and "\n" not in err
    assert main(["slopes", str(sweep_file), "--per-seed", str(one), "--published", str(tmp_path / "s.md")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --published draws published figures in the --figure PNG: "
                                               "give --figure PNG too")


def test_slopes_of_the_validation_gap_read_both_per_seed_forms(tmp_path, capsys):
    """--metric val_gap: the slope of the difference of end-of-run validation gaps (the report's
    ``val_loss_gap`` and the one-row-per-size form's ``val_loss_gap_to_fp8``), in loss units, where the
    crossings (extra tokens) are the same for both treatments -- the snapping a crossing can show."""
    sweep_file = _size_sweep(tmp_path)
    params = {s: non_embedding_params(yaml.safe_load(Path(f"configs/models/{s}.yaml").read_text())) for s in SIZES}
    legacy, report = tmp_path / "a_per_seed.csv", tmp_path / "b_per_seed.csv"
    with open(legacy, "w", newline="") as fa, open(report, "w", newline="") as fb:
        wa, wb = csv.writer(fa), csv.writer(fb)
        wa.writerow(["treatment", "model_size", "seed", "val_loss_gap_to_fp8", "extra_tokens_pct"])
        wb.writerow(["design", "against", "treatment", "seed", "extra_tokens_pct", "val_loss_gap"])
        for i, size in enumerate(SIZES):
            u = math.log10(params[size])
            for k in range(3):
                gaps = (("fp8", 0.0), ("wgrad_fp8", 0.03 + 0.001 * k), ("wgrad_mxfp4", 0.03 + 0.01 * u + 0.001 * k))
                for t, gap in gaps:
                    if i < 2:
                        wa.writerow([t, size, k, gap, 0.0 if t == "fp8" else 5.0])
                    else:
                        wb.writerow([f"model-size={size}", "fp8", t, k, 0.0 if t == "fp8" else 5.0, gap])
    assert main(["slopes", str(sweep_file), "--per-seed", str(legacy), str(report), "--boot", "200",
                 "--metric", "val_gap"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| wgrad_mxfp4 vs wgrad_fp8 |"))
    assert "| +0.0100 (+0.0100, +0.0100; +0.0100, +0.0100) | grows with size |" in row
    assert "validation loss gap" in text and "predicted (loss)" in text
    # the crossings of the same files: every treatment 5 % everywhere, so no slope in extra tokens
    assert main(["slopes", str(sweep_file), "--per-seed", str(legacy), str(report), "--boot", "200"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| wgrad_mxfp4 vs wgrad_fp8"))
    assert "| +0.0000 (+0.0000, +0.0000; +0.0000, +0.0000) |" in row.replace("-0.0000", "+0.0000")
    assert main(["slopes", str(sweep_file), "--per-seed", str(legacy), "--metric", "val_gap",
                 "--figure", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --figure draws extra tokens against size: give --metric "
                                               "extra_tokens, or no --figure")


def _family():
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(Path("configs/models").glob("scale_w*_d*.yaml"))}


def test_the_scale_family_keeps_its_rules_at_every_size():
    """Every size of the Wgrad scale family (configs/sweeps/wgrad_scale_cpu.md, "Design") is one shape
    rule and one training rule: heads of 32, SwiGLU 3x hidden, 2,048 tokens a step, 2 tokens per
    non-embedding parameter (8 for the 4x-horizon size), lr 2e-3 * sqrt(256 / hidden), 5 % warm-up,
    a 20 % cooldown, up to 104 logged points, telemetry and checkpoints at matched fractions."""
    family = _family()
    assert {"scale_w32_d2", "scale_w32_d4", "scale_w64_d2", "scale_w256_d2", "scale_w512_d4"} <= set(family)
    for name, m in family.items():
        d, steps = m["hidden_size"], m["train_iters"]
        assert m["num_attention_heads"] == m["num_query_groups"] == d // 32 and m["ffn_hidden_size"] == 3 * d, name
        assert m["seq_length"] * m["global_batch_size"] == 2048 and m["micro_batch_size"] == 16, name
        ratio = 8 if name.endswith("_h4") else 2
        assert steps * 2048 == ratio * non_embedding_params(m), name
        lr = 2e-3 * math.sqrt(256 / d)
        assert float(f"{lr:.3g}") == m["lr"] and math.isclose(m["min_lr"], m["lr"] / 10), name
        assert m["lr_warmup_iters"] == max(1, round(0.05 * steps)) and m["lr_wsd_decay_iters"] == round(0.2 * steps), name
        assert steps // m["log_interval"] == min(104, steps) and steps % m["log_interval"] == 0, name
        every = m["numerics_interval"]
        assert every == m["save_interval"] and steps % every == 0 and steps // every in (2, 4), name


def test_the_pieces_of_the_scale_sweep_are_its_own_runs():
    """A piece of the scale sweep (a part, a size alone, the 8x look's sizes) runs the whole sweep's
    runs: the same names with the same flags, so pieces and the whole resume each other."""
    whole = {r.name: r for r in expand_runs(load_sweep("configs/sweeps/wgrad_scale_cpu.yaml"), "w")}
    assert len(whole) == 10 * 5 * 3
    names = {}
    for piece in ("part1", "part2", "part3", "part3a", "part3b", "w32", "8x"):
        path = f"configs/sweeps/wgrad_scale_cpu_{piece}.yaml"
        runs = expand_runs(load_sweep(path), path)
        assert runs and all(r == whole[r.name] for r in runs), piece
        names[piece] = {r.name for r in runs}
    assert names["8x"] == names["part3"] | names["w32"] and not names["part3"] & names["w32"]

"""A sweep refuses, in one line and before any run starts, what would cost runs or report wrong
results: a run whose flags ``pretrain.py`` refuses (a typo in the sweep file), a run directory made
by other flags (an edited sweep file), ``--slurm`` without ``sbatch``; and as runs finish it prints
each one's last loss and the whole sweep's ETA."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))

import sweep  # noqa: E402

from pretrain.sweep.cli import Progress  # noqa: E402
from pretrain.sweep.runner import run_args, run_identity  # noqa: E402

SWEEP = "base:\n  model-size: tiny\n  train-iters: {iters}\n  lr-warmup-iters: 1\nbaseline: bf16\n" \
        "grid:\n  presets: [bf16, fp8]\n"


def _file(tmp_path, text: str) -> str:
    f = tmp_path / "s.yaml"
    f.write_text(text)
    return str(f)


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_typo_in_a_base_flag_is_refused_before_any_run(tmp_path, capsys):
    f = _file(tmp_path, SWEEP.format(iters=4).replace("train-iters", "train-iter"))
    assert sweep.main([f, "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert line == ("error: run bf16: pretrain.py refuses its flags: unrecognized arguments: --train-iter 4; "
                    "did you mean --train-iters?")
    assert not (tmp_path / "out" / "runs").exists()  # nothing started


def test_an_edited_sweep_is_refused_rather_than_reported_under_its_new_flags(tmp_path, capsys):
    out = tmp_path / "out"
    old = sweep.expand_runs(sweep.load_sweep(_file(tmp_path, SWEEP.format(iters=4))), "s.yaml")
    for r in old:  # what start_run / finish_run record for a finished run
        d = sweep.run_dir(out, r)
        d.mkdir(parents=True)
        sweep.write_status(d, state="done", identity=run_identity(r, 1, []), nproc=1, args=run_args(r, []))
    f = _file(tmp_path, SWEEP.format(iters=8))
    assert sweep.main([f, "--out", str(out), "--collect"]) == 2
    line = _one_error_line(capsys)
    assert "run bf16 in --out" in line and "(--train-iters 4 -> --train-iters 8; 2 run(s) changed)" in line
    assert line.endswith(f"remove {out / 'runs' / 'bf16'} to run it again")
    f = _file(tmp_path, SWEEP.format(iters=4))
    assert sweep.main([f, "--out", str(out), "--collect", "--", "--lr", "1e-3"]) == 2  # flags after -- count too
    assert "((nothing) -> --lr 1e-3; 2 run(s) changed)" in _one_error_line(capsys)
    assert sweep.main([f, "--out", str(out), "--collect"]) == 0  # the same sweep: collected as before


def test_slurm_without_sbatch_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert sweep.main([_file(tmp_path, SWEEP.format(iters=4)), "--out", str(tmp_path / "o"), "--slurm"]) == 2
    assert _one_error_line(capsys).startswith("error: --slurm: sbatch not found on PATH")


def test_progress_gives_the_last_loss_and_the_eta(tmp_path):
    run = sweep.Run("fp8", "fp8")
    with SummaryWriter(str(sweep.run_dir(tmp_path, run) / "tensorboard")) as w:
        for it, loss in ((1, 9.0), (2, 4.0), (3, 2.5)):
            w.add_scalar("lm loss", loss, it)
    progress = Progress(tmp_path, todo=5, parallel=2)
    assert progress(run, "done", 30.0) == ", last loss 2.5000 at iteration 3; 4 run(s) left, ETA 1m00s"
    # mean of 30 s and 90 s = 60 s per run, 3 left at 2 a time = 2 rounds
    assert progress.__call__(sweep.Run("x", "bf16"), "failed", 90.0) == "; 3 run(s) left, ETA 2m00s"


def test_seeds_runs_a_piece_of_the_sweep_and_refuses_seeds_it_does_not_declare(tmp_path, capsys, monkeypatch):
    """``--seeds`` starts only those seeds' runs (the same runs and names as the whole sweep in the same
    --out), reports over every finished run, and refuses in one line a seed the file does not declare
    and a piece submitted to SLURM."""
    import pretrain.sweep.cli as cli

    f = _file(tmp_path, SWEEP.format(iters=4) + "seeds: [0, 1, 2]\n")
    started, reported = [], []
    monkeypatch.setattr(cli, "run_local", lambda out, runs, *a, **k: started.extend(runs) or 0)
    monkeypatch.setattr(cli, "collect", lambda out, runs, *a, **k: reported.extend(runs))
    whole = sweep.expand_runs(sweep.load_sweep(f), f)
    assert sweep.main([f, "--out", str(tmp_path / "out"), "--seeds", "1"]) == 0
    assert [r.name for r in started] == [r.name for r in whole if r.seed == 1] and len(started) == 2
    assert reported == whole  # the report covers the whole sweep's finished runs
    assert "this piece: seed(s) 1, 2 runs" in capsys.readouterr().out
    assert sweep.main([f, "--out", str(tmp_path / "out"), "--seeds", "1", "7"]) == 2
    assert "--seeds 7: not among" in _one_error_line(capsys)
    assert sweep.main([f, "--out", str(tmp_path / "out"), "--seeds", "0", "--slurm"]) == 2
    assert "give --slurm the whole sweep file" in _one_error_line(capsys)

"""Checkpoints: exact resume (bit for bit on CPU, stochastic rounding included), atomic publication,
``--finetune``, and SIGTERM (finish the iteration, save, exit 0)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import pretrain.checkpointing as ckpt_mod
from pretrain.checkpointing import (
    CHECKSUMS,
    RUN_CONFIG,
    TOKENIZER_DIR,
    TRACKER,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from pretrain.status import RUN_STATUS

from ._launch import (
    TINY,
    load_rank_checkpoint,
    run_pretrain,
    scalars,
    send_sigterm,
    start_pretrain,
    wait_for_line,
    worker_pids,
)


def assert_same_state(a, b, where=""):
    """Bit-for-bit equality of nested checkpoint contents (tensors with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys() ^ b.keys())
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# === exact resume ===


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, stop_at_exit",
    [(["--tensor-model-parallel-size", "2"], True), (["--tensor-model-parallel-size", "1"], False)],
    ids=["tp2", "dp2"],
)
def test_resume_reproduces_the_uninterrupted_run(tmp_path, data_cache, layout, stop_at_exit):
    """6 iterations straight vs 3, then a resume for 3 more: same losses and final state, bit for bit.

    TP=2 stops a run with ``--exit-interval 3`` and resumes it; DP=2 resumes from the straight run's
    own iteration-3 checkpoint (``--ckpt-step 3``; one training run fewer).
    ``mxfp4_sr`` rounds gradients stochastically from each layer's quantization streams, so this
    only holds if the streams' call counters come back with the model (its ``_extra_state``)."""
    common = [
        "--train-iters",
        "6",
        *TINY,
        "--precision",
        "mxfp4_sr",
        "--gemm-backend",
        "reference",
        *layout,
        "--eval-interval",
        "3",
        "--data-cache-dir",
        str(data_cache),
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight_save = ["--save", str(straight)] + ([] if stop_at_exit else ["--save-interval", "3"])
    run_pretrain(common + straight_save + ["--tensorboard-dir", str(straight / "tb")])
    if stop_at_exit:
        first = run_pretrain(
            common
            + [
                "--save",
                str(split),
                "--load",
                str(split),
                "--exit-interval",
                "3",
                "--tensorboard-dir",
                str(split / "tb1"),
            ]
        )
        assert (
            "no checkpoint yet" in first.stdout
            and "--exit-interval 3: stopping after iteration 3" in first.stdout
        )
        assert read_tracker(str(split)) == 3
        mid_dir, load = split / "iter_0000003", ["--load", str(split)]
    else:
        mid_dir, load = straight / "iter_0000003", ["--load", str(straight), "--ckpt-step", "3"]
    second = run_pretrain(common + ["--save", str(split), *load, "--tensorboard-dir", str(split / "tb2")])
    assert f"resumed from {mid_dir}: iteration 3, 12 samples consumed" in second.stdout

    loss = scalars(straight / "tb", "lm loss")
    resumed = scalars(split / "tb2", "lm loss")
    assert sorted(resumed) == [4, 5, 6]
    if stop_at_exit:
        resumed = {**scalars(split / "tb1", "lm loss"), **resumed}
        assert resumed == loss  # float equality, every iteration
    else:
        assert resumed == {k: v for k, v in loss.items() if k > 3}  # float equality, every iteration
    assert scalars(split / "tb2", "lm loss validation") == {6: scalars(straight / "tb", "lm loss validation")[6]}
    assert scalars(split / "tb2", "grad-norm") == {
        k: v for k, v in scalars(straight / "tb", "grad-norm").items() if k > 3
    }

    tp = int(layout[1])
    for rank in range(tp):
        a = load_rank_checkpoint(straight / "iter_0000006", rank)
        b = load_rank_checkpoint(split / "iter_0000006", rank)
        for key in (
            "model",
            "optimizer",
            "opt_param_scheduler",
            "rng_state",
            "consumed_train_samples",
            "precision_plan",
        ):
            assert_same_state(a[key], b[key], key)
        mid = load_rank_checkpoint(mid_dir, rank)
        quant = mid["model"]["decoder.layers.1.mlp.linear_fc2._extra_state"]
        assert quant["calls"]["wgrad"] > 0  # a fresh state would replay the first iterations' SR draws
        assert len(mid["rng_state"]) == 2 // tp  # one per data-parallel rank


# === atomic publication (in-process, one rank) ===


def test_checkpoint_is_published_atomically(tmp_path, monkeypatch, world_of_one):
    save_dir = str(tmp_path / "ckpt")
    state = {"model": {"w": torch.arange(4.0)}, "args": {"tensor_model_parallel_size": 1}}
    path = save_checkpoint(save_dir, 1, state)
    assert path == os.path.join(save_dir, "iter_0000001")
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", TRACKER]
    assert sorted(os.listdir(path)) == [CHECKSUMS, "mp_rank_00"]
    assert os.listdir(os.path.join(path, "mp_rank_00")) == ["model_optim_rng.pt"]

    real_save = torch.save

    def crash_midway(obj, f, *args, **kwargs):  # a crash (or kill) while the checkpoint file is written
        if not str(getattr(f, "name", "")).endswith("model_optim_rng.pt"):
            return real_save(obj, f, *args, **kwargs)  # torch.distributed pickles through torch.save too
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.torch, "save", crash_midway)
    with pytest.raises(ckpt_mod.CheckpointSaveError, match="could not write iteration 2 \\(disk full"):
        save_checkpoint(save_dir, 2, state)
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", TRACKER] and read_tracker(save_dir) == 1
    assert load_checkpoint(save_dir, tp_size=1)["iteration"] == 1  # the last complete checkpoint

    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    save_checkpoint(save_dir, 2, state)  # the next save removes the partial one
    assert (
        sorted(os.listdir(save_dir)) == ["iter_0000001", "iter_0000002", TRACKER]
        and read_tracker(save_dir) == 2
    )
    state["model"]["w"] = torch.ones(4)
    save_checkpoint(save_dir, 2, state)  # re-saving an iteration replaces it whole
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", "iter_0000002", TRACKER]
    assert torch.equal(load_checkpoint(save_dir, tp_size=1)["model"]["w"], torch.ones(4))


def test_tracker_pointing_to_missing_or_other_tp_checkpoint(tmp_path, world_of_one):
    save_dir = tmp_path / "ckpt"
    save_checkpoint(str(save_dir), 3, {"args": {"tensor_model_parallel_size": 2}})
    with pytest.raises(
        ckpt_mod.CheckpointError, match="saved with --tensor-model-parallel-size 2, this run uses 1"
    ):
        load_checkpoint(str(save_dir), tp_size=1)
    (save_dir / TRACKER).write_text("7")
    with pytest.raises(ckpt_mod.CheckpointError, match="missing .*iter_0000007"):
        load_checkpoint(str(save_dir), tp_size=1)


# === SIGTERM and --finetune ===


@pytest.mark.slow
def test_sigterm_finishes_the_iteration_saves_and_exits_zero(tmp_path, data_cache):
    """SIGTERM reaches one worker only (rank 1); both agree, save one complete checkpoint, exit 0."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.txt"
    proc = start_pretrain(
        [
            "--train-iters",
            "1000",
            *TINY,
            "--gemm-backend",
            "reference",
            "--tensor-model-parallel-size",
            "2",
            "--save",
            str(ckpt),
            "--eval-iters",
            "0",
            "--data-cache-dir",
            str(data_cache),
        ],
        nproc=2,
        log_path=log,
    )
    try:
        wait_for_line(log, "iteration    3/1000", proc)
        workers = worker_pids(proc.pid)
        assert sorted(workers) == [0, 1], workers
        send_sigterm(workers[1])
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    stopped = [line for line in text.splitlines() if line.startswith("SIGTERM: stopping after iteration")]
    assert len(stopped) == 1, text[-3000:]
    iteration = int(stopped[0].rsplit(" ", 1)[1])
    assert iteration >= 3 and read_tracker(str(ckpt)) == iteration
    done = ckpt / f"iter_{iteration:07d}"
    assert sorted(os.listdir(done)) == [CHECKSUMS, "mp_rank_00", "mp_rank_01", RUN_CONFIG, TOKENIZER_DIR]
    assert sorted(os.listdir(ckpt)) == [done.name, TRACKER, RUN_STATUS]  # run_status.json: state stopped
    assert json.loads((ckpt / RUN_STATUS).read_text())["state"] == "stopped"
    assert load_rank_checkpoint(done, 1)["consumed_train_samples"] == 4 * iteration


@pytest.mark.slow
def test_finetune_loads_weights_only(tmp_path, data_cache):
    common = [*TINY, "--gemm-backend", "reference", "--eval-iters", "0", "--data-cache-dir", str(data_cache)]
    run_pretrain(["--train-iters", "3", *common, "--save", str(tmp_path / "base")], nproc=0)
    proc = run_pretrain(
        [
            "--train-iters",
            "2",
            *common,
            "--load",
            str(tmp_path / "base"),
            "--finetune",
            "--save",
            str(tmp_path / "ft"),
            "--precision",
            "mxfp4",
        ],
        nproc=0,
    )
    assert (
        f"--finetune: loaded model weights of {tmp_path / 'base' / 'iter_0000003'}; starting at iteration 0"
        in proc.stdout
    )
    assert "the precision of 8 linear layer(s) differs from the checkpoint's plan" in proc.stdout
    assert "iteration 1/2" in proc.stdout and read_tracker(str(tmp_path / "ft")) == 2
    ft = load_rank_checkpoint(tmp_path / "ft" / "iter_0000002", 0)
    assert ft["opt_param_scheduler"]["num_steps"] == 2 and ft["consumed_train_samples"] == 8
    # a checkpoint of another shape is refused in one line, before training
    other = ["--train-iters", "2", *common, "--hidden-size", "256", "--load", str(tmp_path / "base")]
    proc = run_pretrain(other, nproc=0, check=False)
    base = tmp_path / "base" / "iter_0000003"
    refusal = f"pretrain.py: error: --load: {base} has --hidden-size 128, this run 256"
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [refusal]

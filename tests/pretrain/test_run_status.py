"""``--save/run_status.json`` records every ending of a pretraining run (``pretrain.status``): done,
refused input (with each value that did not come from the command line named with its origin), a
failed save; divergence is covered in ``test_reliability.py``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pretrain.arguments import ConfigError
from pretrain.status import EXIT_BAD_INPUT, EXIT_SAVE_FAILED, RUN_STATUS, save_dir_of

from ._launch import REPO, TINY, command, env

FAULTS = REPO / "tests" / "pretrain" / "_faults"
COMMON = ["--gemm-backend", "reference", "--eval-iters", "0", "--num-workers", "0"]


def _status(save) -> dict:
    return json.loads((save / RUN_STATUS).read_text())


def _run(argv: list[str], **faults) -> subprocess.CompletedProcess:
    e = env()
    if faults:
        e = {**e, "PYTHONPATH": os.pathsep.join([str(FAULTS), e["PYTHONPATH"]]), **faults}
    return subprocess.run(command(argv, 0), cwd=REPO, env=e, capture_output=True, text=True, timeout=300,
                          check=False)


def test_save_dir_of_a_command_line():
    assert save_dir_of(["--lr", "1", "--save", "a/b"]) == "a/b"
    assert save_dir_of(["--save=c"]) == "c"
    assert save_dir_of(["--load", "x"]) is None and save_dir_of(["--save"]) is None


def test_a_refusal_is_recorded_and_names_where_a_value_came_from(tmp_path):
    from pretrain.train import _parse

    save = tmp_path / "ckpt"
    with pytest.raises(ConfigError) as e:  # make pretrain's model size with a short run
        _parse(["--model-size", "tiny", "--train-iters", "10", "--save", str(save)], 1, False)
    msg = str(e.value)
    assert msg == "--lr-warmup-iters 20 (from --model-size tiny) exceeds --lr-decay-iters 10 (= --train-iters)"
    assert _status(save) == {"state": "refused", "exit_status": EXIT_BAD_INPUT, "reason": msg}
    with pytest.raises(ConfigError) as e:  # the same value given on the command line: no origin
        _parse(["--model-size", "tiny", "--train-iters", "10", "--lr-warmup-iters", "20", "--lr-decay-iters", "10"],
               1, False)
    assert str(e.value) == "--lr-warmup-iters 20 exceeds --lr-decay-iters 10"


def test_a_finished_run_records_done(tmp_path, data_cache):
    save = tmp_path / "ckpt"
    proc = _run(["--train-iters", "2", *TINY, *COMMON, "--save", str(save), "--data-cache-dir", str(data_cache)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _status(save) == {"state": "done", "exit_status": 0, "iteration": 2,
                             "last_good_checkpoint": str(save / "iter_0000002")}


@pytest.mark.slow
def test_a_failed_save_records_save_failed_with_the_intact_checkpoint(tmp_path, data_cache):
    save = tmp_path / "ckpt"
    proc = _run(["--train-iters", "2", *TINY, *COMMON, "--save", str(save), "--save-interval", "1",
                 "--data-cache-dir", str(data_cache)], FAULT_ENOSPC="iter_0000002")
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-3000:]
    status = _status(save)
    assert status["state"] == "save_failed" and status["exit_status"] == EXIT_SAVE_FAILED
    assert status["last_good_checkpoint"] == str(save / "iter_0000001")
    assert status["reason"].startswith(f"--save {save}: could not write iteration 2")

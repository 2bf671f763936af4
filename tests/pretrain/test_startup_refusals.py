"""Mistakes refused in one line at start-up, while the flags are validated (before any model, data or
process group): an unwritable ``--save`` or ``--tensorboard-dir``, a ``--ckpt-step`` that does not
exist (the line lists those that do)."""

from __future__ import annotations

import os

import pytest

from pretrain.arguments import ConfigError, parse_run_config

from ._launch import TINY

BASE = ["--train-iters", "2", *TINY]


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_run_config(BASE + argv, 1, False)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_a_directory_that_cannot_be_made_is_refused(flag, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert _refusal([flag, str(blocker / "run")]) == (
        f"{flag} {blocker / 'run'}: cannot create it: {blocker} is a file, not a directory")
    assert _refusal([flag, str(blocker)]) == f"{flag}: {blocker} exists and is not a directory"


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_an_unwritable_directory_is_refused(flag, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    msg = _refusal([flag, str(ro / "new" / "run")])  # the nearest existing ancestor decides
    assert msg.startswith(f"{flag} {ro / 'new' / 'run'}: cannot write there ({ro} is not writable")
    parse_run_config(BASE + [flag, str(tmp_path / "ok" / "run")], 1, False)  # a writable place is fine
    assert not (tmp_path / "ok").exists()  # validation creates nothing


def test_a_missing_ckpt_step_lists_the_iterations_there(tmp_path):
    load = tmp_path / "ckpt"
    for it in (4, 2, 10):
        (load / f"iter_{it:07d}").mkdir(parents=True)
    msg = _refusal(["--load", str(load), "--ckpt-step", "7"])
    assert msg == f"--ckpt-step 7: no checkpoint {load / 'iter_0000007'}; iterations there: 2, 4, 10"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _refusal(["--load", str(empty), "--ckpt-step", "1"]).endswith("no iter_* checkpoints there")

"""Failures a person can act on: a corrupt checkpoint, divergence, a full disk, rules that select
nothing, the one-line error under torchrun, checkpoint retention, and a killed rank.

In-process tests drive ``pretrain.checkpointing`` and the policy directly (a world of one). The
end-to-end tests run ``launch/pretrain.py`` with faults injected by ``tests/pretrain/_faults``
(a ``sitecustomize`` switched on by environment variables: a NaN loss at chosen steps, ``torch.save``
raising ENOSPC, a rank 0 that is slow to print).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import pretrain.checkpointing as ckpt_mod
from pretrain.checkpointing import (
    CHECKSUMS,
    TRACKER,
    CheckpointError,
    CheckpointSaveError,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from pretrain.status import EXIT_DIVERGED, EXIT_SAVE_FAILED, RUN_STATUS

from ._launch import REPO, TINY, command, env, load_rank_checkpoint, scalars, start_pretrain, worker_pids

FAULTS = Path(__file__).parent / "_faults"
BASE = ["--train-iters", "2", *TINY]


def run(argv, nproc=2, timeout=300, **faults):
    """``launch/pretrain.py`` as a subprocess with the named faults switched on."""
    e = env()
    if faults:
        e = {**e, "PYTHONPATH": os.pathsep.join([str(FAULTS), e["PYTHONPATH"]]),
             **{k: str(v) for k, v in faults.items()}}  # fmt: skip
    return subprocess.run(command(argv, nproc), cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout,
                          check=False)


def error_lines(proc) -> list[str]:
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("pretrain.py: error:")]


def child_exit_codes(proc) -> list[int]:
    """The workers' exit codes in torchrun's ChildFailedError report."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]


def tiny_state(value: float = 0.0) -> dict:
    return {"model": {"w": torch.full((64,), value)}, "args": {"tensor_model_parallel_size": 1}}


# ================================================================================================
# 1. checkpoint integrity
# ================================================================================================


def test_checksums_of_every_rank_file_are_recorded(tmp_path, world_of_one):
    path = Path(save_checkpoint(str(tmp_path), 1, tiny_state()))
    meta = json.loads((path / CHECKSUMS).read_text())
    rank_file = path / "mp_rank_00" / "model_optim_rng.pt"
    data = rank_file.read_bytes()
    assert meta["iteration"] == 1
    assert meta["files"] == {"mp_rank_00/model_optim_rng.pt": {"bytes": len(data),
                                                                "sha256": hashlib.sha256(data).hexdigest()}}


def test_truncated_rank_file_is_one_line_naming_the_file_and_the_previous_iteration(tmp_path, world_of_one):
    save_checkpoint(str(tmp_path), 1, tiny_state(1.0))
    save_checkpoint(str(tmp_path), 2, tiny_state(2.0))
    bad = tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(str(tmp_path), tp_size=1)
    msg = str(exc.value)
    assert "\n" not in msg and str(bad) in msg and f"{size // 2} of {size} bytes" in msg
    assert "iteration 1" in msg and "--ckpt-step 1" in msg, msg
    # what the line says to do works: the previous iteration loads
    assert torch.equal(load_checkpoint(str(tmp_path), tp_size=1, iteration=1)["model"]["w"], torch.ones(64))


def test_silent_corruption_is_caught_by_the_hash(tmp_path, world_of_one):
    save_checkpoint(str(tmp_path), 3, tiny_state())
    bad = tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupt \(its sha256 differs from the one recorded at save time") as exc:
        load_checkpoint(str(tmp_path), tp_size=1)
    assert "no earlier complete checkpoint" in str(exc.value)


def test_checkpoints_without_checksums_still_load_and_a_truncated_one_is_one_line(tmp_path, world_of_one):
    save_checkpoint(str(tmp_path), 4, tiny_state(4.0))
    (tmp_path / "iter_0000004" / CHECKSUMS).unlink()  # as written before checksums existed
    assert load_checkpoint(str(tmp_path), tp_size=1)["iteration"] == 4
    bad = tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    with open(bad, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=rf"--load: {re.escape(str(bad))} cannot be read") as exc:
        load_checkpoint(str(tmp_path), tp_size=1)
    assert "\n" not in str(exc.value)


# ================================================================================================
# 3. a full disk during a save; 6. retention
# ================================================================================================


def full_disk(monkeypatch):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if not str(getattr(f, "name", "")).endswith(".pt"):
            return real_save(obj, f, *args, **kwargs)  # torch.distributed pickles through torch.save
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    return real_save


def test_full_disk_is_one_line_naming_save_both_iterations_and_leaves_no_partial_directory(
    tmp_path, monkeypatch, world_of_one
):
    save_dir = tmp_path / "ckpt"
    save_checkpoint(str(save_dir), 5, tiny_state())
    full_disk(monkeypatch)
    with pytest.raises(CheckpointSaveError) as exc:
        save_checkpoint(str(save_dir), 6, tiny_state())
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"--save {save_dir}: could not write iteration 6")
    assert "No space left on device" in msg
    assert f"iteration 5 ({save_dir / 'iter_0000005'}) is intact" in msg
    assert sorted(os.listdir(save_dir)) == ["iter_0000005", TRACKER] and read_tracker(str(save_dir)) == 5

    with pytest.raises(CheckpointSaveError, match="no earlier checkpoint"):
        save_checkpoint(str(tmp_path / "empty"), 1, tiny_state())
    assert os.listdir(tmp_path / "empty") == []


def _tmpfs(tmp_path, size: str):
    """A real filesystem of ``size`` (tmpfs; needs root and a kernel that allows the mount): writes
    beyond it fail with ENOSPC inside ``torch.save``'s zip writer, not where a test raised it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                             text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({(mounted.stderr or 'not permitted').strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def small_filesystem(tmp_path):
    yield from _tmpfs(tmp_path, "1m")


@pytest.fixture
def filesystem_for_one_checkpoint(tmp_path):
    """10 MiB: one checkpoint of FULL_DISK_MODEL at TP=2 (6.7 MiB measured) fits, a second does not."""
    yield from _tmpfs(tmp_path, "10m")


def test_a_real_full_disk_is_one_line_and_the_previous_checkpoint_survives(small_filesystem, world_of_one):
    """torch.save on a full filesystem raises OSError ENOSPC and then RuntimeError "[enforce fail at
    inline_container.cc] unexpected pos" on its way out: still one CheckpointSaveError line."""
    save_dir = small_filesystem / "ckpt"
    small = {"model": {"w": torch.zeros(50_000)}, "args": {"tensor_model_parallel_size": 1}}  # 200 kB
    big = {"model": {"w": torch.zeros(400_000)}, "args": {"tensor_model_parallel_size": 1}}  # 1.6 MB > 1 MiB
    save_checkpoint(str(save_dir), 1, small)
    with pytest.raises(CheckpointSaveError) as exc:
        save_checkpoint(str(save_dir), 2, big)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"--save {save_dir}: could not write iteration 2 (No space left")
    assert f"iteration 1 ({save_dir / 'iter_0000001'}) is intact" in msg
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", TRACKER] and read_tracker(str(save_dir)) == 1
    assert torch.equal(load_checkpoint(str(save_dir), tp_size=1)["model"]["w"], small["model"]["w"])
    save_checkpoint(str(save_dir), 3, small)  # the failed save left no space taken
    assert read_tracker(str(save_dir)) == 3


def test_save_retain_keeps_the_newest_complete_checkpoints(tmp_path, monkeypatch, world_of_one):
    for it in range(1, 5):
        save_checkpoint(str(tmp_path), it, tiny_state(it), retain=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", TRACKER]
    real_save = full_disk(monkeypatch)
    with pytest.raises(CheckpointSaveError):
        save_checkpoint(str(tmp_path), 5, tiny_state(5), retain=1)
    # nothing is deleted for a checkpoint that was not completed
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", TRACKER]
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    save_checkpoint(str(tmp_path), 5, tiny_state(5), retain=1)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000005", TRACKER]
    assert load_checkpoint(str(tmp_path), tp_size=1)["iteration"] == 5


# ================================================================================================
# 4. rules that select nothing
# ================================================================================================

NAMES = [f"decoder.layers.{i}.{s}" for i in range(2)
         for s in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
NAMES += ["output_layer"]


@pytest.mark.parametrize("rule, expected", [
    ("layers:9-3=bf16", ("--precision-rule 'layers:9-3=bf16': rule 'layers:9-3': reversed range 9-3; valid: "
                         "layers:A-B with A <= B")),
    ("layers:1-3=bf16", "--precision-rule 'layers:1-3=bf16': layer 3 is beyond the model (2 layers: 0-1)"),
    ("first:3=bf16", "--precision-rule 'first:3=bf16': the model has 2 layers (first:1 .. first:2)"),
    ("last:0=bf16", "--precision-rule 'last:0=bf16': the model has 2 layers (last:1 .. last:2)"),
])  # fmt: skip
def test_rules_beyond_the_model_are_refused_before_anything_starts(rule, expected, capsys, monkeypatch):
    from tests.pretrain.test_cli import refuse

    line = refuse(BASE + ["--precision-rule", rule], capsys, 1, monkeypatch)
    assert expected in line, line


def test_a_rule_that_matches_no_layer_names_the_valid_layers():
    from precision import PrecisionPolicy, SpecError

    for rule in ("decoder.layers.*.mlp.linear_fc3=bf16", "decoder.layers.1.mlp=bf16"):
        with pytest.raises(SpecError) as exc:
            PrecisionPolicy.from_args("mxfp4", [rule]).check_rules(2, NAMES)
        assert str(exc.value).startswith(f"--precision-rule {rule!r}: matches no layer; layers:"), exc.value
        assert "decoder.layers.{0..1}.mlp.linear_fc1" in str(exc.value) and "output_layer" in str(exc.value)
    with pytest.raises(SpecError, match=r"'layers:0-1=fp8': selects no layer: every layer it matches is "
                                        r"taken by an earlier rule \(--precision-rule first:2=bf16\)"):
        PrecisionPolicy.from_args("mxfp4", ["first:2=bf16", "layers:0-1=fp8"]).check_rules(2, NAMES)
    # a rule overriding a preset's own rule, and rules that select something, are fine
    PrecisionPolicy.from_args("mxfp4", ["kind:output=fp8", "first:1=bf16", "*.linear_fc2=fp8"]).check_rules(2, NAMES)


@pytest.mark.parametrize("text, expected", [
    ("base:\n", "base: empty value"),
    ("fprop: mxfp4\nfprop: bf16\nbase: fp8\n", "fprop: given twice"),
])  # fmt: skip
def test_precision_spec_files_that_say_nothing_are_refused(text, expected, tmp_path, capsys, monkeypatch):
    from tests.pretrain.test_cli import refuse

    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    line = refuse(BASE + ["--precision", str(spec)], capsys, 1, monkeypatch)
    assert f"--precision: {spec}: {expected}" in line, line


def test_unknown_base_preset_is_one_line(capsys, monkeypatch):
    from tests.pretrain.test_cli import refuse

    line = refuse(BASE + ["--precision", "base=bogus"], capsys, 1, monkeypatch)
    assert "--precision: unknown precision preset 'bogus'; valid: bf16" in line, line


def test_new_flags_are_validated(capsys, monkeypatch, tmp_path):
    from tests.pretrain.test_cli import refuse

    assert "--skip-nonfinite-steps -1: must be >= 0" in refuse(BASE + ["--skip-nonfinite-steps", "-1"], capsys, 1,
                                                               monkeypatch)
    assert "--save-retain 0: must be > 0" in refuse(BASE + ["--save-retain", "0"], capsys, 1, monkeypatch)
    assert "--save-retain needs --save" in refuse(BASE + ["--save-retain", "2"], capsys, 1, monkeypatch)
    assert "--ckpt-step needs --load" in refuse(BASE + ["--ckpt-step", "2"], capsys, 1, monkeypatch)
    line = refuse(BASE + ["--load", str(tmp_path), "--ckpt-step", "7"], capsys, 1, monkeypatch)
    assert f"--ckpt-step 7: no checkpoint {tmp_path / 'iter_0000007'}" in line, line


# ================================================================================================
# End to end (subprocesses)
# ================================================================================================

COMMON = ["--gemm-backend", "reference", "--eval-iters", "0"]


@pytest.mark.slow
def test_divergence_is_an_outcome_exit_3_status_file_and_the_last_good_checkpoint(tmp_path, data_cache):
    """--lr 1e30 under torchrun: iteration 1 is saved, iteration 2 is non-finite."""
    save = tmp_path / "ckpt"
    argv = ["--train-iters", "6", *TINY, *COMMON, "--lr", "1e30", "--save", str(save), "--save-interval", "1",
            "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-dir", str(data_cache)]  # fmt: skip
    proc = run(argv, nproc=2)
    assert proc.returncode != 0 and child_exit_codes(proc) and set(child_exit_codes(proc)) <= {EXIT_DIVERGED, -15}
    assert "]: Traceback" not in proc.stderr and "FloatingPointError" not in proc.stderr  # no worker's traceback
    (line,) = error_lines(proc)
    assert re.match(r"pretrain\.py: error: diverged at iteration 2: loss \S+, grad norm nan "
                    r"\(--check-for-nan-in-loss-and-grad\)", line), line
    assert f"last good checkpoint: {save / 'iter_0000001'}" in line
    status = json.loads((save / RUN_STATUS).read_text())
    assert status["state"] == "diverged" and status["iteration"] == 2
    assert status["last_good_checkpoint"] == str(save / "iter_0000001") and "grad norm nan" in status["reason"]
    assert read_tracker(str(save)) == 1 and not (save / "iter_0000002").exists()  # never saved
    assert load_checkpoint_file_ok(save / "iter_0000001")
    loss, norm = scalars(tmp_path / "tb", "lm loss"), scalars(tmp_path / "tb", "grad-norm")
    assert sorted(loss) == sorted(norm) == [1, 2] and norm[2] != norm[2]  # the NaN reaches TensorBoard
    assert scalars(tmp_path / "tb", "nonfinite-steps") == {1: 0.0, 2: 1.0}
    assert re.search(r"iteration 2/6 \| loss \S+ .*\| grad norm nan \| non-finite: diverged", proc.stdout)


def load_checkpoint_file_ok(ckpt_dir: Path) -> bool:
    ckpt = load_rank_checkpoint(ckpt_dir, 0)
    return all(torch.isfinite(v).all() for v in ckpt["model"].values() if isinstance(v, torch.Tensor))


@pytest.mark.slow
def test_skip_nonfinite_steps_leaves_the_state_unchanged_and_the_next_one_diverges(tmp_path, data_cache):
    """Steps 3 and 5 get a NaN loss; --skip-nonfinite-steps 1 skips step 3, step 5 is divergence."""
    save = tmp_path / "ckpt"
    argv = ["--train-iters", "6", *TINY, *COMMON, "--skip-nonfinite-steps", "1", "--save", str(save),
            "--save-interval", "1", "--tensorboard-dir", str(tmp_path / "tb"),
            "--data-cache-dir", str(data_cache)]  # fmt: skip
    proc = run(argv, nproc=0, FAULT_NAN_STEPS="3,5")
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    assert re.search(r"iteration 3/6 \| loss nan .*\| non-finite: skipped \(1 of --skip-nonfinite-steps 1\)",
                     proc.stdout), proc.stdout[-3000:]
    (line,) = error_lines(proc)
    assert line.startswith("pretrain.py: error: diverged at iteration 5: loss nan") and "iter_0000004" in line
    assert "2 non-finite steps (--skip-nonfinite-steps 1)" in line, line
    before, skipped, after = (load_rank_checkpoint(save / f"iter_{i:07d}", 0) for i in (2, 3, 4))
    for key in ("model", "optimizer"):  # a skipped step changes neither weights nor optimizer state
        assert_equal(before[key], skipped[key], key)
    assert before["opt_param_scheduler"]["num_steps"] == skipped["opt_param_scheduler"]["num_steps"] == 2
    assert skipped["consumed_train_samples"] == 12 and skipped["nonfinite_steps"] == 1
    assert after["opt_param_scheduler"]["num_steps"] == 3
    assert not torch.equal(after["model"]["embedding.word_embeddings.weight"],
                           before["model"]["embedding.word_embeddings.weight"])
    assert scalars(tmp_path / "tb", "nonfinite-steps") == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}
    assert json.loads((save / RUN_STATUS).read_text())["last_good_checkpoint"] == str(save / "iter_0000004")


def assert_equal(a, b, where):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_full_disk_under_torchrun_is_one_line_and_the_previous_checkpoint_survives(tmp_path, data_cache):
    save = tmp_path / "ckpt"
    argv = ["--train-iters", "3", *TINY, *COMMON, "--tensor-model-parallel-size", "2", "--save", str(save),
            "--save-interval", "1", "--data-cache-dir", str(data_cache)]  # fmt: skip
    proc = run(argv, nproc=2, FAULT_ENOSPC="iter_0000002", FAULT_ENOSPC_RANK=1)
    assert proc.returncode != 0 and EXIT_SAVE_FAILED in child_exit_codes(proc), proc.stderr[-3000:]
    assert "]: Traceback" not in proc.stderr  # torchrun's own ChildFailedError report only
    (line,) = error_lines(proc)
    assert line.startswith(f"pretrain.py: error: --save {save}: could not write iteration 2 (No space left")
    assert f"iteration 1 ({save / 'iter_0000001'}) is intact" in line
    assert sorted(os.listdir(save)) == ["iter_0000001", TRACKER, RUN_STATUS]  # the partial directory is gone
    assert json.loads((save / RUN_STATUS).read_text())["state"] == "save_failed"


FULL_DISK_MODEL = ["--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
                   "2", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
                   "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "1"]  # fmt: skip


@pytest.mark.slow
def test_a_real_full_disk_under_torchrun_is_one_line_and_exit_4(filesystem_for_one_checkpoint, data_cache):
    """The issue's run: --save on a filesystem that fills during the second save. Before the fix each
    worker printed the OSError and zip-writer RuntimeError tracebacks and exited 1."""
    save = filesystem_for_one_checkpoint / "ckpt"
    argv = ["--train-iters", "3", *FULL_DISK_MODEL, "--tensor-model-parallel-size", "2", "--save", str(save),
            "--save-interval", "1", "--data-cache-dir", str(data_cache)]  # fmt: skip
    proc = run(argv, nproc=2)
    # the first worker to exit 4 ends the job (torchrun may SIGTERM the other one first)
    assert proc.returncode != 0 and EXIT_SAVE_FAILED in child_exit_codes(proc), proc.stderr[-3000:]
    assert "]: Traceback" not in proc.stderr and "unexpected pos" not in proc.stderr  # torchrun's own report only
    (line,) = error_lines(proc)
    assert line.startswith(f"pretrain.py: error: --save {save}: could not write iteration 2 (No space left")
    assert f"iteration 1 ({save / 'iter_0000001'}) is intact" in line
    # run_status.json is written where the full disk leaves room for it
    assert sorted(set(os.listdir(save)) - {RUN_STATUS}) == ["iter_0000001", TRACKER] and read_tracker(str(save)) == 1
    assert load_checkpoint_file_ok(save / "iter_0000001")


@pytest.mark.slow
@pytest.mark.parametrize("argv, expected, repeats", [
    (["--lr", "-1"], "pretrain.py: error: --lr -1.0: must be >= 0", 2),
    (["--bogus-flag"], "pretrain.py: error: unrecognized arguments: --bogus-flag", 1),
    (["--precision-rule", "decoder.layers.*.mlp.fc3=bf16"],  # found after torch.distributed started
     "pretrain.py: error: --precision-rule 'decoder.layers.*.mlp.fc3=bf16': matches no layer", 1),
], ids=["validation", "parsing", "after-setup"])  # fmt: skip
def test_the_error_line_reaches_the_user_once_when_rank0_is_slow(argv, expected, repeats, data_cache):
    """Rank 0 sleeps 3 s before printing to stderr: on 22ca48a rank 1 exited first and torchrun
    killed rank 0 before its line (measured: no line at all)."""
    for _ in range(repeats):
        proc = run(BASE + ["--data-cache-dir", str(data_cache), *argv], nproc=2, timeout=180,
                   FAULT_SLOW_STDERR_RANK0=3)
        lines = error_lines(proc)
        assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith(expected), (lines, proc.stderr[-3000:])


@pytest.mark.slow
def test_corrupt_rank1_file_under_torchrun_is_one_line_and_its_advice_works(tmp_path, data_cache):
    save = tmp_path / "ckpt"
    argv = [*TINY, *COMMON, "--tensor-model-parallel-size", "2", "--save", str(save), "--load", str(save),
            "--save-interval", "1", "--data-cache-dir", str(data_cache)]  # fmt: skip
    assert run(["--train-iters", "2", *argv]).returncode == 0
    bad = save / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size - 10)
    proc = run(["--train-iters", "3", *argv], FAULT_SLOW_STDERR_RANK0=2)  # only rank 1 reads the bad file
    assert proc.returncode != 0 and "PytorchStreamReader" not in proc.stderr
    (line,) = error_lines(proc)
    assert line.startswith(f"pretrain.py: error: --load: {bad} is truncated") and "--ckpt-step 1" in line
    proc = run(["--train-iters", "3", *argv, "--ckpt-step", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {save / 'iter_0000001'}" in proc.stdout and read_tracker(str(save)) == 3


@pytest.mark.slow
def test_kill_9_of_one_rank_ends_the_job_in_seconds_and_the_resume_is_exact(tmp_path, data_cache):
    """Twice, SIGKILL one rank at a random moment after some saved iterations (saving every
    iteration, so often mid-save): torchrun ends the job quickly; resuming from the last complete
    checkpoint ends with the weights and optimizer state of an uninterrupted run, bit for bit
    (``--save-retain 2`` deleting old checkpoints meanwhile)."""
    argv = ["--train-iters", "12", *TINY, *COMMON, "--precision", "mxfp4_sr", "--tensor-model-parallel-size", "2",
            "--save-interval", "1", "--data-cache-dir", str(data_cache)]  # fmt: skip
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run([*argv, "--save", str(straight)]).returncode == 0
    rng = random.Random()
    for attempt, (after, victim) in enumerate(((2, 1), (5, 0))):
        log = tmp_path / f"log{attempt}.txt"
        proc = start_pretrain([*argv, "--save", str(killed), "--load", str(killed), "--save-retain", "2"], nproc=2,
                              log_path=log)
        delay = rng.uniform(0.0, 0.5)
        try:
            deadline = time.monotonic() + 240
            while (read_tracker_or_none(killed) or 0) < after:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(delay)
            workers = worker_pids(proc.pid)
            assert victim in workers, f"the run ended before the kill ({delay:.2f}s after iteration {after})"
            os.kill(workers[victim], signal.SIGKILL)
            t0 = time.monotonic()
            assert proc.wait(timeout=60) != 0
            assert time.monotonic() - t0 < 30, "a killed rank must end the job in seconds"
        finally:
            if proc.poll() is None:
                proc.kill()
        assert after <= read_tracker(str(killed)) < 12, f"killed {delay:.2f}s after iteration {after} was saved"
    assert run([*argv, "--save", str(killed), "--load", str(killed), "--save-retain", "2"]).returncode == 0
    assert ckpt_mod.saved_iterations(str(killed)) == [11, 12]  # --save-retain 2, kills or not
    for rank in (0, 1):
        a = load_rank_checkpoint(straight / "iter_0000012", rank)
        b = load_rank_checkpoint(killed / "iter_0000012", rank)
        assert_equal(a["model"], b["model"], "model")
        assert_equal(a["optimizer"], b["optimizer"], "optimizer")


def read_tracker_or_none(path: Path):
    try:
        return read_tracker(str(path))
    except (CheckpointError, OSError):
        return None

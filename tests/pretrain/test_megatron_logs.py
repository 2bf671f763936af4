"""Logs a Megatron-LM user reads unchanged: TensorBoard scalars under Megatron's names (``lm loss``,
``learning-rate``, ``grad-norm``, ``batch-size``, ``iteration-time``, ``throughput``, the memory
scalars, ``lm loss validation``), each loss/lr/norm also against consumed samples and tokens, a
wall-clock time on every progress line, and Weights & Biases offline (skipped without wandb)."""

from __future__ import annotations

import re
import sys

import pytest

from model.gpt import training_flops_per_token
from pretrain.trainer.tags import LEGACY_TAGS, LOSS, VAL_LOSS, series

from ._launch import TINY, run_pretrain

GBS, SEQ = 4, 64  # TINY's global batch and sequence
STAMP = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] "


def read(tb) -> dict[str, dict[int, float]]:
    from pretrain.sweep.results import read_scalars

    return {tag: dict(v) for tag, v in read_scalars(tb).items()}


@pytest.fixture(scope="module")
def logged(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("megatron_logs")
    proc = run_pretrain([*TINY, "--train-iters", "3", "--eval-interval", "3", "--tensorboard-dir", str(root / "tb"),
                         "--log-throughput", "--log-memory-to-tensorboard", "--data-cache-dir", str(data_cache)],
                        nproc=0)  # fmt: skip
    return proc.stdout, read(root / "tb")


def test_megatron_names_and_their_sample_and_token_axes(logged):
    _, sc = logged
    for tag in ("lm loss", "learning-rate", "grad-norm"):
        assert sorted(sc[tag]) == [1, 2, 3], tag
        assert sc[tag + " vs samples"] == {i * GBS: v for i, v in sc[tag].items()}
        assert sc[tag + " vs tokens"] == {i * GBS * SEQ: v for i, v in sc[tag].items()}
    assert sc["learning-rate"][1] == pytest.approx(1.5e-3)  # TINY: lr 3e-3, 2 warm-up iterations
    assert set(sc["batch-size"].values()) == {GBS}
    assert sorted(sc["lm loss validation"]) == [3] and sorted(sc["lm loss validation vs samples"]) == [3 * GBS]
    assert sorted(sc["lm loss validation vs tokens"]) == [3 * GBS * SEQ] and "lm loss validation sem" in sc
    assert set(sc["nonfinite-steps"].values()) == {0.0}
    assert not set(sc) & set(LEGACY_TAGS.values())  # the old names are read, never written


def test_throughput_and_memory_scalars(logged):
    _, sc = logged
    from pretrain.arguments import parse_run_config

    run = parse_run_config([*TINY, "--train-iters", "3"], world_size=1, cuda=False)
    flops = training_flops_per_token(run.model_config(4096), SEQ, 4096)  # the built-in tokenizer's vocabulary
    for it, seconds in sc["iteration-time"].items():
        assert 0 < seconds < 60
        assert sc["tokens-per-sec"][it] == pytest.approx(GBS * SEQ / seconds, rel=1e-5)
        assert sc["throughput"][it] == pytest.approx(sc["tokens-per-sec"][it] * flops / 1e12, rel=1e-5)
    assert "mfu" not in sc  # a CPU has no known peak
    rss = sc["mem-max-rss-bytes"]
    assert sorted(rss) == [1, 2, 3] and all(1e8 < v < 64 * 2**30 for v in rss.values())
    assert list(rss.values()) == sorted(rss.values())  # a peak never falls


def test_progress_lines_carry_time_throughput_and_memory(logged):
    out, sc = logged
    lines = [ln for ln in out.splitlines() if re.match(STAMP + r"iteration +\d+/3 ", ln)]
    assert len(lines) == 3
    for ln in lines:
        assert " TFLOP/s/device | " in ln and " ms/iteration | " in ln and re.search(r"peak mem [\d.]+ GiB \(host RSS\)", ln)
    assert re.search(STAMP + r"validation at iteration 3 \| val loss ", out, re.MULTILINE)
    loss = float(re.search(r"iteration 3/3 \| loss (\S+)", out).group(1))
    assert loss == pytest.approx(sc["lm loss"][3], abs=6e-5)


def test_readers_take_old_and_new_names():
    old = {"train/loss": [(1, 2.0)], "val/loss": [(1, 3.0)]}
    assert series(old, LOSS) == [(1, 2.0)] and series(old, VAL_LOSS) == [(1, 3.0)]
    assert series({LOSS: [(1, 1.0)], "train/loss": [(1, 2.0)]}, LOSS) == [(1, 1.0)]  # the new name wins
    assert series({}, LOSS) == []


def test_wandb_flags_are_checked_before_the_run(monkeypatch):
    from pretrain.arguments import ConfigError, parse_run_config

    base = [*TINY, "--train-iters", "3"]
    with pytest.raises(ConfigError, match="--wandb-project needs --wandb-exp-name"):
        parse_run_config([*base, "--wandb-project", "p", "--save", "x"], world_size=1, cuda=False)
    with pytest.raises(ConfigError, match="need --wandb-project"):
        parse_run_config([*base, "--wandb-exp-name", "e"], world_size=1, cuda=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"not installed; install the extra: pip install 'lowprec-pretrain\[wandb\]'"):
        parse_run_config([*base, "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "w"],
                         world_size=1, cuda=False)


def test_wandb_offline_gets_the_same_scalars(tmp_path, data_cache, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_pretrain([*TINY, "--train-iters", "2", "--eval-interval", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                  "--wandb-project", "lowprec", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb"),
                  "--data-cache-dir", str(data_cache)], nproc=0)  # fmt: skip
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # offline: nothing left the machine; `wandb sync` uploads it
    (records,) = runs[0].glob("*.wandb")
    data = records.read_bytes()
    for key in ("lm loss", "learning-rate", "grad-norm", "lm loss validation", "samples vs steps", "tokens vs steps"):
        assert key.encode() in data, key
    assert b" vs samples" not in data.replace(b"samples vs steps", b"")  # W&B has one step axis


def test_scalar_writer_sends_wandb_each_step_in_order(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from pretrain.trainer.metrics import ScalarWriter

    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = wandb.init(project="p", name="n", dir=str(tmp_path), mode="offline")
    sent, real_log = [], run.log
    monkeypatch.setattr(run, "log", lambda d, step: (sent.append((step, dict(d))), real_log(d, step=step)))
    w = ScalarWriter(None, run)
    w.add_scalar("numerics/x/fprop/x/sqnr_db", 17.0, 2)  # telemetry of step 2 before the steps settle
    for it in (1, 2):
        w.add_scalar("lm loss", 5.0 - it, it)
        w.add_scalar("lm loss vs samples", 5.0 - it, 4 * it)
    w.close()
    assert sent == [(1, {"lm loss": 4.0}), (2, {"numerics/x/fprop/x/sqnr_db": 17.0, "lm loss": 3.0})]

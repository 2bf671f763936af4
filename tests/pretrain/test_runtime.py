"""pretrain.runtime: megatron-core's expected warnings stay quiet (exactly those), and workers end
with their launcher (a real torchrun killed with SIGKILL)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from pretrain import runtime

from ._launch import REPO, TINY, command, env, worker_pids

EXPECTED = ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated")


def _shown(message: str, module: str, category=UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runtime.filter_expected_warnings()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(seen)


def test_only_the_expected_warnings_are_filtered():
    assert not _shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
    assert not _shown("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                      "megatron.core.optimizer")
    assert not _shown("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
                      "megatron.core.transformer.transformer_config")
    # anything else is news: another megatron warning, the same words from elsewhere, another category
    assert _shown("fp8 recipe is deprecated", "megatron.core.transformer.transformer_config")
    assert _shown("Apex is not installed. Falling back to Torch Norm", "mypackage.models")
    assert _shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends",
                  DeprecationWarning)


def test_no_parent_watch_without_a_launcher(monkeypatch):
    monkeypatch.delenv(runtime.LAUNCHER_ENV, raising=False)
    assert runtime.exit_with_parent("pretrain.py") is False


def test_generate_prints_none_of_the_expected_warnings(tmp_path, world_of_one):
    """launch/generate.py in-process, every warning shown: megatron's TransformerConfig warns each
    time a model is built ("full scope is deprecated"); nothing of EXPECTED reaches the user. (At
    start-up the import-time ones are filtered the same way; the torchrun test below reads a real
    run's output.)"""
    from launch.generate import main
    from model.gpt import ModelConfig, build_gpt

    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1,
                      seq_length=16, vocab_size=64)
    state = {k: v[:64] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else v
             for k, v in build_gpt(cfg).state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"model": state, "model_config": dataclasses.asdict(cfg)}, tmp_path / "plain.pt")
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["--load", str(tmp_path / "plain.pt"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                     str(tmp_path / "out"), "--max-new-tokens", "1"]) == 0  # fmt: skip
    assert not [str(w.message) for w in seen if str(w.message).startswith(EXPECTED)]


def _alive(pid: int) -> bool:
    """Running or sleeping (a zombie nobody reaped yet has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads worker pids from /proc")
def test_workers_exit_when_torchrun_is_killed(tmp_path, data_cache):
    """kill -9 of torchrun's process group: torchrun starts its workers in sessions of their own, so
    the signal misses them; each must notice its launcher is gone and exit within seconds."""
    log = tmp_path / "log.txt"
    argv = ["--train-iters", "100000", *TINY, "--data-cache-dir", str(data_cache)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command(argv, 2), cwd=REPO, env={**env(), "PYTHONWARNINGS": "default"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while "| loss " not in log.read_text() or len(workers) < 2:  # training, so set up and watched
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            workers = worker_pids(proc.pid) or workers
            time.sleep(0.2)
        text = log.read_text()
        assert not [w for w in EXPECTED if w in text], text[-3000:]  # a run's start-up: no expected warnings
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        while any(_alive(pid) for pid in workers.values()) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = [pid for pid in workers.values() if _alive(pid)]
        assert not left, f"workers {left} outlived their launcher by 10 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

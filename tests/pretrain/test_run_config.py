"""The run config travels with the checkpoint: ``run_config.json`` and a copy of the tokenizer in every
``iter_*`` directory, found by every entry point that loads one (generation, evaluation, RL and
``--pretrained-checkpoint``) without ``--tokenizer-model``; an explicit flag still wins; checkpoints
written before (no ``run_config.json``) load as they did.

The tokenizer's ids are checked against sentencepiece itself, reading the original file's bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from model.gpt import ModelConfig, build_gpt
from pretrain.checkpointing import CHECKSUMS, RUN_CONFIG, TOKENIZER_DIR, checkpoint_tokenizer, save_checkpoint
from pretrain.data.tokenizer import train_tokenizer

VOCAB = 276
CFG = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1,
                  seq_length=32, vocab_size=VOCAB, init_method_std=0.3)
TEXT = "w3 x3 y3 w12 x5"


def _tokenizer(path, seed_words: str):
    docs = [" ".join(f"{seed_words}{i} x{i % 7} y{i % 13}" for i in range(400))]
    return train_tokenizer(docs, str(path), vocab_size=VOCAB)


def _save(save_dir, tokenizer_path: str, iteration: int = 1) -> str:
    """A training run's checkpoint (the keys pretrain/train.py saves) made with the built-in
    tokenizer: no --tokenizer-model in args, the file it used in ``tokenizer_model``."""
    torch.manual_seed(0)
    model = build_gpt(CFG)
    args = {"tensor_model_parallel_size": 1, "tokenizer_model": None, "tokenizer_type": "SentencePieceTokenizer",
            "seed": 1234}
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(CFG), "tokenizer_model": tokenizer_path,
             "args": args}
    return save_checkpoint(str(save_dir), iteration, state)


def _ids(model_bytes: bytes, text: str) -> list[int]:
    return spm.SentencePieceProcessor(model_proto=model_bytes).encode(text)


@pytest.fixture
def run(tmp_path, world_of_one):
    """A checkpoint whose run's tokenizer file is gone afterwards (a rebuilt cache, another machine)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    tok = _tokenizer(cache / "tokenizer.model", "w")
    original = (cache / "tokenizer.model").read_bytes()
    ckpt_dir = _save(tmp_path / "ckpt", tok.path)
    shutil.rmtree(cache)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": TEXT}) + "\n")
    return tmp_path / "ckpt", ckpt_dir, original, prompts


def _generate(argv) -> int:
    from launch.generate import main

    return main(argv)


def _prompt_ids(out) -> list[int]:
    return json.loads((out / "samples.jsonl").read_text().splitlines()[0])["prompt_ids"]


def test_checkpoint_carries_its_run_config_and_tokenizer(run):
    _, ckpt_dir, original, _ = run
    config = json.loads(Path(os.path.join(ckpt_dir, RUN_CONFIG)).read_text())
    assert config["iteration"] == 1 and config["model_config"] == dataclasses.asdict(CFG)
    assert config["args"]["seed"] == 1234
    assert config["tokenizer"]["type"] == "SentencePieceTokenizer"
    assert config["tokenizer"]["path"] == f"{TOKENIZER_DIR}/tokenizer.model"
    assert config["tokenizer"]["bytes"] == len(original)
    copy = os.path.join(ckpt_dir, TOKENIZER_DIR, "tokenizer.model")
    assert Path(copy).read_bytes() == original
    listed = json.loads(Path(os.path.join(ckpt_dir, CHECKSUMS)).read_text())["files"]
    assert {RUN_CONFIG, f"{TOKENIZER_DIR}/tokenizer.model", "mp_rank_00/model_optim_rng.pt"} == set(listed)
    assert checkpoint_tokenizer(ckpt_dir) == (copy, "SentencePieceTokenizer")


def test_generate_finds_the_runs_tokenizer_and_a_flag_overrides_it(run, tmp_path):
    load, _, original, prompts = run
    out = tmp_path / "gen"
    assert _generate(["--load", str(load), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2"]) == 0
    assert _prompt_ids(out) == _ids(original, TEXT)
    other = _tokenizer(tmp_path / "other.model", "q")  # same vocabulary size, other pieces
    assert _ids(Path(other.path).read_bytes(), TEXT) != _ids(original, TEXT)
    out2 = tmp_path / "gen2"
    assert _generate(["--load", str(load), "--prompts", str(prompts), "--out", str(out2), "--max-new-tokens", "2",
                      "--tokenizer-model", other.path]) == 0  # fmt: skip
    assert _prompt_ids(out2) == _ids(Path(other.path).read_bytes(), TEXT)


def test_evaluation_rl_and_pretrained_loads_find_the_runs_tokenizer(run):
    from pretrain.evaluation.loading import load_for_eval
    from pretrain.pretrained import read_pretrained

    load, ckpt_dir, _, _ = run
    copy = os.path.join(ckpt_dir, TOKENIZER_DIR, "tokenizer.model")
    loaded = load_for_eval(str(load))  # launch/evaluate.py and generate.py
    assert (loaded.tokenizer_model, loaded.tokenizer_dir) == (copy, None)
    pre = read_pretrained(str(load))  # launch/rl.py --load and --pretrained-checkpoint
    assert (pre.tokenizer_model, pre.tokenizer_type) == (copy, "SentencePieceTokenizer")


def _make_old(ckpt_dir: str) -> None:
    """As written before the run config travelled with the checkpoint."""
    os.remove(os.path.join(ckpt_dir, RUN_CONFIG))
    shutil.rmtree(os.path.join(ckpt_dir, TOKENIZER_DIR))
    path = os.path.join(ckpt_dir, CHECKSUMS)
    meta = json.loads(Path(path).read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if k.startswith("mp_rank_")}
    with open(path, "w") as f:
        json.dump(meta, f)


def test_old_checkpoints_load_as_before(run, tmp_path, capsys):
    load, ckpt_dir, original, prompts = run
    _make_old(ckpt_dir)
    assert _generate(["--load", str(load), "--prompts", str(prompts), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("generate.py: error:") and "a text prompt needs a tokenizer; pass --tokenizer-model" in err
    ids_only = tmp_path / "ids.jsonl"
    ids_only.write_text('{"prompt_ids": [5, 6]}\n')
    assert _generate(["--load", str(load), "--prompts", str(ids_only), "--out", str(tmp_path / "g2"),
                      "--max-new-tokens", "1"]) == 0  # fmt: skip
    # the recorded tokenizer file, where it still exists, is used (as --pretrained-checkpoint always did)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tokenizer.model").write_bytes(original)
    assert checkpoint_tokenizer(ckpt_dir, torch.load(os.path.join(ckpt_dir, "mp_rank_00", "model_optim_rng.pt"),
                                                     weights_only=False)) == (str(cache / "tokenizer.model"),
                                                                              "SentencePieceTokenizer")


def test_a_hugging_face_tokenizer_folder_travels_without_the_weights_beside_it(tmp_path, world_of_one):
    """--tokenizer-type HuggingFaceTokenizer: the folder's tokenizer files are copied (not a model's
    weights kept in the same folder); export_hf.py and evaluation find the copy."""
    from pretrain.data.hf_tokenizer import HFTokenizer
    from pretrain.evaluation.loading import load_for_eval
    from pretrain.hf_export import load_tp1_weights
    from tests.pretrain.test_hf_tokenizer_data import TEXTS, _byte_level_bpe

    src = _byte_level_bpe(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\0" * 4096)  # a model folder used as tokenizer
    want = HFTokenizer(src).tokenize(TEXTS[0])
    torch.manual_seed(0)
    state = {"model": build_gpt(CFG).state_dict(), "model_config": dataclasses.asdict(CFG), "tokenizer_model": src,
             "args": {"tensor_model_parallel_size": 1, "tokenizer_model": src,
                      "tokenizer_type": "HuggingFaceTokenizer"}}  # fmt: skip
    ckpt_dir = save_checkpoint(str(tmp_path / "ckpt"), 1, state)
    shutil.rmtree(tmp_path / "hf")
    copy = os.path.join(ckpt_dir, TOKENIZER_DIR)
    assert "tokenizer.json" in os.listdir(copy) and "model.safetensors" not in os.listdir(copy)
    assert HFTokenizer(copy).tokenize(TEXTS[0]) == want
    assert load_tp1_weights(str(tmp_path / "ckpt"))[2] == copy  # launch/export_hf.py copies its files
    assert load_for_eval(str(tmp_path / "ckpt")).tokenizer_dir == copy

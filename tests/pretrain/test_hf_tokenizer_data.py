"""Data tokenized with a Hugging Face tokenizer (``--tokenizer-type HuggingFaceTokenizer``), as
Megatron-LM: preprocess_data, ``load_tokenizer``, the built-in corpus cached per tokenizer, a
training run on it, and the refusals. Tokenizers are built in-process and saved locally; nothing
is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.arguments import build_parser
from pretrain.data import (
    DefaultCorpusConfig,
    HFTokenizer,
    Tokenizer,
    build_default_data,
    build_train_valid_datasets,
    default_cache,
    load_tokenizer,
    stdlib_corpus,
    train_tokenizer,
)
from pretrain.data.gpt_data import TOKENIZER_TYPES

from ._launch import REPO, TINY, run_pretrain
from .test_cli import BASE, refuse

transformers = pytest.importorskip("transformers")

PREPROCESS = str(REPO / "launch" / "preprocess_data.py")
SMALL = DefaultCorpusConfig(max_mb=0.3, vocab_size=400, tokenizer_sample_mb=0.2)
HF = ["--tokenizer-type", "HuggingFaceTokenizer"]
HF_FLAG = "--tokenizer-model (--tokenizer-type HuggingFaceTokenizer)"
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Quantization-aware training keeps the weights in high precision. ",
    "for i in range(10):\n\tprint(i ** 2)  # ünïcode, emoji \U0001f600\n",
    "The quick brown fox jumps over the lazy dog.\n\n",
]


def _byte_level_bpe(out_dir, vocab_size: int = 320) -> str:
    """A tiny byte-level BPE (exact round trips of any text), saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    raw.train_from_iterator(TEXTS * 4, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


def _large_word_level(out_dir, words: list[str]) -> str:
    """A word-level tokenizer of 70,000 ids whose real words sit above 65,535 (as Llama-3's 128k vocab)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"filler{i}": i for i in range(3, 70_000 - len(words))}}
    vocab.update({w: 70_000 - len(words) + i for i, w in enumerate(words)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return _byte_level_bpe(tmp_path_factory.mktemp("hf_tokenizer"))


@pytest.fixture(scope="module")
def hf_tok(hf_dir) -> HFTokenizer:
    return HFTokenizer(hf_dir)


def _preprocess(*args, cwd):
    return subprocess.run(
        [sys.executable, PREPROCESS, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=180
    )


def _documents(prefix) -> list[list[int]]:
    written = IndexedDataset(str(prefix))
    return [written[i].tolist() for i in range(len(written))]


# === the tokenizer and load_tokenizer ===


def test_hf_tokenizer_round_trips_and_identifies_its_files(hf_dir, hf_tok, tmp_path):
    for text in TEXTS:
        ids = hf_tok.tokenize(text)
        assert hf_tok.bos not in ids and hf_tok.eod not in ids  # no special tokens, as Megatron/lm-eval
        assert hf_tok.detokenize(ids) == text
    assert hf_tok.tokenize_batch(TEXTS) == [hf_tok.tokenize(t) for t in TEXTS]
    assert hf_tok.unique_identifiers == {"class": "pretrain.data.HFTokenizer", "sha1": hf_tok.sha1,
                                         "documents": "special tokens"}
    other = HFTokenizer(_byte_level_bpe(tmp_path / "other", vocab_size=300))
    assert other.sha1 != hf_tok.sha1


def test_load_tokenizer_dispatches_on_tokenizer_type(hf_dir, tmp_path):
    assert TOKENIZER_TYPES == tuple(build_parser()._option_string_actions["--tokenizer-type"].choices)
    tok = load_tokenizer(hf_dir, str(tmp_path), tokenizer_type="HuggingFaceTokenizer")
    assert isinstance(tok, HFTokenizer) and tok.path == os.path.abspath(hf_dir)
    sp_model = tmp_path / "sp" / "tokenizer.model"
    train_tokenizer([d.text for d in stdlib_corpus(max_mb=0.2)[0][:6]], str(sp_model), vocab_size=400)
    assert isinstance(load_tokenizer(str(sp_model), str(tmp_path)), Tokenizer)
    sp = load_tokenizer(str(sp_model), str(tmp_path), tokenizer_type="SentencePieceTokenizer")
    assert isinstance(sp, Tokenizer) and sp.path == str(sp_model)

    with pytest.raises(ValueError, match="--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR"):
        load_tokenizer(None, str(tmp_path), tokenizer_type="HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type: unknown 'GPT2BPETokenizer'; valid: Sentence"):
        load_tokenizer(hf_dir, str(tmp_path), tokenizer_type="GPT2BPETokenizer")
    flag = re.escape(f"{HF_FLAG}: ")
    with pytest.raises(FileNotFoundError, match=flag + ".* is a file, not a tokenizer folder"):
        load_tokenizer(str(sp_model), str(tmp_path), tokenizer_type="HuggingFaceTokenizer")
    with pytest.raises(FileNotFoundError, match=flag + "no such directory"):
        load_tokenizer(str(tmp_path / "nope"), str(tmp_path), tokenizer_type="HuggingFaceTokenizer")
    from pretrain import preprocess as preprocess_data
    from pretrain.data import hf_tokenizer

    assert preprocess_data._HF_FILES == hf_tokenizer.TOKENIZER_FILES  # its early check, before imports
    assert preprocess_data._HF_FLAG == hf_tokenizer.FLAG and preprocess_data._HF_HINT == hf_tokenizer.HINT
    # The old import still works; its errors name launch/evaluate.py's flag.
    from pretrain.evaluation.hf_tokenizer import HFTokenizer as EvalHFTokenizer

    assert isinstance(EvalHFTokenizer(hf_dir), HFTokenizer)
    with pytest.raises(FileNotFoundError, match="^--hf-tokenizer: no such directory"):
        EvalHFTokenizer(str(tmp_path / "nope"))


# === launch/preprocess_data.py ===


def test_preprocess_with_hf_tokenizer_decodes_back_to_the_input(hf_dir, hf_tok, tmp_path):
    """In worker processes (``--workers 2``); the single-process path runs in the tests below."""
    records = [{"text": TEXTS[i % len(TEXTS)] * (1 + i % 3) + f"doc {i}"} for i in range(12)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = _preprocess(
        "--input", "in.jsonl", "--output-prefix", "out/qat", *HF, "--tokenizer-model", hf_dir,
        "--append-eod", "--workers", "2", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    docs = _documents(tmp_path / "out" / "qat_text_document")
    assert docs == [hf_tok.tokenize(r["text"]) + [hf_tok.eod] for r in records]
    assert [hf_tok.detokenize(d[:-1]) for d in docs] == [r["text"] for r in records]


def test_documents_keep_the_tokenizers_own_bos_as_megatron_does(tmp_path):
    """A Llama-style tokenizer (post-processor ``<s> $A``): training documents start with BOS, as
    Megatron-LM's HuggingFaceTokenizer writes them; lm-eval contexts (``tokenize``) do not."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import processors

    plain = _byte_level_bpe(tmp_path / "plain")
    raw = RawTokenizer.from_file(os.path.join(plain, "tokenizer.json"))
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    llama_like = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    llama_like.save_pretrained(str(tmp_path / "llama_like"))
    tok = HFTokenizer(str(tmp_path / "llama_like"))
    assert tok.tokenize_documents(TEXTS) == [[bos, *tok.tokenize(t)] for t in TEXTS]

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    proc = _preprocess("--input", "in.jsonl", "--output-prefix", "out/bos", *HF, "--tokenizer-model",
                       str(tmp_path / "llama_like"), "--append-eod", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _documents(tmp_path / "out" / "bos_text_document") == [
        [bos, *tok.tokenize(t), tok.eod] for t in TEXTS
    ]


def test_preprocess_stores_ids_above_65535_as_int32(tmp_path):
    words = ["quantize", "the", "weights", "and", "gradients"]
    tok = HFTokenizer(_large_word_level(tmp_path / "big", words))
    assert tok.vocab_size == 70_000
    texts = ["quantize the weights", "and the gradients", "the"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    proc = _preprocess(
        "--input", "in.jsonl", "--output-prefix", "out/big", *HF, "--tokenizer-model", tok.path, cwd=tmp_path
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    written = IndexedDataset(str(tmp_path / "out" / "big_text_document"))
    assert written.index.dtype == np.int32
    docs = [written[i].tolist() for i in range(len(written))]
    assert docs == [tok.tokenize(t) for t in texts] and min(min(d) for d in docs) > 65535


@pytest.mark.parametrize(
    "args, expected",
    [
        ([*HF, "--tokenizer-model", "nope"], f"{HF_FLAG}: no such directory: nope"),
        ([*HF, "--tokenizer-model", "in.jsonl"], f"{HF_FLAG}: in.jsonl is a file, not a tokenizer folder"),
        ([*HF, "--tokenizer-model", "empty"], f"{HF_FLAG}: empty has none of tokenizer.json, tokenizer"),
        ([*HF, "--tokenizer-model", "tok", "--train-tokenizer", "400"], "--train-tokenizer trains a"),
        (["--tokenizer-model", "HF_DIR"], "is a directory, not a sentencepiece .model; for a Hugging Face"),
    ],
)
def test_preprocess_refuses_bad_tokenizer_flags_in_one_line(tmp_path, hf_dir, args, expected):
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "empty").mkdir()
    args = [hf_dir if a == "HF_DIR" else a for a in args]
    proc = _preprocess("--input", "in.jsonl", "--output-prefix", "out/x", *args, cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("preprocess_data.py: error: ") and expected in line, line
    assert not (tmp_path / "out").exists()


def test_preprocess_tokenizer_type_choices(tmp_path):
    argv = ["--input", "x", "--output-prefix", "y", "--tokenizer-model", "z", "--tokenizer-type", "HF"]
    proc = _preprocess(*argv, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--tokenizer-type: invalid choice: 'HF' (choose from 'SentencePieceTokenizer'," in proc.stderr


# === the built-in corpus, tokenized with a given tokenizer ===


def test_builtin_corpus_is_cached_per_tokenizer(hf_tok, tmp_path):
    cache = str(tmp_path / "cache")
    sp_data = build_default_data(cache, SMALL)
    hf_data = build_default_data(cache, SMALL, tokenizer=hf_tok)
    assert os.path.dirname(sp_data.train_prefix) == cache
    hf_folder = os.path.dirname(hf_data.train_prefix)
    assert os.path.dirname(hf_folder) == cache and os.path.basename(hf_folder).startswith("tokenized-")
    assert hf_data.tokenizer_model == hf_tok.path
    assert hf_data.manifest["key"]["tokenizer"] == dict(hf_tok.unique_identifiers)
    assert hf_data.manifest["tokenizer_sha1"] == hf_tok.sha1 != sp_data.manifest["tokenizer_sha1"]

    # Each cache stays as built: asking again (either one) rebuilds nothing.
    assert build_default_data(cache, SMALL) == sp_data
    assert build_default_data(cache, SMALL, tokenizer=hf_tok) == hf_data
    assert default_cache._read_manifest(cache) == sp_data.manifest

    # The documents are the stdlib files, tokenized by the HF tokenizer, EOD after each.
    _, valid_docs = stdlib_corpus(SMALL.max_mb, SMALL.valid_fraction)
    valid = _documents(hf_data.valid_prefix)
    assert [hf_tok.detokenize(d[:-1]) for d in valid] == [d.text for d in valid_docs]
    assert {d[-1] for d in valid} == {hf_tok.eod}

    # Another tokenizer gets its own folder, never the first one's data.
    other = HFTokenizer(_byte_level_bpe(tmp_path / "other", vocab_size=300))
    other_data = build_default_data(cache, SMALL, tokenizer=other)
    assert os.path.dirname(other_data.train_prefix) != hf_folder
    assert build_default_data(cache, SMALL, tokenizer=hf_tok) == hf_data

    # Without --data-path, an HF tokenizer trains on its own tokenization of the corpus.
    train, valid_ds = build_train_valid_datasets(
        None, hf_tok, 32, 1234, 20, 4, cache_dir=cache, default_corpus=SMALL
    )
    assert len(train) >= 20 and len(valid_ds) >= 4
    assert int(train[0]["tokens"].max()) < hf_tok.vocab_size


def test_builtin_corpus_with_hf_tokenizer_is_built_atomically(hf_tok, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(default_cache, "write_indexed_dataset", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_default_data(str(tmp_path), SMALL, tokenizer=hf_tok)
    (folder,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / folder) == [".default_corpus.lock"]  # no manifest: not built
    monkeypatch.undo()
    data = build_default_data(str(tmp_path), SMALL, tokenizer=hf_tok)
    assert os.path.dirname(data.train_prefix) == str(tmp_path / folder)
    assert os.path.isfile(data.train_prefix + ".bin") and data.manifest["tokenizer_sha1"] == hf_tok.sha1


# === training on it, and the refusals ===


def test_pretrain_trains_on_hf_tokenized_data(hf_dir, hf_tok, tmp_path, world_of_one):
    records = [{"text": TEXTS[i % len(TEXTS)] * 3 + f"document {i}\n"} for i in range(40)]
    (tmp_path / "qat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = _preprocess(
        "--input", "qat.jsonl", "--output-prefix", "data/qat", *HF, "--tokenizer-model", hf_dir, "--append-eod",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    proc = run_pretrain(
        [*TINY, "--train-iters", "3", "--data-path", str(tmp_path / "data" / "qat_text_document"),
         "--split", "90,10,0", *HF, "--tokenizer-model", hf_dir, "--data-cache-dir", str(tmp_path / "cache"),
         "--save", str(tmp_path / "ckpt")],
        nproc=0,
    )  # fmt: skip
    assert f"tokenizer {hf_tok.path} (vocab {hf_tok.vocab_size}," in proc.stdout
    losses = [float(m) for m in re.findall(r"^\[[^]]+\] iteration +\d+/3 \| loss (\S+) ", proc.stdout, re.MULTILINE)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), proc.stdout

    # Evaluation finds the HF tokenizer the checkpoint was trained with (the copy the checkpoint
    # carries: the same files, byte for byte), and can size the vocabulary from it when the checkpoint
    # has no model_config.
    from pretrain.evaluation.loading import load_for_eval

    loaded = load_for_eval(str(tmp_path / "ckpt"))
    assert loaded.tokenizer_model is None
    assert loaded.tokenizer_dir == str(tmp_path / "ckpt" / "iter_0000003" / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (Path(loaded.tokenizer_dir) / name).read_bytes() == (Path(hf_tok.path) / name).read_bytes()
    ckpt_file = tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    ckpt = torch.load(ckpt_file, map_location="cpu", weights_only=False)
    assert ckpt["args"]["tokenizer_type"] == "HuggingFaceTokenizer"
    torch.save({k: v for k, v in ckpt.items() if k != "model_config"}, ckpt_file)
    (ckpt_file.parents[1] / "checksums.json").unlink()  # checkpoints that old had no checksums either
    assert load_for_eval(str(tmp_path / "ckpt")).cfg.vocab_size == hf_tok.vocab_size


def test_pretrain_refuses_bad_tokenizer_flags_in_one_line(hf_dir, tmp_path, capsys, monkeypatch):
    def line_for(*argv):
        return refuse(BASE + list(argv), capsys, 1, monkeypatch)

    (tmp_path / "empty").mkdir()
    (tmp_path / "tok.model").write_bytes(b"x")
    assert "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR" in line_for(*HF)
    assert f"{HF_FLAG}: no such directory: {tmp_path / 'nope'}" in line_for(
        *HF, "--tokenizer-model", str(tmp_path / "nope")
    )
    assert f"{HF_FLAG}: {tmp_path / 'tok.model'} is a file" in line_for(
        *HF, "--tokenizer-model", str(tmp_path / "tok.model")
    )
    assert "has none of tokenizer.json, tokenizer.model, vocab.json" in line_for(
        *HF, "--tokenizer-model", str(tmp_path / "empty")
    )
    line = line_for("--tokenizer-model", hf_dir)
    assert f"--tokenizer-model: {hf_dir} is a directory, not a sentencepiece .model" in line
    assert "add --tokenizer-type HuggingFaceTokenizer" in line
    assert "--tokenizer-type: invalid choice: 'HF'" in line_for("--tokenizer-type", "HF")

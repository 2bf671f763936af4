"""A sentencepiece BPE tokenizer with Megatron-LM naming, and how to train one.

The model is trained for *exact* round-trips of source code and prose: no text normalization, no
dummy-prefix space, whitespace runs (indentation) allowed as pieces, ``"\\n"`` as its own symbol and
byte fallback for any character outside the vocabulary. ``detokenize(tokenize(s)) == s`` for every
string ``s``.

Special ids: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2 (the end-of-document id, ``Tokenizer.eod``);
no pad id (megatron's GPTDataset then pads with -1 and masks the loss there).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from collections import OrderedDict
from collections.abc import Sequence

import sentencepiece as spm

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SAMPLE_MB = 4.0
# Trainer threads are fixed, not taken from the machine: sentencepiece's result depends on them.
_TRAINER_THREADS = 1


class Tokenizer:
    """Megatron-style wrapper around a sentencepiece model file.

    Exposes what megatron-core's GPTDataset and a training loop read: ``vocab_size``, ``eod``,
    ``tokenize``, ``detokenize`` and ``unique_identifiers`` (part of GPTDataset's index-cache key;
    it holds the model file's hash, so a retrained tokenizer never reuses stale indices).
    """

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"--tokenizer-model: no such file: {model_path}")
        self.path = os.path.abspath(model_path)
        with open(self.path, "rb") as f:
            proto = f.read()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError:
            raise ValueError(f"--tokenizer-model: {model_path} is not a sentencepiece model file") from None
        self.sha1 = hashlib.sha1(proto).hexdigest()
        if self._sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model: {model_path} has no end-of-sentence id to use as EOD")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", "pretrain.data.Tokenizer"), ("sha1", self.sha1)])

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts at once (sentencepiece's own threads; the result does not depend on them)."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def tokenize_documents(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Training documents: as ``tokenize_batch`` (no BOS, as Megatron-LM's GPT sentencepiece
        tokenizer encodes them; the end-of-document id is appended by the writer)."""
        return self.tokenize_batch(texts, num_threads)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _sample_lines(documents: Sequence[str], sample_mb: float) -> list[str]:
    """Every k-th document, k chosen so that about ``sample_mb`` MB are kept, split into lines."""
    total = sum(len(d) for d in documents)
    stride = max(1, math.ceil(total / (sample_mb * 1e6)))
    return [line for doc in documents[::stride] for line in doc.split("\n") if line]


def train_tokenizer(
    documents: Sequence[str],
    model_path: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    sample_mb: float = DEFAULT_SAMPLE_MB,
) -> Tokenizer:
    """Train a BPE sentencepiece model on an evenly spaced sample of ``documents``; write ``model_path``.

    Deterministic: the same documents give a byte-identical model file. The file appears
    atomically (written beside, then renamed). Takes seconds for the default 4 MB sample.
    """
    lines = _sample_lines(documents, sample_mb)
    if not lines:
        raise ValueError("--train-tokenizer: no text to train on (all documents are empty)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n"],
            input_sentence_size=0,
            max_sentence_length=16384,
            num_threads=_TRAINER_THREADS,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as err:  # e.g. "Vocabulary size too high (30000). Please set it to a value <= 27698."
        msg = str(err).splitlines()[-1].split("] ")[-1]
        raise ValueError(f"--train-tokenizer {vocab_size}: sentencepiece refused: {msg}") from None
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    tmp_path = f"{model_path}.tmp{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp_path, model_path)
    return Tokenizer(model_path)

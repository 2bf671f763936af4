"""A Hugging Face tokenizer behind our ``Tokenizer`` interface (Megatron-LM's ``HuggingFaceTokenizer``).

``HFTokenizer(dir)`` loads ``AutoTokenizer`` from local files only -- e.g. the ``hf_tokenizer/``
folder that ``launch/convert_hf.py`` writes -- and never the network. It exposes what
``pretrain.data.Tokenizer`` does, so megatron's GPTDataset, ``launch/preprocess_data.py`` and the
training loop take either::

    vocab_size          len(tokenizer), added tokens included (Llama-3: 128256 -> int32 .bin)
    eod                 the EOS id, appended after every document
    bos                 the BOS id or None (lm-eval's add_bos_token)
    tokenize(text)      ids without special tokens (no BOS), as lm-eval's HFLM encodes a context
    tokenize_batch      the same for many texts at once (the fast tokenizer's own threads)
    tokenize_documents  documents for training data, *with* the tokenizer's own special tokens
                        (``tokenizer(text).input_ids``: Megatron-LM's HuggingFaceTokenizer, so a
                        Llama document starts with BOS, as in its pretraining; Qwen2 adds none)
    detokenize(ids)
    sha1                hash of every file in the folder; ``unique_identifiers`` holds it, so
                        GPTDataset's index cache and the built-in corpus cache never mix tokenizers

Use it with ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
FLAG = "--tokenizer-model (--tokenizer-type HuggingFaceTokenizer)"
HINT = "give a local Hugging Face tokenizer folder, e.g. OUT/hf_tokenizer from launch/convert_hf.py"


def hf_tokenizer_dir_problem(path: str) -> str | None:
    """Why ``path`` is no Hugging Face tokenizer folder, or None (file checks only, for early flag checks)."""
    if os.path.isfile(path):
        return f"{path} is a file, not a tokenizer folder"
    if not os.path.isdir(path):
        return f"no such directory: {path}"
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return f"{path} has none of {', '.join(TOKENIZER_FILES)}"
    return None


def _files_sha1(path: str) -> str:
    sha1 = hashlib.sha1()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                sha1.update(name.encode() + f.read())
    return sha1.hexdigest()


class HFTokenizer:
    """A local Hugging Face tokenizer folder; ``flag`` is the option errors name (the caller's CLI)."""

    def __init__(self, path: str, flag: str = FLAG):
        problem = hf_tokenizer_dir_problem(path)
        if problem is not None:
            raise FileNotFoundError(f"{flag}: {problem} ({HINT})")
        from transformers import AutoTokenizer

        self.path = os.path.abspath(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            msg = " ".join(str(e).split())[:200]
            raise ValueError(f"{flag}: transformers cannot load a tokenizer from {path}: {msg}") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"{flag}: {path} has no eos token to use as end of document")
        self.sha1 = _files_sha1(self.path)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._tok.eos_token_id

    @property
    def bos(self) -> int | None:
        return self._tok.bos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False, verbose=False)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts at once (``num_threads`` is unused: the Rust tokenizer picks its own)."""
        return self._tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

    def tokenize_documents(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Training documents: the tokenizer's own special tokens included (see module docstring)."""
        return self._tok(list(texts), verbose=False)["input_ids"]

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Part of GPTDataset's index-cache key: the tokenizer files' hash."""
        return OrderedDict([
            ("class", "pretrain.data.HFTokenizer"), ("sha1", self.sha1), ("documents", "special tokens"),
        ])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"

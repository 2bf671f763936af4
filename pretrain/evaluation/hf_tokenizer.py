"""A Hugging Face tokenizer behind our ``Tokenizer`` interface (for models converted from HF).

``HFTokenizer(dir)`` loads ``AutoTokenizer`` from local files only (e.g. the ``hf_tokenizer/``
folder that ``launch/convert_hf.py`` writes) and exposes ``vocab_size``, ``eod`` (EOS), ``bos``,
``tokenize`` (no special tokens, as lm-eval's HFLM encodes), ``tokenize_batch``, ``detokenize`` and
``unique_identifiers`` -- the interface of ``pretrain.data.Tokenizer`` that megatron's GPTDataset
and ``launch/preprocess_data.py`` read, so it can also tokenize QAT data for a converted model.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

_TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json")


class HFTokenizer:
    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--hf-tokenizer: no such directory: {path}")
        if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_MODELS):
            raise ValueError(f"--hf-tokenizer: {path} has none of {', '.join(_TOKENIZER_MODELS)}")
        from transformers import AutoTokenizer

        self.path = os.path.abspath(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            msg = " ".join(str(e).split())[:200]
            raise ValueError(f"--hf-tokenizer: transformers cannot load a tokenizer from {path}: {msg}") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"--hf-tokenizer: {path} has no eos token to use as end of document")

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
        return self._tok.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Part of GPTDataset's index-cache key: the tokenizer files' hash."""
        sha1 = hashlib.sha1()
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    sha1.update(name.encode() + f.read())
        return OrderedDict([("class", "pretrain.evaluation.HFTokenizer"), ("sha1", sha1.hexdigest())])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"

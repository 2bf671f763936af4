"""Writing and checking megatron-core indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``).

One document is one sequence (its token ids, then EOD when asked). Tokens are stored as uint16
when the vocabulary fits (megatron's ``DType.optimal_dtype``), int32 otherwise. Files are written
under temporary names and renamed, ``.idx`` last, so a crash never leaves a readable half-file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder


def document_prefix(output_prefix: str, key: str = "text") -> str:
    """Megatron-LM's naming: ``{output_prefix}_{json_key}_document``."""
    return f"{output_prefix}_{key}_document"


def check_indexed_prefix(prefix: str, flag: str = "--data-path") -> None:
    """Raise a one-line ``FileNotFoundError`` naming ``flag`` if ``prefix.bin`` or ``prefix.idx`` is missing."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise FileNotFoundError(
                f"{flag}: missing {prefix}{ext} (a data path is a prefix PREFIX with PREFIX.bin and "
                f"PREFIX.idx, as written by launch/preprocess_data.py)"
            )


class IndexedWriter:
    """Streams documents into ``prefix.{bin,idx}``; use as a context manager.

    >>> with IndexedWriter(prefix, vocab_size, eod=tok.eod) as w:
    ...     w.add(tok.tokenize(text))
    """

    def __init__(self, prefix: str, vocab_size: int, eod: int | None = None):
        self.prefix, self.eod = prefix, eod
        self.num_documents = self.num_tokens = self.num_empty = 0
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._builder = IndexedDatasetBuilder(self._tmp + ".bin", dtype=DType.optimal_dtype(vocab_size))

    def add(self, ids: Sequence[int]) -> None:
        """Add one document. Empty documents are skipped (counted in ``num_empty``)."""
        if len(ids) == 0:
            self.num_empty += 1
            return
        if self.eod is not None:
            ids = list(ids) + [self.eod]
        self._builder.add_item(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
        self._builder.end_document()
        self.num_documents += 1
        self.num_tokens += len(ids)

    def __enter__(self):  # -> IndexedWriter
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._builder.finalize(self._tmp + ".idx")
            os.replace(self._tmp + ".bin", self.prefix + ".bin")
            os.replace(self._tmp + ".idx", self.prefix + ".idx")
        else:
            self._builder.data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(self._tmp + ext):
                    os.remove(self._tmp + ext)


def write_indexed_dataset(
    documents: Iterable[Sequence[int]], prefix: str, vocab_size: int, eod: int | None = None
) -> IndexedWriter:
    """Write token-id documents to ``prefix.{bin,idx}``; returns the writer (for its counts)."""
    with IndexedWriter(prefix, vocab_size, eod) as writer:
        for ids in documents:
            writer.add(ids)
    return writer

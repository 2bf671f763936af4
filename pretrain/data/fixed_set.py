"""A fixed training set: the same few sequences in every step (``--fixed-train-set N``).

With ``--global-batch-size N`` every step trains on the whole set, so each step's gradient is the
exact gradient of the set's loss: there is no sampling noise, and a quantized GEMM's error is the
only thing that makes two runs from the same initialization differ. This is the noise-free design
of a precision study (``configs/sweeps/mxfp4_fullbatch_cpu.yaml``).

Which sequences: the training documents (the built-in corpus's training files, or the training
part of ``--data-path`` under ``--split``) are concatenated in file order, EOD tokens included,
and ``N`` windows of ``seq_length + 1`` tokens are cut at evenly spaced offsets
``floor(k * (T - seq_length - 1) / (N - 1))``, ``k = 0..N-1``, over the ``T`` tokens, so the set
spans the whole corpus. The set depends on the data, the tokenizer, ``seq_length`` and ``N`` only:
not on ``--seed``, so seeds change the initialization and nothing else. Sample ``i`` of the
training stream is window ``i mod N``; with ``N`` a multiple of the global batch, every
``N / global_batch`` steps go once through the set in the same order.

Items are the dicts GPTDataset yields (``tokens``, ``labels``, ``loss_mask``, ``position_ids``),
every label counted in the loss.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["FixedTrainSet", "fixed_windows"]


def fixed_windows(documents, seq_length: int, num_sequences: int, source: str = "the training data") -> np.ndarray:
    """``num_sequences`` windows of ``seq_length + 1`` tokens at evenly spaced offsets of the
    concatenated ``documents`` (token arrays, in order): an int64 array ``[num_sequences, seq_length + 1]``.
    Raises ``ValueError`` naming ``--fixed-train-set`` when the data holds fewer tokens than the set."""
    if num_sequences < 1:
        raise ValueError(f"--fixed-train-set: must be >= 1 sequence, got {num_sequences}")
    tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents]) if documents else np.zeros(0, np.int64)
    width = seq_length + 1
    need = num_sequences * width
    if len(tokens) < need:
        raise ValueError(
            f"--fixed-train-set {num_sequences}: {source} holds {len(tokens)} tokens, fewer than "
            f"{num_sequences} x {width} (--seq-length + 1); give fewer sequences or more data"
        )
    span = len(tokens) - width
    starts = [0] if num_sequences == 1 else [k * span // (num_sequences - 1) for k in range(num_sequences)]
    return np.stack([tokens[s : s + width] for s in starts])


class FixedTrainSet(torch.utils.data.Dataset):
    """``length`` training samples cycling through a fixed set of windows (see the module docstring)."""

    def __init__(self, windows: np.ndarray, length: int):
        self.windows = torch.from_numpy(np.ascontiguousarray(windows)).long()
        self.length = length
        seq = self.windows.shape[1] - 1
        self._loss_mask = torch.ones(seq, dtype=torch.float)
        self._position_ids = torch.arange(seq, dtype=torch.long)

    @property
    def num_sequences(self) -> int:
        return self.windows.shape[0]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.length:
            raise IndexError(f"sample {idx} outside the fixed set's {self.length} samples")
        w = self.windows[idx % self.num_sequences]
        return {"tokens": w[:-1].clone(), "labels": w[1:].clone(), "loss_mask": self._loss_mask.clone(),
                "position_ids": self._position_ids.clone()}

    @classmethod
    def from_prefixes(cls, prefixes: list[str], doc_ranges: list[tuple[int, int]] | None, seq_length: int,
                      num_sequences: int, length: int) -> FixedTrainSet:
        """The set cut from indexed datasets ``prefixes`` (documents ``[lo, hi)`` of each, or all)."""
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        docs = []
        for i, prefix in enumerate(prefixes):
            ds = IndexedDataset(prefix)
            lo, hi = doc_ranges[i] if doc_ranges else (0, len(ds))
            docs += [ds[j] for j in range(lo, hi)]
        source = " ".join(prefixes)
        return cls(fixed_windows(docs, seq_length, num_sequences, source), length)

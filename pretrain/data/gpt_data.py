"""Train/validation datasets through megatron-core's GPTDataset, and the batch iterator.

Samples are ``seq_length`` windows cut from the concatenated, EOD-separated documents of the
``.bin/.idx`` data and shuffled by megatron with ``seed``. Sample ``i`` is a fixed function of
(data files, tokenizer, ``seq_length``, ``seed``, ``train_samples``): keep all of them when resuming
(``train_samples`` sets the number of epochs, and with it the shuffle).

How samples are consumed (megatron's ``MegatronPretrainingSampler`` order)::

    global_batch_size = micro_batch_size * dp_size * num_micro_batches
    iteration i consumes samples [i * global_batch_size, (i + 1) * global_batch_size)
    micro-batch m of iteration i, data-parallel rank r, gets samples
        i * global_batch_size + m * micro_batch_size * dp_size + r * micro_batch_size + [0, micro_batch_size)

so the data position of a run is one number, the samples consumed (``iteration *
global_batch_size``), and ``batches(dataset, start_sample=that, ...)`` resumes exactly where it left.
``batch_loader`` yields the same micro-batches through a ``DataLoader`` with worker processes and
pinned memory (training; ``--num-workers``).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list

from pretrain.data.default_cache import DEFAULT_CORPUS, DefaultCorpusConfig, build_default_data
from pretrain.data.fixed_set import FixedTrainSet
from pretrain.data.helpers import ensure_dataset_helpers
from pretrain.data.hf_tokenizer import HINT as HF_HINT
from pretrain.data.hf_tokenizer import HFTokenizer
from pretrain.data.indexed import check_indexed_prefix
from pretrain.data.tokenizer import Tokenizer

DEFAULT_SPLIT = "99,1,0"
# Megatron-LM's --tokenizer-type names for what --tokenizer-model holds.
TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")


def load_tokenizer(
    tokenizer_model: str | None,
    cache_dir: str,
    default_corpus: DefaultCorpusConfig = DEFAULT_CORPUS,
    *,
    tokenizer_type: str = "SentencePieceTokenizer",
    is_rank0: bool | None = None,
    barrier: Callable[[], None] | None = None,
) -> Tokenizer | HFTokenizer:
    """The ``--tokenizer-type`` tokenizer of ``--tokenizer-model``.

    ``SentencePieceTokenizer``: the model file if given, else the built-in corpus's trained one
    (building the cache once). ``HuggingFaceTokenizer``: a local Hugging Face tokenizer folder (required).
    """
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR ({HF_HINT})")
        return HFTokenizer(tokenizer_model)
    if tokenizer_type != "SentencePieceTokenizer":
        raise ValueError(f"--tokenizer-type: unknown {tokenizer_type!r}; valid: {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_model is not None:
        return Tokenizer(tokenizer_model)
    data = build_default_data(cache_dir, default_corpus, is_rank0=is_rank0, barrier=barrier)
    return Tokenizer(data.tokenizer_model)


def _fingerprint(prefixes: list[str]) -> str:
    """Names the index cache by the data files' identity, so rewritten data never reuses old indices."""
    h = hashlib.sha1()
    for prefix in sorted(set(prefixes)):
        for ext in (".bin", ".idx"):
            st = os.stat(prefix + ext)
            h.update(f"{os.path.abspath(prefix)}{ext}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _checked_blend(paths: list[str], flag: str) -> tuple[list[str], list[float] | None]:
    try:
        blend = get_blend_from_list(list(paths))
    except ValueError:
        raise ValueError(
            f"{flag}: expected PREFIX ... or WEIGHT PREFIX WEIGHT PREFIX ..., got {paths}"
        ) from None
    if not blend[0]:
        raise ValueError(f"{flag}: no data prefix given")
    for prefix in blend[0]:
        check_indexed_prefix(prefix, flag)
    if len(blend[0]) > 1 and not torch.distributed.is_initialized():
        raise ValueError(
            f"{flag}: blending {len(blend[0])} datasets needs torch.distributed initialized (megatron-core's "
            f"BlendedDataset asks for the rank); run under torchrun or init a process group first"
        )
    return blend


def _num_sequences(prefix: str) -> int:
    """Sequence count from the ``.idx`` header (magic 9 B, version 8 B, dtype 1 B, then the count)."""
    with open(prefix + ".idx", "rb") as f:
        f.seek(18)
        return struct.unpack("<Q", f.read(8))[0]


def _check_split_nonempty(prefixes: list[str], split: str) -> None:
    """megatron-core loops forever on a split with no documents; refuse it with a clear message instead."""
    try:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError, ZeroDivisionError):
        raise ValueError(
            f"--split: expected non-negative weights 'train,valid,test' like 99,1,0, got {split!r}"
        ) from None
    for prefix in prefixes:
        n = _num_sequences(prefix)
        for name, bookends in zip(("train", "valid", "test"), matrix):
            if bookends is not None and round(bookends[0] * n) == round(bookends[1] * n):
                raise ValueError(
                    f"--split {split}: the {name} part of {prefix} has no documents ({n} in total); "
                    f"give more data, another --split, or --valid-data-path"
                )


def build_train_valid_datasets(
    data_path: list[str] | None,
    tokenizer: Tokenizer | HFTokenizer,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int | None,
    *,
    cache_dir: str,
    split: str = DEFAULT_SPLIT,
    valid_data_path: list[str] | None = None,
    default_corpus: DefaultCorpusConfig = DEFAULT_CORPUS,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
    is_rank0: bool | None = None,
    barrier: Callable[[], None] | None = None,
    fixed_train_set: int | None = None,
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    """The (train, valid) datasets; items are dicts of ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` (each ``[seq_length]``; plus ``attention_mask`` if ``create_attention_mask``).

    Args:
        data_path: megatron ``--data-path``: prefixes, optionally weighted (``["0.3", "a", "0.7", "b"]``);
            ``None`` is the built-in stdlib corpus (its own train/valid files; ``split`` unused) and
            then ``tokenizer`` must be the one ``load_tokenizer(None, cache_dir)`` returns, or an
            ``HFTokenizer``, which the corpus is then tokenized with (cached per tokenizer).
        train_samples: samples the train set must provide (train_iters * global_batch_size); more
            than one epoch of data is fine.
        valid_samples: samples of the validation set; ``None`` = one epoch of it.
        split: megatron ``--split`` ("train,valid,test" weights over documents, in file order), used
            when ``valid_data_path`` is not given. A zero valid weight gives ``valid = None``.
        valid_data_path: megatron ``--valid-data-path``: separate validation prefixes.
        cache_dir: the built-in corpus lives here, and GPTDataset's index cache under
            ``cache_dir/gpt_index_cache/<data fingerprint>``.
        fixed_train_set: ``--fixed-train-set N``: the train set is ``N`` fixed sequences of the
            training documents, repeated (``pretrain.data.fixed_set``); the validation set is unchanged.

    Call on every rank: under ``torch.distributed`` rank 0 builds and caches the indices first, the
    others then load them. Every rank holds the whole dataset; ``batches`` picks its share.
    """
    if seq_length <= 0 or train_samples <= 0:
        raise ValueError(f"seq_length and train_samples must be > 0, got {seq_length} and {train_samples}")
    ensure_dataset_helpers(os.path.join(cache_dir, "megatron_helpers"))
    if data_path is None:
        if valid_data_path is not None:
            raise ValueError("--valid-data-path needs --data-path (without it the built-in corpus is used)")
        given = tokenizer if isinstance(tokenizer, HFTokenizer) else None
        default = build_default_data(
            cache_dir, default_corpus, tokenizer=given, is_rank0=is_rank0, barrier=barrier
        )
        if tokenizer.sha1 != default.manifest["tokenizer_sha1"]:
            raise ValueError(
                f"--tokenizer-model: the built-in corpus (no --data-path) is tokenized with "
                f"{default.tokenizer_model}; drop --tokenizer-model, or give --data-path"
            )
        blends = {"blend_per_split": [([default.train_prefix], None), ([default.valid_prefix], None), None]}
        prefixes = [default.train_prefix, default.valid_prefix]
    elif valid_data_path is not None:
        train_blend = _checked_blend(data_path, "--data-path")
        valid_blend = _checked_blend(valid_data_path, "--valid-data-path")
        blends = {"blend_per_split": [train_blend, valid_blend, None]}
        prefixes = train_blend[0] + valid_blend[0]
    else:
        blend = _checked_blend(data_path, "--data-path")
        _check_split_nonempty(blend[0], split)
        blends = {"blend": blend, "split": split}
        prefixes = blend[0]

    fixed = None
    if fixed_train_set is not None:
        if data_path is None:
            train_prefixes, ranges = [default.train_prefix], None
        elif valid_data_path is not None:
            train_prefixes, ranges = train_blend[0], None
        else:
            train_prefixes = blend[0]
            bookends = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
            ranges = [(round(bookends[0] * n), round(bookends[1] * n))
                      for n in (_num_sequences(q) for q in train_prefixes)]
        fixed = FixedTrainSet.from_prefixes(train_prefixes, ranges, seq_length, fixed_train_set, train_samples)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        path_to_cache=os.path.join(cache_dir, "gpt_index_cache", _fingerprint(prefixes)),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        **blends,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [fixed_train_set or train_samples, valid_samples, 0], lambda: True, config
    ).build()
    return (fixed or train), valid


class MicroBatchSampler(torch.utils.data.Sampler):
    """Sample indices of this rank's micro-batches from ``start_sample`` on, in megatron's order
    (the module docstring): the batch sampler of :func:`batch_loader`, the indices of :func:`batches`."""

    def __init__(self, num_samples: int, start_sample: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1):
        step = micro_batch_size * dp_size
        if micro_batch_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need micro_batch_size > 0 and 0 <= dp_rank < dp_size, got {micro_batch_size}, {dp_rank}, {dp_size}"
            )
        if start_sample < 0 or start_sample % step:
            raise ValueError(
                f"start_sample={start_sample} must be a non-negative multiple of micro_batch_size*dp_size={step}"
            )
        self.num_samples, self.start, self.mbs, self.rank, self.step = num_samples, start_sample, micro_batch_size, dp_rank, step

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.start, self.num_samples - self.step + 1, self.step):
            lo = first + self.rank * self.mbs
            yield list(range(lo, lo + self.mbs))

    def __len__(self) -> int:
        return max(0, (self.num_samples - self.start) // self.step)


def _stack(items: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def batch_loader(
    dataset: torch.utils.data.Dataset,
    start_sample: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`batches` through a ``torch.utils.data.DataLoader``: ``num_workers`` worker
    processes (``--num-workers``) read and stack micro-batches ahead of the training loop, into
    pinned memory with ``pin_memory`` (CUDA: the host-to-device copies can then overlap). The same
    micro-batches, in the same order, as :func:`batches` -- so resuming at ``start_sample`` (the
    samples consumed) is exact whatever the number of workers."""
    sampler = MicroBatchSampler(len(dataset), start_sample, micro_batch_size, dp_rank, dp_size)
    # its own generator: a DataLoader draws its workers' base seed from it, and a draw from torch's
    # default generator would shift the RNG stream a resumed run restores (dropout)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=_stack, num_workers=num_workers, pin_memory=pin_memory,
        prefetch_factor=4 if num_workers else None, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return iter(loader)


def batches(
    dataset: torch.utils.data.Dataset,
    start_sample: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches from sample ``start_sample`` on: dicts of ``[micro_batch_size, seq]`` tensors.

    Each step consumes ``micro_batch_size * dp_size`` samples (rank ``r`` takes the ``r``-th slice;
    see the module docstring), so ``start_sample`` must be a multiple of that. Stops when the dataset
    cannot fill another step. Starting at sample ``k`` yields exactly what starting at 0 yields
    after skipping ``k // (micro_batch_size * dp_size)`` steps.
    """
    for indices in MicroBatchSampler(len(dataset), start_sample, micro_batch_size, dp_rank, dp_size):
        yield _stack([dataset[i] for i in indices])

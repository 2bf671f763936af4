"""--fixed-train-set: the noise-free (full-batch) training set, its windows, its errors, and a smoke run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.arguments import ConfigError, parse_args, validate_args
from pretrain.data import batches, build_train_valid_datasets, load_tokenizer, write_indexed_dataset
from pretrain.data.fixed_set import FixedTrainSet, fixed_windows
from tests.pretrain._launch import TINY, run_pretrain, scalars


def test_windows_are_evenly_spaced_over_the_concatenated_documents():
    docs = [np.arange(0, 50), np.arange(50, 100)]  # one token stream 0..99 across two documents
    w = fixed_windows(docs, seq_length=9, num_sequences=5)
    # offsets floor(k * (100 - 10) / 4): 0, 22, 45, 67, 90 -- the last window ends at the last token
    assert w.tolist() == [list(range(s, s + 10)) for s in (0, 22, 45, 67, 90)]
    assert fixed_windows(docs, 9, 1).tolist() == [list(range(10))]


def test_too_small_data_names_the_flag_and_the_sizes():
    with pytest.raises(ValueError, match=r"--fixed-train-set 4: data.bin holds 30 tokens, fewer than 4 x 10"):
        fixed_windows([np.arange(30)], 9, 4, "data.bin")


def test_items_cycle_through_the_set_as_gpt_dataset_items():
    ds = FixedTrainSet(np.arange(30).reshape(3, 10), length=7)
    assert len(ds) == 7
    assert ds[4]["tokens"].tolist() == list(range(10, 19)) and ds[4]["labels"].tolist() == list(range(11, 20))
    assert ds[6]["tokens"].tolist() == ds[0]["tokens"].tolist()
    assert ds[0]["loss_mask"].tolist() == [1.0] * 9 and ds[0]["position_ids"].tolist() == list(range(9))
    with pytest.raises(IndexError):
        ds[7]


def test_every_full_batch_step_is_the_whole_set_whatever_the_seed(data_cache):
    tok = load_tokenizer(None, str(data_cache))
    sets = [build_train_valid_datasets(None, tok, 32, seed, 5 * 4, 4, cache_dir=str(data_cache),
                                       fixed_train_set=4)[0] for seed in (1234, 7)]
    first = torch.stack([sets[0][i]["tokens"] for i in range(4)])
    # the oracle: megatron's own reader of the training documents, concatenated in file order
    docs = IndexedDataset(str(data_cache / "default_train_text_document"))
    stream = np.concatenate([docs[i] for i in range(len(docs))])
    span = len(stream) - 33
    for k in range(4):
        start = k * span // 3
        assert first[k].tolist() == stream[start:start + 32].tolist()
    for ds in sets:  # every step of a global batch of 4 (two micro-batches of 2) is the same 4 sequences
        steps = list(batches(ds, 0, 2))
        assert len(steps) == 10
        for i in range(0, 10, 2):
            assert torch.equal(torch.cat([steps[i]["tokens"], steps[i + 1]["tokens"]]), first)


def test_data_path_uses_the_training_part_of_the_split(tmp_path, data_cache):
    tok = load_tokenizer(None, str(data_cache))
    prefix = str(tmp_path / "d_text_document")
    write_indexed_dataset([list(range(10 * i + 1, 10 * i + 11)) for i in range(10)], prefix, tok.vocab_size)
    train, _ = build_train_valid_datasets([prefix], tok, 4, 0, 8, 2, cache_dir=str(tmp_path / "c"),
                                          split="80,20,0", fixed_train_set=2)
    # documents 0..7 (tokens 1..80) are the training part; windows of 5 at offsets 0 and 75
    assert train[0]["tokens"].tolist() == [1, 2, 3, 4] and train[1]["labels"].tolist() == [77, 78, 79, 80]


def test_a_set_that_is_no_multiple_of_the_global_batch_is_refused():
    args = parse_args(["--model-size", "tiny", "--global-batch-size", "4", "--micro-batch-size", "2",
                       "--fixed-train-set", "6"])
    with pytest.raises(ConfigError, match="--fixed-train-set 6: must be a positive multiple of --global-batch-size 4"):
        validate_args(args, world_size=1, cuda=False)


def test_noise_free_smoke_only_the_wgrad_recipe_changes_the_updates(tmp_path, data_cache):
    """The noise-free design end to end: full batch on a fixed set, Fprop and Dgrad MXFP4, two Wgrad
    recipes from one seed. Step 1's loss (same weights, same set, same forward) is bit-identical; the
    updates then differ, and a rerun reproduces its losses exactly."""
    common = [*TINY, "--global-batch-size", "4", "--fixed-train-set", "4", "--train-iters", "4", "--eval-interval",
              "4", "--data-cache-dir", str(data_cache), "--seed", "3"]
    losses = {}
    for name, wgrad in (("exact", "fp32"), ("mxfp4", "mxfp4"), ("exact_again", "fp32")):
        tb = tmp_path / name
        run_pretrain([*common, "--precision", f"fprop=mxfp4,dgrad=mxfp4,wgrad={wgrad}", "--tensorboard-dir",
                      str(tb)], nproc=0)
        losses[name] = [v for _, v in sorted(scalars(tb, "lm loss").items())]
    assert losses["exact"][0] == losses["mxfp4"][0]
    assert losses["exact"][1:] != losses["mxfp4"][1:]
    assert losses["exact"] == losses["exact_again"]
    assert losses["exact"][-1] < losses["exact"][0]

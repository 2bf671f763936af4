"""``--num-workers``: the training loop's DataLoader (``pretrain.data.batch_loader``) hands out the
micro-batches of ``batches`` -- megatron's sample order -- whatever the number of worker
processes, so the data position (samples consumed) still resumes exactly."""

import itertools

import pytest
import torch

from pretrain.data import batch_loader, batches, build_train_valid_datasets, load_tokenizer


@pytest.fixture(scope="module")
def train_ds(data_cache):
    tokenizer = load_tokenizer(None, str(data_cache))
    train, _ = build_train_valid_datasets(None, tokenizer, 64, 1234, 64, 4, cache_dir=str(data_cache))
    return train


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_yields_the_batches_of_every_rank_and_resumes_exactly(train_ds, num_workers):
    mbs, dp, steps = 2, 2, 6
    for rank in range(dp):
        expected = list(itertools.islice(batches(train_ds, 0, mbs, rank, dp), steps))
        got = list(itertools.islice(batch_loader(train_ds, 0, mbs, rank, dp, num_workers=num_workers), steps))
        assert _equal(got, expected)
        # resuming at 3 steps' samples gives what the uninterrupted loader gave from step 4 on
        resumed = list(itertools.islice(batch_loader(train_ds, 3 * mbs * dp, mbs, rank, dp, num_workers=num_workers), 3))
        assert _equal(resumed, expected[3:])
    # an independent reference for one micro-batch: dataset items stacked in megatron's order
    first = next(batch_loader(train_ds, 4 * mbs * dp, mbs, 1, dp, num_workers=num_workers))
    lo = 4 * mbs * dp + mbs
    assert torch.equal(first["tokens"], torch.stack([train_ds[lo]["tokens"], train_ds[lo + 1]["tokens"]]))


def test_loader_stops_when_a_step_cannot_be_filled(train_ds):
    n = len(train_ds)
    start = (n // 4 - 1) * 4  # the last whole step of micro-batch 2 x DP 2
    assert len(list(batch_loader(train_ds, start, 2, 0, 2, num_workers=2))) == 1
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        batch_loader(train_ds, 3, 2, 0, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_loader_pins_memory_on_cuda(train_ds):
    batch = next(batch_loader(train_ds, 0, 2, num_workers=2, pin_memory=True))
    assert all(t.is_pinned() for t in batch.values())


def test_loader_leaves_torch_s_random_stream_alone(train_ds):
    """Starting a loader draws no number from torch's default generator (a resumed run restores that
    stream from its checkpoint; dropout draws from it)."""
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    next(batch_loader(train_ds, 0, 2, num_workers=2))
    assert torch.equal(torch.rand(3), expected)

"""Data pipeline: stdlib corpus, tokenizer, default cache, preprocess_data CLI, GPTDataset, batches."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.data import (
    DefaultCorpusConfig,
    batches,
    build_default_data,
    build_train_valid_datasets,
    default_cache,
    ensure_dataset_helpers,
    load_tokenizer,
    stdlib_corpus,
    train_tokenizer,
    write_indexed_dataset,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREPROCESS = os.path.join(REPO, "launch", "preprocess_data.py")
SMALL = DefaultCorpusConfig(max_mb=1.0, vocab_size=512, tokenizer_sample_mb=0.5)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data_cache"))
    build_default_data(path, SMALL)
    return path


@pytest.fixture(scope="session")
def tokenizer(cache_dir):
    return load_tokenizer(None, cache_dir, SMALL)


def _run_preprocess(*args, cwd):
    return subprocess.run(
        [sys.executable, PREPROCESS, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120
    )


# === corpus ===


def test_corpus_is_deterministic_capped_and_split_by_file():
    train, valid = stdlib_corpus(max_mb=1.0)
    again_train, again_valid = stdlib_corpus(max_mb=1.0)
    assert train == again_train and valid == again_valid
    train_paths, valid_paths = {d.path for d in train}, {d.path for d in valid}
    assert valid_paths and train_paths and not train_paths & valid_paths
    assert sum(len(d.text.encode()) for d in train + valid) <= 1e6
    assert not any(part in {"test", "tests", "site-packages"} for p in train_paths for part in p.split("/"))


# === tokenizer ===


@pytest.mark.parametrize(
    "text",
    ["def f(x):\n    return  x\n", "\tindent\r\n\n\n  two", "naïve café 日本語 🙂", " leading space", ""],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer.tokenize(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.eod not in ids


def test_tokenizer_training_is_deterministic(tmp_path):
    docs = [d.text for d in stdlib_corpus(max_mb=0.3)[0]]
    a = train_tokenizer(docs, str(tmp_path / "a.model"), vocab_size=512)
    b = train_tokenizer(docs, str(tmp_path / "b.model"), vocab_size=512)
    assert a.sha1 == b.sha1 and a.vocab_size == 512 and a.eod == 2


# === the default cache ===


def test_default_cache_is_built_once(cache_dir):
    manifest = os.path.join(cache_dir, default_cache.MANIFEST)
    before = os.stat(manifest).st_mtime_ns
    data = build_default_data(cache_dir, SMALL)
    assert os.stat(manifest).st_mtime_ns == before
    for prefix in (data.train_prefix, data.valid_prefix):
        assert os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    assert data.manifest["splits"]["valid"]["documents"] >= 1


def test_default_cache_crash_leaves_no_partial_cache(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(default_cache, "write_indexed_dataset", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_default_data(str(tmp_path), SMALL)
    assert sorted(os.listdir(tmp_path)) == [".default_corpus.lock"]
    monkeypatch.undo()
    data = build_default_data(str(tmp_path), SMALL)
    assert os.path.isfile(data.train_prefix + ".bin")


def _rank_builds(rank, cache_dir, init_file, log_dir):
    """Run in a spawned process: two gloo ranks race for an empty cache; log which ones build."""
    import torch.distributed as dist

    real_build = default_cache._build

    def logged_build(*args):
        open(os.path.join(log_dir, f"built_by_{rank}"), "w").close()
        return real_build(*args)

    default_cache._build = logged_build
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    data = build_default_data(cache_dir, SMALL)
    with open(os.path.join(log_dir, f"sha_{rank}"), "w") as f:
        f.write(data.manifest["tokenizer_sha1"])
    dist.destroy_process_group()


def test_default_cache_two_ranks_build_once(tmp_path, cache_dir):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    args = (str(tmp_path / "cache"), str(tmp_path / "init"), str(log_dir))
    torch.multiprocessing.spawn(_rank_builds, args=args, nprocs=2)
    assert sorted(os.listdir(log_dir)) == ["built_by_0", "sha_0", "sha_1"]
    expected = default_cache._read_manifest(cache_dir)["tokenizer_sha1"]  # deterministic across builds
    assert (log_dir / "sha_0").read_text() == (log_dir / "sha_1").read_text() == expected


# === launch/preprocess_data.py ===


def test_preprocess_jsonl_round_trips_through_indexed_dataset(tmp_path, tokenizer):
    records = [
        {"text": f"doc {i}: " + "x = [1, 2]\n" * (i % 4) + "ünïcode", "title": f"T{i}"} for i in range(40)
    ]
    records[7]["text"] = ""  # an empty document is skipped, not written
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = _run_preprocess(
        "--input", "in.jsonl", "--output-prefix", "out/corpus", "--tokenizer-model", tokenizer.path,
        "--json-keys", "text", "title", "--append-eod", "--workers", "2", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for key in ("text", "title"):
        expected = [tokenizer.tokenize(r[key]) + [tokenizer.eod] for r in records if r[key]]
        written = IndexedDataset(str(tmp_path / "out" / f"corpus_{key}_document"))
        assert len(written) == len(expected)
        for i, ids in enumerate(expected):
            assert written[i].tolist() == ids


def test_preprocess_text_files_with_trained_tokenizer(tmp_path):
    texts = [d.text for d in stdlib_corpus(max_mb=0.2)[0][:6]]
    for i, text in enumerate(texts):
        (tmp_path / f"f{i}.py").write_text(text)
    proc = _run_preprocess(
        "--input", "f*.py", "--output-prefix", "out/py", "--tokenizer-model", "tok.model",
        "--train-tokenizer", "400", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    from pretrain.data import Tokenizer

    tok = Tokenizer(str(tmp_path / "tok.model"))
    written = IndexedDataset(str(tmp_path / "out" / "py_text_document"))
    assert [written[i].tolist() for i in range(len(written))] == [tok.tokenize(t) for t in texts]


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--input", "missing.jsonl"], "--input"),
        (["--tokenizer-model", "missing.model"], "--tokenizer-model"),
        (["--json-keys", "body"], "--json-keys"),
        (["--train-tokenizer", "400"], "--tokenizer-model"),  # refuses to overwrite an existing model
        (["--workers", "0"], "--workers"),
        (["--tokenizer-model", "in.jsonl"], "--tokenizer-model"),  # not a sentencepiece model
    ],
)
def test_preprocess_refuses_bad_inputs_in_one_line(tmp_path, tokenizer, args, flag):
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    base = {"--input": "in.jsonl", "--output-prefix": "out/x", "--tokenizer-model": tokenizer.path}
    base.update(dict(zip(args[::2], args[1::2])))
    proc = _run_preprocess(*[x for kv in base.items() for x in kv], cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


# === GPTDataset and batches ===


def _samples(dataset, n):
    return [dataset[i]["tokens"] for i in range(n)]


def test_gpt_dataset_samples_have_shape_and_are_deterministic(tmp_path, cache_dir, tokenizer):
    train, valid = build_train_valid_datasets(
        None, tokenizer, 32, 1234, 50, 8, cache_dir=cache_dir, default_corpus=SMALL
    )
    assert len(train) >= 50 and len(valid) >= 8
    item = train[3]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert all(v.shape == (32,) for v in item.values())
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert int(item["tokens"].max()) < tokenizer.vocab_size

    # Same seed from a fresh index cache: same samples. Another seed: another order.
    data = build_default_data(cache_dir, SMALL)
    fresh = str(tmp_path / "fresh")
    same, _ = build_train_valid_datasets(
        [data.train_prefix], tokenizer, 32, 1234, 50, 8, cache_dir=fresh, split="100,0,0"
    )
    other, none = build_train_valid_datasets(
        [data.train_prefix], tokenizer, 32, 99, 50, 8, cache_dir=fresh, split="100,0,0"
    )
    assert none is None
    assert all(torch.equal(a, b) for a, b in zip(_samples(train, 20), _samples(same, 20)))
    assert not all(torch.equal(a, b) for a, b in zip(_samples(train, 20), _samples(other, 20)))


def test_user_data_split_valid_path_and_blend(tmp_path, tokenizer):
    rng = np.random.default_rng(0)
    docs = [
        rng.integers(3, tokenizer.vocab_size, size=int(n)).tolist() for n in rng.integers(5, 60, size=100)
    ]
    a, b, c = (str(tmp_path / name) for name in "abc")
    write_indexed_dataset(docs, a, tokenizer.vocab_size, eod=tokenizer.eod)
    write_indexed_dataset(docs[50:], b, tokenizer.vocab_size, eod=tokenizer.eod)
    write_indexed_dataset(docs[:10], c, tokenizer.vocab_size, eod=tokenizer.eod)
    cache = str(tmp_path / "cache")
    train, valid = build_train_valid_datasets([a], tokenizer, 16, 1, 40, 5, cache_dir=cache, split="90,10,0")
    assert len(train) >= 40 and len(valid) >= 5
    train, valid = build_train_valid_datasets(
        [a], tokenizer, 16, 1, 40, 5, cache_dir=cache, valid_data_path=[c]
    )
    assert len(train) >= 40 and valid[0]["tokens"].shape == (16,)
    with pytest.raises(ValueError, match="valid part of .* has no documents"):  # 1% of 10 documents
        build_train_valid_datasets([c], tokenizer, 16, 1, 40, 5, cache_dir=cache, split="99,1,0")

    blend = ["0.7", a, "0.3", b]
    with pytest.raises(ValueError, match="torch.distributed"):
        build_train_valid_datasets(blend, tokenizer, 16, 1, 40, 5, cache_dir=cache, split="90,10,0")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        train, valid = build_train_valid_datasets(
            blend, tokenizer, 16, 1, 40, 5, cache_dir=cache, split="90,10,0"
        )
    finally:
        torch.distributed.destroy_process_group()
    assert len(train) == 40 and len(valid) >= 5


def test_missing_data_path_is_one_line_error(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError) as err:
        build_train_valid_datasets([str(tmp_path / "nope")], tokenizer, 16, 1, 10, 2, cache_dir=str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and "--data-path" in message and str(tmp_path / "nope.bin") in message


def test_default_data_refuses_a_foreign_tokenizer(tmp_path, cache_dir):
    foreign = train_tokenizer([d.text for d in stdlib_corpus(0.2)[0]], str(tmp_path / "t.model"), 400)
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_train_valid_datasets(None, foreign, 16, 1, 10, 2, cache_dir=cache_dir, default_corpus=SMALL)


def test_batches_resume_and_split_across_data_parallel_ranks(cache_dir, tokenizer):
    train, _ = build_train_valid_datasets(
        None, tokenizer, 16, 7, 64, 4, cache_dir=cache_dir, default_corpus=SMALL
    )
    mbs, dp = 2, 2
    per_rank = [list(itertools.islice(batches(train, 0, mbs, r, dp), 6)) for r in range(dp)]
    assert per_rank[0][0]["tokens"].shape == (mbs, 16)
    # step s, rank r holds samples s*mbs*dp + r*mbs + [0, mbs)
    for step in range(3):
        for r in range(dp):
            for j in range(mbs):
                assert torch.equal(
                    per_rank[r][step]["tokens"][j], train[step * mbs * dp + r * mbs + j]["tokens"]
                )
    # resuming at sample k equals skipping k / (mbs*dp) steps
    k = 3 * mbs * dp
    for r in range(dp):
        resumed = list(itertools.islice(batches(train, k, mbs, r, dp), 3))
        skipped = per_rank[r][3:]
        assert all(torch.equal(a[key], b[key]) for a, b in zip(resumed, skipped) for key in a)
    with pytest.raises(ValueError, match="multiple"):
        next(batches(train, 3, mbs, 0, dp))


# === megatron's compiled helpers ===


def test_prebuilt_dataset_helpers_import():
    assert os.path.isfile(ensure_dataset_helpers())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_dataset_helpers_compile_when_not_prebuilt(tmp_path):
    """Hide the prebuilt extension, let ensure_dataset_helpers compile helpers.cpp, compare results."""
    pytest.importorskip("pybind11")
    from megatron.core.datasets import helpers_cpp

    args = (np.array([5, 7, 9, 30], np.int32), np.array([3, 1, 0, 2], np.int32), 4, 1, 51, True, True)
    expected = helpers_cpp.build_sample_idx_int32(*args).tolist()
    code = f"""
import sys, numpy as np

class HidePrebuilt:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron.core.datasets.helpers_cpp":
            raise ImportError("hidden by the test")

sys.meta_path.insert(0, HidePrebuilt())
from pretrain.data.helpers import ensure_dataset_helpers
path = ensure_dataset_helpers({str(tmp_path)!r})
assert path.startswith({str(tmp_path)!r}), path
from megatron.core.datasets import helpers
print(helpers.build_sample_idx(*{args!r}[:2], 4, 1, 51, True, True).tolist())
""".replace("array(", "np.array(").replace("dtype=int32", "dtype=np.int32")
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected

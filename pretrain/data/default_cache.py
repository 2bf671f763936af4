"""Build-once cache of the built-in data: stdlib corpus -> tokenizer -> indexed datasets.

Layout of ``cache_dir`` after a build::

    tokenizer.model                          sentencepiece BPE, trained on the train split
    default_train_text_document.{bin,idx}    one document per stdlib file, EOD appended
    default_valid_text_document.{bin,idx}
    default_corpus.json                      what was built, and from what; written last
    tokenized-<hash>/                        the same corpus tokenized with a given tokenizer (e.g. a
                                             Hugging Face one): default_*_text_document.{bin,idx} and
                                             its own default_corpus.json, one folder per tokenizer

Safety:

- **Atomic.** Everything is built in ``cache_dir/.build-*`` and renamed into place with the manifest
  ``default_corpus.json`` renamed last; the cache counts as built only when the manifest is there
  and matches the request. A crash leaves no manifest, so the next run rebuilds.
- **No races.** Under ``torch.distributed`` (or with ``is_rank0``/``barrier`` given), only global
  rank 0 builds while the others wait on the barrier. A file lock additionally serializes
  independent processes sharing one cache; a rank that still finds no cache after the barrier
  (node-local ``cache_dir``) builds its own, and the build is deterministic, so every node ends up
  with identical bytes.
- A manifest for different settings (another size cap, vocabulary or interpreter) is rebuilt over.
  With a given tokenizer the folder name and the manifest key hold its ``unique_identifiers``, so
  data tokenized by one tokenizer is never read with another.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from pretrain.data.corpus import DEFAULT_MAX_MB, DEFAULT_VALID_FRACTION, stdlib_corpus, stdlib_root
from pretrain.data.indexed import document_prefix, write_indexed_dataset
from pretrain.data.tokenizer import DEFAULT_SAMPLE_MB, DEFAULT_VOCAB_SIZE, train_tokenizer

logger = logging.getLogger(__name__)

_FORMAT = 1
MANIFEST = "default_corpus.json"
TOKENIZER_FILE = "tokenizer.model"
GIVEN_TOKENIZER_DIR = "tokenized-"  # + a hash of the tokenizer's unique_identifiers


@dataclass(frozen=True)
class DefaultCorpusConfig:
    """Settings of the built-in corpus; any change rebuilds the cache."""

    max_mb: float = DEFAULT_MAX_MB  # size cap on the stdlib text taken (MB = 1e6 bytes)
    vocab_size: int = DEFAULT_VOCAB_SIZE
    valid_fraction: float = DEFAULT_VALID_FRACTION
    tokenizer_sample_mb: float = DEFAULT_SAMPLE_MB  # train-split text the tokenizer is trained on


DEFAULT_CORPUS = DefaultCorpusConfig()


@dataclass(frozen=True)
class DefaultData:
    """Where the built cache lives; prefixes are megatron data paths (no ``.bin``/``.idx``)."""

    tokenizer_model: str  # the trained sentencepiece model, or the given tokenizer's path
    train_prefix: str
    valid_prefix: str
    manifest: dict


def dist_rank0_and_barrier(
    is_rank0: bool | None = None, barrier: Callable[[], None] | None = None
) -> tuple[bool, Callable[[], None]]:
    """Fill in ``is_rank0``/``barrier`` from ``torch.distributed`` when initialized, else (True, no-op)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        is_rank0 = dist.get_rank() == 0 if is_rank0 is None else is_rank0
        barrier = barrier or dist.barrier
    return (True if is_rank0 is None else is_rank0), (barrier or (lambda: None))


def build_default_data(
    cache_dir: str,
    config: DefaultCorpusConfig = DEFAULT_CORPUS,
    *,
    tokenizer=None,
    is_rank0: bool | None = None,
    barrier: Callable[[], None] | None = None,
) -> DefaultData:
    """Make sure the built-in data is in ``cache_dir`` (building it on rank 0 if needed); all ranks call this.

    ``tokenizer`` (anything with ``tokenize_documents``, ``vocab_size``, ``eod``, ``sha1``, ``path`` and
    ``unique_identifiers``, e.g. an ``HFTokenizer``): tokenize the corpus with it instead of training
    a sentencepiece model (``config.vocab_size``/``tokenizer_sample_mb`` are then unused); the data
    lives in ``cache_dir/tokenized-<hash of its unique_identifiers>/``.
    """
    is_rank0, barrier = dist_rank0_and_barrier(is_rank0, barrier)
    if is_rank0:
        _ensure_built(cache_dir, config, tokenizer)
    barrier()
    return _ensure_built(cache_dir, config, tokenizer)


def _identifiers(tokenizer) -> dict:
    return {k: str(v) for k, v in tokenizer.unique_identifiers.items()}


def _data_dir(cache_dir: str, tokenizer) -> str:
    if tokenizer is None:
        return cache_dir
    digest = hashlib.sha1(json.dumps(_identifiers(tokenizer), sort_keys=True).encode()).hexdigest()
    return os.path.join(cache_dir, GIVEN_TOKENIZER_DIR + digest[:16])


def _expected_key(config: DefaultCorpusConfig, tokenizer=None) -> dict:
    key = {"format": _FORMAT, "python": sys.version.split()[0], "stdlib": stdlib_root()}
    if tokenizer is None:
        return {**key, **asdict(config)}
    corpus = {"max_mb": config.max_mb, "valid_fraction": config.valid_fraction}
    return {**key, **corpus, "tokenizer": _identifiers(tokenizer)}


def _paths(cache_dir: str, tokenizer=None) -> DefaultData:
    return DefaultData(
        tokenizer_model=os.path.join(cache_dir, TOKENIZER_FILE) if tokenizer is None else tokenizer.path,
        train_prefix=document_prefix(os.path.join(cache_dir, "default_train")),
        valid_prefix=document_prefix(os.path.join(cache_dir, "default_valid")),
        manifest={},
    )


def _read_manifest(cache_dir: str) -> dict | None:
    try:
        with open(os.path.join(cache_dir, MANIFEST)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@contextmanager
def _file_lock(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_built(cache_dir: str, config: DefaultCorpusConfig, tokenizer=None) -> DefaultData:
    cache_dir = _data_dir(cache_dir, tokenizer)
    paths = _paths(cache_dir, tokenizer)
    key = _expected_key(config, tokenizer)
    manifest = _read_manifest(cache_dir)
    if manifest is None or manifest.get("key") != key:
        os.makedirs(cache_dir, exist_ok=True)
        with _file_lock(os.path.join(cache_dir, ".default_corpus.lock")):
            manifest = _read_manifest(cache_dir)  # another process may have built it meanwhile
            if manifest is None or manifest.get("key") != key:
                manifest = _build(cache_dir, config, key, tokenizer)
    return DefaultData(paths.tokenizer_model, paths.train_prefix, paths.valid_prefix, manifest)


def _build(cache_dir: str, config: DefaultCorpusConfig, key: dict, tokenizer=None) -> dict:
    """Build everything in a scratch directory, then rename it into ``cache_dir``, manifest last."""
    t0 = time.perf_counter()
    for stale in os.listdir(cache_dir):  # left by a crashed build; we hold the lock
        if stale.startswith(".build-"):
            shutil.rmtree(os.path.join(cache_dir, stale), ignore_errors=True)
    old_manifest = os.path.join(cache_dir, MANIFEST)
    if os.path.exists(old_manifest):
        os.remove(old_manifest)
    tokenized_by = tokenizer or "a sentencepiece model trained on it"
    logger.info(
        "building the built-in stdlib corpus in %s (%s), tokenized by %s", cache_dir, config, tokenized_by
    )

    scratch = tempfile.mkdtemp(prefix=".build-", dir=cache_dir)
    try:
        train_docs, valid_docs = stdlib_corpus(config.max_mb, config.valid_fraction)
        if tokenizer is None:
            tokenizer = train_tokenizer(
                [d.text for d in train_docs],
                os.path.join(scratch, TOKENIZER_FILE),
                vocab_size=config.vocab_size,
                sample_mb=config.tokenizer_sample_mb,
            )
        out = _paths(scratch)
        threads = min(8, os.cpu_count() or 1)
        stats = {}
        for split, docs, prefix in (
            ("train", train_docs, out.train_prefix),
            ("valid", valid_docs, out.valid_prefix),
        ):
            ids = tokenizer.tokenize_documents([d.text for d in docs], num_threads=threads)
            writer = write_indexed_dataset(ids, prefix, tokenizer.vocab_size, eod=tokenizer.eod)
            stats[split] = {
                "documents": writer.num_documents,
                "tokens": writer.num_tokens,
                "bytes": sum(len(d.text.encode()) for d in docs),
            }
        manifest = {
            "key": key,
            "splits": stats,
            "valid_files": [d.path for d in valid_docs],
            "tokenizer_sha1": tokenizer.sha1,
            "build_seconds": round(time.perf_counter() - t0, 2),
        }
        with open(os.path.join(scratch, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        for name in sorted(os.listdir(scratch)):
            if name != MANIFEST:
                os.replace(os.path.join(scratch, name), os.path.join(cache_dir, name))
        os.replace(os.path.join(scratch, MANIFEST), os.path.join(cache_dir, MANIFEST))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("built-in corpus ready in %.1fs: %s", manifest["build_seconds"], stats)
    return manifest

"""``launch/preprocess_data.py``'s work: jsonl or plain-text files into megatron-core indexed datasets.

``preprocess(args)`` checks the inputs and the tokenizer (before torch and megatron are imported, so a
bad flag fails in a second), optionally trains a sentencepiece tokenizer first, then tokenizes the
documents in ``args.workers`` processes and writes ``{prefix}_{key}_document.bin/.idx`` per json key in
input order. Every bad input raises :class:`PreprocessError` with one line naming the flag or file.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable

_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


class PreprocessError(ValueError):
    """A bad input: one line naming the flag or file and what would be valid."""


def _strip_compression(path: str) -> str:
    for ext in _COMPRESSED:
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def _resolve_inputs(patterns: list[str]) -> tuple[list[str], bool]:
    """Expand globs, check existence, return (files, is_json); fail on a missing or mixed input."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise PreprocessError(f"--input: no file matches {pattern!r}")
        for path in matches:
            if not os.path.isfile(path):
                raise PreprocessError(f"--input: no such file: {path} (give existing .jsonl/.json or text files, or globs)")
            files.append(path)
    kinds = {_strip_compression(f).endswith(_JSON_SUFFIXES) for f in files}
    if len(kinds) > 1:
        raise PreprocessError("--input: mixes json and text files; preprocess them in separate runs")
    return files, kinds.pop()


def _check_json_keys(files: list[str], keys: list[str]) -> None:
    """Cheap early check of the first record of each plain .jsonl file (before importing datasets)."""
    for path in files:
        if not path.endswith((".jsonl", ".ndjson")):
            continue
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            line = next((ln for ln in f if ln.strip()), None)
        if line is None:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PreprocessError(f"--input: {path}: first record is not valid json ({err.msg}, col {err.colno})")
        if not isinstance(record, dict):
            raise PreprocessError(f"--input: {path}: records must be json objects, got {type(record).__name__}")
        _check_record_keys(record, keys, path)


def _check_record_keys(record: dict, keys: list[str], path: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise PreprocessError(
            f"--json-keys: {missing[0]!r} not in {path} (its records have keys: {', '.join(sorted(record))})"
        )


def _check_tokenizer_model(path: str) -> None:
    """Fail fast (before the heavy torch/megatron imports) on a missing or unreadable model."""
    if os.path.isdir(path):
        raise PreprocessError(
            f"--tokenizer-model: {path} is a directory, not a sentencepiece .model; for a Hugging Face "
            "tokenizer folder add --tokenizer-type HuggingFaceTokenizer"
        )
    if not os.path.isfile(path):
        raise PreprocessError(
            f"--tokenizer-model: no such file: {path} "
            "(give a sentencepiece .model, or add --train-tokenizer VOCAB_SIZE)"
        )
    import sentencepiece as spm  # the flag checks run before any heavy import (the module docstring)

    try:
        spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError):
        raise PreprocessError(f"--tokenizer-model: {path} is not a sentencepiece model file")


# What pretrain.data.hf_tokenizer checks, repeated here to fail before the heavy torch/megatron imports.
_HF_FLAG = "--tokenizer-model (--tokenizer-type HuggingFaceTokenizer)"
_HF_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_HF_HINT = "give a local Hugging Face tokenizer folder, e.g. OUT/hf_tokenizer from launch/convert_hf.py"


def _check_hf_tokenizer_dir(path: str) -> None:
    """Fail fast on a path that is no Hugging Face tokenizer folder (loading it checks the rest)."""
    if os.path.isfile(path):
        raise PreprocessError(f"{_HF_FLAG}: {path} is a file, not a tokenizer folder ({_HF_HINT})")
    if not os.path.isdir(path):
        raise PreprocessError(f"{_HF_FLAG}: no such directory: {path} ({_HF_HINT})")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _HF_FILES):
        raise PreprocessError(f"{_HF_FLAG}: {path} has none of {', '.join(_HF_FILES)} ({_HF_HINT})")


# Per-worker encoder (texts -> token ids per text), loaded once per process.
_WORKER_ENCODE = None


def _init_worker(model_path: str, tokenizer_type: str) -> None:
    global _WORKER_ENCODE
    if tokenizer_type == "HuggingFaceTokenizer":
        from pretrain.data.hf_tokenizer import HFTokenizer  # in the worker process: its own start-up

        _WORKER_ENCODE = HFTokenizer(model_path).tokenize_documents  # Megatron-LM's: special tokens kept
    else:
        import sentencepiece as spm  # in the worker process: its own start-up

        _WORKER_ENCODE = spm.SentencePieceProcessor(model_file=model_path).encode


def _encode_batch(texts: list[str]) -> list[list[int]]:
    return _WORKER_ENCODE(texts)


def _records(files: list[str], is_json: bool, sample_by: str):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from datasets import load_dataset  # seconds at start-up; after the flag checks, HF offline set first

    if is_json:
        return load_dataset("json", data_files=files, split="train", streaming=True)
    return load_dataset("text", data_files=files, split="train", streaming=True, sample_by=sample_by)


def _text_batches(records, keys: list[str], source: str, batch_size: int = 256):
    """Yields lists of {key: text} dicts; fails with one line on a record whose key is missing or not text."""
    batch = []
    for record in records:
        for key in keys:
            value = record.get(key)
            if value is None:  # HF fills keys absent from a record with None
                raise PreprocessError(f"--json-keys: {key!r} is missing or null in a record of {source}")
            if not isinstance(value, str):
                raise PreprocessError(f"--json-keys: {key!r} holds {type(value).__name__}, not text, in a record of {source}")
        batch.append({k: record[k] for k in keys})
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _train_tokenizer(records, args, source: str) -> str:
    """Train ``--tokenizer-model`` on the first ``--tokenizer-sample-mb`` MB; returns the line to log."""
    # pretrain.data loads torch and megatron: only after the flag checks
    from pretrain.data.tokenizer import train_tokenizer

    budget, sample = args.tokenizer_sample_mb * 1e6, []
    for batch in _text_batches(records, args.json_keys[:1], source):
        sample.extend(r[args.json_keys[0]] for r in batch)
        budget -= sum(len(r[args.json_keys[0]]) for r in batch)
        if budget <= 0:
            break
    try:
        train_tokenizer(
            sample, args.tokenizer_model, args.train_tokenizer, sample_mb=args.tokenizer_sample_mb
        )
    except ValueError as err:
        raise PreprocessError(str(err)) from None
    return f"trained tokenizer: {args.tokenizer_model} (vocab {args.train_tokenizer}, {len(sample)} documents)"


def _encoded(batches, keys: list[str], model_path: str, tokenizer_type: str, workers: int):
    """Yields (key, token ids per document) in input order, tokenized in a worker pool if workers > 1."""
    if workers == 1:
        _init_worker(model_path, tokenizer_type)
        for batch in batches:
            for key in keys:
                yield key, _encode_batch([r[key] for r in batch])
        return
    with mp.get_context("spawn").Pool(workers, _init_worker, (model_path, tokenizer_type)) as pool:
        jobs = ([r[key] for r in batch] for batch in batches for key in keys)
        for i, ids in enumerate(pool.imap(_encode_batch, jobs, chunksize=4)):
            yield keys[i % len(keys)], ids


def preprocess(args, log: Callable[[str], None] = print) -> list:
    """Run ``launch/preprocess_data.py``'s parsed ``args``; ``log`` gets the progress lines. Returns the
    closed ``pretrain.data.indexed.IndexedWriter`` of each key (prefix, documents, tokens, empty)."""
    files, is_json = _resolve_inputs(args.input)
    if args.workers < 1:
        raise PreprocessError(f"--workers: must be >= 1, got {args.workers}")
    hf = args.tokenizer_type == "HuggingFaceTokenizer"
    if args.train_tokenizer is not None:
        if hf:
            raise PreprocessError(
                "--train-tokenizer trains a sentencepiece model; with --tokenizer-type HuggingFaceTokenizer "
                "give an existing tokenizer folder as --tokenizer-model instead"
            )
        if args.train_tokenizer < 260:
            raise PreprocessError(
                "--train-tokenizer: vocabulary size must be >= 260 (256 byte pieces + 4 special ids), "
                f"got {args.train_tokenizer}"
            )
        if os.path.exists(args.tokenizer_model):
            raise PreprocessError(
                f"--tokenizer-model: {args.tokenizer_model} exists; --train-tokenizer will not overwrite it"
            )
    elif hf:
        _check_hf_tokenizer_dir(args.tokenizer_model)
    else:
        _check_tokenizer_model(args.tokenizer_model)
    keys = args.json_keys if is_json else ["text"]
    if is_json:
        _check_json_keys(files, keys)
    source = files[0] if len(files) == 1 else f"{len(files)} input files"

    t0 = time.perf_counter()
    if args.train_tokenizer is not None:
        log(_train_tokenizer(_records(files, is_json, args.text_sample_by), args, source))

    # torch and megatron (through pretrain.data) only once the inputs are known good: seconds at start-up
    from pretrain.data.hf_tokenizer import HFTokenizer
    from pretrain.data.indexed import IndexedWriter, document_prefix
    from pretrain.data.tokenizer import Tokenizer

    try:
        tokenizer = (HFTokenizer if hf else Tokenizer)(args.tokenizer_model)
    except (ValueError, FileNotFoundError) as err:
        raise PreprocessError(str(err)) from None
    eod = tokenizer.eod if args.append_eod else None
    batches = _text_batches(_records(files, is_json, args.text_sample_by), keys, source)
    with contextlib.ExitStack() as stack:  # on any failure the writers delete their partial files
        writers = {
            k: stack.enter_context(
                IndexedWriter(document_prefix(args.output_prefix, k), tokenizer.vocab_size, eod)
            )
            for k in keys
        }
        for key, ids in _encoded(batches, keys, tokenizer.path, args.tokenizer_type, args.workers):
            for doc in ids:
                writers[key].add(doc)
    for writer in writers.values():
        empty = f", {writer.num_empty} empty skipped" if writer.num_empty else ""
        log(f"{writer.prefix}.bin/.idx: {writer.num_documents} documents, {writer.num_tokens} tokens{empty}")
    log(f"done in {time.perf_counter() - t0:.1f}s")
    return list(writers.values())

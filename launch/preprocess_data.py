"""Turn jsonl or plain-text files into megatron-core indexed datasets (``.bin/.idx``).

    python launch/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model tok.model --append-eod --workers 4
    # -> data/corpus_text_document.bin/.idx, usable as --data-path data/corpus_text_document

    python launch/preprocess_data.py --input qat.jsonl --output-prefix data/qat \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model OUT/hf_tokenizer --append-eod
    # a local Hugging Face tokenizer folder (launch/convert_hf.py writes OUT/hf_tokenizer); train on
    # it with the same --tokenizer-type/--tokenizer-model. Vocabularies of 65500+ ids store int32.

Inputs are read with HF ``datasets`` in streaming mode (no Arrow cache, never the network):
``*.jsonl``/``*.json`` (optionally ``.gz``/``.bz2``/``.xz``/``.zst``) as json, one document per record
and one output per ``--json-keys`` key; anything else as text, one document per file (or per
line/paragraph with ``--text-sample-by``). Documents are tokenized in ``--workers`` processes and
written in input order, so the output does not depend on the worker count.

``--train-tokenizer VOCAB_SIZE`` first trains a sentencepiece BPE model on the first
``--tokenizer-sample-mb`` MB of the input (first key) and writes it to ``--tokenizer-model``.
"""

from __future__ import annotations

import argparse
import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain.preprocess import PreprocessError, preprocess

_PROG = "preprocess_data.py"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", nargs="+", required=True, help="input files or glob patterns (jsonl/json or text)"
    )
    p.add_argument(
        "--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx per json key"
    )
    p.add_argument(
        "--tokenizer-model",
        required=True,
        help="sentencepiece .model (written with --train-tokenizer), or a Hugging Face tokenizer folder "
        "with --tokenizer-type HuggingFaceTokenizer",
    )
    p.add_argument(
        "--tokenizer-type",
        choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"],
        default="SentencePieceTokenizer",
        help="what --tokenizer-model is (default SentencePieceTokenizer)",
    )
    p.add_argument("--json-keys", nargs="+", default=["text"], help="json fields to tokenize (default: text)")
    p.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document id to every document"
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument(
        "--train-tokenizer", type=int, metavar="VOCAB_SIZE", help="train a tokenizer on the input first"
    )
    p.add_argument(
        "--tokenizer-sample-mb", type=float, default=4.0, help="input MB used by --train-tokenizer"
    )
    p.add_argument(
        "--text-sample-by", choices=["document", "line", "paragraph"], default="document",
        help="for text inputs: one document per file (default), per line, or per blank-line-separated paragraph",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    try:
        preprocess(args)  # prints its progress lines
    except PreprocessError as err:  # one line on stderr, exit status 2
        print(f"{_PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

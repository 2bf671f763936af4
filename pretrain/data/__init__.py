"""Data for pretraining: tokenizer, megatron indexed datasets, GPTDataset samples, batches.

Two ways in, one path through::

    your jsonl/text --launch/preprocess_data.py--> PREFIX_text_document.{bin,idx} --+
                                                                                      +--> GPTDataset --> batches()
    (no --data-path) stdlib *.py --tokenizer--> cache_dir/default_*_text_document --+

Typical use from a training loop (all ranks call the same functions)::

    tokenizer = load_tokenizer(args.tokenizer_model, cache_dir,        # None -> built-in corpus's
                               tokenizer_type=args.tokenizer_type)     # or "HuggingFaceTokenizer"
    train_ds, valid_ds = build_train_valid_datasets(
        args.data_path, tokenizer, args.seq_length, args.seed,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=args.eval_iters * args.global_batch_size, cache_dir=cache_dir)
    for batch in batches(train_ds, consumed_samples, args.micro_batch_size, dp_rank, dp_size):
        batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]  # [mbs, seq]

Modules: ``corpus`` (the stdlib corpus and its split), ``tokenizer`` (sentencepiece wrapper and
training), ``hf_tokenizer`` (a local Hugging Face tokenizer behind the same interface), ``indexed``
(writing ``.bin/.idx``), ``default_cache`` (build-once, atomic, rank-safe cache of the built-in
data), ``helpers`` (megatron's compiled dataset helpers), ``gpt_data`` (GPTDataset construction
and the batch iterator, with the sample-order contract).
"""

from pretrain.data.corpus import Document, stdlib_corpus
from pretrain.data.default_cache import DefaultCorpusConfig, DefaultData, build_default_data
from pretrain.data.gpt_data import batch_loader, batches, build_train_valid_datasets, load_tokenizer
from pretrain.data.helpers import ensure_dataset_helpers
from pretrain.data.hf_tokenizer import HFTokenizer
from pretrain.data.indexed import IndexedWriter, check_indexed_prefix, document_prefix, write_indexed_dataset
from pretrain.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "DefaultCorpusConfig",
    "DefaultData",
    "Document",
    "HFTokenizer",
    "IndexedWriter",
    "Tokenizer",
    "batch_loader",
    "batches",
    "build_default_data",
    "build_train_valid_datasets",
    "check_indexed_prefix",
    "document_prefix",
    "ensure_dataset_helpers",
    "load_tokenizer",
    "stdlib_corpus",
    "train_tokenizer",
    "write_indexed_dataset",
]

"""``--pretrained-checkpoint``: QAT training that starts from a converted Hugging Face model.

A tiny random Llama (transformers, built locally, vocabulary = the built-in tokenizer's 4096) is
saved as safetensors and converted with ``launch/convert_hf.py``. ``launch/pretrain.py`` then
takes the model shape from the converted file, loads its weights sharded over TP=2, and trains
with the HiF8 QAT recipe (BF16 warm-up, switch). The first iteration's loss (BF16 warm-up: every
GEMM operand rounded to bf16, FP32 accumulation) must be transformers' float32 loss of the same
global batch to bf16 accuracy -- which a randomly initialised model would miss by ~1.5 nats.
Re-running the same command line resumes from ``--load`` instead of starting over.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.pretrain._launch import run_pretrain
from tests.pretrain._launch import scalars as read_scalar

VOCAB = 4096  # pretrain.data.tokenizer.DEFAULT_VOCAB_SIZE: the built-in corpus's tokenizer (conftest)
RUN = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-5",
       "--min-lr", "1e-6", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
       "--precision", "hif8_w8a8", "--qat-warmup-iters", "1", "--tensor-model-parallel-size", "2",
       # 2 layers: hif8_w8a8's own rules would keep every linear in BF16 (a run that is refused)
       "--precision-rule", "kind:mlp=hif8_w8a8"]  # fmt: skip


def _first_global_batch(data_cache, train_iters: int):
    """The 4 samples iteration 1 trains on (megatron's sample order, as pretrain.data serves them)."""
    from pretrain.data import batches, build_train_valid_datasets, load_tokenizer

    tok = load_tokenizer(None, str(data_cache))
    train_ds, _ = build_train_valid_datasets(None, tok, 64, 1234, train_samples=train_iters * 4,
                                             valid_samples=4, cache_dir=str(data_cache))
    mb = next(batches(train_ds, 0, 4, 0, 1))
    return mb["tokens"], mb["labels"], mb["loss_mask"].float()


@pytest.mark.slow
def test_qat_from_converted_hf_checkpoint_tp2_and_resume(converted, data_cache, tmp_path):
    out_dir, hf_model = converted
    save, tb = tmp_path / "qat", tmp_path / "tb"
    argv = [*RUN, "--pretrained-checkpoint", str(out_dir), "--train-iters", "3", "--data-cache-dir",
            str(data_cache), "--save", str(save), "--load", str(save), "--tensorboard-dir", str(tb)]
    first = run_pretrain([*argv, "--exit-interval", "2"], nproc=2).stdout
    assert "--pretrained-checkpoint: initial weights from" in first and "hf_converted" in first
    assert "iteration 2: QAT warm-up done" in first

    tokens, labels, mask = _first_global_batch(data_cache, 3)
    with torch.no_grad():
        logits = hf_model(tokens).logits.float()
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    hf_loss = float((per_token * mask.reshape(-1)).sum() / mask.sum())
    ours = read_scalar(tb, "lm loss")[1]
    assert ours == pytest.approx(hf_loss, abs=5e-3), (ours, hf_loss)

    again = run_pretrain(argv, nproc=2).stdout  # the same command line: resumes, does not reload
    assert "resumed from" in again and "initial weights from" not in again
    assert sorted(read_scalar(tb, "lm loss")) == [1, 2, 3]


def test_shape_flags_must_agree_with_the_checkpoint(converted, tmp_path):
    out_dir, _ = converted
    proc = run_pretrain([*RUN, "--pretrained-checkpoint", str(out_dir), "--train-iters", "1",
                         "--hidden-size", "64"], nproc=0, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"pretrain.py: error: --hidden-size 64 disagrees with --pretrained-checkpoint {out_dir} (128); "
        "drop the flag (the shape comes from the checkpoint)"
    )
    proc = run_pretrain(["--pretrained-checkpoint", str(tmp_path), "--seq-length", "64", "--train-iters", "1"],
                        nproc=0, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "neither a launch/convert_hf.py output" in proc.stderr


@pytest.mark.slow
def test_pretrained_training_checkpoint_of_another_tp_size(data_cache, tmp_path):
    """A TP=2 training checkpoint starts a TP=1 run: shape and tokenizer come from the checkpoint
    (no shape flags given), the weights are resharded, and the first loss continues from its last."""
    from tests.pretrain._launch import TINY

    base, tb = tmp_path / "base", tmp_path / "tb_base"
    run_pretrain([*TINY, "--train-iters", "3", "--data-cache-dir", str(data_cache), "--save", str(base),
                  "--tensorboard-dir", str(tb), "--tensor-model-parallel-size", "2"], nproc=2)
    tb2 = tmp_path / "tb_next"
    out = run_pretrain(["--pretrained-checkpoint", str(base), "--seq-length", "64", "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-9", "--eval-iters", "0",
                        "--data-cache-dir", str(data_cache), "--tensorboard-dir", str(tb2)], nproc=0).stdout
    assert f"initial weights from {base} (checkpoint, iteration 3)" in out
    assert "world size 1 = TP 1 x PP 1 x DP 1" in out
    first = read_scalar(tb2, "lm loss")[1]
    untrained = read_scalar(tb, "lm loss")[1]
    assert first < untrained - 0.5  # the trained weights, not a fresh initialization

"""``--ckpt-format torch_dist``: megatron-core ``dist_checkpointing`` checkpoints (``pretrain.dist_checkpoint``).

One TP=2 run (``bf16``, 4 iterations, checkpoints at 2 and 4) is shared: resumed at TP=2 (bit-identical
losses), loaded at TP=1 by a one-process run (no resharder: megatron's loader reshards), read back by
torch DCP's own reader, and loaded into a plain megatron-core GPTModel. In-process tests (one rank)
check atomic publication, checksums and retention; ``--no-load-optim`` / ``--no-load-rng`` are shown
for both formats."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from pretrain.checkpointing import (
    CHECKSUMS,
    RUN_CONFIG,
    TOKENIZER_DIR,
    TRACKER,
    CheckpointError,
    CheckpointSaveError,
    load_checkpoint,
    read_tracker,
)
from pretrain.dist_checkpoint import (
    METADATA,
    WRITER_DCP,
    is_dist_checkpoint,
    load_dist_state,
    save_dist_checkpoint,
)

from ._launch import TINY, run_pretrain, scalars

BASE = ["--train-iters", "4", *TINY, "--precision", "bf16", "--gemm-backend", "reference", "--eval-interval", "2",
        "--ckpt-format", "torch_dist"]  # fmt: skip


def _series(tb, kind: str) -> dict[int, float]:
    """The run's training loss or grad norm: Megatron-LM's scalar names, or the earlier ones."""
    megatron, ours = {"loss": ("lm loss", "train/loss"), "grad_norm": ("grad-norm", "train/grad_norm")}[kind]
    try:
        return scalars(tb, megatron)
    except KeyError:
        return scalars(tb, ours)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, data_cache):
    """A TP=2 torch_dist run: checkpoints at iterations 2 and 4, TensorBoard in ``tb``."""
    out = tmp_path_factory.mktemp("tp2_run")
    run_pretrain(BASE + ["--tensor-model-parallel-size", "2", "--save-interval", "2", "--save", str(out),
                         "--tensorboard-dir", str(out / "tb"), "--data-cache-dir", str(data_cache)])  # fmt: skip
    return out


def test_layout_metadata_and_checksums(tp2_run):
    ckpt = tp2_run / "iter_0000002"
    assert read_tracker(str(tp2_run)) == 4 and is_dist_checkpoint(str(ckpt))
    assert not any(n.startswith("mp_rank_") for n in os.listdir(ckpt))
    assert json.loads((ckpt / METADATA).read_text())["sharded_backend"] == "torch_dist"  # megatron's marker
    sums = json.loads((ckpt / CHECKSUMS).read_text())
    on_disk = {os.path.relpath(os.path.join(r, n), ckpt) for r, _, ns in os.walk(ckpt) for n in ns} - {CHECKSUMS}
    assert set(sums["files"]) == on_disk and {"common.pt", ".metadata", METADATA, RUN_CONFIG} <= on_disk
    assert any(n.endswith(".distcp") for n in on_disk) and any(n.startswith(TOKENIZER_DIR + "/") for n in on_disk)
    assert (sums["format"], sums["writer"]) == ("torch_dist", WRITER_DCP)  # no CUDA here: torch DCP wrote it
    common = torch.load(ckpt / "common.pt", weights_only=False)
    assert (common["checkpoint_format"], common["checkpoint_writer"], common["iteration"]) == ("torch_dist", WRITER_DCP, 2)
    assert "model" not in common and common["args"]["tensor_model_parallel_size"] == 2


def test_resume_at_tp2_is_bit_identical(tp2_run, tmp_path, data_cache):
    run = run_pretrain(BASE + ["--tensor-model-parallel-size", "2", "--load", str(tp2_run), "--ckpt-step", "2",
                               "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-dir", str(data_cache)])  # fmt: skip
    assert f"resumed from {tp2_run / 'iter_0000002'}: iteration 2, 8 samples consumed" in run.stdout
    straight = _series(tp2_run / "tb", "loss")
    assert _series(tmp_path / "tb", "loss") == {k: v for k, v in straight.items() if k > 2}  # float equality
    assert _series(tmp_path / "tb", "grad_norm") == {
        k: v for k, v in _series(tp2_run / "tb", "grad_norm").items() if k > 2}


def test_tp2_checkpoint_resumes_at_tp1_without_the_resharder(tp2_run, tmp_path, data_cache, monkeypatch):
    """One process (TP=1) resumes the TP=2 checkpoint, optimizer state included: megatron's loader
    reshards. Losses agree with the TP=2 run to float rounding (TP=2 sums partial products in
    another order), not bit for bit."""
    run = run_pretrain(BASE + ["--load", str(tp2_run), "--ckpt-step", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                               "--data-cache-dir", str(data_cache)], nproc=0)  # fmt: skip
    assert "resumed from" in run.stdout and "RNG states not restored" in run.stdout
    straight = _series(tp2_run / "tb", "loss")
    resumed = _series(tmp_path / "tb", "loss")
    assert sorted(resumed) == [3, 4]
    for k in resumed:
        assert resumed[k] == pytest.approx(straight[k], rel=1e-5, abs=0)


def _dcp_global(ckpt_dir) -> dict:
    """Every tensor of a torch_dist checkpoint whole, read by torch DCP's own converter (an oracle
    independent of megatron's loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(ckpt_dir, "..", "whole.pt")
    dcp_to_torch_save(str(ckpt_dir), out)
    return torch.load(out, weights_only=False)


def test_tp1_load_matches_torch_dcp_reading_the_whole_tensors(tp2_run, world_of_one):
    ckpt = load_checkpoint(str(tp2_run), tp_size=1)  # the model built from model_config, loaded at TP=1
    assert ckpt["resharded"] and ckpt["iteration"] == 4 and "optimizer" not in ckpt
    whole = _dcp_global(tp2_run / "iter_0000004")
    sd = ckpt["model"]
    assert torch.equal(sd["embedding.word_embeddings.weight"], whole["embedding.word_embeddings.weight"])
    for layer in range(2):
        for name in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            assert torch.equal(sd[f"decoder.layers.{layer}.{name}"], whole[f"decoder.layers.{name}"][layer]), name
    # the quantization state of every policy linear travelled (TP rank 0's), the output layer's too
    assert sd["output_layer._extra_state"]["name"] == "output_layer"
    assert sd["decoder.layers.1.mlp.linear_fc2._extra_state"]["calls"]["wgrad"] > 0


class _CpuBuffer:
    """megatron's global memory buffer, allocating on the CPU (its own allocates on CUDA)."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


def test_plain_megatron_gptmodel_loads_our_bf16_checkpoint_and_gives_our_logits(tp2_run, world_of_one, monkeypatch):
    """A Megatron user's model -- GPTModel from megatron's own local layer spec, no policy layers --
    loads the TP=2 checkpoint at TP=1 with megatron's ``dist_checkpointing.load``: every weight equal
    to the one our model loads, and the logits our model gives under the ``fp32`` plan (exact FP32
    GEMMs, as megatron's local linears compute) to FP32 rounding: not bit for bit, because its core
    attention is megatron's ``DotProductAttention`` (baddbmm, then softmax) and ours torch's
    ``scaled_dot_product_attention`` -- the same function, summed in another order. Under the run's
    ``bf16`` plan our GEMMs round their operands to BF16, so those logits differ from FP32 ones by
    BF16 rounding (checked loosely)."""
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from model.gpt import (
        ModelConfig,
        PortableRotaryEmbedding,
        apply_precision_plan,
        build_gpt,
        padded_vocab_size,
        policy_linear_names,
        transformer_config,
    )
    from precision.policy import PrecisionPolicy

    ckpt_dir = str(tp2_run / "iter_0000004")
    cfg = ModelConfig(**torch.load(os.path.join(ckpt_dir, "common.pt"), weights_only=False)["model_config"])
    torch.manual_seed(0)
    plain = GPTModel(transformer_config(cfg), get_gpt_layer_local_spec(normalization=cfg.normalization),
                     vocab_size=padded_vocab_size(cfg, 1), max_sequence_length=cfg.seq_length,
                     share_embeddings_and_output_weights=not cfg.untie_embeddings,
                     position_embedding_type=cfg.position_embedding, rotary_base=cfg.rotary_base)  # fmt: skip
    if not torch.cuda.is_available():  # megatron-core 0.16 computes two things on CUDA only, neither a weight:
        plain.rotary_pos_emb.__class__ = PortableRotaryEmbedding  # RoPE frequencies (ours: CUDA only where it exists)
        monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _CpuBuffer())  # attention scores
        # attention dropout forks megatron's CUDA RNG tracker (p = 0 here, in eval mode: nothing is drawn)
        monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    loaded = dist_checkpointing.load({"model": plain.sharded_state_dict()}, ckpt_dir)
    plain.load_state_dict(loaded["model"], strict=False)  # its linears' _extra_state entries are None
    ours = build_gpt(cfg)
    ckpt = load_checkpoint(str(tp2_run), tp_size=1)
    ours.load_state_dict(ckpt["model"], strict=True)
    for name, p in plain.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(p, ckpt["model"][name]), name

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    pos = torch.arange(cfg.seq_length).expand(2, -1)
    plain.eval(), ours.eval()
    with torch.no_grad():
        causal = torch.triu(torch.ones(cfg.seq_length, cfg.seq_length, dtype=torch.bool), 1)[None, None]
        theirs = plain(tokens, pos, causal)  # Megatron-LM's mask (True: masked out); megatron's default is on CUDA
        apply_precision_plan(ours, PrecisionPolicy.from_args("fp32").resolve(policy_linear_names(ours), cfg.num_layers))
        torch.testing.assert_close(ours(tokens, pos, None), theirs, rtol=1e-5, atol=1e-5)
        apply_precision_plan(ours, PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(ours), cfg.num_layers))
        torch.testing.assert_close(ours(tokens, pos, None), theirs, rtol=0.05, atol=0.05)


# === in-process: atomicity, checksums, retention ===


def _tiny_model():
    from model.gpt import ModelConfig, build_gpt

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=2,
                      seq_length=16, vocab_size=128)  # fmt: skip
    return build_gpt(cfg), cfg


def _state(cfg, it):
    import dataclasses

    return {"args": {"tensor_model_parallel_size": 1}, "model_config": dataclasses.asdict(cfg), "iteration_note": it}


def test_dist_save_is_atomic_checked_and_retained(tmp_path, monkeypatch, world_of_one):
    model, cfg = _tiny_model()
    save_dir = str(tmp_path / "ckpt")
    assert save_dist_checkpoint(save_dir, 1, _state(cfg, 1), model, None) == os.path.join(save_dir, "iter_0000001")
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", TRACKER]
    first = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystemWriter.write_data

    def crash(self, plan, planner):  # a full disk while the shards are written
        raise OSError(28, "No space left on device", "__0_0.distcp")

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", crash)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.add_(1.0)
    with pytest.raises(CheckpointSaveError, match="could not write iteration 2 \\(No space left on device"):
        save_dist_checkpoint(save_dir, 2, _state(cfg, 2), model, None)
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", TRACKER] and read_tracker(save_dir) == 1
    ckpt = load_checkpoint(save_dir, tp_size=1)  # the previous checkpoint, whole
    assert torch.equal(ckpt["model"]["embedding.word_embeddings.weight"], first["embedding.word_embeddings.weight"])

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", real)
    for it in (2, 3):
        save_dist_checkpoint(save_dir, it, _state(cfg, it), model, None, retain=2)
    assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000003", TRACKER]

    shard = next(p for p in os.listdir(os.path.join(save_dir, "iter_0000003")) if p.endswith(".distcp"))
    target = os.path.join(save_dir, "iter_0000003", shard)
    with open(target, "r+b") as f:  # silent corruption, size unchanged
        f.seek(os.path.getsize(target) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(save_dir, tp_size=1)
    msg = str(e.value)
    assert "\n" not in msg and shard in msg and "is corrupt" in msg and "--ckpt-step 2" in msg
    os.truncate(target, 10)
    with pytest.raises(CheckpointError, match="is truncated"):
        load_checkpoint(save_dir, tp_size=1)


def test_a_dist_checkpoint_of_another_model_is_one_line(tmp_path, world_of_one):
    from model.gpt import ModelConfig, build_gpt

    model, cfg = _tiny_model()
    save_dist_checkpoint(str(tmp_path), 1, _state(cfg, 1), model, None)
    other = build_gpt(ModelConfig(num_layers=1, hidden_size=128, ffn_hidden_size=128, num_attention_heads=2,
                                  num_query_groups=2, seq_length=16, vocab_size=128))  # fmt: skip
    ckpt = load_checkpoint(str(tmp_path), 1, model_entry=False)
    with pytest.raises(CheckpointError) as e:
        load_dist_state(ckpt, other)
    assert "\n" not in str(e.value) and "does not fit this model" in str(e.value)


# === --no-load-optim, --no-load-rng (both formats) ===


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_no_load_optim_and_no_load_rng(fmt, tmp_path, data_cache):
    """Hidden dropout draws from the torch RNG, so a resume repeats the straight run's iteration 3
    only with the RNG states restored; ``--no-load-optim`` starts Adam afresh (its step count in the
    next checkpoint is the iterations run since the resume, not the total). One resume takes both
    flags: iteration 3's loss is computed before its optimizer step, so only the RNG can move it,
    and only the optimizer sets Adam's step count."""
    base = ["--train-iters", "3", *TINY, "--precision", "bf16", "--gemm-backend", "reference", "--eval-interval", "0",
            "--eval-iters", "0", "--hidden-dropout", "0.2", "--ckpt-format", fmt, "--data-cache-dir", str(data_cache)]  # fmt: skip
    straight = tmp_path / "straight"
    run_pretrain(base + ["--save", str(straight), "--save-interval", "2", "--tensorboard-dir", str(straight / "tb")],
                 nproc=0)
    loss3 = _series(straight / "tb", "loss")[3]

    def resume(name, *flags):
        out = tmp_path / name
        run = run_pretrain(base + ["--load", str(straight), "--ckpt-step", "2", "--save", str(out),
                                   "--tensorboard-dir", str(out / "tb"), *flags], nproc=0)  # fmt: skip
        return run, out, _series(out / "tb", "loss")[3]

    _, _, same = resume("full")
    assert same == loss3
    run, out, fresh = resume("fresh", "--no-load-rng", "--no-load-optim")
    assert "--no-load-rng: RNG states not restored" in run.stdout and fresh != loss3
    assert "--no-load-optim" in run.stdout and "resumed from" in run.stdout

    def adam_step(ckpt_dir):
        if fmt == "legacy":
            state = torch.load(ckpt_dir / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["optimizer"]["state"]
            return float(state[0]["step"])
        return float(torch.load(ckpt_dir / "common.pt", weights_only=False)["optimizer_steps"][0])

    assert adam_step(straight / "iter_0000003") == 3.0
    assert adam_step(out / "iter_0000003") == 1.0  # one step since a fresh optimizer


# === kill -9 mid-save ===


@pytest.mark.slow
def test_kill_9_of_one_rank_mid_save_leaves_a_loadable_checkpoint_and_the_resume_is_exact(tmp_path, data_cache):
    """``test_reliability.py``'s kill test for ``torch_dist``: SIGKILL one rank at a random moment of a
    run that saves every iteration (so often mid-save); resuming from the last complete checkpoint
    ends with the uninterrupted run's weights and optimizer state, bit for bit (read whole by torch
    DCP), with ``--save-retain 2`` deleting old checkpoints meanwhile."""
    import random
    import signal
    import time

    from ._launch import start_pretrain, worker_pids

    argv = ["--train-iters", "8", *TINY, "--precision", "mxfp4_sr", "--gemm-backend", "reference", "--eval-iters", "0",
            "--tensor-model-parallel-size", "2", "--save-interval", "1", "--ckpt-format", "torch_dist",
            "--data-cache-dir", str(data_cache)]  # fmt: skip
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_pretrain([*argv, "--save", str(straight)])
    log = tmp_path / "log.txt"
    proc = start_pretrain([*argv, "--save", str(killed), "--load", str(killed), "--save-retain", "2"], log_path=log)
    try:
        deadline = time.monotonic() + 600
        while not (killed / TRACKER).exists() or int((killed / TRACKER).read_text() or 0) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 0.5))
        workers = worker_pids(proc.pid)
        assert 1 in workers, "the run ended before the kill"
        os.kill(workers[1], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 3 <= read_tracker(str(killed)) < 8
    run_pretrain([*argv, "--save", str(killed), "--load", str(killed), "--save-retain", "2"])
    assert sorted(n for n in os.listdir(killed) if n.startswith("iter_")) == ["iter_0000007", "iter_0000008"]
    a, b = _dcp_global(straight / "iter_0000008"), _dcp_global(killed / "iter_0000008")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.exp_avg.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k

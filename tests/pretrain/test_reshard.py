"""Tensor-parallel resharding (pretrain/reshard.py) and loading checkpoints across TP sizes.

  - identity: a TP=1 state dict split to TP=2 (and 4) and merged back is bit-identical, for a GQA
    SwiGLU model with untied embeddings, one with ``linear_qkv`` biases and tied embeddings, and a
    GPT-2 style one (biases everywhere, LayerNorm, learned positions); vocabulary 300 pads to 384
    at TP=1, 512 at TP=2 and 4. SwiGLU's ``linear_fc1`` shards are [gate_r; up_r].
  - quantization state: amax histories merge to their elementwise maximum, counters are rank 0's.
  - ``load_checkpoint``: another TP size is refused in one line without ``reshard_model``; with
    it, the model (only) is resharded; ``load_training_checkpoint`` merges a TP=2 checkpoint.
  - the real thing (slow): ``torchrun --nproc-per-node 2 launch/pretrain.py`` at TP=2 (GQA,
    SwiGLU, qkv biases, vocabulary 4096 padded to 4224 at TP=2 and 4128 at TP=1, FP8 with delayed
    scaling so every linear has amax histories), then this file as a 2-process worker: megatron's
    own TP=2 forward of the saved shards vs the TP=1 model merged by ``load_training_checkpoint``.
    With exact GEMMs (``F.linear``, tests/model's test double) they agree to fp32 summation order
    (measured 6e-7 on logits of range 2.2; bound 1e-5 of the range): the fused-QKV (GQA) and SwiGLU
    layouts are right. Through a bf16 plan they agree bit for bit here, but in general only to bf16
    accuracy (a last-bit fp32 difference in a row-parallel sum can flip a bf16 rounding in the next
    GEMM, as tests/pretrain/test_convert_hf.py measured): bound 2% of the logits' std. Through the
    checkpoint's FP8 plan (per-tensor scales of whole tensors instead of shards) they differ by 0.11,
    less than that plan's own error (0.28). The merged checkpoint, saved at TP=1 and loaded at TP=2
    with ``reshard_model=True``, gives back the saved shards bit for bit (padding rows past the TP=1
    padding aside: zeros).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, padded_vocab_size, policy_linear_names
from precision import PrecisionPolicy
from pretrain.checkpointing import TRACKER, CheckpointError, load_checkpoint, rank_file, save_checkpoint
from pretrain.reshard import ReshardError, merge_quant_states, merge_tp_shards, reshard, split_tp
from tests._dist import free_port
from tests.pretrain._launch import REPO, TINY, env, load_rank_checkpoint, run_pretrain

BASE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "num_query_groups": 2, "seq_length": 32, "vocab_size": 300}
CONFIGS = {
    "gqa_swiglu_untied": ModelConfig(**BASE),
    "gqa_swiglu_qkv_bias_tied": ModelConfig(**BASE, add_qkv_bias=True, untie_embeddings=False),
    "gpt2_tp4": ModelConfig(**{**BASE, "hidden_size": 128, "ffn_hidden_size": 256, "num_query_groups": 4},
                            normalization="LayerNorm", activation="gelu", untie_embeddings=False,
                            position_embedding="learned_absolute", add_bias_linear=True),
}
EMBED, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
FC1 = "decoder.layers.1.mlp.linear_fc1"
PATHS = ("exact", "own", "bf16")  # F.linear GEMMs; the checkpoint's plan (FP8, delayed); a bf16 plan


def _amax(history: list[float], ema: float | None = None) -> dict:
    return {"algo": "max", "history_len": 4, "ema_decay": 0.9, "history": history, "ema": ema}


def assert_same(a, b, where=""):
    """Bit-for-bit equality of nested state (tensors: same dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys() ^ b.keys())
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, (where, a, b)


def _tp1_state(cfg: ModelConfig, seed: int = 0) -> dict:
    """A TP=1 state dict with every parameter random (norms too) and amax histories in one layer."""
    torch.manual_seed(seed)
    model = build_gpt(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    state = model.state_dict()
    state[f"{FC1}._extra_state"]["amax"] = {"fprop/w": _amax([1.0, 2.0], 1.5)}
    return state


# ================================================================================================
# Merge / split identity
# ================================================================================================


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_then_merge_is_the_identity(name):
    cfg = CONFIGS[name]
    full = _tp1_state(cfg)
    shards = [split_tp(full, cfg, 2, r) for r in range(2)]
    assert shards[0][EMBED].shape[0] == padded_vocab_size(cfg, 2) // 2 == 256  # 300 -> 512 at TP=2
    assert full[EMBED].shape[0] == padded_vocab_size(cfg, 1) == 384
    assert torch.equal(shards[1][EMBED][300 - 256 : 384 - 256], full[EMBED][300:384])  # padding kept...
    assert not shards[1][EMBED][384 - 256 :].any()  # ...and extended with zeros
    assert_same(merge_tp_shards(shards, cfg), full)
    for r in range(2):  # every rank holds a copy of the quantization state
        assert_same(shards[r][f"{FC1}._extra_state"], full[f"{FC1}._extra_state"])
    if cfg.activation == "swiglu":  # TP=1 is [gate; up]; rank r holds [gate_r; up_r]
        gate, up = full[f"{FC1}.weight"].chunk(2)
        for r in range(2):
            assert torch.equal(shards[r][f"{FC1}.weight"], torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
    if cfg.num_query_groups % 4 == 0:  # TP=2 -> TP=4 -> TP=2 and the TP=4 shards merge to TP=1 too
        four = reshard(shards, cfg, 4)
        assert four[3][f"{FC1}.weight"].shape[0] == cfg.ffn_hidden_size // 4
        assert_same(merge_tp_shards(four, cfg), full)
        for r, sd in enumerate(reshard(four, cfg, 2)):
            assert_same(sd, shards[r], f"rank {r}")


@pytest.mark.usefixtures("world_of_one")
def test_state_dicts_of_another_config_are_refused():
    cfg = CONFIGS["gqa_swiglu_untied"]
    full = _tp1_state(cfg)
    missing = r"missing \['decoder.layers.0.self_attention.linear_qkv.bias', 'decoder.layers.1"
    with pytest.raises(ReshardError, match=missing):
        split_tp(full, dataclasses.replace(cfg, add_qkv_bias=True), 2, 0)
    shards = [split_tp(full, cfg, 2, r) for r in range(2)]
    with pytest.raises(ReshardError, match="2 shards hold 512 vocabulary rows, the config pads 300 to 384"):
        merge_tp_shards(shards, dataclasses.replace(cfg, make_vocab_size_divisible_by=64))
    with pytest.raises(ValueError, match="--num-query-groups 2 is not divisible by --tensor-model-parallel"):
        reshard(shards, cfg, 4)


def test_quant_states_merge_amax_to_the_max_and_keep_rank0s_counters():
    a = {"seed": 7, "name": "x", "calls": {"fprop": 3, "dgrad": 2, "wgrad": 2},
         "amax": {"fprop/w": _amax([1.0, 5.0, 2.0], 2.5), "fprop/x": _amax([4.0], 4.0)}}
    b = {"seed": 7, "name": "x", "calls": {"fprop": 9, "dgrad": 9, "wgrad": 9},
         "amax": {"fprop/w": _amax([3.0, 1.0, 4.0], 3.0), "fprop/x": _amax([1.0, 2.0], None)}}
    before = copy.deepcopy((a, b))
    merged = merge_quant_states([a, b])
    assert merged["calls"] == a["calls"] and merged["seed"] == 7 and merged["name"] == "x"
    assert merged["amax"]["fprop/w"] == _amax([3.0, 5.0, 4.0], 3.0)
    assert merged["amax"]["fprop/x"] == _amax([1.0, 4.0], 4.0)  # aligned at the newest entry
    assert (a, b) == before  # inputs untouched
    assert merge_quant_states([None, None]) is None


# ================================================================================================
# load_checkpoint / load_training_checkpoint (one process, a hand-written TP=2 checkpoint)
# ================================================================================================


def _write_tp2_checkpoint(root, cfg: ModelConfig, full: dict, plan, model_config: bool = True) -> list[dict]:
    shards = [split_tp(full, cfg, 2, r) for r in range(2)]
    shards[0][f"{FC1}._extra_state"]["amax"] = {"fprop/w": _amax([1.0, 2.0])}
    shards[1][f"{FC1}._extra_state"]["amax"] = {"fprop/w": _amax([3.0, 1.0])}
    for r, sd in enumerate(shards):
        path = rank_file(str(root / "iter_0000005"), r)
        os.makedirs(os.path.dirname(path))
        payload = {"checkpoint_version": 3.0, "iteration": 5, "model": sd, "optimizer": {"rank": r},
                   "opt_param_scheduler": {"num_steps": 5}, "rng_state": [{}], "consumed_train_samples": 20,
                   "args": {"tensor_model_parallel_size": 2}, "precision_plan": plan.to_dict(),
                   "tokenizer_model": None}
        if model_config:
            payload["model_config"] = dataclasses.asdict(cfg)
        torch.save(payload, path)
    (root / TRACKER).write_text("5")
    return shards


@pytest.fixture
def tp2_checkpoint(tmp_path, world_of_one):
    cfg = CONFIGS["gqa_swiglu_untied"]
    torch.manual_seed(0)
    model = build_gpt(cfg)
    plan = PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), cfg.num_layers)
    full = _tp1_state(cfg)
    _write_tp2_checkpoint(tmp_path / "ckpt", cfg, full, plan)
    return tmp_path / "ckpt", cfg, full, plan


def test_another_tp_size_is_refused_without_the_option(tp2_checkpoint):
    root, *_ = tp2_checkpoint
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(root), tp_size=1)
    assert str(e.value) == (
        f"--load: {root / 'iter_0000005'} was saved with --tensor-model-parallel-size 2, this run uses 1; "
        "resuming needs the same size (--finetune loads its model weights at any size, and so does "
        "launch/evaluate.py)"
    )


def test_load_checkpoint_reshards_the_model_only(tp2_checkpoint):
    root, cfg, full, plan = tp2_checkpoint
    ckpt = load_checkpoint(str(root), tp_size=1, reshard_model=True)
    assert ckpt["resharded"] is True and ckpt["path"] == str(root / "iter_0000005")
    assert ckpt["iteration"] == 5 and ckpt["args"]["tensor_model_parallel_size"] == 2
    assert ckpt["precision_plan"] == plan.to_dict() and ckpt["model_config"] == dataclasses.asdict(cfg)
    assert not {"optimizer", "opt_param_scheduler", "rng_state", "consumed_train_samples"} & ckpt.keys()
    expected = copy.deepcopy(full)
    expected[f"{FC1}._extra_state"]["amax"] = {"fprop/w": _amax([3.0, 2.0])}
    assert_same(ckpt["model"], expected)


def test_load_training_checkpoint_merges_tp2(tp2_checkpoint):
    from pretrain.evaluation.loading import load_training_checkpoint

    root, cfg, full, plan = tp2_checkpoint
    loaded = load_training_checkpoint(str(root))
    assert loaded.cfg == cfg and loaded.plan.to_dict() == plan.to_dict()
    state = loaded.model.state_dict()
    for name, value in full.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[name], value), name
    assert loaded.model.get_submodule(FC1).quant_state.amax["fprop/w"].history == [3.0, 2.0]


def test_resharding_needs_the_model_config(tmp_path, world_of_one):
    cfg = CONFIGS["gqa_swiglu_untied"]
    torch.manual_seed(0)
    plan = PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(build_gpt(cfg)), cfg.num_layers)
    _write_tp2_checkpoint(tmp_path, cfg, _tp1_state(cfg), plan, model_config=False)
    with pytest.raises(CheckpointError, match="no model_config .* with --tensor-model-parallel-size 2"):
        load_checkpoint(str(tmp_path), tp_size=1, reshard_model=True)


# ================================================================================================
# A real TP=2 run, evaluated at TP=1 and loaded back at TP=2 (this file is the torchrun worker)
# ================================================================================================


@pytest.mark.slow
def test_tp2_run_merges_to_tp1_and_splits_back(tmp_path, data_cache, world_of_one):
    run, tp1, out = tmp_path / "tp2", tmp_path / "tp1", tmp_path / "report"
    run_pretrain([
        "--train-iters", "4", *TINY, "--tensor-model-parallel-size", "2", "--add-qkv-bias",
        "--make-vocab-size-divisible-by", "96", "--precision", "fp8", "--amax-algo", "max",
        "--amax-history-len", "8", "--gemm-backend", "reference", "--eval-iters", "0",
        "--save", str(run), "--data-cache-dir", str(data_cache),
    ])  # fmt: skip
    shards = [load_rank_checkpoint(run / "iter_0000004", r) for r in range(2)]
    cfg = ModelConfig(**shards[0]["model_config"])
    assert (cfg.vocab_size, padded_vocab_size(cfg, 1), padded_vocab_size(cfg, 2)) == (4096, 4128, 4224)

    # quantization state: histories present; what every shard sees whole agrees; merged = max
    full = merge_tp_shards([s["model"] for s in shards], cfg)
    for layer, whole in (("self_attention.linear_qkv", "fprop/x"), ("mlp.linear_fc2", "dgrad/dy")):
        key = f"decoder.layers.1.{layer}._extra_state"
        amax = [{op: {**h, "history": [float(v) for v in h["history"]]} for op, h in s["model"][key]["amax"].items()}
                for s in shards]  # histories are saved as tensors
        assert amax[0].keys() == {"fprop/x", "fprop/w", "dgrad/dy", "dgrad/w", "wgrad/dy", "wgrad/x"}
        assert amax[0][whole]["history"] == amax[1][whole]["history"] and len(amax[0][whole]["history"]) >= 4
        for op, merged in full[key]["amax"].items():
            pairs = zip(amax[0][op]["history"], amax[1][op]["history"])
            assert merged["history"] == [max(a, b) for a, b in pairs]
    assert full[key]["calls"] == shards[0]["model"][key]["calls"]

    args = {**shards[0]["args"], "tensor_model_parallel_size": 1}
    save_checkpoint(str(tp1), 4, {"model": full, "model_config": shards[0]["model_config"], "args": args,
                                  "precision_plan": shards[0]["precision_plan"]})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__),
           "--tp2-dir", str(run), "--tp1-dir", str(tp1), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = torch.load(out / "rank0.pt")
    ref = report["tp2", "exact"]
    scale = ref.abs().max().item()
    print({k: v for k, v in report.items() if not isinstance(v, torch.Tensor)})
    assert (report["tp1", "exact"] - ref).abs().max().item() <= 1e-5 * scale, report["diff"]
    assert report["diff"]["bf16"] <= 0.02 * ref.std().item(), report["diff"]
    # the checkpoint's FP8 plan: per-tensor scales of whole tensors (merged amax histories) instead of
    # shards change the logits, but by less than FP8 itself moves them from the exact ones
    assert torch.isfinite(report["tp1", "own"]).all() and report["diff"]["own"] < report["fp8_noise_tp2"]
    for rank in range(2):  # TP=1 checkpoint loaded at TP=2: the run's own shards back, bit for bit
        r = torch.load(out / f"rank{rank}.pt")
        assert r["resplit_mismatch"] == [] and r["resplit_padding_zero"], r
        assert torch.equal(r["resplit", "exact"], ref)


def _worker() -> None:
    from megatron.core import parallel_state

    import model.layers
    from precision import PrecisionPlan
    from pretrain.evaluation.loading import load_training_checkpoint
    from tests.model._fakes import ReferenceLinear

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp2-dir", required=True)
    ap.add_argument("--tp1-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    real_linear, report = model.layers.policy_linear, {}

    def logits(gpt, cfg, tokens) -> dict:
        group, out = parallel_state.get_tensor_model_parallel_group(), {}
        bf16 = PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(gpt), cfg.num_layers)
        own = {n: gpt.get_submodule(n).precision for n in policy_linear_names(gpt)}
        for path, linear, plan in (("exact", ReferenceLinear(), own), ("own", real_linear, own),
                                   ("bf16", real_linear, bf16)):
            model.layers.policy_linear = linear
            apply_precision_plan(gpt, plan)
            with torch.no_grad():
                shard = gpt(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
            parts = [torch.empty_like(shard) for _ in range(group.size())]
            torch.distributed.all_gather(parts, shard.contiguous(), group=group)
            out[path] = torch.cat(parts, dim=-1)[..., : cfg.vocab_size]
        model.layers.policy_linear = real_linear
        apply_precision_plan(gpt, own)
        return out

    def build(ckpt):
        cfg = ModelConfig(**ckpt["model_config"])
        torch.manual_seed(0)
        gpt = build_gpt(cfg)
        gpt.load_state_dict(ckpt["model"], strict=True)
        apply_precision_plan(gpt, PrecisionPlan.from_dict(ckpt["precision_plan"]))
        return gpt.eval(), cfg

    # TP=2: megatron's own forward of the saved shards, and of the TP=1 checkpoint split again
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    native = load_checkpoint(args.tp2_dir, 2)
    gpt, cfg = build(native)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    for path, value in logits(gpt, cfg, tokens).items():
        report["tp2", path] = value
    resplit = load_checkpoint(args.tp1_dir, 2, reshard_model=True)
    assert resplit["resharded"]
    mismatch, padding_zero = [], True
    for name, value in native["model"].items():
        got = resplit["model"][name]
        if not isinstance(value, torch.Tensor):
            continue
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # keep the TP=1 padding
            row = torch.arange(value.shape[0]) + rank * value.shape[0]
            kept = row < padded_vocab_size(cfg, 1)
            padding_zero &= not got[~kept].any()
            value, got = value[kept], got[kept]
        if not torch.equal(value, got):
            mismatch.append(name)
    report["resplit_mismatch"], report["resplit_padding_zero"] = mismatch, padding_zero
    regpt, _ = build(resplit)
    report["resplit", "exact"] = logits(regpt, cfg, tokens)["exact"]
    parallel_state.destroy_model_parallel()

    # TP=1 (each rank alone): the merged model, as launch/evaluate.py loads it
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    loaded = load_training_checkpoint(args.tp2_dir)
    for path, value in logits(loaded.model, cfg, tokens).items():
        report["tp1", path] = value
    ref = report["tp2", "exact"]
    report["diff"] = {p: (report["tp1", p] - report["tp2", p]).abs().max().item() for p in PATHS}
    report["logits_absmax_std"] = (ref.abs().max().item(), ref.std().item())
    report["fp8_noise_tp2"] = (report["tp2", "own"] - ref).abs().max().item()  # the plan's own error
    os.makedirs(args.out, exist_ok=True)
    torch.save(report, os.path.join(args.out, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker()

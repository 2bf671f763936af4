"""launch/generate.py and launch/bench_rollout.py end to end on a tiny plain checkpoint (CPU).

generate.py: samples and log-probs written per prompt, reproducible from the seed, equal to the
engine's own; the rollout batch it hands a trainer; bad input refused in one line naming the flag
or file (unknown preset or KV format, a KV block that does not divide the head dimension, a
prompts file that does not parse, a tokenizer whose vocabulary is not the checkpoint's).
bench_rollout.py: weight and KV bytes against an independent count from the shapes and the
formats' bits, the largest batch from the budget, BF16 as the reference, labelled as emulated.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model.gpt import ModelConfig, build_gpt

CFG = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1,
                  seq_length=32, vocab_size=90, init_method_std=0.3)


def _plain(path, cfg=CFG) -> str:
    torch.manual_seed(0)
    model = build_gpt(cfg)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[name] = state[name][: cfg.vocab_size]
    torch.save({"model": state, "model_config": dataclasses.asdict(cfg)}, path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(world_of_one, tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    prompts = d / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3, 4]}\n{"prompt_ids": [7]}\n\n{"prompt_ids": [9, 8, 7]}\n')
    return _plain(d / "plain.pt"), str(prompts), d


def _run(argv):
    from launch.generate import main

    return main(argv)


def _error(err: str) -> str:
    """The one error line (library warnings may come before it on stderr)."""
    lines = [line for line in err.splitlines() if line.startswith(("generate.py: error:", "bench_rollout.py: error:"))]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n"), err
    return lines[0]


def _samples(out) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_generate_writes_samples_and_logprobs(ckpt, tmp_path):
    plain, prompts, _ = ckpt
    argv = ["--load", plain, "--prompts", prompts, "--rollout-precision", "mxfp4", "--max-new-tokens", "4",
            "--temperature", "0.8", "--top-k", "40", "--seed", "3", "--batch-size", "2"]
    assert _run(argv + ["--out", str(tmp_path / "a")]) == 0
    assert _run(argv + ["--out", str(tmp_path / "b")]) == 0
    a, b = _samples(tmp_path / "a"), _samples(tmp_path / "b")
    assert a == b  # reproducible from the seed
    assert [r["prompt_ids"] for r in a] == [[1, 2, 3, 4], [7], [9, 8, 7]]
    for r in a:
        assert len(r["response_ids"]) == len(r["logprobs"]) == 4 and r["finish_reason"] == "length"
        assert all(lp <= 0 for lp in r["logprobs"]) and all(0 <= t < CFG.vocab_size for t in r["response_ids"])
    meta = json.loads((tmp_path / "a" / "rollout.json").read_text())
    assert meta["rollout_plan"]["kv_cache"] == "mxfp4" and meta["kv_bytes_per_token"] == 2 * 1 * 1 * 32 * 4.25 / 8
    assert meta["generated_tokens"] == 12 and meta["gemms"].startswith("emulated")


def test_rollout_batch_is_what_the_cli_wrote(ckpt, tmp_path):
    """The function a trainer-recompute step calls returns the padded batch of the written samples."""
    import launch.generate as cli
    import pretrain.generate_run as gen

    plain, prompts, _ = ckpt
    args = cli.build_parser().parse_args(["--load", plain, "--prompts", prompts, "--out", str(tmp_path),
                                          "--rollout-precision", "nvfp4", "--max-new-tokens", "3"])
    session = gen.load_session(args)
    rows = gen.read_prompts(args.prompts, session.tokenizer)
    out = gen.generate_rollouts(session, [r["prompt_ids"] for r in rows], gen.sampling_params(args, None), 16)
    batch = out.rollout_batch()
    assert _run(["--load", plain, "--prompts", prompts, "--out", str(tmp_path / "cli"), "--rollout-precision",
                 "nvfp4", "--max-new-tokens", "3"]) == 0
    written = _samples(tmp_path / "cli")
    for i, r in enumerate(written):
        n = len(r["response_ids"])
        assert batch.response_ids[i, :n].tolist() == r["response_ids"] and int(batch.response_mask[i].sum()) == n
        assert batch.rollout_logprobs[i, :n].tolist() == pytest.approx(r["logprobs"], abs=0)
        assert batch.prompt_ids[i, : len(r["prompt_ids"])].tolist() == r["prompt_ids"]


def test_record_rounding_writes_bits_and_agreement(ckpt, tmp_path):
    """--record-rounding: the engine's records of the chosen linears, their size and the trainer's agreement."""
    plain, prompts, _ = ckpt
    argv = ["--load", plain, "--prompts", prompts, "--rollout-precision", "mxfp4", "--max-new-tokens", "3",
            "--record-rounding", "kind:fc1", "--record-rounding", "decoder.layers.0.self_attention.linear_qkv",
            "--precision", "bf16", "--out", str(tmp_path)]
    assert _run(argv) == 0
    rec = json.loads((tmp_path / "rollout.json").read_text())["rounding_records"]
    assert set(rec["linears"]) == {"decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.self_attention.linear_qkv"}
    tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) - 1 for r in _samples(tmp_path))
    for r in rec["linears"].values():
        assert r["format"] == "mxfp4" and r["bits_per_element"] == 1.25 and r["elements"] == tokens * 64
        assert 0 < r["agreement_own"] <= r["agreement_replay"] <= 1
    qkv = rec["linears"]["decoder.layers.0.self_attention.linear_qkv"]
    assert qkv["agreement_own"] == 1.0  # embeddings + norm: the trainer's x is the rollout's


MOE_CFG = dataclasses.replace(CFG, num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)


def test_moe_samples_record_each_tokens_experts(ckpt, tmp_path):
    """A MoE policy's samples.jsonl lists, per MoE layer, each token's top-k experts (prompt, then the
    response but its last token), across engine batches (--batch-size 2 over 3 prompts); they are what
    the routers choose in one teacher-forced forward of the written tokens under the same rollout plan."""
    import launch.generate as cli
    import pretrain.generate_run as gen
    from model.generate import attention_mask, forward_logits
    from model.moe_replay import RoutingTap

    _, prompts, d = ckpt
    moe = _plain(d / "moe.pt", MOE_CFG)
    argv = ["--load", moe, "--prompts", prompts, "--rollout-precision", "mxfp4", "--max-new-tokens", "5",
            "--batch-size", "2", "--out", str(tmp_path)]
    assert _run(argv) == 0
    written = _samples(tmp_path)
    layers = json.loads((tmp_path / "rollout.json").read_text())["moe_layers"]
    assert layers == [f"decoder.layers.{i}.mlp.router" for i in range(2)]
    session = gen.load_session(cli.build_parser().parse_args(argv))
    tap = RoutingTap(session.loaded.model)
    for r in written:
        seq = r["prompt_ids"] + r["response_ids"][:-1]  # the tokens the engine ran
        assert [len(x) for x in r["prompt_experts"]] == [len(r["prompt_ids"])] * 2
        assert [len(x) for x in r["response_experts"]] == [len(r["response_ids"]) - 1] * 2
        tokens = torch.tensor([seq])
        with torch.no_grad(), session.rollout.active(), tap.attached():
            forward_logits(session.loaded.model, tokens, torch.arange(len(seq))[None],
                           attention_mask(torch.ones_like(tokens, dtype=torch.bool), len(seq)))
        for layer, (experts, _) in enumerate(tap.last):
            got = r["prompt_experts"][layer] + r["response_experts"][layer]
            assert [sorted(e) for e in got] == [sorted(e) for e in experts.tolist()]  # top-k sets, position by position
    plain = ckpt[0]  # a dense policy's samples have no expert lists
    assert _run(["--load", plain, "--prompts", prompts, "--max-new-tokens", "2", "--out", str(tmp_path / "dense")]) == 0
    assert not any("prompt_experts" in r for r in _samples(tmp_path / "dense"))


@pytest.mark.parametrize("extra,match", [
    (["--rollout-precision", "mxfp5"], "--rollout-precision 'mxfp5': unknown rollout preset; valid: "),
    (["--rollout-precision", "base=mxfp4,kv=int4"], "unknown KV-cache format 'int4'; valid: "),
    (["--rollout-precision-rule", "last:3=bf16"], "--rollout-precision-rule 'last:3=bf16': the model has 1 layers"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--record-rounding", "kind:fc1"], ("--record-rounding 'kind:fc1': decoder.layers.0.mlp.linear_fc1 runs x as "
                                         "bf16 under the rollout plan bf16; recordable during generation: ")),
])
def test_bad_flags_are_refused_in_one_line(ckpt, tmp_path, capsys, extra, match):
    plain, prompts, _ = ckpt
    assert _run(["--load", plain, "--prompts", prompts, "--out", str(tmp_path)] + extra) == 2
    assert match in _error(capsys.readouterr().err)


def test_bad_files_are_refused_in_one_line(ckpt, tmp_path, capsys):
    plain, prompts, _ = ckpt
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [1, \n')
    assert _run(["--load", plain, "--prompts", str(bad), "--out", str(tmp_path)]) == 2
    assert f"--prompts {bad} line 2: not JSON" in _error(capsys.readouterr().err)
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt_ids": [1, 95]}\n')
    assert _run(["--load", plain, "--prompts", str(big), "--out", str(tmp_path)]) == 2
    assert "token id 95 is outside the vocabulary (0..89)" in _error(capsys.readouterr().err)
    text = tmp_path / "text.txt"
    text.write_text("hello\n")
    assert _run(["--load", plain, "--prompts", str(text), "--out", str(tmp_path)]) == 2
    assert "a text prompt needs a tokenizer" in _error(capsys.readouterr().err)
    # a KV format whose block does not divide the head dimension (hidden 64 / 4 heads = 16)
    narrow = _plain(tmp_path / "narrow.pt", dataclasses.replace(CFG, num_attention_heads=4, num_query_groups=2))
    assert _run(["--load", narrow, "--prompts", prompts, "--out", str(tmp_path), "--rollout-precision", "mxfp4"]) == 2
    err = _error(capsys.readouterr().err)
    assert "--rollout-precision kv mxfp4: its 32-element blocks do not divide the head dimension 16" in err


def test_tokenizer_whose_vocabulary_differs_is_refused(ckpt, tmp_path, capsys):
    from pretrain.data.tokenizer import train_tokenizer

    plain, prompts, _ = ckpt
    docs = [" ".join(f"w{i} x{i % 7} y{i % 13}" for i in range(400))]
    tok = train_tokenizer(docs, str(tmp_path / "tok.model"), vocab_size=276)
    assert _run(["--load", plain, "--prompts", prompts, "--out", str(tmp_path), "--tokenizer-model", tok.path]) == 2
    err = _error(capsys.readouterr().err)
    assert f"--tokenizer-model {tok.path} has 276 tokens but --load {plain} was built for a vocabulary of 90" in err


def test_bench_rollout_bytes_and_budget(world_of_one, tmp_path, capsys):
    from launch.bench_rollout import main

    argv = ["--out", str(tmp_path), "--presets", "mxfp4,nvfp4,fp8", "--num-layers", "1", "--hidden-size", "64",
            "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--num-query-groups", "1", "--vocab-size", "128",
            "--batch-size", "2", "--prompt-length", "3", "--max-new-tokens", "2", "--memory-budget-gib", "0.001"]
    assert main(argv) == 0
    rows = {r["preset"]: r for r in json.loads((tmp_path / "bench_rollout.json").read_text())["rows"]}
    assert list(rows) == ["bf16", "mxfp4", "nvfp4", "fp8"]
    # independent count: linears qkv 64x128, proj 64x64, fc1 (SwiGLU) 64x128, fc2 64x64; output layer BF16
    elems = 64 * 128 + 64 * 64 + 128 * 64 + 64 * 64
    out_layer = 128 * 64 * 2
    for preset, bits, tensor_scales in (("bf16", 16, 0), ("mxfp4", 4.25, 0), ("nvfp4", 4.5, 4), ("fp8", 8, 4)):
        r = rows[preset]
        assert r["packed_linear_bytes"] == elems * bits / 8 + 4 * tensor_scales + out_layer
        kv_bits = 16 if preset == "bf16" else bits
        assert r["kv_bytes_per_token"] == 2 * 1 * 1 * 32 * kv_bits / 8
        budget = 0.001 * 2**30
        assert r["max_batch_at_budget"] == int((budget - r["weight_bytes"]) // (5 * r["kv_bytes_per_token"]))
        assert r["tokens_per_s"] > 0 and r["gemms"] == "emulated"
    assert rows["mxfp4"]["kv_bytes_vs_bf16"] == 4.25 / 16
    md = (tmp_path / "bench_rollout.md").read_text()
    assert "emulated on CPU" in md and "| mxfp4 | mxfp4 |" in md
    assert main(argv[:2] + ["--presets", "mxfp3"]) == 2
    assert "unknown rollout preset" in _error(capsys.readouterr().err)

"""``launch/bench_rollout.py`` on a mixture-of-experts policy (CPU): expert and router bytes against an
independent count from the shapes, KV bytes as for a dense model, and the expert-choice column."""

import json


def test_bench_rollout_moe_bytes(world_of_one, tmp_path):
    from launch.bench_rollout import main

    argv = ["--out", str(tmp_path), "--presets", "nvfp4", "--num-layers", "1", "--hidden-size", "64",
            "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--num-query-groups", "1", "--vocab-size", "128",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--moe-shared-expert-intermediate-size", "64", "--batch-size", "2", "--prompt-length", "3",
            "--max-new-tokens", "3"]
    assert main(argv) == 0
    rows = {r["preset"]: r for r in json.loads((tmp_path / "bench_rollout.json").read_text())["rows"]}
    # independent count: 4 experts of fc1 (SwiGLU) 64 -> 2 x 32 and fc2 32 -> 64, a shared expert 64 -> 128, 64 -> 64
    experts = [(64, 64)] * 4 + [(64, 32)] * 4 + [(128, 64), (64, 64)]  # (out, in) of each linear
    elems = sum(o * i for o, i in experts)
    assert rows["bf16"]["expert_linear_bytes"] == elems * 2
    assert rows["nvfp4"]["expert_linear_bytes"] == elems * 4.5 / 8 + 4 * len(experts)
    for r in rows.values():
        assert r["router_bytes"] == 4 * 64 * 4  # FP32 router [experts, hidden] under every preset
        assert r["kv_bytes_per_token"] == 2 * 32 * (16 if r["preset"] == "bf16" else 4.5) / 8
        assert 0.0 <= r["expert_choice_differs_from_bf16"] <= 1.0
    assert rows["bf16"]["expert_choice_differs_from_bf16"] == 0.0
    md = (tmp_path / "bench_rollout.md").read_text()
    assert "emulated on CPU" in md and "expert linear bytes" in md and "| nvfp4 | " in md.split("expert linear bytes")[1]

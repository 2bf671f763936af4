"""``launch/pretrain.py``'s command line: model-size files, precedence, and bad input refused in one line.

Most refusals are checked in-process through ``pretrain.train.main`` (it exits with status 2 before
initializing anything, so no process group or model exists afterwards); the entry point itself is
checked as a subprocess, alone and under torchrun.
"""

from __future__ import annotations

import pytest

from pretrain.arguments import ConfigError, model_config, model_sizes, parse_args, validate_args
from pretrain.train import main

from ._launch import TINY, run_pretrain

REPO_SIZES = {"tiny", "125m", "350m", "1.3b", "8b"}


def refuse(argv, capsys, world_size, monkeypatch):
    """Run main(argv) as one of ``world_size`` ranks; return its one stderr line (asserting exit 2,
    nothing else printed)."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pretrain.py: error: ")
    return lines[0]


# === model sizes and precedence ===


def test_model_size_files_exist_and_validate():
    assert REPO_SIZES <= set(model_sizes())
    for name, tp in (("tiny", 2), ("125m", 4), ("350m", 8), ("1.3b", 8), ("8b", 8)):
        args = parse_args(
            ["--model-size", name, "--train-iters", "100000", "--tensor-model-parallel-size", str(tp)]
        )
        validate_args(args, world_size=tp, cuda=False)


def test_llama_8b_shape():
    a = parse_args(["--model-size", "8b", "--train-iters", "10"])
    shape = (
        a.num_layers,
        a.hidden_size,
        a.ffn_hidden_size,
        a.num_attention_heads,
        a.num_query_groups,
        a.rotary_base,
    )
    assert shape == (32, 4096, 14336, 32, 8, 500000)
    assert (
        a.swiglu
        and a.normalization == "RMSNorm"
        and a.untie_embeddings_and_output_weights
        and not a.add_bias_linear
    )
    assert model_config(a, vocab_size=128256).rope_scaling_factor == 8.0  # Llama 3.1's RoPE scaling


def test_explicit_flags_override_the_model_size_file():
    a = parse_args(["--model-size", "tiny", "--hidden-size", "512", "--lr", "1e-4", "--train-iters", "3"])
    assert (a.hidden_size, a.lr, a.num_layers, a.train_iters) == (512, 1e-4, 4, 3)
    assert a.lr_decay_iters == 3  # derived default follows --train-iters


def test_model_size_file_path_and_unknown_key(tmp_path, capsys):
    good = tmp_path / "m.yaml"
    good.write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 2\nseq_length: 32\ntrain_iters: 5\n"
    )
    assert parse_args(["--model-size", str(good)]).ffn_hidden_size == 256  # 4 x hidden by default
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 2\nhiden_size: 64\n")
    with pytest.raises(SystemExit):
        parse_args(["--model-size", str(bad)])
    assert "unknown key(s) hiden_size" in capsys.readouterr().err


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--tensor-model-parallel-size",
        "--precision-rule",
        "--gemm-backend",
        "--data-cache-dir",
        "--finetune",
    ):
        assert flag in out


# === bad input: one line, exit 2 ===

BASE = ["--train-iters", "2", *TINY]
TP = "--tensor-model-parallel-size"

# fmt: off
BAD_INPUTS = [  # (extra flags, world size, expected part of the one line)
    (["--precision", "bogus"], 1, "--precision: unknown precision 'bogus'"),
    (["--precision", "fprop=mxfp5"], 1, "--precision: fprop: unknown format 'mxfp5'; valid:"),
    (["--precision-rule", "nope"], 1, "--precision-rule 'nope': expected SELECTOR=PRESET_OR_SPEC"),
    (["--precision-rule", "first:x=bf16"], 1, "--precision-rule 'first:x=bf16': rule 'first:x'"),
    (["--precision-rule", "first:1=zz"], 1, "--precision-rule 'first:1=zz': unknown precision 'zz'"),
    ([TP, "3"], 2, f"{TP} 3 x --pipeline-model-parallel-size 1 does not divide the world size 2"),
    ([TP, "4", "--num-attention-heads", "6", "--num-query-groups", "6", "--hidden-size", "384"], 4,
     f"--num-attention-heads 6 is not divisible by {TP} 4"),
    (["--global-batch-size", "6"], 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--hidden-size", "144"], 1, "--hidden-size 144 must be a multiple of 32"),
    (["--ffn-hidden-size", "200"], 1, "--ffn-hidden-size 200 must be a multiple of 32"),
    (["--pipeline-model-parallel-size", "2"], 2,
     "--pipeline-model-parallel-size 2: pipeline parallelism needs CUDA"),
    (["--sequence-parallel", TP, "2"], 2, "--sequence-parallel needs CUDA"),
    (["--model-size", "huge"], 1, "--model-size: unknown size 'huge'; valid: 1.3b, 125m, 350m, 8b, moe_tiny, scale_w128_d2, scale_w128_d4, "
     "scale_w256_d2, scale_w256_d4, scale_w32_d2, scale_w32_d4, scale_w512_d2, scale_w512_d4, scale_w64_d2, scale_w64_d2_h4, scale_w64_d4, tiny"),
    (["--bogus-flag"], 1, "unrecognized arguments: --bogus-flag"),
    (["--lr-decay-style", "step"], 1, "--lr-decay-style: invalid choice: 'step'"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size 0: must be > 0"),
    (["--lr-warmup-iters", "5"], 1, "--lr-warmup-iters 5 exceeds --lr-decay-iters 2"),
    (["--finetune"], 1, "--finetune needs --load"),
]
# fmt: on


@pytest.mark.parametrize("argv, world_size, expected", BAD_INPUTS)
def test_bad_input_is_refused_in_one_line(argv, world_size, expected, capsys, monkeypatch):
    line = refuse(BASE + argv, capsys, world_size, monkeypatch)
    assert expected in line, line


def test_missing_required_flags(capsys, monkeypatch):
    line = refuse([], capsys, 1, monkeypatch)
    assert "missing --num-layers, --hidden-size, --num-attention-heads, --seq-length, --train-iters" in line
    assert "--model-size NAME" in line


def test_missing_files_are_refused(tmp_path, capsys, monkeypatch):
    def line_for(*argv):
        return refuse(BASE + list(argv), capsys, 1, monkeypatch)

    tok = tmp_path / "tok.model"
    tok.write_bytes(b"not read before the data check")
    line = line_for("--data-path", str(tmp_path / "nope"), "--tokenizer-model", str(tok))
    assert f"--data-path: missing {tmp_path / 'nope'}.bin" in line
    line = line_for("--data-path", "0.5", str(tmp_path / "a"), "0.5")
    assert "--data-path: expected PREFIX ... or WEIGHT PREFIX WEIGHT PREFIX" in line
    line = line_for("--tokenizer-model", str(tmp_path / "missing.model"))
    assert f"--tokenizer-model: no such file: {tmp_path / 'missing.model'}" in line
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    assert "--data-path needs --tokenizer-model" in line_for("--data-path", str(tmp_path / "d"))
    line = line_for("--load", str(tmp_path / "no_ckpt"))
    assert f"--load: no such checkpoint directory: {tmp_path / 'no_ckpt'}" in line


def test_cuda_only_checks():
    PP = "--pipeline-model-parallel-size"
    validate_args(parse_args(BASE + [TP, "2", PP, "2"]), world_size=4, cuda=True)  # megatron engine (auto)
    validate_args(parse_args(BASE + [PP, "2", "--use-distributed-optimizer"]), world_size=4, cuda=True)
    args = parse_args(BASE + [PP, "2", "--ddp-impl", "torch"])
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 needs --ddp-impl megatron"):
        validate_args(args, world_size=2, cuda=True)
    args = parse_args(BASE + [PP, "2", "--num-layers", "3"])
    with pytest.raises(ConfigError, match="--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"):
        validate_args(args, world_size=2, cuda=True)
    with pytest.raises(ConfigError, match="--ddp-impl megatron needs CUDA"):
        validate_args(parse_args(BASE + ["--ddp-impl", "megatron"]), world_size=1, cuda=False)
    with pytest.raises(ConfigError, match="--use-distributed-optimizer needs the megatron engine on CUDA"):
        validate_args(parse_args(BASE + ["--use-distributed-optimizer"]), world_size=1, cuda=False)
    with pytest.raises(ConfigError, match="--use-distributed-optimizer needs the megatron engine on CUDA"):
        validate_args(parse_args(BASE + ["--use-distributed-optimizer", "--ddp-impl", "torch"]), world_size=1,
                      cuda=True)
    args = parse_args(BASE + [TP, "2", "--sequence-parallel", "--seq-length", "63"])
    with pytest.raises(ConfigError, match="--sequence-parallel: --seq-length 63 is not divisible by"):
        validate_args(args, world_size=2, cuda=True)
    validate_args(parse_args(BASE + [TP, "2", "--sequence-parallel"]), world_size=2, cuda=True)


def test_finetune_needs_a_checkpoint(tmp_path, capsys, monkeypatch):
    line = refuse(BASE + ["--finetune", "--load", str(tmp_path)], capsys, 1, monkeypatch)
    assert (
        f"--finetune: no checkpoint in --load {tmp_path} (latest_checkpointed_iteration.txt missing)" in line
    )


def test_load_equal_to_save_may_not_exist_yet(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = parse_args(BASE + ["--save", ckpt, "--load", ckpt])
    validate_args(args, world_size=1, cuda=False)  # the resume-if-present idiom of job scripts


def test_a_save_directory_holding_another_runs_checkpoints_is_refused(tmp_path, capsys, monkeypatch):
    """A fresh run (no --load, or --load elsewhere) into a --save that holds checkpoints would overwrite
    them at its first save: refused in one line that says how to resume; --load equal to --save resumes."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0001500").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1500")
    line = refuse(BASE + ["--save", str(ckpt)], capsys, 1, monkeypatch)
    assert (f"--save {ckpt} already holds a run's checkpoints (latest iteration 1500) and no --load: this run "
            f"would overwrite them; add --load {ckpt} to resume that run, or give an empty --save directory") in line
    other = tmp_path / "start"
    other.mkdir()
    line = refuse(BASE + ["--save", str(ckpt), "--load", str(other)], capsys, 1, monkeypatch)
    assert f"and --load {other} starts from another checkpoint: this run would overwrite them" in line
    from pretrain.arguments import parse_run_config

    assert parse_run_config(BASE + ["--save", str(ckpt), "--load", str(ckpt)], 1, False).checkpoint.load == str(ckpt)


# === the entry point as a process ===


def test_entry_point_refuses_fast_in_one_line():
    proc = run_pretrain(BASE + ["--precision", "mxfp9"], nproc=0, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    from precision import presets

    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("pretrain.py: error: --precision: unknown precision 'mxfp9': not a preset, a spec")
    assert f"presets: {', '.join(presets.names())}" in line


@pytest.mark.slow
def test_under_torchrun_only_rank0_prints_the_error():
    proc = run_pretrain(BASE + [TP, "2", "--hidden-size", "160"], nproc=2, timeout=180, check=False)
    assert proc.returncode != 0
    output = (proc.stdout + proc.stderr).splitlines()
    refusal = f"pretrain.py: error: --hidden-size 160 / {TP} 2 = 80 per rank must be a multiple of 32"
    assert [line for line in output if line.startswith("pretrain.py: error:")] == [
        f"{refusal} (MX block size)"
    ]
    assert "world size" not in proc.stdout  # refused before torch.distributed was initialized

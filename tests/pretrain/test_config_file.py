"""``--config FILE``: a run's flags in YAML/JSON (command line wins), unknown keys refused naming the
nearest one, and a checkpoint's ``run_config.json`` loading back to the run's own ``RunConfig``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from pretrain.arguments import ConfigError, parse_args_or_raise, parse_run_config

from ._launch import TINY, run_pretrain


def _write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if name.endswith((".yaml", ".yml")) else json.dumps(data))
    return str(path)


def test_yaml_file_equals_the_same_flags_and_the_command_line_overrides_it(tmp_path):
    path = _write(tmp_path, {
        "model_size": "tiny", "train-iters": 40, "lr": 1.0e-3, "precision": "mxfp4",
        "precision_rule": ["first:1=bf16", "last:1=bf16"],  # a repeatable flag: a list
        "check_for_nan_in_loss_and_grad": False,          # BooleanOptionalAction: --no-...
        "disable_bias_linear": True,                      # a store_false switch by its own name
        "data-cache-path": str(tmp_path),                 # an alias by its own name
        "seed": None,                                     # null: the flag's default
    })  # fmt: skip
    flags = ["--model-size", "tiny", "--train-iters", "40", "--lr", "1e-3", "--precision", "mxfp4",
             "--precision-rule", "first:1=bf16", "--precision-rule", "last:1=bf16",
             "--no-check-for-nan-in-loss-and-grad", "--data-cache-dir", str(tmp_path)]
    run = parse_run_config(["--config", path], 1, False)
    assert run == parse_run_config(flags, 1, False)
    assert run.training.seed == 1234 and run.precision.precision_rule == ("first:1=bf16", "last:1=bf16")
    # the command line wins, a repeatable flag's whole list included; the rest stays the file's
    over = parse_run_config(["--config", path, "--lr", "2e-3", "--precision-rule", "kind:mlp=bf16"], 1, False)
    assert over.training.lr == 2e-3 and over.precision.precision_rule == ("kind:mlp=bf16",)
    assert over.precision.precision == "mxfp4" and over.training.train_iters == 40
    # the file's values count as given: a file's --lr-warmup-iters beats the model-size file's
    args = parse_args_or_raise(["--config", _write(tmp_path, {"model_size": "tiny", "train_iters": 40,
                                                              "lr_warmup_iters": 5}, "b.yaml")])
    assert args.lr_warmup_iters == 5 and args.ffn_hidden_size == 768


def test_store_true_and_megatron_spellings_in_a_file(tmp_path):
    path = _write(tmp_path, {"model_size": "tiny", "train_samples": 320, "fp8_format": "hybrid",
                             "fp8_recipe": "tensorwise", "first_last_layers_bf16": True, "print_model": True})
    run = parse_run_config(["--config", path], 1, False)
    assert run.training.train_iters == 40 and run.logging.print_model
    assert run.precision.precision == "fp8" and run.precision.precision_rule == ("first:1=bf16", "last:1=bf16")


@pytest.mark.parametrize("data,words", [
    ({"train_iter": 10}, ["unknown key 'train_iter'", "did you mean train_iters?"]),
    ({"train-iter": 10}, ["did you mean train-iters?"]),
    ({"precison": "fp8"}, ["did you mean precision?"]),
    ({"zzzz": 1}, ["unknown key 'zzzz'", "keys are flag names"]),
    ({"lr": "fast"}, ["--config", "argument --lr: invalid float value: 'fast'"]),
    ({"lr_decay_style": "sideways"}, ["--config", "invalid choice: 'sideways'"]),
    ({"sequence_parallel": "yes"}, ["sequence_parallel", "give true or false"]),
    ({"bf16": 1}, ["bf16", "give true or false"]),
    ({"lr": [1, 2]}, ["--lr takes one value"]),
    ({"config": "other.yaml"}, ["cannot name another one"]),
])  # fmt: skip
def test_bad_files_are_one_line(tmp_path, data, words):
    path = _write(tmp_path, {"model_size": "tiny", **data})
    with pytest.raises(ConfigError) as e:
        parse_run_config(["--config", path], 1, False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--config {path}") and all(w in msg for w in words), msg


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="--config: no such file"):
        parse_args_or_raise(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML \("):
        parse_args_or_raise(["--config", str(bad)])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping of flag names"):
        parse_args_or_raise(["--config", str(tmp_path / "list.yaml")])


def test_a_run_stops_at_its_duration_and_its_run_config_reproduces_it(tmp_path, data_cache):
    """One real run, configured by a file with Megatron-LM's spellings: it prints the plan they became,
    stops after its first iteration at --exit-duration-in-mins with a checkpoint and run_status.json
    state stopped; that checkpoint's run_config.json loads back (--config) to an equal RunConfig."""
    save = tmp_path / "ckpt"
    path = _write(tmp_path, {"fp8-format": "hybrid", "fp8-recipe": "tensorwise", "train-samples": 20,
                             "exit-duration-in-mins": 1.0e-6, "data-cache-path": str(data_cache),
                             "save": str(save), "eval_iters": 0})
    argv = ["--config", path, *TINY, "--gemm-backend", "reference"]  # eager: no compilation
    original = parse_run_config(argv, 1, False)  # before the run: afterwards --save holds its checkpoint
    proc = run_pretrain(argv, nproc=0)
    assert "Megatron-LM flags --fp8-format hybrid --fp8-recipe tensorwise -> --precision fp8" in proc.stdout
    assert "--exit-duration-in-mins 1e-06: stopping after iteration 1" in proc.stdout, proc.stdout[-2000:]
    status = json.loads((save / "run_status.json").read_text())
    assert status["state"] == "stopped" and status["exit_status"] == 0 and status["iteration"] == 1
    saved = save / "iter_0000001" / "run_config.json"
    assert original.training.train_iters == 5 and original.precision.precision == "fp8"
    # reproduced into a new directory (as is, it would save over this run's checkpoint: refused below)
    again = str(tmp_path / "again")
    expected = dataclasses.replace(original, checkpoint=dataclasses.replace(original.checkpoint, save=again))
    assert parse_run_config(["--config", str(saved), "--save", again], 1, False) == expected
    # the same command again would save over that checkpoint: refused, and told how to resume
    for cmd in (argv, ["--config", str(saved)]):
        with pytest.raises(ConfigError, match=f"--save {save} .*already holds a run's checkpoints .*add --load {save} to"):
            parse_run_config(cmd, 1, False)
    # a flag on the command line still wins over the checkpoint's
    assert parse_run_config(["--config", str(saved), "--save", again, "--train-iters", "7"], 1,
                            False).training.train_iters == 7

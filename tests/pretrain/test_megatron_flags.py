"""Megatron-LM's precision and run-control flags are spellings of this project's flags.

The flag sets are the ones Megatron-LM's documentation gives for its recipes (FP8 delayed, tensorwise
and MXFP8; NVFP4; the BF16 first/last layers). Each is resolved into the per-layer, per-GEMM plan the
trainer applies and compared with the plan of our own spelling -- ``--precision`` with
``--amax-algo``/``--amax-history-len`` (a different code path: the trainer's override) or recipes
built field by field from megatron-core's definitions -- never by comparing strings.
"""

from __future__ import annotations

import argparse

import pytest

from precision.recipe import GemmRecipe, LinearPrecision, OperandFormat
from pretrain.arguments import ConfigError, build_parser, parse_run_config, validate_args
from pretrain.trainer.plans import _resolve_plan

LAYERS = 4
SHAPE = ["--num-layers", str(LAYERS), "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "4"]  # fmt: skip
NAMES = [f"decoder.layers.{i}.{m}" for i in range(LAYERS) for m in
         ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
NAMES += ["output_layer"]


def plan(argv: list[str], train_iters: bool = True):
    """``(run, {layer: LinearPrecision})``: the whole-model plan the trainer resolves for ``argv``."""
    run = parse_run_config(SHAPE + (["--train-iters", "10"] if train_iters else []) + argv, 1, False)
    whole = _resolve_plan(run, run.precision.precision, NAMES, NAMES, None)[1]
    return run, {n: whole[n] for n in whole}


def same_for_layers(recipe: LinearPrecision, bf16_layers=()) -> dict:
    """``recipe`` on every transformer-layer linear (BF16 on ``bf16_layers``), the output layer BF16 --
    where megatron-core's FP8/FP4 contexts reach (the transformer layers only)."""
    out = {n: LinearPrecision() if int(n.split(".")[2]) in bf16_layers else recipe for n in NAMES[:-1]}
    return {**out, "output_layer": LinearPrecision()}


def _three(x: OperandFormat, w: OperandFormat, dy: OperandFormat) -> LinearPrecision:
    """Fprop x@w, Dgrad dy@w, Wgrad dy@x (the operand order of each GEMM)."""
    return LinearPrecision(GemmRecipe(x, w), GemmRecipe(dy, w), GemmRecipe(dy, x))


# ---- the recipes, as Megatron-LM's docs spell them, against ours -------------------------------------------------

def test_fp8_delayed_equals_precision_fp8_with_amax_flags():
    # Megatron-LM's FP8 example: delayed scaling (the default recipe), max over a 1024-step window
    run, got = plan(["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"])
    _, ours = plan(["--precision", "fp8", "--amax-algo", "max", "--amax-history-len", "1024"])
    assert got == ours
    e4m3 = OperandFormat("fp8_e4m3", amax_algo="max", amax_history_len=1024)
    e5m2 = OperandFormat("fp8_e5m2", amax_algo="max", amax_history_len=1024)
    assert got == same_for_layers(_three(e4m3, e4m3, e5m2))  # hybrid: E5M2 for dy only
    assert run.precision.megatron_flags.startswith("Megatron-LM flags --fp8-format hybrid --fp8-amax-history-len 1024")
    # megatron-core's defaults (history 1, most_recent)
    _, default = plan(["--fp8-format", "hybrid", "--fp8-recipe", "delayed"])
    _, ours = plan(["--precision", "fp8", "--amax-algo", "most_recent", "--amax-history-len", "1"])
    assert default == ours and default["decoder.layers.0.mlp.linear_fc1"].fprop.a.amax_algo == "most_recent"


def test_fp8_delayed_margin_is_the_plans_margin():
    _, got = plan(["--fp8-format", "hybrid", "--fp8-margin", "2"])
    _, ours = plan(["--precision", "fp8", "--amax-algo", "most_recent", "--amax-history-len", "1", "--fp8-margin", "2"])
    assert got == ours and got["decoder.layers.3.mlp.linear_fc2"].wgrad.a.margin == 2


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_tensorwise(fmt):
    run, got = plan(["--fp8-format", fmt, "--fp8-recipe", "tensorwise"])
    e4m3, e5m2 = OperandFormat("fp8_e4m3"), OperandFormat("fp8_e5m2")  # current scaling
    assert got == same_for_layers(_three(e4m3, e4m3, e5m2 if fmt == "hybrid" else e4m3))
    if fmt == "hybrid":
        assert got == plan(["--precision", "fp8"])[1]
        assert run.precision.megatron_flags.endswith("-> --precision fp8")


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_mxfp8(fmt):
    # TE's MXFP8BlockScaling: 32-element blocks along each GEMM's contraction, E8M0 scale rounded up
    _, got = plan(["--fp8-format", fmt, "--fp8-recipe", "mxfp8"])
    e4m3 = OperandFormat("mxfp8_e4m3", scale_rule="rceil")
    dy = OperandFormat("mxfp8_e5m2", scale_rule="rceil") if fmt == "hybrid" else e4m3
    assert got == same_for_layers(_three(e4m3, e4m3, dy))


def test_nvfp4_equals_the_nvfp4_preset():
    run, got = plan(["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"])
    assert got == plan(["--precision", "nvfp4"])[1]
    lp = got["decoder.layers.1.self_attention.linear_qkv"]  # TE's NVFP4BlockScaling, field by field
    assert lp.fprop.b.block2d and lp.dgrad.a.rounding == "stochastic" and lp.wgrad.rotation == "rht16_te"
    assert got["output_layer"] == LinearPrecision()
    assert run.precision.megatron_flags == "Megatron-LM flags --fp4-format e2m1 --fp4-recipe nvfp4 -> --precision nvfp4"
    assert plan(["--fp4-format", "e2m1"])[1] == got  # nvfp4 is Megatron's default --fp4-recipe


@pytest.mark.parametrize("argv,bf16", [
    (["--first-last-layers-bf16"], {0, 3}),  # megatron-core's defaults: one layer at each end
    (["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0"], {0, 1}),
    (["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "0", "--num-layers-at-end-in-bf16", "2"], {2, 3}),
])  # fmt: skip
def test_first_last_layers_bf16(argv, bf16):
    run, got = plan(["--fp4-format", "e2m1"] + argv)
    start, end = len({0, 1} & bf16) if 0 in bf16 else 0, len({2, 3} & bf16) if 3 in bf16 else 0
    rules = [r for r in (f"first:{start}=bf16" if start else None, f"last:{end}=bf16" if end else None) if r]
    ours = plan(["--precision", "nvfp4"] + [t for r in rules for t in ("--precision-rule", r)])[1]
    assert got == ours
    assert got == same_for_layers(got["decoder.layers.1.mlp.linear_fc1" if 1 not in bf16 else
                                      "decoder.layers.2.mlp.linear_fc1"], bf16_layers=bf16)
    assert run.precision.precision_rule == tuple(rules)


def test_flags_are_not_saved_the_plan_is():
    run, _ = plan(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"])
    saved = run.to_dict()
    assert saved["precision"] == "fp8" and saved["precision_rule"] == ["first:1=bf16", "last:1=bf16"]
    assert not any(k.startswith(("fp8_format", "fp8_recipe", "fp4_", "first_last", "num_layers_at")) for k in saved)


# ---- refusals: one line, naming the flag and the nearest plan --------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], ["blockwise", "--fp8-recipe mxfp8", "tensorwise"]),
    (["--fp8-format", "hybrid", "--fp8-recipe", "custom"], ["custom", "--precision spec"]),
    (["--fp4-format", "e2m1", "--fp4-recipe", "custom"], ["--fp4-recipe custom", "--precision spec"]),
    (["--fp8-format", "hybrid", "--precision", "fp8"], ["--fp8-format hybrid and --precision fp8", "not both"]),
    (["--fp8-format", "hybrid", "--precision-schedule", "0:fp8,5:bf16"], ["--precision-schedule"]),
    (["--fp8-format", "hybrid", "--amax-algo", "max"], ["--amax-algo max", "not both"]),
    (["--fp8-format", "hybrid", "--fp4-format", "e2m1"], ["one of them"]),
    (["--fp8-recipe", "mxfp8"], ["--fp8-recipe mxfp8 needs --fp8-format"]),
    (["--fp4-recipe", "nvfp4"], ["--fp4-recipe nvfp4 needs --fp4-format e2m1"]),
    (["--first-last-layers-bf16"], ["needs --fp8-format or --fp4-format", "--precision-rule first:N=bf16"]),
    (["--fp4-format", "e2m1", "--num-layers-at-end-in-bf16", "2"], ["needs --first-last-layers-bf16"]),
    (["--fp4-format", "e2m1", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "5"],
     ["--num-layers-at-start-in-bf16 5", "(4)"]),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16"],
     ["--fp8-amax-history-len 16", "only --fp8-recipe delayed"]),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--fp8-margin", "1"], ["--fp8-margin 1", "delayed"]),
    (["--fp4-format", "e2m1", "--fp8-margin", "1"], ["--fp8-margin 1", "drop it"]),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"],
     ["megatron-core refuses it", "--precision-rule first:1=bf16 --precision-rule last:1=bf16"]),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], ["--fp8-amax-history-len 0", ">= 1"]),
])  # fmt: skip
def test_refusals(argv, words):
    with pytest.raises(ConfigError) as e:
        plan(argv)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_blockwise_refusal_names_the_nearest_plans_which_parse():
    # the plans the refusal names are accepted as they are written
    for recipe in ("mxfp8", "tensorwise"):
        plan(["--fp8-format", "hybrid", "--fp8-recipe", recipe])


def test_another_programs_parser_refuses_what_it_would_ignore():
    # a parser that does not rewrite the spellings (RL's) refuses them instead of training in BF16
    args = build_parser().parse_args(SHAPE + ["--train-iters", "10", "--fp8-format", "hybrid"])
    args.precision = "bf16"
    with pytest.raises(ConfigError, match=r"^--fp8-format hybrid: this program takes"):
        validate_args(args, 1, False)


# ---- run control -----------------------------------------------------------------------------------------------

def test_train_samples_is_iterations_of_the_global_batch():
    run = parse_run_config(SHAPE + ["--train-samples", "40"], 1, False)
    assert run.training.train_iters == 10 and run.training.lr_decay_iters == 10
    assert run == parse_run_config(SHAPE + ["--train-iters", "10"], 1, False)


@pytest.mark.parametrize("argv,words", [
    (["--train-samples", "42"], ["--train-samples 42", "--global-batch-size 4", "give 40 or 44"]),
    (["--train-samples", "40", "--train-iters", "10"], ["give one of them"]),
    (["--train-samples", "0"], ["positive multiple", "give 4"]),
])  # fmt: skip
def test_train_samples_refusals(argv, words):
    with pytest.raises(ConfigError) as e:
        parse_run_config(SHAPE + argv, 1, False)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_train_samples_needs_a_global_batch():
    shape = SHAPE[:SHAPE.index("--global-batch-size")]
    with pytest.raises(ConfigError, match="--train-samples 40 needs --global-batch-size"):
        parse_run_config(shape + ["--train-samples", "40"], 1, False)


def test_data_cache_path_is_data_cache_dir(tmp_path):
    a = parse_run_config(SHAPE + ["--train-iters", "10", "--data-cache-path", str(tmp_path)], 1, False)
    b = parse_run_config(SHAPE + ["--train-iters", "10", "--data-cache-dir", str(tmp_path)], 1, False)
    assert a == b and a.data.data_cache_dir == str(tmp_path)


def test_exit_duration_must_be_positive():
    with pytest.raises(ConfigError, match=r"--exit-duration-in-mins -1.0: must be > 0"):
        parse_run_config(SHAPE + ["--train-iters", "10", "--exit-duration-in-mins", "-1"], 1, False)


def test_exit_duration_stopper_stops_before_the_last_step():
    from pretrain.trainer.stopper import Stopper

    class NoSignal:
        def any_rank(self):
            return False

    past = Stopper(NoSignal(), None, 10, exit_duration_in_mins=0.5, started=-1e9)  # started long ago
    assert past.should_stop(3) == "--exit-duration-in-mins 0.5"
    assert past.should_stop(10) is None  # the last step is the end, not a stop
    assert Stopper(NoSignal(), None, 10, exit_duration_in_mins=60.0).should_stop(3) is None
    assert Stopper(NoSignal(), None, 10).should_stop(3) is None


def test_help_lists_the_spellings():
    text = build_parser().format_help()
    assert "Megatron-LM spellings" in text and "--fp8-format" in text and "--data-cache-path" in text
    assert isinstance(build_parser().parse_args(["--fp8-recipe", "mxfp8"]), argparse.Namespace)


def test_no_fp8_wgrad_keeps_wgrad_in_bf16_under_delayed_scaling():
    _, got = plan(["--fp8-format", "hybrid", "--no-fp8-wgrad"])
    _, ours = plan(["--precision", "fprop=fp8,dgrad=fp8,wgrad=bf16", "--amax-algo", "most_recent",
                    "--amax-history-len", "1"])
    assert got == ours and got["decoder.layers.2.mlp.linear_fc1"].wgrad.is_high_precision
    with pytest.raises(ConfigError, match=r"^--no-fp8-wgrad: Megatron honours it only with --fp8-recipe delayed"):
        plan(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--no-fp8-wgrad"])


@pytest.mark.parametrize("argv,expected", [
    (["--fp8-param-gather"], "--fp8-param-gather: Megatron-LM's flag has no counterpart here: keeps FP8 copies"),
    (["--lr-decay-samples=100"], "--lr-decay-samples: Megatron-LM's flag has no counterpart here: the schedule"),
    (["--fp8-interval", "1"], "--fp8-interval: Megatron-LM's flag has no counterpart here: deprecated"),
    (["--train-iter", "3"], "unrecognized arguments: --train-iter 3; did you mean --train-iters?"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])  # fmt: skip
def test_unknown_flags_say_why_or_name_the_nearest(argv, expected):
    with pytest.raises(ConfigError) as e:
        plan(argv)
    assert str(e.value) == expected if expected.endswith("flag") else str(e.value).startswith(expected), str(e.value)

"""The lr schedule is megatron-core's ``OptimizerParamScheduler`` behind Megatron-LM's flags.

Oracles: the schedule formulas as Megatron-LM documents them (linear warm-up, half-cosine / linear
decay to ``--min-lr``; WSD: constant, then the annealing shape over the last
``--lr-wsd-decay-iters``), written out here, and the values the previous hand-written schedule gave
for the default (cosine with warm-up), which must stay bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.arguments import ConfigError, parse_args_or_raise, parse_run_config
from pretrain.optim import LRSchedule, LRScheduleConfig, build_optimizer

from ._launch import TINY


def _args(*extra):
    """The validated training flags (``pretrain.config.TrainingConfig``)."""
    return parse_run_config([*TINY, "--train-iters", "200", "--lr", "2e-3", "--min-lr", "2e-4",
                             "--lr-warmup-iters", "20", *extra], 1, False).training


def _model_and_opt(*extra):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    args = _args(*extra)
    opt = build_optimizer(model, args)
    return model, opt, args


def _previous_schedule(it, max_lr, min_lr, warmup, decay, style):
    """The schedule this project computed before megatron-core's (the ``make pretrain`` default)."""
    if warmup > 0 and it <= warmup:
        return max_lr * it / warmup
    if style == "constant":
        return max_lr
    if it >= decay:
        return min_lr
    ratio = (it - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_default_styles_bit_identical_to_the_previous_schedule(style):
    # the tiny model's make-pretrain schedule: lr 2e-3, min 2e-4, 20 warm-up iterations, 200 in all
    _, opt, args = _model_and_opt("--lr-decay-style", style)
    s = LRSchedule.from_training(opt, args)
    got = [s.step() for _ in range(230)]
    want = [_previous_schedule(i, 2e-3, 2e-4, 20, 200, style) for i in range(1, 231)]
    assert got == want  # exact, not approx
    assert opt.param_groups[1]["lr"] == got[-1] and s.num_steps == 230


def test_warmup_as_long_as_the_decay():
    # megatron-core's constructor refuses it; the previous schedule ran it (smoke tests warm up only)
    _, opt, args = _model_and_opt("--train-iters", "4", "--lr-warmup-iters", "4")
    s = LRSchedule.from_training(opt, args)
    assert [s.step() for _ in range(6)] == [_previous_schedule(i, 2e-3, 2e-4, 4, 4, "cosine") for i in range(1, 7)]


def test_warmup_fraction_and_init():
    _, opt, args = _model_and_opt("--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.1", "--lr-warmup-init", "1e-4")
    s = LRSchedule.from_training(opt, args)
    assert s.lr_warmup_steps == pytest.approx(20.0)
    assert s.lr_at(0) == pytest.approx(1e-4) and s.lr_at(10) == pytest.approx(1e-4 + (2e-3 - 1e-4) / 2)
    assert s.lr_at(20) == pytest.approx(2e-3)


@pytest.mark.parametrize(("wsd_style", "coeff"), [
    ("linear", lambda r: 1.0 - r),
    ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1.0)),
    ("exponential", lambda r: 2.0 * 0.5**r - 1.0),
    ("minus_sqrt", lambda r: 1.0 - math.sqrt(r)),
])  # fmt: skip
def test_wsd_holds_then_anneals_over_its_last_iterations(wsd_style, coeff):
    _, opt, args = _model_and_opt("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "50",
                                  "--lr-wsd-decay-style", wsd_style)
    s = LRSchedule.from_training(opt, args)
    lrs = {i: s.step() for i in range(1, 211)}
    assert lrs[10] == pytest.approx(1e-3)  # warm-up
    assert all(lrs[i] == 2e-3 for i in range(20, 151))  # stable: exactly --lr, comparable mid-run
    for i in (151, 175, 199):
        assert lrs[i] == pytest.approx(2e-4 + coeff((i - 150) / 50) * 1.8e-3, rel=1e-12)
    assert lrs[200] == pytest.approx(2e-4) and lrs[201] == lrs[210] == 2e-4


def test_weight_decay_by_group_and_increment():
    _, opt, args = _model_and_opt("--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
                                  "--end-weight-decay", "0.1")
    s = LRSchedule.from_training(opt, args)
    for _ in range(100):
        s.step()
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.05)  # matrices, halfway up
    assert opt.param_groups[1]["weight_decay"] == 0.0  # biases and norms never decay
    _, opt, args = _model_and_opt("--weight-decay", "0.05")
    LRSchedule.from_training(opt, args).step()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


OLD_STATE = {"num_steps": 7, "max_lr": 2e-3, "min_lr": 2e-4, "warmup_iters": 20, "decay_iters": 200,
             "decay_style": "cosine"}  # what checkpoints saved before megatron-core's scheduler


def test_old_checkpoint_state_resumes():
    model, opt, args = _model_and_opt()
    # an old checkpoint's optimizer state: its param groups predate "wd_mult"
    old_opt = torch.optim.AdamW([{"params": [model[0].weight], "weight_decay": 0.1},
                                 {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0}])
    s = LRSchedule.from_training(opt, args)  # as at --load: the schedule is built, then the states load
    opt.load_state_dict(old_opt.state_dict())
    assert "wd_mult" not in opt.param_groups[1]
    s.load_state_dict(dict(OLD_STATE))
    assert s.num_steps == 7 and s.load_notes == []
    assert s.step() == _previous_schedule(8, 2e-3, 2e-4, 20, 200, "cosine")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # the new state round-trips (megatron-core's keys plus WSD's)
    fresh = LRSchedule.from_training(build_optimizer(model, args), args)
    fresh.load_state_dict(s.state_dict())
    assert fresh.num_steps == 8 and fresh.state_dict() == s.state_dict()


def test_changed_schedule_on_resume_flags_win_or_checkpoint_with_flag():
    _, opt, args = _model_and_opt("--lr-decay-iters", "300")
    s = LRSchedule.from_training(opt, args)
    s.load_state_dict(dict(OLD_STATE))
    assert s.lr_decay_steps == 300
    assert s.load_notes == ["--lr-decay-iters: the checkpoint's lr schedule has 200, this run 300; using this run's"]
    _, opt, args = _model_and_opt("--lr-decay-iters", "300", "--use-checkpoint-opt_param-scheduler")
    s = LRSchedule.from_training(opt, args)
    s.load_state_dict(dict(OLD_STATE))
    assert s.lr_decay_steps == 200 and "using the checkpoint's" in s.load_notes[0]


def test_config_is_megatron_lms_defaults():
    cfg = LRScheduleConfig.from_training(_args())
    assert (cfg.decay_style, cfg.wsd_decay_style, cfg.init_lr, cfg.wsd_decay_iters) == ("cosine", "exponential", 0.0, None)
    assert (cfg.warmup_iters, cfg.decay_iters, cfg.start_wd, cfg.end_wd) == (20, 200, 0.1, 0.1)


@pytest.mark.parametrize(("extra", "message"), [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters N"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "300"], "--lr-wsd-decay-iters 300: must be in [0, "),
    (["--lr-wsd-decay-iters", "30"], "--lr-wsd-decay-iters 30: used only with --lr-decay-style WSD"),
    (["--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction 0.1 and --lr-warmup-iters 20: give one of them"),
    (["--lr-warmup-iters", "0", "--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction 1.5: must be in [0, 1)"),
    (["--lr-warmup-init", "1"], "--lr-warmup-init 1.0: must be in [0, --lr 0.002]"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay / --end-weight-decay: used only with"),
    (["--weight-decay-incr-style", "cosine"], "--weight-decay-incr-style cosine needs --start-weight-decay"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"], "give one of them"),
    (["--lr-wsd-decay-style", "step"], "--lr-wsd-decay-style: invalid choice: 'step'"),
])  # fmt: skip
def test_bad_schedule_flags_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError) as e:
        _args(*extra)
    assert message in str(e.value) and "\n" not in str(e.value)


# === QAT after a BF16 warm-up: a constant low lr ===


@pytest.mark.parametrize("spelling", [["--qat-warmup-iters", "3"], ["--precision-schedule", "0:observe,3:hif8_w8a8"]])
def test_qat_after_a_bf16_warmup_runs_at_a_constant_lr(spelling):
    # the case: a 6-iteration run, 3 of them the BF16 warm-up, lr 1e-5 / min 1e-6. Under the
    # old default (cosine) QAT's first step (iteration 4) ran at 3.25e-6; the recipe means 1e-5
    argv = [*TINY, "--train-iters", "6", "--lr", "1e-5", "--min-lr", "1e-6", "--lr-warmup-iters", "0"]
    extra = ["--precision", "hif8_w8a8"] if spelling[0] == "--qat-warmup-iters" else []
    training = parse_run_config([*argv, *extra, *spelling], 1, False).training
    assert training.lr_decay_style == "constant"
    s = LRSchedule.from_training(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), training)
    assert [s.step() for _ in range(6)] == [1e-5] * 6
    # a decay asked for is kept; without a warm-up phase the default stays cosine
    assert parse_args_or_raise([*argv, *extra, *spelling, "--lr-decay-style", "cosine"]).lr_decay_style == "cosine"
    # a model-size file's pretraining warm-up (1.3b: 2,000 iterations) is not applied; a flag's is
    qat = ["--model-size", "1.3b", "--precision", "hif8_w8a8", "--qat-warmup-iters", "500", "--lr", "1e-5",
           "--min-lr", "1e-6", "--train-iters", "10500"]
    assert parse_args_or_raise(qat).lr_warmup_iters == 0
    assert parse_args_or_raise([*qat, "--lr-warmup-iters", "100"]).lr_warmup_iters == 100
    cosine = LRSchedule.from_training(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]),
                                      parse_run_config([*argv, "--precision", "hif8_w8a8"], 1, False).training)
    assert cosine.lr_at(4) == pytest.approx(3.25e-6)

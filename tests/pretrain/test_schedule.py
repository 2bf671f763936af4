"""Precision schedules in training (``--precision-schedule``; ``precision.schedule``): refusals before
anything is built, the switch between steps (log line, plan in force, TensorBoard, checkpoints),
resume across a switch equal to the straight run bit for bit, and ``--qat-warmup-iters N`` equal to
its schedule spelling ``0:observe,N:PRECISION`` bit for bit.

The single-process runs call ``pretrain.train.main`` in this process (a world of one, torn down
after each run; one thread, as the subprocess runs use), which is much faster than a torchrun
subprocess; TP/PP runs go through torchrun (``tests.pretrain._launch``) and are marked slow.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from pretrain import runtime
from pretrain.train import main
from tests.pretrain._launch import TINY, load_rank_checkpoint, run_pretrain, scalars

FAST = [*TINY, "--gemm-backend", "reference", "--eval-interval", "0", "--eval-iters", "1", "--num-workers", "0"]
# delayed scaling on Fprop in FP8 (histories to keep or drop), then MXFP4 with stochastic rounding
# (SR call counters), then the first plan again: its histories must start over after the gap
FP8_DELAYED = "base=fp8,fprop=fp8+delayed(max,4)"
SCHEDULE = f"0:{FP8_DELAYED},2:mxfp4_sr,4:{FP8_DELAYED}"
MXFP4_SR = "fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4+sr"  # str(presets.get("mxfp4_sr"))


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv)`` in this process; (exit status, stdout + stderr). Leaves no process group,
    parallel state, SIGTERM handler or torchrun variables behind."""
    from megatron.core import parallel_state

    environ, handler, threads = dict(os.environ), signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        runtime.reset_groups()
        os.environ.clear()
        os.environ.update(environ)
        signal.signal(signal.SIGTERM, handler)
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return status, out + err


def ckpt(save: Path, iteration: int, rank: str = "mp_rank_00") -> dict:
    return torch.load(save / f"iter_{iteration:07d}" / rank / "model_optim_rng.pt", map_location="cpu",
                      weights_only=False)


def assert_same_state(a: dict, b: dict) -> None:
    """Weights, quantization state (SR counters, amax histories) and optimizer state bit for bit."""
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b["model"][k]), k
        else:  # _extra_state: the layer's LayerQuantState
            assert v["calls"] == b["model"][k]["calls"], k
            assert v["amax"].keys() == b["model"][k]["amax"].keys(), k
            for key, h in v["amax"].items():
                assert torch.equal(h["history"], b["model"][k]["amax"][key]["history"]), (k, key)
    for (_, sa), (_, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items(), strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[name], sb[name])


# === refusals: one line, exit 2, before anything is built ===

# fmt: off
BAD = [  # (extra flags, the key part of the one line)
    (["--precision", "fp8", "--precision-schedule", "0:fp8,2:bf16"],
     "--precision-schedule and --precision: give each phase's precision in the schedule"),
    (["--precision-schedule", "0:observe,2:hif8_w8a8", "--qat-warmup-iters", "2"],
     "--precision-schedule and --qat-warmup-iters 2: spell the warm-up as an observe phase"),
    (["--precision-schedule", "0:fp8,6:bf16"],
     ("--precision-schedule '0:fp8,6:bf16': phase 6:bf16 starts after iteration 6, but --train-iters is 6: "
     "it would never run")),
    (["--precision-schedule", "0:fp8,2:fp4"], ("--precision-schedule '0:fp8,2:fp4': phase 2:fp4: unknown precision "
                                              "'fp4': not a preset, a spec (GEMM=RECIPE,...) or a file; presets: bf16")),
    (["--precision-schedule", "0:fp8,3:bf16,3:mxfp4"], "phases 1 (3:bf16) and 2 (3:mxfp4) both start at 3"),
    (["--precision-schedule", "0:fp8,4:bf16,3:mxfp4"], "phase 2 (3:mxfp4) starts before phase 1 (4:bf16)"),
    (["--precision-schedule", "2:fp8"], "--precision-schedule '2:fp8': the first phase starts at 2; it must start at 0"),
    (["--precision-schedule", "0:fp8,3:observe"], "the last phase (3:observe) is observe"),
    (["--precision-schedule", "0:fp8;3:bf16"], "phase 0:fp8;3:bf16: unknown precision"),
    # --precision-rule applies in every phase and is checked once per phase's plan
    (["--precision-schedule", "0:fp8,3:bf16", "--precision-rule", "layers:1-4=bf16"],
     "--precision-rule 'layers:1-4=bf16': layer 4 is beyond the model (2 layers: 0-1)"),
]
# fmt: on


@pytest.mark.parametrize("argv, expected", BAD)
def test_bad_schedules_are_refused_in_one_line(argv, expected, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exc:
        main([*FAST, "--train-iters", "6", *argv])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: "), err
    assert expected in lines[0], lines[0]


def test_a_schedule_replaces_precision_and_keeps_the_default_elsewhere():
    from pretrain.arguments import parse_args_or_raise, precision_schedule

    args = parse_args_or_raise([*FAST, "--train-iters", "4"])
    assert args.precision == "bf16" and str(precision_schedule(args)) == "0:bf16"
    args = parse_args_or_raise([*FAST, "--train-iters", "4", "--precision", "hif8_w8a8", "--qat-warmup-iters", "3"])
    assert str(precision_schedule(args)) == "0:observe,3:hif8_w8a8"
    args = parse_args_or_raise([*FAST, "--train-iters", "4", "--precision-schedule", "0:nvfp4,3:bf16"])
    assert args.precision is None and str(precision_schedule(args)) == "0:nvfp4,3:bf16"


# === the switch ===


def test_switch_is_logged_shown_and_checkpointed(tmp_path, data_cache, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    status, out = run_main([*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "3",
                            "--precision-schedule", "0:bf16,2:mxfp4", "--precision-rule", "first:1=fp8",
                            "--save", str(save), "--save-interval", "1", "--tensorboard-dir", str(tb)], capsys)
    assert status == 0, out
    assert ("precision schedule (--precision-schedule 0:bf16,2:mxfp4 --precision-rule first:1=fp8): "
            "phase 0 bf16 (iterations 1..2) | phase 1 mxfp4 (iterations 3..3)") in out
    assert "iteration 1: precision phase 0 -> bf16 (iterations 1..2)" in out
    switch = out.index("iteration 3: precision phase 1 -> mxfp4 (iterations 3..3)")
    assert out.index("iteration 2/3") < switch < out.index("iteration 3/3")
    # the plan in force, as checkpoints hold it: the rule applies in both phases
    plans = {i: ckpt(save, i)["precision_plan"] for i in (1, 2, 3)}
    assert plans[1] == plans[2] and plans[2] != plans[3]
    assert plans[2]["decoder.layers.1.mlp.linear_fc1"] == {"precision": "fprop=bf16,dgrad=bf16,wgrad=bf16",
                                                          "rule": "--precision-schedule 0:bf16"}
    assert plans[3]["decoder.layers.1.mlp.linear_fc1"] == {"precision": "fprop=mxfp4,dgrad=mxfp4,wgrad=mxfp4",
                                                          "rule": "--precision-schedule 2:mxfp4"}
    for i in (2, 3):
        assert plans[i]["decoder.layers.0.mlp.linear_fc1"]["rule"] == "--precision-rule first:1=fp8"
    assert [ckpt(save, i)["precision_phase"] for i in (1, 2, 3)] == [0, 0, 1]
    assert ckpt(save, 3)["precision_schedule"] == {"phases": [{"start": 0, "precision": "bf16"},
                                                              {"start": 2, "precision": "mxfp4"}]}
    # TensorBoard: the phase of every iteration, and each phase's plan table from its first iteration
    assert scalars(tb, "precision/phase") == {1: 0.0, 2: 0.0, 3: 1.0}
    acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("precision_plan/text_summary")}
    assert sorted(texts) == [1, 3] and "phase 1 (2:mxfp4) from iteration 3" in texts[3]
    assert "mxfp4" in texts[3] and "mxfp4" not in texts[1].split("\n", 1)[1]


def test_resume_across_switches_equals_the_straight_run(tmp_path, data_cache, capsys):
    """Resumed exactly at each switch (the checkpoint before the new phase's first step) and in the
    middle of a phase, runs repeat the straight run bit for bit: losses, weights, SR counters,
    amax histories, Adam moments. Histories the previous phase did not record start over."""
    common = [*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "5", "--precision-schedule", SCHEDULE]
    straight, tb = tmp_path / "straight", tmp_path / "tb"
    status, out = run_main([*common, "--save", str(straight), "--save-interval", "1", "--tensorboard-dir", str(tb)],
                           capsys)
    assert status == 0, out

    def history(i: int) -> dict:
        return ckpt(straight, i)["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"]["amax"]

    assert len(history(2)["fprop/x"]["history"]) == 2  # iterations 1, 2 recorded
    assert torch.equal(history(4)["fprop/x"]["history"], history(2)["fprop/x"]["history"])  # MXFP4: not recorded
    # phase 2 starts after the MXFP4 gap: the stale history was dropped at the switch, iteration 5 recorded
    assert len(history(5)["fprop/x"]["history"]) == 1
    want, want_lines = scalars(tb, "lm loss"), out
    lines = {2: "iteration 3: precision phase 1 -> mxfp4_sr (iterations 3..4)\n",
             3: "iteration 4: precision phase 1 -> mxfp4_sr (iterations 3..4; resumed within the phase)\n",
             4: f"iteration 5: precision phase 2 -> {FP8_DELAYED} (iterations 5..5)\n"}
    for at, line in lines.items():
        resumed, tb_r = tmp_path / f"from{at}", tmp_path / f"tb{at}"
        status, out = run_main([*common, "--load", str(straight), "--ckpt-step", str(at), "--save", str(resumed),
                                "--tensorboard-dir", str(tb_r)], capsys)
        assert status == 0, out
        assert line in out and (line in want_lines or at == 3), at
        assert "was saved under precision schedule" not in out  # the same schedule: no note
        got = scalars(tb_r, "lm loss")
        assert got == {i: v for i, v in want.items() if i > at}, at
        assert_same_state(ckpt(resumed, 5), ckpt(straight, 5))
        assert ckpt(resumed, 5)["precision_plan"] == ckpt(straight, 5)["precision_plan"]


def test_a_checkpoint_of_another_schedule_is_noted(tmp_path, data_cache, capsys):
    save = tmp_path / "ckpt"
    common = [*FAST, "--data-cache-dir", str(data_cache), "--save", str(save), "--load", str(save)]
    status, out = run_main([*common, "--train-iters", "2", "--precision-schedule", "0:bf16,1:fp8"], capsys)
    assert status == 0, out
    status, out = run_main([*common, "--train-iters", "3", "--precision-schedule", "0:bf16,1:fp8,2:mxfp4"], capsys)
    assert status == 0, out
    assert (f"note: {save / 'iter_0000002'} was saved under precision schedule 0:bf16,1:fp8, this run's is "
            "0:bf16,1:fp8,2:mxfp4 (the same for iterations 1..2); iteration 3 on follows this run's: phase 2 "
            "(2:mxfp4)") in out
    assert "iteration 3: precision phase 2 -> mxfp4" in out
    status, out = run_main([*common, "--train-iters", "4", "--precision", "bf16"], capsys)
    assert status == 0, out
    assert "(iterations 1..3 trained under another schedule: not this schedule's straight run)" in out


# === --qat-warmup-iters is a schedule ===


def test_qat_warmup_iters_equals_its_schedule(tmp_path, data_cache, capsys):
    common = [*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "3", "--precision-rule",
              "kind:mlp=hif8_w8a8", "--eval-interval", "1"]
    runs = {}
    for name, flags in (("qat", ["--precision", "hif8_w8a8", "--qat-warmup-iters", "2"]),
                        ("schedule", ["--precision-schedule", "0:observe,2:hif8_w8a8"])):
        save, tb = tmp_path / name, tmp_path / f"tb_{name}"
        status, out = run_main([*common, *flags, "--save", str(save), "--tensorboard-dir", str(tb)], capsys)
        assert status == 0, out
        assert ("iteration 1: precision phase 0 -> observe (BF16 GEMMs fill the amax histories of phase 1's plan, "
                "hif8_w8a8) (iterations 1..2)") in out
        assert ("iteration 3: QAT warm-up done (2 BF16 iterations filled the amax histories): precision phase 1 -> "
                "hif8_w8a8 (iterations 3..3)") in out
        runs[name] = (ckpt(save, 3), scalars(tb, "lm loss"), scalars(tb, "lm loss validation"))
    (a, loss_a, val_a), (b, loss_b, val_b) = runs["qat"], runs["schedule"]
    assert loss_a == loss_b and val_a == val_b and sorted(val_a) == [1, 2, 3]
    assert_same_state(a, b)
    # the warm-up filled the histories: two BF16 steps and the first HiF8 one
    assert len(a["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"]["amax"]["fprop/x"]["history"]) == 3
    assert a["precision_plan"] == b["precision_plan"]


# === tensor and pipeline parallelism (torchrun) ===


@pytest.mark.slow
def test_tp2_resume_across_a_switch(tmp_path, data_cache):
    common = [*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "4", "--tensor-model-parallel-size", "2",
              "--precision-schedule", f"0:{FP8_DELAYED},2:mxfp4_sr"]
    straight, tb = tmp_path / "straight", tmp_path / "tb"
    out = run_pretrain([*common, "--save", str(straight), "--save-interval", "2", "--tensorboard-dir", str(tb)]).stdout
    assert "iteration 3: precision phase 1 -> mxfp4_sr (iterations 3..4)" in out
    resumed, tb_r = tmp_path / "resumed", tmp_path / "tb_r"
    run_pretrain([*common, "--load", str(straight), "--ckpt-step", "2", "--save", str(resumed),
                  "--tensorboard-dir", str(tb_r)])
    assert scalars(tb_r, "lm loss") == {i: v for i, v in scalars(tb, "lm loss").items() if i > 2}
    for rank in (0, 1):
        a, b = load_rank_checkpoint(straight / "iter_0000004", rank), load_rank_checkpoint(resumed / "iter_0000004", rank)
        assert_same_state(a, b)
        assert a["precision_plan"]["decoder.layers.0.mlp.linear_fc1"]["precision"] == MXFP4_SR


@pytest.mark.slow
def test_pp2_stage_plans_and_resume_across_a_switch(tmp_path, data_cache):
    """Megatron's engine and 1F1B schedule over two pipeline stages (the CPU harness): each stage
    switches its own layers' plan; a resume at the switch repeats the straight run."""
    harness = str(Path(__file__).with_name("_megatron_on_cpu.py"))
    common = [*FAST, "--data-cache-dir", str(data_cache), "--train-iters", "4", "--pipeline-model-parallel-size", "2",
              "--ddp-impl", "megatron", "--clip-grad", "0", "--precision-schedule", "0:bf16,2:mxfp4_sr",
              "--precision-rule", "last:1=wgrad_hadamard"]
    straight, tb = tmp_path / "straight", tmp_path / "tb"
    out = run_pretrain([*common, "--save", str(straight), "--save-interval", "2", "--tensorboard-dir", str(tb)],
                       script=harness).stdout
    assert "iteration 3: precision phase 1 -> mxfp4_sr" in out
    resumed, tb_r = tmp_path / "resumed", tmp_path / "tb_r"
    run_pretrain([*common, "--load", str(straight), "--ckpt-step", "2", "--save", str(resumed),
                  "--tensorboard-dir", str(tb_r)], script=harness)
    assert scalars(tb_r, "lm loss") == {i: v for i, v in scalars(tb, "lm loss").items() if i > 2}
    stage0, stage1 = (ckpt(straight, 4, f"mp_rank_00_00{s}") for s in (0, 1))
    assert set(stage0["precision_plan"]) == {f"decoder.layers.0.{n}" for n in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    assert stage0["precision_plan"]["decoder.layers.0.mlp.linear_fc1"]["precision"] == MXFP4_SR
    assert stage1["precision_plan"]["decoder.layers.1.mlp.linear_fc1"]["rule"] == "--precision-rule last:1=wgrad_hadamard"
    assert ckpt(straight, 2, "mp_rank_00_000")["precision_plan"]["decoder.layers.0.mlp.linear_fc1"]["precision"] == (
        "fprop=bf16,dgrad=bf16,wgrad=bf16")
    for s in (0, 1):
        a, b = ckpt(straight, 4, f"mp_rank_00_00{s}"), ckpt(resumed, 4, f"mp_rank_00_00{s}")
        for k, v in a["model"].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b["model"][k]), k

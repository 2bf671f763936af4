"""HiF8 QAT: amax algorithms on a scripted amax sequence, and an end-to-end QAT run from a
checkpoint with BF16 warm-up, the switch to the quantized plan, and a resume across the switch
(``--qat-warmup-iters N`` is the precision schedule ``0:observe,N:PRECISION``; tests/pretrain/test_schedule.py
checks the two spellings train alike, bit for bit)."""

import pytest
import torch

from precision import OperandFormat, quantize
from precision.tensorwise import AmaxHistory
from tests.pretrain._launch import TINY, run_pretrain
from tests.pretrain._launch import scalars as read_scalar

# HiF8 with TE's FP8 rule (amax -> 2^15, no headroom): the amax algorithms' clipping after a jump
FP8_RULE = OperandFormat("hif8", margin=-12)


def clipped_per_step(algo: str, amaxes: list[float], window: int = 64, fmt=FP8_RULE) -> list[int]:
    """Quantize a tensor per step whose amax follows ``amaxes``, scaled from the history."""
    hist = AmaxHistory(algo, window, ema_decay=0.5)
    out = []
    for a in amaxes:
        x = torch.linspace(-a, a, 101)  # 101 values, amax a
        q = quantize(x, fmt, amax=hist.amax())
        hist.update(float(q.amax))
        out.append(int(q.num_clipped))
    return out


AMAXES = [1.0, 1.0, 8.0, 1.0, 8.0, 2.0]


def test_most_recent_clips_after_every_jump():
    assert clipped_per_step("most_recent", AMAXES) == [0, 0, 88, 0, 88, 0]


def test_max_window_does_not_clip_within_the_window():
    assert clipped_per_step("max", AMAXES) == [0, 0, 88, 0, 0, 0]
    # ... but does once the 8.0 has left a short window
    assert clipped_per_step("max", AMAXES + [1.0, 1.0, 8.0], window=2)[-1] == 88


def test_ema_lags():
    got = clipped_per_step("ema", AMAXES)
    assert got[2] == 88 and 0 < got[4] < 88 and got[5] == 0  # EMA (0.5) of 1,1,8,1 = 3.25 < 8


def test_current_scaling_never_clips():
    assert clipped_per_step("current", AMAXES) == [0] * len(AMAXES)


def test_clipped_count_is_exact():
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.0, 2.5, 4.0])
    assert int(quantize(x, FP8_RULE, amax=2.0).num_clipped) == 3  # -3, 2.5 and 4 exceed 2


def test_hif8_scale_target_leaves_12_binades_of_headroom():
    # amax -> 2^3: the 8x jumps above clip nothing under most_recent; a value clips only beyond
    # amax * 2^15 / 2^3 = 4096 amax (saturating there)
    assert clipped_per_step("most_recent", AMAXES, fmt=OperandFormat("hif8")) == [0] * len(AMAXES)
    x = torch.tensor([4095.0, 4096.0, 4097.0, -5000.0])
    q = quantize(x, "hif8", amax=1.0)
    assert int(q.num_clipped) == 2 and q.dequantize()[3].item() == -4096.0


QAT = ["--precision", "hif8_w8a8", "--precision-rule", "kind:mlp=hif8_w8a8", "--qat-warmup-iters", "2",
       "--gemm-backend", "reference", "--eval-interval", "0"]


@pytest.mark.slow
def test_qat_from_checkpoint_warmup_switch_and_resume(tmp_path, data_cache):
    common = [*TINY, "--data-cache-dir", str(data_cache), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "0"]
    base = tmp_path / "pretrained"
    run_pretrain([*common, "--train-iters", "2", "--save", str(base), "--gemm-backend", "reference"], nproc=0)

    straight, tb1 = tmp_path / "qat", tmp_path / "tb1"
    out = run_pretrain([*common, *QAT, "--load", str(base), "--finetune", "--train-iters", "4",
                        "--save", str(straight), "--save-interval", "3", "--tensorboard-dir", str(tb1)], nproc=0).stdout
    # --qat-warmup-iters 2 is the schedule 0:observe,2:hif8_w8a8: its switch, logged
    assert ("iteration 3: QAT warm-up done (2 BF16 iterations filled the amax histories): precision phase 1 -> "
            "hif8_w8a8 (iterations 3..4)") in out
    assert "hif8+delayed(max,64)" in out  # the plan table
    clipped = read_scalar(tb1, "qat/decoder.layers.0.mlp.linear_fc1/fprop/x/clipped_fraction")
    ratio = read_scalar(tb1, "qat/decoder.layers.1.mlp.linear_fc2/fprop/w/amax_ratio")
    assert sorted(clipped) == [3, 4] and sorted(ratio) == [3, 4]  # logged from the switch on
    assert all(0.0 <= v <= 1.0 for v in clipped.values())

    # Resume from the checkpoint the straight run saved at iteration 3 (just after the switch) and
    # match the straight run's iteration 4.
    ck = torch.load(straight / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", map_location="cpu",
                    weights_only=False)
    extra = ck["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"]
    # one history entry per optimizer step, the maximum over its micro-batches (TINY runs 2 per
    # iteration; precision.state): 2 warm-up iterations + the first QAT iteration
    assert len(extra["amax"]["fprop/x"]["history"]) == 3
    resumed, tb2 = tmp_path / "qat_resumed", tmp_path / "tb2"
    out = run_pretrain([*common, *QAT, "--load", str(straight), "--ckpt-step", "3", "--train-iters", "4", "--save",
                        str(resumed), "--tensorboard-dir", str(tb2)], nproc=0).stdout
    assert f"resumed from {straight / 'iter_0000003'}: iteration 3" in out
    assert read_scalar(tb2, "lm loss") == {4: read_scalar(tb1, "lm loss")[4]}

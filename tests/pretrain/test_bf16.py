"""``--bf16`` on CPU at tiny size: BF16 parameters and activations, FP32 main weights and gradients
(``pretrain.optim.MainParams`` on the torch engine); checkpoints hold the FP32 mains and a resumed
run repeats the uninterrupted one bit for bit."""

import pytest
import torch

from pretrain.optim import MainParams
from tests.pretrain._launch import TINY, load_rank_checkpoint, run_pretrain, scalars


def test_main_params_accumulate_bf16_grads_in_fp32_and_round_to_nearest():
    """Against an independent FP32 reference: the main's gradient is the FP32 sum of the BF16
    micro-batch gradients (not a BF16 sum), and the model takes the main rounded to nearest."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    main = MainParams(model)
    (name, w_main), = main.named_parameters()
    assert name == "weight" and w_main.dtype == torch.float32 and torch.equal(w_main.bfloat16(), model.weight)
    xs = [torch.randn(8, 64).bfloat16() * 10 ** k for k in range(3)]  # magnitudes BF16 sums would round
    for x in xs:
        model(x).float().square().sum().backward()
    assert model.weight.grad is None  # moved into the main at once
    expected = torch.zeros(32, 64)
    for x in xs:  # each micro-batch's BF16 gradient, summed in FP32
        w = model.weight.detach().clone().requires_grad_()
        torch.nn.functional.linear(x, w).float().square().sum().backward()
        expected += w.grad.float()
    assert torch.equal(w_main.grad, expected)
    with torch.no_grad():
        w_main += 1e-3 * torch.randn(32, 64)  # an update BF16 cannot hold
    main.copy_to_model()
    assert torch.equal(model.weight, w_main.detach().to(torch.bfloat16))
    assert not torch.equal(model.weight.float(), w_main.detach())  # the main keeps FP32 precision


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory, data_cache):
    """An uninterrupted 4-iteration --bf16 run saving at 2 and 4, and a run resumed from its
    iteration 2 (a fresh process); both load data through 2 DataLoader workers (--num-workers)."""
    root = tmp_path_factory.mktemp("bf16")
    common = [*TINY, "--bf16", "--precision", "bf16", "--train-iters", "4", "--eval-interval", "0", "--num-workers", "2",
              "--eval-iters", "0", "--data-cache-dir", str(data_cache), "--save-interval", "2"]
    whole = run_pretrain([*common, "--save", str(root / "whole"), "--tensorboard-dir", str(root / "tb_whole")], nproc=0)
    resumed = run_pretrain([*common, "--load", str(root / "whole"), "--ckpt-step", "2", "--save", str(root / "resumed"),
                            "--tensorboard-dir", str(root / "tb_resumed")], nproc=0)
    return root, whole, resumed


def test_bf16_resume_is_bit_identical(bf16_runs):
    root, whole, resumed = bf16_runs
    assert "--bf16: BF16 parameters and activations, FP32 main parameters and gradients" in whole.stdout
    assert "resumed from" in resumed.stdout
    loss_whole, loss_resumed = scalars(root / "tb_whole", "lm loss"), scalars(root / "tb_resumed", "lm loss")
    assert sorted(loss_resumed) == [3, 4]
    assert all(loss_whole[i] == loss_resumed[i] for i in (3, 4)), (loss_whole, loss_resumed)
    a = load_rank_checkpoint(root / "whole" / "iter_0000004", 0)
    b = load_rank_checkpoint(root / "resumed" / "iter_0000004", 0)
    for key, value in a["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["model"][key]), key


def test_checkpoints_hold_fp32_main_weights(bf16_runs):
    """The model entry is FP32 and holds values BF16 cannot (the mains after Adam steps), while the
    saved args say the model ran in BF16."""
    root, _, _ = bf16_runs
    ckpt = load_rank_checkpoint(root / "whole" / "iter_0000004", 0)
    assert ckpt["args"]["bf16"] is True
    weights = {k: v for k, v in ckpt["model"].items() if isinstance(v, torch.Tensor) and k.endswith("weight")}
    assert weights and all(v.dtype == torch.float32 for v in weights.values())
    w = weights["decoder.layers.0.mlp.linear_fc1.weight"]
    assert not torch.equal(w, w.bfloat16().float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's mixed-precision optimizer needs CUDA")
def test_megatron_engine_bf16_resume_is_bit_identical(tmp_path, data_cache):
    """megatron-core's mixed-precision optimizer keeps the FP32 mains (in its state, as in
    Megatron-LM): a resumed --bf16 run on the megatron engine repeats the uninterrupted one."""
    common = [*TINY, "--bf16", "--ddp-impl", "megatron", "--precision", "bf16", "--train-iters", "4",
              "--eval-iters", "0", "--data-cache-dir", str(data_cache), "--save-interval", "2"]
    run_pretrain([*common, "--save", str(tmp_path / "a"), "--tensorboard-dir", str(tmp_path / "tb_a")], nproc=1)
    run_pretrain([*common, "--load", str(tmp_path / "a"), "--ckpt-step", "2", "--save", str(tmp_path / "b"),
                  "--tensorboard-dir", str(tmp_path / "tb_b")], nproc=1)
    a, b = scalars(tmp_path / "tb_a", "lm loss"), scalars(tmp_path / "tb_b", "lm loss")
    assert a[3] == b[3] and a[4] == b[4]


def test_bf16_data_parallel_sums_the_fp32_gradients(bf16_runs, tmp_path, data_cache):
    """DP=2 (no torch DDP under --bf16: the FP32 main gradients are all-reduced by the engine) sees
    the gradient of DP=1 with two micro-batches: the same global norm before clipping (summation
    order differs, so to FP32 rounding), the same first loss."""
    root, _, _ = bf16_runs
    run_pretrain([*TINY, "--bf16", "--precision", "bf16", "--train-iters", "4", "--exit-interval", "1",
                  "--eval-iters", "0", "--data-cache-dir", str(data_cache), "--tensorboard-dir", str(tmp_path / "tb")],
                 nproc=2)
    for tag, rel in (("lm loss", 1e-6), ("grad-norm", 1e-5)):
        dp2, dp1 = scalars(tmp_path / "tb", tag)[1], scalars(root / "tb_whole", tag)[1]
        assert abs(dp2 - dp1) <= rel * abs(dp1), (tag, dp2, dp1)


def test_weights_loaded_into_a_bf16_model_keep_their_fp32_bits_in_the_mains():
    """--pretrained-checkpoint under --bf16: the loaders copy into the model, which is FP32 while
    ``full_precision_weights`` is open, so the mains hold the file's FP32 values exactly."""
    from pretrain.arguments import parse_run_config
    from pretrain.engine import TorchEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    run = parse_run_config([*TINY, "--train-iters", "4", "--bf16", "--lr", "1e-3", "--weight-decay", "0.1"], 1, False)
    engine = TorchEngine(model, run, torch.device("cpu"))
    pretrained = {"weight": torch.randn(8, 16), "bias": torch.randn(8)}  # FP32 values BF16 cannot hold
    with engine.full_precision_weights():
        model.load_state_dict(pretrained)
        engine.weights_loaded()
    mains = dict(engine.main.named_parameters())
    for name, value in pretrained.items():
        assert torch.equal(mains[name].detach(), value), name
        assert getattr(model, name).dtype == torch.bfloat16
        assert torch.equal(getattr(model, name), value.to(torch.bfloat16)), name

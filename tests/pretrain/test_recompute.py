"""Activation recomputation changes no bit: losses, gradients and quantization state are identical
with and without ``--recompute-granularity`` (``model.recompute``), stochastic rounding (``mxfp4_sr``)
and delayed scaling (``hif8_w8a8``) included, over several micro-batches and optimizer steps."""

import pytest
import torch

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names, policy_linears
from model.recompute import RecomputeConfig
from precision import PrecisionPolicy, presets

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  seq_length=32, vocab_size=256)
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--train-iters", "1"]
RECOMPUTE = {
    "full-uniform-1": RecomputeConfig("full", "uniform", 1),
    "full-uniform-2": RecomputeConfig("full", "uniform", 2),
    "full-block-1": RecomputeConfig("full", "block", 1),
    "selective": RecomputeConfig("selective"),
}


def _train(precision: str, recompute: RecomputeConfig | None, interleaved: bool = False, steps: int = 2):
    """Losses, gradients (per step) and final quantization state of a few SGD steps of two
    micro-batches each. ``interleaved``: both forwards before both backwards, as a pipeline
    schedule keeps micro-batches in flight (backwards in forward order)."""
    torch.manual_seed(0)
    model = build_gpt(CFG, seed=7, recompute=recompute)
    # every linear in the preset (hif8_w8a8's default rules would keep this 2-layer model in BF16)
    apply_precision_plan(model, {n: presets.get(precision) for n in policy_linear_names(model)})
    for _, m in policy_linears(model):
        m.gemm_backend = "reference"  # the eager spec: no compilation in this test
    data = torch.Generator().manual_seed(1)
    position_ids = torch.arange(CFG.seq_length).expand(2, -1)
    losses, grads = [], []
    for _ in range(steps):
        pending = []
        for _ in range(2):
            tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), generator=data)
            loss = model(tokens, position_ids, None, labels=tokens).float().mean()
            losses.append(loss.detach())
            pending.append(loss)
            if not interleaved:
                pending.pop().backward()
        for loss in pending:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        for _, m in policy_linears(model):
            m.quant_state.end_step()
    state = {n: m.quant_state.state_dict() for n, m in policy_linears(model)}
    return torch.stack(losses), grads, state


_runs = {}


def _reference(precision: str, interleaved: bool):
    if (precision, interleaved) not in _runs:
        _runs[precision, interleaved] = _train(precision, None, interleaved)
    return _runs[precision, interleaved]


@pytest.mark.parametrize("precision, name, interleaved", [
    ("mxfp4_sr", "full-uniform-2", False),
    ("mxfp4_sr", "full-block-1", False),
    ("mxfp4_sr", "selective", False),
    ("mxfp4_sr", "full-uniform-1", True),
    ("hif8_w8a8", "full-uniform-1", False),
])  # fmt: skip
def test_recompute_is_bit_identical(world_of_one, precision, name, interleaved):
    losses, grads, state = _reference(precision, interleaved)
    r_losses, r_grads, r_state = _train(precision, RECOMPUTE[name], interleaved)
    assert torch.equal(losses, r_losses), (losses - r_losses).abs().max()
    for step, (g, rg) in enumerate(zip(grads, r_grads, strict=True)):
        for n in g:
            assert torch.equal(g[n], rg[n]), f"step {step + 1}: {n} differs ({precision}, {name})"
    for n in state:  # the same SR call counts; every delayed-scaling amax recorded once per step
        assert state[n]["calls"] == r_state[n]["calls"], n
        for key, hist in state[n]["amax"].items():
            assert torch.equal(hist["history"], r_state[n]["amax"][key]["history"]), (n, key)
    if precision == "hif8_w8a8":  # delayed scaling is in play: one history entry per step
        assert any(len(h["history"]) == 2 for st in state.values() for h in st["amax"].values())


def test_recompute_keeps_fewer_activations(world_of_one):
    """Recomputation does something: the autograd graph of a full-recompute forward saves fewer
    tensors than the plain one (an independent count through saved-tensor hooks)."""

    def saved_bytes(recompute):
        torch.manual_seed(0)
        model = build_gpt(CFG, seed=7, recompute=recompute)
        apply_precision_plan(model, PrecisionPolicy.from_args("bf16", []).resolve(policy_linear_names(model), 2))
        total = []
        tokens = torch.zeros(2, CFG.seq_length, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel()) or t, lambda t: t):
            model(tokens, torch.arange(CFG.seq_length).expand(2, -1), None, labels=tokens)
        return sum(total)

    assert saved_bytes(RecomputeConfig("full", "uniform", 2)) < 0.5 * saved_bytes(None)


def test_recompute_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--recompute-num-layers 3 does not divide the 4 layers"):
        RecomputeConfig("full", "uniform", 3).check(4)
    with pytest.raises(ValueError, match="--recompute-num-layers 5 exceeds"):
        RecomputeConfig("full", "block", 5).check(4)
    with pytest.raises(ValueError, match="--recompute-method 'x'"):
        RecomputeConfig("full", "x", 1)
    with pytest.raises(ValueError, match="need --recompute-granularity full"):
        RecomputeConfig("selective", "uniform", 1)


@pytest.mark.parametrize("extra, expected", [
    (["--recompute-method", "block"], "--recompute-method needs --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "3"],
     "--recompute-num-layers 3 does not divide the 2 layers per pipeline stage"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0: must be >= 1"),
    (["--num-workers", "-1"], "--num-workers -1: must be >= 0"),
])  # fmt: skip
def test_bad_flags_are_one_line_naming_the_flag(extra, expected):
    from pretrain.arguments import ConfigError, parse_args_or_raise, validate_args

    args = parse_args_or_raise([*TINY_FLAGS, *extra])
    with pytest.raises(ConfigError) as err:
        validate_args(args, 1, False)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value), str(err.value)


def test_flag_defaults_follow_the_device():
    from pretrain.arguments import parse_run_config

    for cuda, bf16, workers in ((False, False, 0), (True, True, 2)):
        run = parse_run_config(TINY_FLAGS, 1, cuda)
        assert (run.memory.bf16, run.data.num_workers, run.memory.recompute()) == (bf16, workers, None)
    run = parse_run_config([*TINY_FLAGS, "--no-bf16", "--recompute-granularity", "full"], 1, True)
    assert run.memory.bf16 is False and run.memory.recompute() == RecomputeConfig("full", "uniform", 1)

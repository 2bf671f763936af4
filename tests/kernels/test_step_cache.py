"""A weight is quantized once per optimizer step, and never served after the step that wrote it.

The layer state keeps what its GEMMs derived from a weight (``LayerQuantState.step_cache``: the
finished operands of every GEMM that consumes ``w`` unrotated with nearest rounding, and NVFP4's 2-D
tiles, which Dgrad shares with Fprop) until ``end_step``. The cache is keyed on the tensor's
identity, so these tests update the weights the ways megatron-core's optimizers do -- neither moves
``p._version``:

* ``copy``: ``model_param.data.copy_(main_param)`` (BF16 parameters with FP32 mains);
* ``flat_buffer``: the parameters are views of one flat buffer (the distributed optimizer's param
  buffer) and the buffer is written in place.

After the step ends, the next forward and backward must equal, bit for bit, those of a fresh state
(the same counters and amax histories, nothing cached) on the same new weights -- for every preset.
"""

from __future__ import annotations

import pytest
import torch

import kernels.operand as operand
from model.linear import policy_linear
from precision import presets
from precision.recipe import Gemm
from precision.state import LayerQuantState

OUT, IN, TOKENS, MICRO = 48, 80, 32, 2


def _inputs(step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


def _step(w, state, p, backend, step, micro=MICRO):
    """Forward and backward of ``micro`` micro-batches (gradients accumulate in ``w.grad``); returns
    every output and input gradient."""
    outs = []
    for m in range(micro):
        x, dy = _inputs(step, m)
        x.requires_grad_(True)
        y = policy_linear(x, w, p, state=state, backend=backend)
        y.backward(dy)
        outs += [y.detach(), x.grad]
    return outs


def _write(w: torch.nn.Parameter, new: torch.Tensor, how: str, flat: torch.Tensor | None):
    if how == "copy":
        w.data.copy_(new)
    else:  # the parameter views a flat buffer; the optimizer writes the buffer
        with torch.no_grad():
            flat[: w.numel()].copy_(new.reshape(-1))


def _param(how: str, w0: torch.Tensor):
    if how == "copy":
        return torch.nn.Parameter(w0.clone()), None
    flat = torch.zeros(w0.numel() + 64)
    flat[: w0.numel()] = w0.reshape(-1)
    w = torch.nn.Parameter(torch.empty(0))
    w.data = flat[: w0.numel()].view(OUT, IN)
    return w, flat


CASES = [(name, backend) for name in presets.names() for backend in ("emulated", "bf16_mm")
         if not (backend == "bf16_mm" and not all(presets.get(name).recipe(g).a.format.bf16_exact
                                                    and presets.get(name).recipe(g).b.format.bf16_exact for g in Gemm))]


@pytest.mark.parametrize("how", ["copy", "flat_buffer"])
@pytest.mark.parametrize(("name", "backend"), CASES)
def test_next_step_sees_the_new_weights(name, backend, how):
    p = presets.get(name)
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(OUT, IN, generator=g) * torch.exp2(torch.randint(-3, 3, (OUT, 1), generator=g)).float()
    w, flat = _param(how, w0)
    state = LayerQuantState(seed=11, name="decoder.layers.0.mlp.linear_fc1")
    _step(w, state, p, backend, step=0)
    version = w._version
    new = w.detach() - 0.25 * w.grad.sign() * w.detach().abs().mean()  # a visible update
    _write(w, new, how, flat)
    assert w._version == version and torch.equal(w.detach(), new)  # the write megatron makes: no new version
    state.end_step()
    assert not state.step_cache

    fresh = LayerQuantState()
    fresh.load_state_dict(state.state_dict())  # the same counters and histories, nothing cached
    w_fresh = torch.nn.Parameter(new.clone())
    w.grad = None
    got = _step(w, state, p, backend, step=1)
    want = _step(w_fresh, fresh, p, backend, step=1)
    for a, b in zip(got + [w.grad], want + [w_fresh.grad]):
        assert torch.equal(a, b)


@pytest.fixture
def weight_quantizations(monkeypatch):
    """Quantizations of the operand ``w`` (GEMM -> count), counted where the pipeline does the work."""
    counts: dict[str, int] = {}
    real = operand._quantize_operand

    def counted(t, axis, fmt, gemm, name, *a, **k):
        if name == "w":
            counts[gemm.value] = counts.get(gemm.value, 0) + 1
        return real(t, axis, fmt, gemm, name, *a, **k)

    monkeypatch.setattr(operand, "_quantize_operand", counted)
    return counts


@pytest.mark.parametrize(("name", "per_step"), [
    ("fp8", {"fprop": 1, "dgrad": 1}),  # nearest, unrotated: once per step whatever the micro-batches
    ("mxfp4", {"fprop": 1, "dgrad": 1}),
    ("nvfp4", {"fprop": 1, "dgrad": 1}),
    ("hif8_w8a8", {"fprop": 1, "dgrad": 3}),  # Dgrad consumes BF16 w: nothing to keep
    ("mxfp4_hadamard_all", {"fprop": 3, "dgrad": 3}),  # rotated: each GEMM's own copy
    ("bf16", {"fprop": 3, "dgrad": 3}),  # nothing to keep (a view or a cast)
])
def test_weight_quantized_once_per_step(name, per_step, weight_quantizations):
    p = presets.get(name)
    w = torch.nn.Parameter(torch.randn(OUT, IN))
    state = LayerQuantState(seed=3)
    for step in range(2):
        weight_quantizations.clear()
        _step(w, state, p, "emulated", step=step, micro=3)
        assert weight_quantizations == per_step
        w.data.mul_(0.5)
        state.end_step()


def test_telemetry_steps_quantize_every_call(weight_quantizations):
    """On a telemetry step each call records its own statistics: nothing is served from the cache."""
    state = LayerQuantState()
    state.collect_stats = True
    _step(torch.nn.Parameter(torch.randn(OUT, IN)), state, presets.get("fp8"), "emulated", step=0, micro=2)
    assert weight_quantizations == {"fprop": 2, "dgrad": 2} and not state.step_cache


def test_a_version_bump_within_a_step_is_seen():
    """An in-place write through autograd (a new version) is never served stale, even mid-step."""
    p = presets.get("fp8")
    w = torch.nn.Parameter(torch.randn(OUT, IN))
    state = LayerQuantState()
    x, _ = _inputs(0, 0)
    policy_linear(x, w, p, state=state)
    with torch.no_grad():
        w.mul_(3.0)
    fresh = LayerQuantState()
    fresh.load_state_dict(state.state_dict())
    assert torch.equal(policy_linear(x, w, p, state=state), policy_linear(x, w.detach().clone(), p, state=fresh))


def test_a_skipped_step_restored_from_a_checkpoint_drops_the_cache():
    state = LayerQuantState()
    _step(torch.nn.Parameter(torch.randn(OUT, IN)), state, presets.get("mxfp4"), "emulated", step=0, micro=1)
    assert state.step_cache
    state.load_state_dict(state.state_dict())
    assert not state.step_cache


def test_the_torch_engine_ends_the_step(world_of_one):
    """The training loop's optimizer step (``pretrain.engine``, shared by the torch and megatron
    engines) drops every layer's step cache."""
    from pretrain.arguments import parse_run_config
    from pretrain.engine import TorchEngine
    from pretrain.optim import LRSchedule
    from pretrain.train import build_model

    tiny = ["--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", "2", "--precision", "nvfp4", "--gemm-backend", "reference"]
    run = parse_run_config(tiny, world_size=1, cuda=False)
    torch.manual_seed(0)
    model, _, _ = build_model(run, vocab_size=256, device=torch.device("cpu"))
    engine = TorchEngine(model, run, torch.device("cpu"))
    schedule = LRSchedule.from_training(engine.optimizer, run.training)
    g = torch.Generator().manual_seed(0)
    micro = []
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        micro.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(32).expand(2, 32),
                      "loss_mask": torch.ones(2, 32)})
    seen, step = [], engine.optimizer.step

    def step_and_look(*a, **k):  # what the caches hold when the optimizer writes the weights
        seen.extend(len(m.quant_state.step_cache) for _, m in engine.policy_linears())
        return step(*a, **k)

    engine.optimizer.step = step_and_look
    engine.train_step(micro, schedule)
    assert sum(seen) > 0  # (layers kept in BF16 by the preset's rules keep nothing)
    assert all(not m.quant_state.step_cache for _, m in engine.policy_linears())

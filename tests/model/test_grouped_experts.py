"""Grouped expert GEMMs (``--moe-grouped-gemm``, ``model.grouped_experts``): the grouped experts equal
megatron's sequential experts bit for bit -- forward, Dgrad and both experts' Wgrads -- for BF16
(through ``torch._grouped_mm`` on CPU) and an emulated format (MXFP4, the per-expert loop), with uneven
token counts and an expert without tokens; the quantization states advance alike; experts planned
differently run as separate groups; the checkpoint is the sequential experts' own; the start-up lines say which path each format takes."""

import dataclasses

import pytest
import torch

from model.gpt import apply_precision_plan, build_gpt, policy_linear_names
from model.grouped_experts import (
    GROUPED_MM,
    LOOP,
    SCALED_GROUPED_MM,
    GroupedSequentialMLP,
    describe_grouped_paths,
    gemm_path,
)
from model.moe import PaddedSequentialMLP
from model.spec import PolicySpecProvider
from precision import presets
from precision.policy import PrecisionPolicy

from ._fakes import TINY_LLAMA

MOE = dataclasses.replace(TINY_LLAMA, num_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
COUNTS = [5, 0, 40, 19]  # uneven, one expert without tokens (buckets 32, 32, 64, 32)
pytestmark = pytest.mark.usefixtures("world_of_one")


def experts_pair(base: str, rules=(), dtype=torch.float32):
    """The sequential and the grouped experts of one layer, the grouped loaded from the sequential's
    state dict, both under the plan ``base`` + ``rules``."""
    mods = []
    for grouped in (False, True):
        torch.manual_seed(0)
        model = build_gpt(dataclasses.replace(MOE, moe_grouped_gemm=grouped), params_dtype=dtype)
        names = policy_linear_names(model)
        apply_precision_plan(model, PrecisionPolicy.from_args(base, list(rules)).resolve(names, MOE.num_layers))
        experts = model.decoder.layers[0].mlp.experts
        for e in experts.local_experts:  # quantized experts: the eager quantizers (same bits, no compile time)
            for lin in (e.linear_fc1, e.linear_fc2):
                if str(lin.precision) != str(presets.get("bf16")):
                    lin.gemm_backend = "reference"
        mods.append(experts)
    seq, grp = mods
    assert type(seq) is PaddedSequentialMLP and type(grp) is GroupedSequentialMLP
    assert grp.state_dict().keys() == seq.state_dict().keys()  # the same checkpoint entries
    grp.load_state_dict(seq.state_dict())
    return seq, grp


def run(experts, x, probs):
    x = x.clone().requires_grad_()
    y, _ = experts(x, torch.tensor(COUNTS), probs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype))
    grads = {n: p.grad for n, p in experts.named_parameters()}
    return y, x.grad, grads


def inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), MOE.hidden_size, generator=gen).to(dtype)
    return x, torch.rand(sum(COUNTS), generator=gen)


@pytest.mark.parametrize("base, rules, dtype", [
    ("bf16", (), torch.float32),
    ("bf16", (), torch.bfloat16),
    ("mxfp4", (), torch.float32),
    ("bf16", ("experts:0-1=mxfp4", "experts:3-3=nvfp4"), torch.float32),  # three groups
])
def test_grouped_experts_equal_the_sequential_experts_bit_for_bit(monkeypatch, base, rules, dtype):
    seq, grp = experts_pair(base, rules, dtype)
    x, probs = inputs(dtype)
    y_seq, dx_seq, dw_seq = run(seq, x, probs)
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    y_grp, dx_grp, dw_grp = run(grp, x, probs)
    assert torch.equal(y_grp, y_seq)  # forward
    assert torch.equal(dx_grp, dx_seq)  # Dgrad
    for name, g in dw_seq.items():  # Wgrad of every expert's fc1 and fc2
        assert torch.equal(dw_grp[name], g), name
    assert dw_grp["local_experts.1.linear_fc1.weight"].abs().max() == 0  # no tokens: a zero gradient
    # BF16 experts ran through torch._grouped_mm: fc1 and fc2, each Fprop, Dgrad and Wgrad, once per group
    bf16_groups = 1 if base == "bf16" else 0
    assert len(calls) == 6 * bf16_groups
    for e_seq, e_grp in zip(seq.local_experts, grp.local_experts, strict=True):  # call counters, amax records
        for k in ("linear_fc1", "linear_fc2"):
            assert getattr(e_grp, k).quant_state.state_dict() == getattr(e_seq, k).quant_state.state_dict()


def test_paths_per_format_and_device():
    names = [f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{k}" for e in range(2) for k in (1, 2)]
    plan = {**dict.fromkeys(names[:2], presets.get("bf16")), **dict.fromkeys(names[2:], presets.get("mxfp4"))}
    cpu = describe_grouped_paths(plan, "cpu")
    assert cpu.splitlines()[0] == "Grouped expert GEMMs (--moe-grouped-gemm) on cpu:"
    assert f"bf16 -> {GROUPED_MM}, operands emulated" in cpu and f"mxfp4 -> {LOOP}, operands emulated" in cpu
    hopper = describe_grouped_paths({**plan, names[0]: presets.get("fp8")}, (9, 0))
    assert "fp8_e5m2" not in hopper.split("dgrad:")[0]  # Fprop: E4M3 x E4M3
    # Hopper: FP8 on FP8 tensor cores, grouped; MXFP4 on BF16 tensor cores (bf16_mm), grouped
    assert f"fp8_e4m3 -> {SCALED_GROUPED_MM}" in hopper and f"mxfp4 -> {GROUPED_MM}, operands bf16_mm" in hopper
    blackwell = describe_grouped_paths(plan, (10, 0))  # block-scaled tensor cores: no grouped entry point used
    assert f"mxfp4 -> {LOOP}, operands mx_scaled_mm" in blackwell
    assert describe_grouped_paths({"decoder.layers.0.mlp.linear_fc1": presets.get("bf16")}, "cpu") == ""


def test_refusals_name_the_flag_and_the_layer():
    from model.gpt import validate_config

    with pytest.raises(ValueError, match="^--moe-grouped-gemm needs --num-experts"):
        validate_config(dataclasses.replace(TINY_LLAMA, moe_grouped_gemm=True), 1)
    with pytest.raises(ValueError, match="--moe-use-legacy-grouped-gemm is not supported") as e:
        PolicySpecProvider().grouped_mlp_modules(True, True)
    assert "\n" not in str(e.value)
    torch.manual_seed(0)
    experts = build_gpt(dataclasses.replace(MOE, moe_grouped_gemm=True)).decoder.layers[0].mlp.experts
    x, probs = inputs(torch.float32)
    with pytest.raises(RuntimeError, match="local_experts.0.linear_fc1 has no precision recipe"):
        experts(x, torch.tensor(COUNTS), probs)


def _cuda_capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.parametrize("base, needs, path", [("bf16", (8, 0), GROUPED_MM), ("mxfp4", (8, 0), GROUPED_MM),
                                              ("fp8", (9, 0), SCALED_GROUPED_MM)])
def test_grouped_kernels_on_gpu_match_the_per_expert_gemms(base, needs, path):
    """On a GPU: BF16 and MXFP4 (below Blackwell: ``bf16_mm``) through ``torch._grouped_mm``, FP8 E4M3
    Fprop through ``torch._scaled_grouped_mm``, against the sequential experts' per-expert GEMMs."""
    if _cuda_capability() < needs or _cuda_capability()[0] >= 10 and base == "mxfp4":
        pytest.skip(f"{base}: needs CUDA sm_{needs[0]}{needs[1]}+" + (" below sm_100 (bf16_mm)" if base == "mxfp4" else ""))
    seq, grp = experts_pair(base, (), torch.bfloat16)
    for m in (seq, grp):
        m.cuda()
        for e in m.local_experts:
            for lin in (e.linear_fc1, e.linear_fc2):
                lin.gemm_backend = "auto"
    fc1 = grp.local_experts[0].linear_fc1
    assert gemm_path(fc1.precision.fprop, "cuda", "auto")[0] == path
    x, probs = inputs(torch.bfloat16)
    y_seq, dx_seq, dw_seq = run(seq, x.cuda(), probs.cuda())
    y_grp, dx_grp, dw_grp = run(grp, x.cuda(), probs.cuda())
    # the same quantized operands; the grouped kernel may sum in another order: within a BF16 rounding or two
    torch.testing.assert_close(y_grp, y_seq, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx_grp, dx_seq, rtol=2e-2, atol=2e-2)
    for name, g in dw_seq.items():
        torch.testing.assert_close(dw_grp[name], g, rtol=2e-2, atol=2e-2)


def test_per_linear_features_run_the_per_expert_loop(monkeypatch):
    """``--qat-backward ste`` (like a rollout plan's packed weights and ``fprop_x``) is a per-linear
    feature: the grouped experts run the sequential experts' loop then, and give their results."""
    seq, grp = experts_pair("bf16")
    for m in (seq, grp):
        for e in m.local_experts:
            e.linear_fc1.backward_operands = e.linear_fc2.backward_operands = "ste"
    x, probs = inputs(torch.float32)
    y_seq, dx_seq, _ = run(seq, x, probs)
    monkeypatch.setattr(torch, "_grouped_mm", None)  # would fail if called
    y_grp, dx_grp, _ = run(grp, x, probs)
    assert torch.equal(y_grp, y_seq) and torch.equal(dx_grp, dx_seq)


def test_evaluation_reads_the_states_and_changes_nothing():
    """Under ``torch.no_grad`` (evaluation, generation) the grouped experts give the sequential experts'
    output and leave every expert's quantization state as it was (``precision.state``: reading is not
    training)."""
    seq, grp = experts_pair("bf16", ("experts:2-3=mxfp4",))
    x, probs = inputs(torch.float32)
    before = [e.linear_fc1.quant_state.state_dict() for e in grp.local_experts]
    with torch.no_grad():
        y_seq, _ = seq(x, torch.tensor(COUNTS), probs)
        y_grp, _ = grp(x, torch.tensor(COUNTS), probs)
    assert torch.equal(y_grp, y_seq)
    assert [e.linear_fc1.quant_state.state_dict() for e in grp.local_experts] == before

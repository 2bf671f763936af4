"""Mixture-of-experts layer in the policy-routed GPT (single process): every expert, shared-expert and
router GEMM goes through its recipe; the layer equals an independent top-k mixture written here in
plain torch; the aux and z losses reach the router's gradient as their formulas say; padding experts'
tokens changes no bit; plan rules select experts; bad settings are refused in one line."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from model.gpt import apply_precision_plan, build_gpt, policy_linear_names, policy_linears, validate_config
from model.layers import PolicyColumnParallelLinear, PolicyRowParallelLinear
from model.moe import PaddedSequentialMLP, PolicyRouter, set_aux_loss_scale, token_bucket
from precision import presets
from precision.policy import PrecisionPolicy
from precision.recipe import SpecError

from ._fakes import TINY_LLAMA, plan_for

MOE = dataclasses.replace(TINY_LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                          moe_shared_expert_intermediate_size=64)
pytestmark = pytest.mark.usefixtures("world_of_one")


def built(cfg=MOE, preset="fp32"):
    torch.manual_seed(0)
    model = build_gpt(cfg)
    if preset is not None:
        apply_precision_plan(model, dict.fromkeys(policy_linear_names(model), presets.get(preset)))
    return model


def batch(cfg=MOE, seed=0, b=2):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=gen)
    return tokens, torch.arange(cfg.seq_length).expand_as(tokens), torch.roll(tokens, -1, dims=1)


def test_every_expert_router_and_shared_linear_is_named_and_routed(reference_linear):
    model = built(preset=None)
    names = policy_linear_names(model)
    layer = [n.removeprefix("decoder.layers.0.") for n in names if n.startswith("decoder.layers.0.")]
    assert layer == ["self_attention.linear_proj", "self_attention.linear_qkv", "mlp.router",
                     *[f"mlp.experts.local_experts.{e}.linear_fc{k}" for e in range(4) for k in (1, 2)],
                     "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    kinds = {type(m) for _, m in policy_linears(model)}
    assert kinds == {PolicyColumnParallelLinear, PolicyRowParallelLinear, PolicyRouter}
    plan = plan_for(model)
    apply_precision_plan(model, plan)
    tokens, pos, labels = batch(b=4)
    model(tokens, pos, None, labels=labels).mean().backward()
    # every linear ran with its own recipe (all experts receive tokens at this size)
    assert {str(p) for p in reference_linear.seen} == {str(p) for p in plan.values()}


def independent_moe(layer, x):
    """Top-k mixture of SwiGLU experts plus the shared expert, from the weights, in plain torch."""
    x2 = x.reshape(-1, x.shape[-1])
    logits = x2 @ layer.router.weight.T
    top_logits, top_e = torch.topk(logits, k=2, dim=-1)
    top_p = torch.softmax(top_logits, dim=-1)  # megatron's default: softmax over the chosen experts (Mixtral)

    def swiglu_mlp(mlp, h):
        a, g = (h @ mlp.linear_fc1.weight.T).chunk(2, dim=-1)
        return (F.silu(a) * g) @ mlp.linear_fc2.weight.T

    out = torch.zeros_like(x2)
    for e, expert in enumerate(layer.experts.local_experts):
        rows, slot = (top_e == e).nonzero(as_tuple=True)
        out[rows] += top_p[rows, slot, None] * swiglu_mlp(expert, x2[rows])
    return (out + swiglu_mlp(layer.shared_experts, x2)).reshape(x.shape)


def test_moe_layer_equals_an_independent_top_k_mixture():
    layer = built().decoder.layers[0].mlp
    x = torch.randn(32, 2, MOE.hidden_size, generator=torch.Generator().manual_seed(3))
    y, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(y, independent_moe(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["aux", "z"])
def test_aux_and_z_losses_reach_the_router_gradient(which):
    """grad(router | coeff) - grad(router | 0) is the gradient of the loss formula (Switch Transformer's
    load balancing, ST-MoE's z-loss) computed here from the router's logits."""
    coeff = 0.5
    on = {"moe_aux_loss_coeff": coeff} if which == "aux" else {"moe_z_loss_coeff": coeff}
    off = {"moe_aux_loss_coeff": 0.0} if which == "aux" else {}
    x = torch.randn(32, 2, MOE.hidden_size, generator=torch.Generator().manual_seed(5))
    # the losses' backward weight is megatron's process-wide MoEAuxLossAutoScaler scale (a training run
    # in this process sets 1 / micro-batches): one micro-batch here
    set_aux_loss_scale(1.0)

    def router_grad(cfg):
        layer = built(dataclasses.replace(MOE, **cfg)).decoder.layers[0].mlp
        layer.train()
        y, _ = layer(x)
        y.sum().backward()
        return layer.router.weight.grad.clone(), layer.router.weight.detach().clone()

    with_loss, w = router_grad(on)
    without, _ = router_grad(off)
    w = w.requires_grad_()
    logits = x.reshape(-1, MOE.hidden_size) @ w.T
    t, e, k = logits.shape[0], MOE.num_experts, MOE.moe_router_topk
    if which == "aux":
        probs = torch.softmax(logits, dim=-1)
        counts = torch.zeros(e).index_add_(0, torch.topk(probs, k).indices.flatten(), torch.ones(t * k))
        loss = coeff * e / (k * t * t) * (probs.sum(0) * counts).sum()
    else:
        loss = coeff * torch.logsumexp(logits, dim=-1).square().mean()
    (expected,) = torch.autograd.grad(loss, w)
    assert expected.abs().max() > 0
    torch.testing.assert_close(with_loss - without, expected, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("preset", ["wgrad_hadamard", "mxfp4_sr", "fp8"])
def test_padding_experts_tokens_changes_no_bit(preset):
    """PaddedSequentialMLP (token counts bucketed) gives megatron's SequentialMLP's y, dx and dw: bit for bit
    under MXFP4 (every operand the same, and sums of E2M1 products are exact in FP32, so the order the
    CPU's GEMM picks for a taller matrix cannot matter); under FP8 the quantized operands are the same
    too, but FP32 sums of FP8 products round, and the GEMM's blocking changes with the row count:
    equal up to FP32 summation order (measured ~1e-7 relative)."""
    model = built(preset=preset)
    padded = model.decoder.layers[0].mlp.experts
    plain = SequentialMLP.__new__(SequentialMLP)
    plain.__dict__.update(padded.__dict__)  # same experts, same quantization states
    counts = torch.tensor([5, 40, 1, 18])
    x = torch.randn(int(counts.sum()), MOE.hidden_size, generator=torch.Generator().manual_seed(1))
    probs = torch.rand(int(counts.sum()), generator=torch.Generator().manual_seed(2))
    results = []
    for experts in (plain, padded):
        states = [m.quant_state.state_dict() for _, m in policy_linears(model)]
        xi = x.clone().requires_grad_()
        y, _ = SequentialMLP.forward(experts, xi, counts, probs) if experts is plain else experts(xi, counts, probs)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in experts.parameters()]))
        model.zero_grad()
        for (_, m), s in zip(policy_linears(model), states, strict=True):
            m.quant_state.load_state_dict(s)  # the second run draws the same SR numbers
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    tol = {"rtol": 0, "atol": 0} if preset != "fp8" else {"rtol": 1e-5, "atol": 1e-7}
    for a, b in zip([y0, dx0, *dw0], [y1, dx1, *dw1], strict=True):
        torch.testing.assert_close(b, a, **tol)


def test_token_bucket():
    assert [token_bucket(n) for n in (0, 1, 32, 33, 64, 65, 500)] == [32, 32, 32, 64, 64, 128, 512]


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    model = built(preset="wgrad_hadamard")
    experts = model.decoder.layers[0].mlp.experts
    x = torch.randn(8, MOE.hidden_size, requires_grad=True)
    y, _ = experts(x, torch.tensor([8, 0, 0, 0]), torch.ones(8))
    y.sum().backward()
    assert all(p.grad is not None for p in experts.parameters())
    assert all(p.grad.abs().max() == 0 for p in experts.local_experts[1].parameters())


def test_router_defaults_to_fp32_and_rules_select_experts():
    model = built(preset=None)
    names = policy_linear_names(model)
    rules = ["kind:expert_fc2,layers:1-1=mxfp4", "experts:0-1=nvfp4", "kind:shared_expert=bf16"]
    policy = PrecisionPolicy.from_args("fp8", rules)
    policy.check_rules(MOE.num_layers, names)
    plan = policy.resolve(names, MOE.num_layers)
    apply_precision_plan(model, plan)
    got = {n: str(p) for n, p in plan.items()}
    assert got["decoder.layers.0.mlp.router"] == str(presets.get("fp32"))
    assert got["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2"] == str(presets.get("mxfp4"))
    assert got["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2"] == str(presets.get("mxfp4"))
    assert got["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1"] == str(presets.get("nvfp4"))
    assert got["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1"] == str(presets.get("fp8"))
    assert got["decoder.layers.0.mlp.shared_experts.linear_fc2"] == str(presets.get("bf16"))
    assert got["decoder.layers.0.self_attention.linear_qkv"] == str(presets.get("fp8"))
    quantized_router = PrecisionPolicy.from_args("fp8", ["kind:router=mxfp4"]).resolve(names, MOE.num_layers)
    assert str(quantized_router["decoder.layers.1.mlp.router"]) == str(presets.get("mxfp4"))
    with pytest.raises(SpecError, match="experts:8-9.*matches no layer"):
        PrecisionPolicy.from_args("fp8", ["experts:8-9=bf16"]).check_rules(MOE.num_layers, names)
    dense = policy_linear_names(built(TINY_LLAMA, preset=None))
    with pytest.raises(SpecError, match="kind:router.*matches no layer"):
        PrecisionPolicy.from_args("fp8", ["kind:router=bf16"]).check_rules(MOE.num_layers, dense)


@pytest.mark.parametrize("change, message", [
    ({"moe_router_topk": 5}, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    ({"moe_ffn_hidden_size": 48}, "--moe-ffn-hidden-size 48"),
    ({"moe_layer_freq": (1, 0, 1)}, "--moe-layer-freq"),
    ({"moe_router_load_balancing_type": "global_aux_loss"}, "aux_loss, seq_aux_loss, sinkhorn, none"),
    ({"moe_token_dispatcher_type": "flex"}, "flex needs DeepEP"),
    ({"num_experts": None}, "--moe-ffn-hidden-size needs --num-experts"),
    ({"expert_model_parallel_size": 3}, "not divisible by --expert-model-parallel-size 3"),
])
def test_bad_moe_settings_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        validate_config(dataclasses.replace(MOE, **change), 1)
    assert "\n" not in str(e.value)


def test_moe_layer_freq_builds_dense_and_moe_layers():
    model = built(dataclasses.replace(MOE, moe_layer_freq=(0, 1)), preset=None)
    names = policy_linear_names(model)
    assert "decoder.layers.0.mlp.linear_fc1" in names and "decoder.layers.1.mlp.router" in names
    assert not any(n.startswith("decoder.layers.0.mlp.experts") for n in names)


def test_training_flops_count_the_router_top_k_and_shared_experts():
    from model.gpt import training_flops_per_token

    h, s, v = MOE.hidden_size, MOE.seq_length, MOE.vocab_size
    swiglu_mlp = 2 * h * 64 * 2 + 2 * 64 * h  # width 64: fc1's two projections, fc2
    moe_layer = 2 * h * 4 + 2 * swiglu_mlp + swiglu_mlp  # router, top-2 experts, shared expert
    dense_layer = 2 * h * 128 * 2 + 2 * 128 * h
    attention = 2 * h * (h + 2 * 32) + 2 * h * h + 4 * s * h
    assert training_flops_per_token(MOE, s) == 3.0 * (2 * (attention + moe_layer) + 2 * h * v)
    mixed = dataclasses.replace(MOE, moe_layer_freq=(0, 1))
    assert training_flops_per_token(mixed, s) == 3.0 * (2 * attention + moe_layer + dense_layer + 2 * h * v)

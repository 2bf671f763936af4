"""Single-process (TP=1) tests of the policy-routed GPT: build, train step, plans, printing."""

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from model.gpt import (
    ModelConfig,
    apply_precision_plan,
    build_gpt,
    padded_vocab_size,
    policy_linear_names,
    transformer_config,
)
from model.layers import PolicyColumnParallelLinear, PolicyRowParallelLinear

from ._fakes import TINY_LLAMA, plan_for

LLAMA = TINY_LLAMA
GPT2 = dataclasses.replace(
    LLAMA,
    normalization="LayerNorm",
    activation="gelu",
    position_embedding="learned_absolute",
    untie_embeddings=False,
    add_bias_linear=True,
    num_query_groups=4,
)
STYLES = pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
LAYER_LINEARS = [
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
]
NAMES = [f"decoder.layers.{i}.{n}" for i in range(2) for n in LAYER_LINEARS] + ["output_layer"]

pytestmark = pytest.mark.usefixtures("world_of_one")


def batch(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    return tokens, torch.arange(cfg.seq_length).expand_as(tokens), torch.roll(tokens, -1, dims=1)


def built(cfg):
    torch.manual_seed(0)
    return build_gpt(cfg)


@STYLES
def test_forward_backward_routes_every_linear_through_its_recipe(cfg, reference_linear):
    model = built(cfg)
    plan = plan_for(model)
    apply_precision_plan(model, plan)
    tokens, position_ids, labels = batch(cfg)
    loss = model(tokens, position_ids, None, labels=labels)
    assert loss.shape == tokens.shape
    loss.mean().backward()
    assert torch.isfinite(loss).all()
    assert 4.0 < loss.mean().item() < 7.0  # ~ln(256) at init
    assert sorted(map(str, reference_linear.seen)) == sorted(map(str, plan.values()))  # each once
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@STYLES
def test_every_linear_is_a_policy_linear(cfg):
    model = built(cfg)
    assert policy_linear_names(model) == NAMES
    assert isinstance(model.output_layer, PolicyColumnParallelLinear)
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            assert isinstance(m, (PolicyColumnParallelLinear, PolicyRowParallelLinear)), name
            assert m.layer_name == name and m.precision is None
    assert (model.output_layer.weight is None) == (not cfg.untie_embeddings)


@STYLES
def test_initial_weights_equal_megatron_local_spec(cfg):
    """Same seed, same weights as megatron's own local-spec GPTModel: our spec adds/loses no
    parameters and swapping in the policy output layer draws no extra random numbers."""
    ours = built(cfg).state_dict()
    torch.manual_seed(0)
    config = transformer_config(cfg)
    theirs = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=cfg.normalization),
        vocab_size=padded_vocab_size(cfg, 1),
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=not cfg.untie_embeddings,
        position_embedding_type=cfg.position_embedding,
    ).state_dict()
    tensors = lambda sd: {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    ours, theirs = tensors(ours), tensors(theirs)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_print_shows_each_recipe():
    model = built(LLAMA)
    apply_precision_plan(model, plan_for(model))
    text = str(model)
    for name in NAMES:
        assert f"precision=fake[{name}])" in text, name
    assert "PolicyColumnParallelLinear(in_features=64, out_features=256, bias=False, TP=1" in text


def test_plan_missing_or_unknown_layer_is_an_error():
    model = built(LLAMA)
    plan = plan_for(model)
    missing = {k: v for k, v in plan.items() if k not in ("output_layer", "decoder.layers.1.mlp.linear_fc2")}
    with pytest.raises(ValueError) as err:
        apply_precision_plan(model, missing)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.endswith("linear layer(s): decoder.layers.1.mlp.linear_fc2, output_layer")
    with pytest.raises(ValueError, match=r"does not have: decoder\.layers\.10\.mlp\.linear_fc1$"):
        apply_precision_plan(model, {**plan, "decoder.layers.10.mlp.linear_fc1": plan["output_layer"]})
    assert all(m.precision is None for n, m in model.named_modules() if n in NAMES)  # nothing applied


def test_forward_without_a_recipe_names_the_layer():
    model = built(LLAMA)
    tokens, position_ids, labels = batch(LLAMA)
    with pytest.raises(
        RuntimeError, match=r"^linear layer decoder\.layers\.0\.self_attention\.linear_qkv has no"
    ):
        model(tokens, position_ids, None, labels=labels)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusal")
def test_sequence_parallel_is_refused_on_cpu():
    with pytest.raises(ValueError, match="^--sequence-parallel needs CUDA"):
        build_gpt(LLAMA, sequence_parallel=True)


@pytest.mark.parametrize("bias", [False, True])
def test_policy_layers_match_megatron_layers(bias, reference_linear):
    """Same init, same outputs and gradients as megatron's own column/row-parallel linears."""
    config = transformer_config(LLAMA)
    init = config.init_method
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pairs = []
    for cls, policy_cls, kw in [
        (ColumnParallelLinear, PolicyColumnParallelLinear, {"gather_output": False}),
        (RowParallelLinear, PolicyRowParallelLinear, {"input_is_parallel": True, "skip_bias_add": False}),
    ]:
        layers = []
        for c in (cls, policy_cls):
            torch.manual_seed(3)
            layers.append(c(64, 96, config=config, init_method=init, bias=bias, tp_group=tp_group, **kw))
            if bias:
                torch.nn.init.normal_(layers[-1].bias)
        layers[1].precision = "any"
        pairs.append(layers)
    for theirs, ours in pairs:
        x = torch.randn(5, 2, 64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        (y, _), (y2, _) = theirs(x), ours(x2)
        torch.testing.assert_close(y2, y, rtol=0, atol=0)
        y.square().sum().backward()
        y2.square().sum().backward()
        torch.testing.assert_close(x2.grad, x.grad)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)


# ---------------------------------------------------------------- with the real precision core


@pytest.mark.parametrize("preset", ["bf16", "fp8", "mxfp4", "wgrad_hadamard", "nvfp4"])
def test_real_presets_train_through_megatron_loss(preset):
    """The real policy_linear under megatron's vocab-parallel cross-entropy (which edits the
    logits in place), each layer advancing its own quantization state."""
    from precision import presets

    model = built(LLAMA)
    recipe = presets.get(preset)
    apply_precision_plan(model, dict.fromkeys(policy_linear_names(model), recipe))
    assert f"precision={recipe})" in str(model)
    tokens, position_ids, labels = batch(LLAMA)
    loss = model(tokens, position_ids, None, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert fc1.quant_state.name == "decoder.layers.0.mlp.linear_fc1"
    assert fc1.quant_state.calls == {"fprop": 1, "dgrad": 1, "wgrad": 1}


def test_quant_state_is_saved_in_state_dict(reference_linear):
    model = built(LLAMA)
    fc2 = model.decoder.layers[1].mlp.linear_fc2
    fc2.quant_state.calls["wgrad"] = 7
    sd = model.state_dict()
    assert sd["decoder.layers.1.mlp.linear_fc2._extra_state"]["calls"]["wgrad"] == 7
    fresh = built(LLAMA)
    fresh.load_state_dict(sd)
    assert fresh.decoder.layers[1].mlp.linear_fc2.quant_state.calls["wgrad"] == 7
    assert fresh.decoder.layers[0].mlp.linear_fc2.quant_state.calls["wgrad"] == 0


def test_training_flops_match_megatron_papers_formula():
    """Narayanan et al. (2021), without activation recomputation: 72 L h^2 (1 + s / 6h) + 6 h V per
    token for a GPT with a 4h GeLU MLP and plain multi-head attention."""
    from model.gpt import training_flops_per_token

    L, h, s, V = 24, 1024, 2048, 51200
    cfg = ModelConfig(num_layers=L, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=16,
                      num_query_groups=16, seq_length=s, vocab_size=V, activation="gelu")
    assert training_flops_per_token(cfg, s) == 72 * L * h * h * (1 + s / (6 * h)) + 6 * h * V
    # SwiGLU adds one h x ffn GEMM per layer; 8 query groups of 16 halve K and V
    glu = ModelConfig(num_layers=L, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=16,
                      num_query_groups=8, seq_length=s, vocab_size=V)
    extra = 3 * L * (2 * h * 4 * h - 2 * h * h)  # + fc1 gate, - half of K and V
    assert training_flops_per_token(glu, s) == training_flops_per_token(cfg, s) + extra

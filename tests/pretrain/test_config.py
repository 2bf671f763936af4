"""Typed run configs (``pretrain.config``): the parser is generated from them, every field is
documented, a validated Namespace freezes into one ``RunConfig`` that saves as it did, and the model
flags map to and from ``ModelConfig`` in one place."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools

import pytest
import torch

from pretrain.arguments import build_parser, parse_args_or_raise, parse_run_config, validate_args
from pretrain.config import GROUPS, ModelArgs, RunConfig, flag_name, model_config, shape_of
from pretrain.config.config_file import ConfigFileArgs
from pretrain.config.megatron_flags import MegatronFlags
from pretrain.engine import NonFinitePolicy

from ._launch import TINY

CLASSES = [cls for _, classes in GROUPS for cls in classes]


def test_every_flag_is_a_config_field_and_every_field_a_flag():
    # besides the run's fields: the parse-time flags (--config, Megatron-LM's spellings), never saved
    parse_time = {f.name for cls in (ConfigFileArgs, MegatronFlags) for f in dataclasses.fields(cls)}
    dests = {a.dest for a in build_parser()._actions} - {"help"}
    fields = {f.name for cls in CLASSES for f in dataclasses.fields(cls) if f.metadata.get("saved", True)}
    assert dests == fields | parse_time and not fields & parse_time
    derived = [f for cls in CLASSES for f in dataclasses.fields(cls) if not f.metadata.get("saved", True)]
    assert [f.name for f in derived] == ["resolved", "megatron_flags"]
    assert not any(f.metadata["flags"] for f in derived)
    titles = [g.title for g in build_parser()._action_groups][2:]  # after argparse's own two
    assert titles[:len(GROUPS)] == [t for t, _ in GROUPS]
    assert titles[len(GROUPS):] == ["run configuration file", "Megatron-LM spellings (rewritten into the flags "
                                    "above; printed at start-up, never saved)"]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring_under_it(cls):
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    documented = {a.target.id for a, b in itertools.pairwise(body)
                  if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                  and isinstance(b.value.value, str) and b.value.value.strip()}
    assert [f.name for f in dataclasses.fields(cls) if f.name not in documented] == []


def test_a_validated_run_freezes_into_one_config_that_saves_as_the_namespace_did():
    argv = ["--train-iters", "4", *TINY, "--precision", "mxfp4", "--precision-rule", "first:1=bf16",
            "--skip-nonfinite-steps", "2"]
    args = parse_args_or_raise(argv)
    args = validate_args(args, world_size=1, cuda=False)
    run = RunConfig.from_namespace(args)
    # what checkpoints save as "args", unchanged; value_origins (where a derived value came from, for
    # validation's error messages) and megatron_flags (the start-up line of Megatron-LM's spellings)
    # stay with the Namespace and are not saved
    assert run.to_dict() == {k: v for k, v in vars(args).items() if k not in ("value_origins", "megatron_flags")}
    assert run.training.lr == 3e-3 and run.training.global_batch_size == 4 and run.memory.bf16 is False
    assert run.precision.precision_rule == ("first:1=bf16",) and NonFinitePolicy.of(run.training).max_skips == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.lr = 1.0
    assert parse_run_config(argv, 1, False) == run


def test_the_precision_flags_are_parsed_once_and_carried_typed(monkeypatch, world_of_one):
    import precision.policy
    from precision.schedule import PrecisionSchedule
    from pretrain.trainer.plans import build_scheduled_model

    calls = []
    real = precision.policy.PrecisionPolicy.from_args.__func__
    monkeypatch.setattr(precision.policy.PrecisionPolicy, "from_args",
                        classmethod(lambda cls, *a, **k: calls.append(a) or real(cls, *a, **k)))
    argv = ["--train-iters", "6", *TINY, "--precision-schedule", "0:fp8,3:mxfp4", "--precision-rule", "first:1=bf16"]
    run = parse_run_config(argv, 1, False)
    # the schedule's own syntax check reads each phase once; the run's policies are built once each
    assert calls == [("fp8",), ("mxfp4",), ("fp8", ["first:1=bf16"]), ("mxfp4", ["first:1=bf16"])]
    assert isinstance(run.precision.schedule(), PrecisionSchedule) and str(run.precision.schedule()) == "0:fp8,3:mxfp4"
    assert list(run.precision.resolved.policies) == ["fp8", "mxfp4"]
    calls.clear()
    _, plans = build_scheduled_model(run, 512, torch.device("cpu"))
    assert calls == [] and [plans.whole[k]["decoder.layers.0.mlp.linear_fc1"].fprop.a.fmt for k in (0, 1)] == \
        ["bf16", "bf16"] and plans.whole[1]["decoder.layers.1.mlp.linear_fc1"].fprop.a.fmt == "mxfp4"


def test_the_model_flags_map_to_the_model_config_and_back():
    run = parse_run_config(["--train-iters", "4", *TINY, "--no-swiglu", "--use-rope-scaling",
                            "--rope-scaling-factor", "4", "--add-bias-linear"], 1, False)
    cfg = run.model_config(vocab_size=512)
    assert cfg.activation == "gelu" and cfg.rope_scaling_factor == 4.0 and cfg.add_bias_linear and cfg.vocab_size == 512
    assert model_config(run.model, 512) == cfg  # the same function reads a Namespace or the config
    for name, v in shape_of(cfg).items():
        assert getattr(run.model, name) == v, name
    assert flag_name("num_query_groups") == "--num-query-groups"
    assert isinstance(run.model, ModelArgs)


def test_one_table_maps_every_model_flag_to_its_model_config_field():
    from model.gpt import ModelConfig
    from pretrain.config.model import MODEL_FLAGS

    flags = {f.name for f in dataclasses.fields(ModelArgs)} - {"model_size", "use_rope_scaling", "rope_scaling_factor"}
    assert set(MODEL_FLAGS) == flags  # the rope pair is the one two-flags-to-one-field case
    assert {m.field for m in MODEL_FLAGS.values()} == {f.name for f in dataclasses.fields(ModelConfig)} - {
        "vocab_size", "kv_quant", "rope_scaling_factor"}


def test_the_training_loop_and_its_components_read_no_namespace():
    import pretrain.train
    import pretrain.trainer.checkpointer
    import pretrain.trainer.metrics
    import pretrain.trainer.phases
    import pretrain.trainer.validator

    for module in (pretrain.train, pretrain.trainer.checkpointer, pretrain.trainer.metrics, pretrain.trainer.phases,
                   pretrain.trainer.validator):
        tree = ast.parse(inspect.getsource(module))
        reads = [f"{module.__name__}:{n.lineno}" for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "args"
                 or isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"]
        assert reads == []


def test_validation_never_changes_its_input():
    """STYLE.md pattern 11: validate_args returns the validated values (the device and world-size
    defaults filled in) in a new Namespace; the one it was given is left as it was."""
    args = parse_args_or_raise(["--train-iters", "4", *TINY])
    before = dict(vars(args))
    validated = validate_args(args, world_size=1, cuda=False)
    assert vars(args) == before and (args.bf16, args.num_workers) == (None, None)  # defaults by device
    assert (validated.bf16, validated.num_workers, validated.global_batch_size) == (False, 0, 4)

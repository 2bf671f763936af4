"""The engine's one optimizer step (``pretrain.engine``): the step a caller's own backward reaches
(RL's losses) is pretraining's step bit for bit, and a skipped non-finite step rolls back."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pretrain.arguments import parse_run_config

from ._launch import TINY

VOCAB = 512


def _engine(max_skips: int = 0, check: bool = True):
    from pretrain.engine import NonFinitePolicy, TorchEngine
    from pretrain.optim import LRSchedule
    from pretrain.train import build_model

    run = parse_run_config(["--train-iters", "4", *TINY, "--precision", "mxfp4_sr", "--gemm-backend", "reference"],
                           world_size=1, cuda=False)
    torch.manual_seed(0)
    model, _, _ = build_model(run, vocab_size=VOCAB, device=torch.device("cpu"))
    engine = TorchEngine(model, run, torch.device("cpu"), NonFinitePolicy(check=check, max_skips=max_skips))
    return engine, LRSchedule.from_training(engine.optimizer, run.training)


def _micro(seed: int, n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (2, 65), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(64).expand(2, 64),
                    "loss_mask": torch.ones(2, 64)})
    return out


def _quant(engine) -> list[dict]:
    return [copy.deepcopy(m.quant_state.state_dict()) for _, m in engine.policy_linears()]


def test_a_callers_backward_then_optimizer_step_is_the_pretraining_step(world_of_one):
    a, sched_a = _engine()
    b, sched_b = _engine()
    for step in range(2):
        micro = _micro(step)
        loss_a, norm_a, lr_a, outcome_a = a.train_step(micro, sched_a)
        # RL's way: the caller computes and backpropagates its own loss, the engine does the rest
        b.begin_step()
        tokens = sum(mb["loss_mask"].sum() for mb in micro)
        total = torch.zeros(())
        for mb in micro:
            s, _ = b._loss_sum(b.model, mb)
            (s / tokens).backward()
            total += s.detach()
        res = b.optimizer_step(sched_b, loss=total / tokens)
        assert outcome_a == res.outcome == "pending"  # the default policy reads nothing to the host
        assert torch.equal(loss_a, res.loss) and torch.equal(norm_a, res.grad_norm) and lr_a == res.lr
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert _quant(a) == _quant(b)  # SR counters and amax histories advanced alike (end_step included)


def test_a_skipped_step_changes_nothing_but_the_count_and_the_next_one_diverges(world_of_one):
    engine, schedule = _engine(max_skips=1)
    engine.train_step(_micro(0), schedule)  # one good step: optimizer state and schedule exist
    params = [p.detach().clone() for p in engine.model.parameters()]
    opt_state = copy.deepcopy(engine.optimizer.state_dict())
    quant, steps = _quant(engine), schedule.num_steps
    lrs = [g["lr"] for g in engine.optimizer.param_groups]

    def nan_step():
        engine.begin_step()
        s, n = engine._loss_sum(engine.model, _micro(1)[0])
        loss = s * float("nan") / n
        loss.backward()
        return engine.optimizer_step(schedule, loss=loss.detach())

    res = nan_step()
    assert res.outcome == "skipped" and math.isnan(res.loss) and engine.nonfinite.count == 1
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), params, strict=True))
    assert str(engine.optimizer.state_dict()) == str(opt_state)
    assert schedule.num_steps == steps and [g["lr"] for g in engine.optimizer.param_groups] == lrs
    assert _quant(engine) == quant  # the forward's SR calls and amax records undone
    assert nan_step().outcome == "diverged" and engine.nonfinite.count == 2


@pytest.mark.parametrize("check", [True, False])
def test_a_finite_step_read_each_step_is_ok(world_of_one, check):
    engine, schedule = _engine(max_skips=1 if check else 0, check=check)
    res = engine.train_step(_micro(0), schedule)
    assert res.outcome == "ok" and isinstance(res.loss, float) and isinstance(res.grad_norm, float)
    assert engine.stepped and schedule.num_steps == 1

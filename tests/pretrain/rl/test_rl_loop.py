"""The RL loop (``pretrain.rl.trainer``, ``launch/rl.py``) on a tiny randomly initialised policy.

In-process tests share one world of one (gloo, TP=1); the subprocess tests run ``launch/rl.py``
as users do (plain python, torchrun). The policy is random, so the task's exact-answer reward is
always 0: the tests that need a learning signal use ``rl_rewards.odd`` (``--reward-function``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tests.pretrain._launch import REPO, command, env

REWARDS = str(Path(__file__).with_name("rl_rewards.py"))
RL = str(REPO / "launch" / "rl.py")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """A sentencepiece tokenizer of the arithmetic task's text (274 pieces, trained in a second)."""
    from pretrain.data.tokenizer import train_tokenizer
    from pretrain.rl.task import load_task, sft_examples

    path = tmp_path_factory.mktemp("rl_tok") / "tok.model"
    train_tokenizer(sft_examples(load_task(str(REPO / "configs/rl/arith.yaml")), 2000), str(path), vocab_size=274)
    return str(path)


def base(tok: str, *extra: str) -> list[str]:
    return ["--task", str(REPO / "configs/rl/arith.yaml"), "--tokenizer-model", tok, "--num-layers", "2",
            "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "2", "--seq-length", "24",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-prompts", "4",
            "--reward-function", f"{REWARDS}:odd", "--lr", "1e-3", "--log-interval", "1", *extra]  # fmt: skip


class _Flag:
    """The loop's stop signal (``pretrain.train._SigtermFlag``'s interface) without a signal handler."""

    def __init__(self, received: bool = False):
        self.received = received

    def any_rank(self) -> bool:
        return self.received


def _trainer(argv):
    from pretrain.rl.arguments import parse_rl_args
    from pretrain.rl.trainer import setup

    args, cfg = parse_rl_args(argv, 1, False)
    return setup(args, cfg)


# ================================================================================================
# One step against a reference written here
# ================================================================================================


def test_one_step_equals_a_reference_update(world_of_one, tokenizer):
    """Generation, rewards, GRPO advantages, plain per-sequence forwards, the TIS-weighted clipped
    surrogate (ratio 1 on the first pass), autograd, clipping and AdamW -- computed here, not by the
    loop's code -- give the loop's weights after its first step. An FP32 trainer (--precision fp32):
    under BF16 operands the batched and the per-sequence forwards, a float rounding apart, put a few
    activations on the other BF16 neighbour; Adam's eps 1e-3 keeps its first step from amplifying
    float noise in near-zero gradients (the update is g / (|g| + eps))."""
    from pretrain.rl.task import train_problems
    from tests.pretrain.rl.rl_rewards import odd

    t = _trainer(base(tokenizer, "--precision", "fp32", "--rollout-precision", "mxfp4", "--rollout-correction", "tis",
                      "--group-size", "4", "--rollout-is-threshold", "1.01", "--adam-eps", "1e-3"))
    model, G, V = t.model, 4, t.vocab_size
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    problems, gen, _ = t.generate(0)  # the engine reads the state only: the step samples the same
    scalars = t.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert [p.prompt for p in problems] == [p.prompt for p in train_problems(t.spec, 0, 2)]

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    eod = t.tokenizer.eod
    rewards = torch.tensor([odd(None, t.tokenizer.detokenize([x for x in toks if x != eod]), None)
                            for toks in gen.tokens]).view(-1, G)
    assert float(rewards.std(1).max()) > 0, "no reward variance: the test would not test the update"
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)
    terms, n_tokens, entropy = [], 0, 0.0
    for i, (prompt, toks) in enumerate(zip(gen.prompts, gen.tokens)):
        seq = torch.tensor(prompt + toks)[None]
        logits = model(seq, torch.arange(seq.shape[1])[None], None)[0, len(prompt) - 1: len(prompt) - 1 + len(toks)]
        logp = torch.log_softmax(logits[:, :V].float(), -1)
        lp = logp.gather(-1, torch.tensor(toks)[:, None])[:, 0]
        entropy += float(-(logp.exp() * logp).sum())
        weight = torch.exp(lp.detach() - torch.tensor(gen.logprobs[i])).clamp(max=1.01)  # TIS, cap 1.01
        ratio = torch.exp(lp - lp.detach())  # 1: the first pass's policy is the recompute's
        surrogate = torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2))
        terms.append((surrogate * weight).sum())
        n_tokens += len(toks)
    loss = torch.stack(terms).sum() / n_tokens  # token-mean over the whole batch
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0)
    opt.step()
    moved = max(float((after[n] - init[n]).abs().max()) for n in init)
    assert moved > 1e-4  # the step did update the policy
    for n, p in model.named_parameters():
        torch.testing.assert_close(after[n], p.detach(), atol=1e-6, rtol=0, msg=n)
    # the loss is a sum of +-O(1/N) terms (a group's advantages sum to 0): float32 order shows at 1e-7
    assert math.isclose(scalars["rl/pg_loss"], float(loss), rel_tol=1e-5, abs_tol=2e-7)
    assert math.isclose(scalars["rl/grad_norm"], float(norm), rel_tol=1e-5)
    assert math.isclose(scalars["rl/entropy"], entropy / n_tokens, rel_tol=1e-5)  # the policy's, token-mean
    assert scalars["mismatch/k3_kl"] > 0  # MXFP4 rollouts, FP32 trainer
    for tag in ("rl/reward_mean", "rl/response_length", "rl/entropy", "rl/clipfrac", "rl/grad_norm",
                "correction/ess", "correction/masked_fraction", "rollout/tokens_per_sec", "rollout/kv_bytes_per_token",
                "rollout/packed_weight_bytes", "rollout/peak_memory_bytes", "fallback/num_layers"):
        assert tag in scalars and math.isfinite(scalars[tag]), tag


# ================================================================================================
# Exact resume, stop
# ================================================================================================


def _weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_exact_resume(world_of_one, tokenizer, tmp_path):
    """4 iterations straight == 2, stop (--exit-interval), resume from --save, 2 more: the same
    weights, optimizer state and logged metrics, bit for bit."""
    from pretrain.rl.trainer import train

    extra = ("--rl-iters", "4", "--rollout-precision", "mxfp4", "--rollout-correction", "tis", "--eval-interval", "2")
    straight = _trainer(base(tokenizer, *extra, "--save", str(tmp_path / "a")))
    assert train(straight, _Flag()) == 0
    first = _trainer(base(tokenizer, *extra, "--save", str(tmp_path / "b"), "--exit-interval", "2"))
    assert train(first, _Flag()) == 0 and first.iteration == 2
    resumed = _trainer(base(tokenizer, *extra, "--save", str(tmp_path / "b"), "--exit-interval", "2"))
    assert resumed.iteration == 2
    assert train(resumed, _Flag()) == 0 and resumed.iteration == 4
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert max(float((a[k] - _weights(first)[k]).abs().max()) for k in a if a[k].is_floating_point()) > 0
    for key in ("rl/reward_mean", "mismatch/k3_kl", "rl/pg_loss", "rl/grad_norm", "correction/ess"):
        assert [r[key] for r in straight.history] == [r[key] for r in resumed.history], key
    assert straight.evals == resumed.evals and [e[0] for e in straight.evals] == [0, 2, 4]
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    import json

    summary = json.loads((tmp_path / "a" / "rl_summary.json").read_text())
    assert summary["iterations"] == 4 and len(summary["reward_mean"]) == 4
    assert summary["reward_auc"] == pytest.approx(sum(summary["reward_mean"]) / 4)
    for key in ("final_heldout_accuracy", "mean_k3_kl", "tokens_per_sec", "peak_memory_bytes", "args"):
        assert summary[key] is not None, key


def test_stop_signal_saves_after_the_iteration(world_of_one, tokenizer, tmp_path):
    from pretrain.checkpointing import read_tracker
    from pretrain.rl.trainer import train

    t = _trainer(base(tokenizer, "--rl-iters", "5", "--save", str(tmp_path / "s")))
    assert train(t, _Flag(received=True)) == 0
    assert t.iteration == 1 and read_tracker(str(tmp_path / "s")) == 1


# ================================================================================================
# Bad input: one line naming the flag
# ================================================================================================


@pytest.mark.parametrize("extra, flag", [
    (("--group-size", "1"), "--group-size"),
    (("--rollout-correction", "tis", "--rollout-is-threshold", "0.5"), "--rollout-is-threshold"),
    (("--rollout-precision", "mxfp5"), "--rollout-precision"),
    (("--prompts-per-step", "3", "--ppo-mini-batches", "2"), "--ppo-mini-batches"),
    (("--rollout-precision-rule", "layers:7=bf16"), "--rollout-precision-rule 'layers:7=bf16'"),
])
def test_bad_flags_refused_in_one_line(tokenizer, extra, flag):
    from pretrain.arguments import ConfigError
    from pretrain.rl.arguments import parse_rl_args

    with pytest.raises(ConfigError) as e:
        parse_rl_args(base(tokenizer, *extra), 1, False)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_unparsable_task_file_refused(tokenizer, tmp_path):
    from pretrain.arguments import ConfigError
    from pretrain.rl.arguments import parse_rl_args

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    argv = base(tokenizer)
    argv[argv.index("--task") + 1] = str(bad)
    with pytest.raises(ConfigError, match=r"^--task .*bad\.yaml") as e:
        parse_rl_args(argv, 1, False)
    assert "\n" not in str(e.value)


def test_rollout_plan_the_model_cannot_take(world_of_one, tokenizer):
    """MXFP4 KV-cache blocks of 32 along a head dimension of 16 (4 heads of 64): refused, naming the flag."""
    from pretrain.arguments import ConfigError

    argv = base(tokenizer, "--rollout-precision", "mxfp4")
    argv[argv.index("--num-attention-heads") + 1] = "4"
    with pytest.raises(ConfigError, match="--rollout-precision") as e:
        _trainer(argv)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--rollout-precision-rule 'layers:7-7=bf16'"):  # a 2-layer model
        _trainer(base(tokenizer, "--rollout-precision-rule", "layers:7-7=bf16"))


def test_cli_refusal_is_one_line_and_exit_2(tokenizer):
    import subprocess

    proc = subprocess.run(command(base(tokenizer, "--group-size", "1"), nproc=0, script=RL), cwd=REPO, env=env(),
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("rl.py: error: --group-size 1"), proc.stderr


# ================================================================================================
# Processes: TP=2 under torchrun, SIGTERM
# ================================================================================================


@pytest.mark.slow
def test_tp2_runs_like_tp1(tokenizer, tmp_path):
    """torchrun, 2 processes, --tensor-model-parallel-size 2 vs one process, from the same initial
    weights: both train and log; the mismatch is of the same size. (The sampled tokens themselves
    may differ: a random policy's near-uniform logits, summed in another order over TP ranks and
    quantized to MXFP4, can move a multinomial draw across a boundary.)"""
    import json
    import subprocess

    from pretrain.checkpointing import read_tracker
    from tests.pretrain._launch import scalars

    runs = {}
    for tp, nproc in ((1, 0), (2, 2)):
        out = tmp_path / f"tp{tp}"
        argv = base(tokenizer, "--rl-iters", "2", "--eval-interval", "2", "--rollout-precision", "mxfp4",
                    "--tensor-model-parallel-size", str(tp), "--save", str(out), "--tensorboard-dir", str(out / "tb"))
        proc = subprocess.run(command(argv, nproc=nproc, script=RL), cwd=REPO, env=env(), capture_output=True,
                              check=False, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[tp] = json.loads((out / "rl_summary.json").read_text())
        assert read_tracker(str(out)) == 2
        assert set(scalars(out / "tb", "mismatch/k3_kl")) == {1, 2}
        assert set(scalars(out / "tb", "rl/heldout_accuracy")) == {0, 2}
    assert sorted(p.name for p in (tmp_path / "tp2" / "iter_0000002").glob("mp_rank_*")) == ["mp_rank_00", "mp_rank_01"]
    for a, b in zip(runs[1]["k3_kl"], runs[2]["k3_kl"]):
        assert 0 < a and 0 < b and 1 / 3 < b / a < 3
    assert runs[1]["kv_bytes_per_token"] == runs[2]["kv_bytes_per_token"]  # the whole model's (summed over TP)


@pytest.mark.slow
def test_sigterm_saves_and_exits_0(tokenizer, tmp_path):
    import subprocess
    import time

    from pretrain.checkpointing import read_tracker
    from tests.pretrain._launch import wait_for_line

    log = tmp_path / "log.txt"
    argv = base(tokenizer, "--rl-iters", "200", "--save", str(tmp_path / "ck"))
    with open(log, "w") as out:
        proc = subprocess.Popen(command(argv, nproc=0, script=RL), cwd=REPO, env=env(), stdout=out,
                                stderr=subprocess.STDOUT)
    wait_for_line(log, "iteration   1/200", proc)
    os.kill(proc.pid, 15)
    assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert "SIGTERM: stopping after iteration" in text
    stopped = int(text.split("SIGTERM: stopping after iteration ")[1].split()[0])
    assert read_tracker(str(tmp_path / "ck")) == stopped < 200
    time.sleep(0)


# ================================================================================================
# What the trainer scores (issue: top-p / top-k, QAT and the fallback, the verl knobs)
# ================================================================================================


@pytest.mark.parametrize("sampling", [("--top-p", "0.8"), ("--top-k", "5")])
def test_truncated_sampling_scores_the_distribution_the_engine_sampled(world_of_one, tokenizer, sampling):
    """BF16 rollouts and a BF16 trainer (no quantization at all) under top-p 0.8 or top-k 5: the
    trainer scores the engine's truncated, renormalised distribution, so the mismatch is the float
    floor -- scoring the full distribution read a random policy's truncation as k3 of order 1."""
    t = _trainer(base(tokenizer, "--precision", "bf16", "--rollout-precision", "bf16", *sampling))
    scalars = t.step()
    assert scalars["mismatch/k3_kl"] < 1e-4, scalars["mismatch/k3_kl"]
    assert scalars["mismatch/outside_support_fraction"] == 0.0
    assert math.isfinite(scalars["rl/pg_loss"]) and math.isfinite(scalars["rl/entropy"])


def test_qat_recompute_leaves_the_mismatch_and_the_fallback_their_signal(world_of_one, tokenizer):
    """--rollout-qat replay recomputes pi_old inside the QAT forward (k3 ~0 by construction); the
    mismatch metrics and --rollout-fallback see the rollout against the trainer's own numerics."""
    t = _trainer(base(tokenizer, "--precision", "bf16", "--rollout-precision", "mxfp4", "--rollout-qat", "replay",
                      "--rollout-fallback", "k3_kl=1e-6"))
    scalars = t.step()
    assert scalars["mismatch/k3_kl"] > 1e-6 and t.fallback.events, scalars  # the fallback triggered
    assert scalars["qat/k3_kl"] < 1e-9 and scalars["mismatch/ess_raw"] < 1.0
    assert t.fallback.events[0]["value"] == pytest.approx(scalars["mismatch/k3_kl"])


def test_verl_knobs(world_of_one, tokenizer):
    """--clip-ratio-c, --entropy-coeff, --overlong-buffer-len / --overlong-penalty-factor and
    --overlong-filter reach the step; bad values are one line naming the flag."""
    from pretrain.arguments import ConfigError
    from pretrain.rl.arguments import build_rl_parser, parse_rl_args

    _, cfg = parse_rl_args(base(tokenizer, "--clip-ratio-c", "2.5"), 1, False)
    assert cfg.clip_ratio_c == 2.5 and parse_rl_args(base(tokenizer), 1, False)[1].clip_ratio_c == 3.0
    helptext = build_rl_parser().format_help()
    for flag in ("--clip-ratio-c", "--entropy-coeff", "--overlong-buffer-len", "--overlong-penalty-factor",
                 "--overlong-filter"):
        assert flag in helptext, flag
    for extra, flag in ((("--clip-ratio-c", "1.0"), "--clip-ratio-c 1.0"),
                        (("--overlong-buffer-len", "9"), "--overlong-buffer-len 9"),
                        (("--overlong-penalty-factor", "-1"), "--overlong-penalty-factor -1.0")):
        with pytest.raises(ConfigError) as e:
            parse_rl_args(base(tokenizer, *extra), 1, False)
        assert str(e.value).startswith(flag) and "\n" not in str(e.value)

    # a random policy rarely stops within 4 tokens: DAPO's penalty over the last 2, and the filter
    plain = _trainer(base(tokenizer, "--rl-iters", "1"))
    penal = _trainer(base(tokenizer, "--rl-iters", "1", "--overlong-buffer-len", "2", "--overlong-penalty-factor",
                          "0.5", "--entropy-coeff", "0.01", "--overlong-filter"))
    a, b = plain.step(), penal.step()  # the same samples: same seed, same weights
    lengths = [len(x) for x in plain.generate(0)[1].tokens]
    penalty = sum(min(-(n - 2) / 2 * 0.5, 0.0) for n in lengths) / len(lengths)
    assert b["rl/reward_mean"] == pytest.approx(a["rl/reward_mean"] + penalty, abs=1e-6) and penalty < 0
    assert b["rl/truncated_fraction"] > 0 and "rl/entropy_loss" in b and "rl/entropy_loss" not in a
    if b["rl/truncated_fraction"] == 1.0:  # every response filtered: no loss, no update
        assert b["rl/pg_loss"] == 0.0


def test_entropy_bonus_is_differentiable_over_the_sampled_support(world_of_one, tokenizer):
    """--entropy-coeff's entropy (of the top-k distribution here) carries a gradient to the weights,
    and it equals the entropy the step logs."""
    from pretrain.rl.score import policy_logprobs, score

    t = _trainer(base(tokenizer, "--top-k", "5", "--entropy-coeff", "1.0"))
    problems, gen, _ = t.generate(0)
    s = score(t, problems, gen)
    t.optimizer.zero_grad(set_to_none=True)
    _, ent, _ = policy_logprobs(t.model, s.tokens, s.valid, s.slot, s.response_ids, vocab_size=t.vocab_size,
                                keep=s.keep, entropy=True, entropy_grad=True)
    m = s.loss_mask
    assert float(ent[m].max()) <= math.log(5) + 1e-5  # at most 5 tokens to choose from
    assert float((ent * m).sum() / m.sum()) == pytest.approx(s.scalars["rl/entropy"], rel=1e-5)
    (ent * m).sum().backward()
    grads = [p.grad for p in t.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and max(float(g.abs().max()) for g in grads) > 0


def test_nonfinite_steps_use_pretrainings_policy(world_of_one, tokenizer, tmp_path):
    """RL steps through pretraining's optimizer_step: with --skip-nonfinite-steps 1 a NaN update is
    rolled back (weights unchanged), the next one is divergence (rl.py exits 3)."""
    from pretrain.rl.update import RLDiverged

    nan_reward = tmp_path / "nan_reward.py"
    nan_reward.write_text("def nan(problem, text, spec):\n    return float('nan')\n")
    argv = base(tokenizer, "--skip-nonfinite-steps", "1")
    argv[argv.index("--reward-function") + 1] = f"{nan_reward}:nan"
    t = _trainer(argv)
    before = _weights(t)
    t.step()
    assert t.train_engine.nonfinite.count == 1 and all(torch.equal(before[k], v) for k, v in _weights(t).items())
    with pytest.raises(RLDiverged, match="non-finite gradient norm nan at RL iteration 2"):
        t.step()

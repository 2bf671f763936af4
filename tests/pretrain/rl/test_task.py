"""pretrain.rl.task (the seeded arithmetic task) and launch/rl_task.py."""

import json
import os
import subprocess
import sys

import pytest

from pretrain.rl.task import (
    Problem,
    TaskError,
    TaskSpec,
    eval_problems,
    extract_answer,
    load_task,
    reward,
    sft_examples,
    train_problems,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ARITH = os.path.join(REPO, "configs", "rl", "arith.yaml")
# one-digit addition: 100 problems, 40 held out -- a training draw lands on a held-out one often
SMALL = TaskSpec("small", seed=3, a_digits=(1, 1), b_digits=(1, 1), operations=("+",), n_eval=40)


def _solve(prompt: str) -> int:
    """The answer of ``\na{op}b=`` by plain Python (the operator is the first of + - * after a's digits)."""
    body = prompt.strip().rstrip("=")
    i = next(k for k in range(1, len(body)) if body[k] in "+-*")
    a, op, b = int(body[:i]), body[i], int(body[i + 1 :])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_the_shipped_task_file():
    spec = load_task(ARITH)
    assert spec.name == "arith" and spec.operations == ("+", "-") and spec.n_eval == 1000
    problems = train_problems(spec, 0, 50) + eval_problems(spec)
    assert all(int(p.answer) == _solve(p.prompt) and p.prompt.startswith("\n") and p.prompt.endswith("=")
               for p in problems)  # the newline marks where a problem starts
    assert any(p.answer.startswith("-") for p in problems)  # subtraction gives negatives
    lengths = {len(p.prompt) for p in problems}
    assert min(lengths) == 5 and max(lengths) == 2 * spec.a_digits[1] + 3  # easy and hard mixed


def test_problems_are_a_function_of_seed_iteration_and_index():
    spec = load_task(ARITH)
    first = train_problems(spec, 7, 6)
    assert first == train_problems(spec, 7, 6)
    assert train_problems(spec, 7, 2, rank_offset=4) == first[4:6]  # a DP rank's slice
    assert train_problems(spec, 8, 6) != first
    other_seed = TaskSpec(**{**spec.__dict__, "seed": spec.seed + 1})
    assert train_problems(other_seed, 7, 6) != first and eval_problems(other_seed) != eval_problems(spec)
    # another process (another hash seed) draws the same problems: exact resume needs no state
    code = ("from pretrain.rl.task import load_task, train_problems as t, eval_problems as e; "
            f"s = load_task({ARITH!r}); print([p.prompt for p in t(s, 7, 6)], e(s)[0].prompt)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == f"{[p.prompt for p in first]} {eval_problems(spec)[0].prompt}"


def test_held_out_set_is_fixed_distinct_and_never_trained_on():
    held = eval_problems(SMALL)
    assert held == eval_problems(SMALL) and len({p.prompt for p in held}) == SMALL.n_eval == 40
    held_prompts = {p.prompt for p in held}
    trained = [p.prompt for it in range(25) for p in train_problems(SMALL, it, 20)]
    sft = [t[: t.index("=") + 1] for t in sft_examples(SMALL, 500)]
    assert not held_prompts & set(trained) and not held_prompts & set(sft)
    # the training draws still cover the 60 problems that are not held out (nothing else is lost)
    assert len(set(trained)) == 100 - 40
    arith = load_task(ARITH)
    assert not {p.prompt for p in eval_problems(arith)} & {p.prompt for it in range(20) for p in
                                                            train_problems(arith, it, 32)}


def test_sft_examples_are_prompt_then_answer():
    spec = load_task(ARITH)
    docs = sft_examples(spec, 200)
    assert docs == sft_examples(spec, 200) and docs[:10] == sft_examples(spec, 10)
    for d in docs:
        prompt, answer = d.split("=")
        assert int(answer) == _solve(prompt + "=") and answer == str(int(answer))


@pytest.mark.parametrize("response,answer,got", [
    ("357", "357", 1.0), (" 357\n", "357", 1.0), ("-55", "-55", 1.0),
    ("0357", "357", 0.0),  # leading zero: not the canonical answer
    ("55", "-55", 0.0), ("-0", "0", 0.0), ("+357", "357", 0.0),
    ("357 is it", "357", 0.0), ("3574+1=", "357", 0.0), ("35 7", "357", 0.0), ("", "357", 0.0),
])
def test_reward_is_the_exact_canonical_answer(response, answer, got):
    spec = load_task(ARITH)
    assert reward(Problem("x=", answer), response, spec) == got


def test_extract_answer_and_format_reward():
    assert extract_answer(" -12 ") == "-12" and extract_answer("007") == "007"
    for bad in ("", "  ", "12a", "1 2", "--1", "1-", "twelve", "1.0"):
        assert extract_answer(bad) is None, bad
    spec = TaskSpec("f", format_reward=0.1)
    p = Problem("1+2=", "3")
    assert reward(p, "3", spec) == 1.0 and reward(p, "4", spec) == 0.1 and reward(p, "4!", spec) == 0.0


@pytest.mark.parametrize("text,match", [
    ("name: [unclosed", "not valid YAML at line 1"),
    ("- name: a\n", "expected a mapping of task fields, got list"),
    ("seed: 1\n", "missing field 'name'"),
    ("name: a\ndigits: 3\n", "unknown field 'digits' \\(valid: name, seed, a_digits"),
    ("name: a\na_digits: [3, 1]\n", "a_digits: must be \\[MIN, MAX\\] digit counts with 1 <= MIN <= MAX <= 9"),
    ("name: a\nb_digits: [0, 2]\n", "b_digits: must be"),
    ("name: a\noperations: ['/']\n", "operations: must be a non-empty list of distinct operations from \\+, -, \\*"),
    ("name: a\noperations: []\n", "operations: must be"),
    ("name: a\nseed: -1\n", "seed: must be an integer >= 0"),
    ("name: a\nn_eval: 0\n", "n_eval: must be an integer >= 1"),
    ("name: a\na_digits: 1\nb_digits: 1\noperations: ['+']\nn_eval: 60\n",
     "n_eval: 60 held-out problems leave too few for training: .* give 100 problems; use n_eval <= 50"),
    ("name: a\nprompt_template: '{a}+{b}='\n", "prompt_template: must use each of \\{a\\}, \\{op\\}, \\{b\\}"),
    ("name: a\nprompt_template: '{a}{op}{b}{c}='\n", "prompt_template: must use each"),
    ("name: a\nprompt_template: '{a'\n", "prompt_template: "),
    ("name: a\nformat_reward: 1.5\n", "format_reward: must be a number in \\[0, 1\\)"),
    ("name: ''\n", "name: must be a non-empty string"),
])
def test_bad_task_files_are_refused_in_one_line(tmp_path, text, match):
    path = tmp_path / "task.yaml"
    path.write_text(text)
    with pytest.raises(TaskError, match=match) as e:
        load_task(str(path))
    msg = str(e.value)
    assert msg.startswith(f"--task {path}: ") and "\n" not in msg
    with pytest.raises(TaskError, match=f"^--rl-task {path}: "):
        load_task(str(path), flag="--rl-task")


def test_missing_or_binary_task_file(tmp_path):
    with pytest.raises(TaskError, match=r"^--task .*nope.yaml: no such file \(give a task seed file"):
        load_task(str(tmp_path / "nope.yaml"))
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TaskError, match="bin.yaml: "):
        load_task(str(tmp_path / "bin.yaml"))


# ================================================================================================
# launch/rl_task.py
# ================================================================================================


def test_rl_task_writes_the_corpus_and_the_commands(tmp_path, capsys):
    from launch.rl_task import main, tokenizer_vocab_size
    from pretrain.data.tokenizer import train_tokenizer

    out = tmp_path / "data"
    assert main(["--task", ARITH, "--out", str(out), "--sft-examples", "300"]) == 0
    spec = load_task(ARITH)
    sft = [json.loads(line)["text"] for line in (out / "sft.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert sft == sft_examples(spec, 300)
    assert held == [{"prompt": p.prompt, "answer": p.answer} for p in eval_problems(spec)]
    printed = capsys.readouterr().out
    assert "launch/preprocess_data.py --input" in printed and "launch/pretrain.py" in printed
    vocab = tokenizer_vocab_size(sft)
    assert f"--train-tokenizer {vocab} --append-eod" in printed
    # that vocabulary is what sentencepiece accepts for this corpus, and spells numbers digit by digit
    tok = train_tokenizer(sft, str(tmp_path / "tok.model"), vocab)
    ids = tok.tokenize("12-34=-22")
    assert len(ids) == 9 and tok.detokenize(ids) == "12-34=-22"
    prompt = tok.tokenize(eval_problems(spec)[0].prompt)  # the start marker is one token of its own
    assert tok.detokenize(prompt[:1]) == "\n" and tok.detokenize(prompt) == eval_problems(spec)[0].prompt


def test_rl_task_prints_each_starting_policys_training_command(tmp_path, capsys):
    """--policy-width picks the SFT recipe: the printed pretrain.py command parses under pretrain.py's own
    parser into that width, schedule and checkpoint directory (the fp4_rollout and fp4_rollout_h256
    sweeps load them)."""
    import shlex

    from launch.rl_task import main
    from pretrain.arguments import build_parser

    out = tmp_path / "data"
    for width, ffn, lr, iters, save in ((128, 512, 3e-3, 3000, "sft"), (256, 1024, 1.5e-3, 4000, "sft_h256")):
        assert main(["--task", ARITH, "--out", str(out), "--sft-examples", "300", "--policy-width", str(width)]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "launch/pretrain.py" in x)
        tokens = shlex.split(line)
        args = build_parser().parse_args(tokens[tokens.index("launch/pretrain.py") + 1:])
        assert (args.hidden_size, args.ffn_hidden_size, args.num_layers) == (width, ffn, 3)
        assert args.lr == pytest.approx(lr) and args.min_lr == pytest.approx(lr / 10) and args.train_iters == iters
        assert args.save == str(out / save)
    with pytest.raises(SystemExit):
        main(["--task", ARITH, "--out", str(out), "--policy-width", "512"])
    assert "--policy-width: invalid choice: 512 (choose from 128, 256)" in capsys.readouterr().err


def test_the_moe_starting_policy_is_the_one_the_moe_rollout_study_loads(tmp_path, capsys):
    """--policy-moe prints the MoE starting policy's commands: they parse under pretrain.py's and
    preprocess_data.py's own parsers into the MoE shape, the checkpoint directory they save to is the
    moe_rollout sweep's load:, and moe_rollout.md's commands (for --out runs/rl_task) are the printed
    ones. A width without a MoE recipe is refused in one line naming both flags."""
    import re
    import shlex

    import yaml

    from launch.preprocess_data import _parse_args as parse_preprocess
    from launch.rl_task import main
    from pretrain.arguments import build_parser
    from pretrain.rl.starting_policy import MOE_RECIPES, commands, tokenizer_vocab_size

    out = tmp_path / "data"
    assert main(["--task", ARITH, "--out", str(out), "--sft-examples", "300", "--policy-moe"]) == 0
    printed = [x.strip() for x in capsys.readouterr().out.splitlines() if "launch/" in x]
    pre, sft = (shlex.split(x) for x in printed)
    pre_args = parse_preprocess(pre[pre.index("launch/preprocess_data.py") + 1:])
    args = build_parser().parse_args(sft[sft.index("launch/pretrain.py") + 1:])
    assert pre_args.input == [str(out / "sft.jsonl")] and args.data_path == [f"{pre_args.output_prefix}_text_document"]
    assert (args.num_layers, args.hidden_size, args.num_experts, args.moe_router_topk) == (3, 128, 4, 2)
    assert (args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size) == (128, 256)
    assert 2 * args.moe_ffn_hidden_size + args.moe_shared_expert_intermediate_size == args.ffn_hidden_size
    assert args.save == str(out / "sft_moe")

    with open(os.path.join(REPO, "configs", "sweeps", "moe_rollout.yaml")) as f:
        sweep = yaml.safe_load(f)
    study_out = os.path.dirname(sweep["base"]["load"])
    assert sweep["base"]["load"] == os.path.join(study_out, MOE_RECIPES[128].save_dir)
    with open(os.path.join(REPO, "configs", "sweeps", "moe_rollout.md")) as f:
        md = f.read()
    block = md.split("## Starting policy", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    documented = [" ".join(x.split()) for x in re.sub(r"\\\n\s*", " ", block).splitlines() if x.strip()]
    vocab = tokenizer_vocab_size(sft_examples(load_task(ARITH), 50000))  # rl_task.py's default --sft-examples
    for cmd in commands(study_out, vocab, 128, moe=True):
        assert cmd in documented, (cmd, documented)

    assert main(["--task", ARITH, "--out", str(out), "--policy-moe", "--policy-width", "256"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rl_task.py: error: --policy-width 256 --policy-moe: no MoE starting policy of that width; "
                   "MoE widths: 128")


@pytest.mark.slow
def test_the_moe_starting_policy_trains_and_the_study_loads_it(tmp_path, capsys):
    """The printed commands run as printed (2 SFT iterations instead of 3,000, on a 300-document corpus),
    and the moe_rollout sweep's RL flags, with its load: pointed at the checkpoint they wrote, take
    the MoE shape from it."""
    import shlex

    import yaml

    from launch.rl_task import main
    from pretrain.rl.arguments import parse_rl_args
    from pretrain.rl.starting_policy import MOE_RECIPES
    from tests.pretrain._launch import env

    out = tmp_path / "data"
    assert main(["--task", ARITH, "--out", str(out), "--sft-examples", "300", "--policy-moe"]) == 0
    pre, sft = ([t for t in shlex.split(x) if not t.startswith("OMP_NUM_THREADS=")]
                for x in capsys.readouterr().out.splitlines() if "launch/" in x)
    short = ["--train-iters", "2", "--eval-interval", "2", "--save-interval", "2", "--lr-warmup-iters", "0"]
    for cmd in (pre, sft + short):
        assert cmd[0] == "python"
        proc = subprocess.run([sys.executable, *cmd[1:]], cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(REPO, "configs", "sweeps", "moe_rollout.yaml")) as f:
        sweep = yaml.safe_load(f)
    # the study starts at a checkpoint the full SFT saves (ckpt-step); this 2-iteration one saved iteration 2
    r = MOE_RECIPES[128]
    assert sweep["base"]["ckpt-step"] % r.save_interval == 0 and sweep["base"]["ckpt-step"] <= r.iters
    flags = {**sweep["base"], "load": str(out / "sft_moe"), "ckpt-step": "2", "task-replicate": "0"}
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    run, cfg = parse_rl_args(argv, 1, False)
    m = run.model
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk) == (3, 128, 4, 2)
    assert cfg.task_replicate == 0 and run.checkpoint.load == str(out / "sft_moe")


def test_rl_task_refuses_bad_input_in_one_line(tmp_path, capsys):
    from launch.rl_task import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: a\nwhat: 1\n")
    for argv, want in (
        (["--task", str(bad), "--out", str(tmp_path)], f"--task {bad}: unknown field 'what'"),
        (["--task", ARITH, "--out", str(tmp_path), "--group-size", "1", "--evaluate", "x"], "--group-size 1:"),
        (["--task", ARITH, "--out", str(tmp_path), "--sft-examples", "0"], "--sft-examples 0: must be >= 1"),
        (["--task", ARITH, "--out", str(tmp_path), "--evaluate", str(tmp_path / "none")],
         f"--evaluate {tmp_path / 'none'}: no such checkpoint directory"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("rl_task.py: error: ") and want in err and "\n" not in err


@pytest.mark.usefixtures("world_of_one")
def test_rl_task_evaluates_a_checkpoint_through_the_engine(tmp_path, capsys):
    """A tiny random GPT saved as a training checkpoint: accuracy, format and group statistics are those
    of the responses the engine gave (every held-out problem is in the examples here)."""
    import torch

    from launch.rl_task import main
    from model.gpt import ModelConfig, build_gpt, policy_linear_names
    from precision import PrecisionPolicy
    from pretrain.arguments import parse_args
    from pretrain.checkpointing import save_checkpoint
    from pretrain.data.tokenizer import train_tokenizer

    task = tmp_path / "task.yaml"
    task.write_text("name: tiny\nseed: 5\na_digits: 1\nb_digits: 1\nn_eval: 6\n")
    spec = load_task(str(task))
    tok = train_tokenizer(sft_examples(spec, 300), str(tmp_path / "tok.model"), 273)
    shape = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "2",
             "--num-query-groups", "1", "--seq-length", "32"]
    args = parse_args([*shape, "--train-iters", "1", "--tokenizer-model", tok.path, "--precision", "bf16"])
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=2, num_query_groups=1, seq_length=32, init_method_std=0.3)
    torch.manual_seed(0)
    model = build_gpt(cfg)
    plan = PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), cfg.num_layers)
    save_checkpoint(str(tmp_path / "ckpt"), 1, {"model": model.state_dict(), "args": dict(vars(args)),
                                                "precision_plan": plan.to_dict()})
    for rollout in ("bf16", "mxfp4"):
        out = tmp_path / "eval"
        assert main(["--task", str(task), "--evaluate", str(tmp_path / "ckpt"), "--out", str(out),
                     "--rollout-precision", rollout, "--group-size", "2", "--group-prompts", "3"]) == 0
        res = json.loads((out / f"eval_{rollout}.json").read_text())
        assert res["rollout_precision"] == rollout and res["heldout_problems"] == 6
        ex = res["examples"]
        assert [e["prompt"] for e in ex] == [p.prompt for p in eval_problems(spec)]
        assert res["heldout_accuracy"] == sum(e["response"] == e["answer"] for e in ex) / 6
        assert res["well_formed"] == sum(extract_answer(e["response"]) is not None for e in ex) / 6
        assert res["group_size"] == 2 and res["group_prompts"] == 3 and 0 <= res["sampled_reward_mean"] <= 1
        assert res["groups_all_correct"] + res["groups_all_wrong"] + res["groups_with_reward_variance"] == 1
        assert f"rollout {rollout}" in capsys.readouterr().out

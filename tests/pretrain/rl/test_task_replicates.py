"""True replicates of the RL task (issue #37): a replicate draws its own training prompt stream and
its own evaluation sample, disjoint from every other replicate's and from every training draw; the
default (no replicate) keeps the task seed's shared stream and set, problem for problem."""

import dataclasses

import pytest

from pretrain.rl.task import TaskError, TaskSpec, eval_problems, load_task, sft_examples, train_problems

SPEC = TaskSpec(name="t", seed=3, a_digits=(1, 3), b_digits=(1, 3), n_eval=400)


def test_replicates_have_their_own_prompt_streams_and_disjoint_eval_samples():
    reps = [dataclasses.replace(SPEC, replicate=r, replicate_eval=100) for r in range(4)]
    evals = [{p.prompt for p in eval_problems(s)} for s in reps]
    assert all(len(e) == 100 for e in evals)
    assert all(not (evals[i] & evals[j]) for i in range(4) for j in range(i + 1, 4))  # disjoint samples
    held = {p.prompt for p in eval_problems(SPEC)}
    assert set().union(*evals) == held  # together: the held-out set, which no training draw reaches
    streams = [[p.prompt for it in range(5) for p in train_problems(s, it, 8)] for s in reps]
    assert len({tuple(x) for x in streams}) == 4  # each replicate its own prompts
    shared = [p.prompt for it in range(5) for p in train_problems(SPEC, it, 8)]
    assert all(x != shared for x in streams)
    for x in [*streams, shared, sft_examples(SPEC, 300)]:
        assert not held & {q.split("=")[0] + "=" if "=" in q else q for q in x}


def test_no_replicate_is_the_task_seeds_shared_stream_unchanged():
    # the stream keys of a run without replicate: "{seed}/train/{iteration}/{index}" as before
    again = TaskSpec(name="t", seed=3, a_digits=(1, 3), b_digits=(1, 3), n_eval=400)
    assert train_problems(SPEC, 2, 4) == train_problems(again, 2, 4)
    assert [p.prompt for p in eval_problems(SPEC)] == [p.prompt for p in eval_problems(again)]
    assert len(eval_problems(SPEC)) == 400


@pytest.mark.parametrize("extra, message", [
    ("replicate: -1\n", r"replicate: must be an integer >= 0"),
    ("replicate: 4\nreplicate_eval: 100\n", (r"replicate: 4 needs 500 held-out problems \(100 per replicate\) but "
                                            r"n_eval is 400")),
    ("replicate_eval: 0\n", r"replicate_eval: must be an integer >= 1"),
])
def test_bad_replicate_fields_are_one_line_errors(tmp_path, extra, message):
    f = tmp_path / "task.yaml"
    f.write_text("name: t\nseed: 3\nn_eval: 400\n" + extra)
    with pytest.raises(TaskError, match=message):
        load_task(str(f))


def test_task_replicate_flag_overrides_the_files_replicate(tmp_path):
    """--task-replicate R: one task file serves every replicate of a sweep; bad values are one line
    naming the flag."""
    f = tmp_path / "task.yaml"
    f.write_text("name: t\nseed: 3\nn_eval: 400\nreplicate: 0\nreplicate_eval: 100\n")
    assert load_task(str(f)).replicate == 0
    spec = load_task(str(f), "--task", 2)
    assert spec.replicate == 2
    assert eval_problems(spec) == eval_problems(dataclasses.replace(load_task(str(f)), replicate=2))
    with pytest.raises(TaskError, match=r"--task-replicate -1: must be >= 0"):
        load_task(str(f), "--task", -1)
    with pytest.raises(TaskError, match=r"with --task-replicate 4: replicate: 4 needs 500 held-out problems"):
        load_task(str(f), "--task", 4)

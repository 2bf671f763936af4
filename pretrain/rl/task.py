"""An offline verifiable task for RL: integer arithmetic with exact answers, generated from a seed.

A task seed file (``configs/rl/arith.yaml``) fixes everything; no data files, no network::

    spec = load_task("configs/rl/arith.yaml")          # TaskSpec (frozen); bad file -> TaskError, one line
    train_problems(spec, iteration=7, n=4)             # [Problem("\n12+34=", "46"), ...]
    eval_problems(spec)                                # the fixed held-out set (spec.n_eval problems)
    reward(problem, "46", spec)                        # 1.0;  "046", "46 ok", "4" -> 0.0 (+ format reward)
    sft_examples(spec, 20000)                          # ["\n12+34=46", ...] the starting policy's corpus

How problems are drawn: each operand first draws its digit count uniformly from its range
(``a_digits`` / ``b_digits``, inclusive), then a value uniformly among the numbers with that many
digits (1 digit: 0..9, d > 1 digits: 10^(d-1)..10^d - 1), and the operation uniformly from
``operations`` (``+``, ``-``, ``*``). Drawing the digit count first mixes easy and hard problems, so a
starting policy solves some and not others -- what GRPO needs (reward variance within a group).

Determinism: problem ``index`` of training ``iteration`` comes from its own ``random.Random`` seeded
with the string ``"{seed}/train/{iteration}/{index}/{attempt}"`` (string seeds are hashed with
SHA-512, independent of ``PYTHONHASHSEED``), so any rank at any iteration regenerates its
problems without state -- exact resume needs nothing saved. ``rank_offset`` shifts the index
(data-parallel ranks take disjoint slices of one iteration's problems).

Held-out set: ``eval_problems`` draws ``n_eval`` distinct problems from the stream ``"{seed}/eval/..."``;
every training and SFT draw that lands on a held-out problem is redrawn (``attempt`` + 1), so the
held-out set is disjoint from every problem the policy is ever trained on.

True replicates: with ``replicate: r`` in the task seed file a run draws its training prompts from
its own stream (``"{seed}/rep{r}/train/..."``) and evaluates on its own share of the held-out set
(``replicate_eval`` problems, disjoint from every other replicate's), so replicates differ in prompts
and in evaluation sample, not only in response sampling, and an interval over replicates carries the
evaluation sample's error. Every replicate's problems still come from the one held-out set, so none
was seen by the starting policy's SFT corpus or by any replicate's training.

Where a problem starts: in the starting policy's corpus every example follows an end-of-document
id, but an RL prompt is tokenized from its text alone and sits at position 0. The default template
therefore begins with a newline (one token of the task tokenizer), so the corpus holds
``</s>\n12+34=46</s>\n5-7=-2</s>...`` and a prompt ``\n12+34=`` starts the way every training
example does. Measured on an earlier starting policy (3 layers, hidden 128, 3,000 iterations of 16
sequences): without any start marker the held-out greedy accuracy was 2 %, with the end-of-document
id in front of the same prompts 28.5 %.

Answers and rewards: the answer is the canonical decimal integer (``-`` for negatives, no leading
zeros, no ``+``). The end of an answer is the tokenizer's end-of-document id, which
``launch/preprocess_data.py --append-eod`` appends to every SFT example and the RL engine stops on;
detokenized, it is no text, so a response's text is just the answer. ``extract_answer`` returns
the response's text stripped of surrounding whitespace if that is an integer (``-?[0-9]+``), else
None (trailing text, a second problem started without the end marker, an empty response).
``reward`` is 1.0 for the exact canonical answer (``"0357"`` is not ``"357"``), else
``format_reward`` if the response is a well-formed integer, else 0.0.
"""

from __future__ import annotations

import os
import random
import re
import string
from dataclasses import dataclass, fields

import yaml

__all__ = [
    "OPERATIONS",
    "Problem",
    "TaskError",
    "TaskSpec",
    "eval_problems",
    "extract_answer",
    "load_task",
    "reward",
    "sft_examples",
    "train_problems",
]

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_DIGITS = 9
_INTEGER = re.compile(r"-?[0-9]+")
_PLACEHOLDERS = ("a", "op", "b")


class TaskError(ValueError):
    """A task seed file that cannot be used; the message is one line naming the flag and the file."""


@dataclass(frozen=True)
class TaskSpec:
    """One verifiable task, as a task seed file states it (every field has a default but ``name``)."""

    name: str
    """What logs and summaries call the task."""
    seed: int = 0
    """Seeds every problem stream (training, held-out, SFT)."""
    a_digits: tuple[int, int] = (1, 3)
    """Digit count range (inclusive) of the first operand."""
    b_digits: tuple[int, int] = (1, 3)
    """Digit count range (inclusive) of the second operand."""
    operations: tuple[str, ...] = ("+", "-")
    """Drawn uniformly; each of ``+``, ``-``, ``*``."""
    n_eval: int = 200
    """Size of the fixed held-out set."""
    prompt_template: str = "\n{a}{op}{b}="
    """The prompt text; ``{a}``, ``{op}`` and ``{b}`` are replaced (each must appear once). The leading
    newline marks where a problem starts, in the SFT corpus as in an RL prompt (see the module docstring)."""
    format_reward: float = 0.0
    """Reward of a well-formed but wrong integer answer (0: off); must be in [0, 1)."""
    replicate: int | None = None
    """A true replicate (0, 1, ...): its own training prompt stream (``"{seed}/rep{r}/train/..."``) and
    its own evaluation sample -- the ``replicate_eval`` problems at ``r * replicate_eval`` of a seeded
    shuffle of the held-out set, disjoint from every other replicate's. None: the task seed's stream
    and the whole held-out set, shared by every run (a run's ``--seed`` then changes only sampling)."""
    replicate_eval: int | None = None
    """Held-out problems per replicate (default: ``n_eval // 4``); ``(replicate + 1) * replicate_eval``
    must not exceed ``n_eval``. Every replicate's problems come from the held-out set, which no
    training or starting-policy (SFT) draw ever lands on."""

    def __post_init__(self):
        object.__setattr__(self, "a_digits", tuple(self.a_digits))
        object.__setattr__(self, "b_digits", tuple(self.b_digits))
        object.__setattr__(self, "operations", tuple(self.operations))

    def problem_space(self) -> int:
        """How many distinct (a, op, b) problems the spec can draw."""
        def count(lo, hi):
            return sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in range(lo, hi + 1))
        return count(*self.a_digits) * count(*self.b_digits) * len(self.operations)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


# ================================================================================================
# The task seed file
# ================================================================================================


def load_task(path: str, flag: str = "--task", replicate: int | None = None) -> TaskSpec:
    """The :class:`TaskSpec` of a YAML task seed file; any problem -> :class:`TaskError` naming ``flag`` and ``path``.
    ``replicate`` (``--task-replicate``): this run's replicate, in place of the file's ``replicate``."""
    where = f"{flag} {path}"
    if not os.path.isfile(path):
        raise TaskError(f"{where}: no such file (give a task seed file, e.g. configs/rl/arith.yaml)")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise TaskError(f"{where}: not valid YAML{at} ({getattr(err, 'problem', None) or err})") from None
    except UnicodeDecodeError:
        raise TaskError(f"{where}: not a UTF-8 text file") from None
    if not isinstance(data, dict):
        raise TaskError(f"{where}: expected a mapping of task fields, got {type(data).__name__}")
    valid = [f.name for f in fields(TaskSpec)]
    unknown = sorted(set(data) - set(valid), key=str)
    if unknown:
        raise TaskError(f"{where}: unknown field {unknown[0]!r} (valid: {', '.join(valid)})")
    if "name" not in data:
        raise TaskError(f"{where}: missing field 'name'")
    if replicate is not None:
        if replicate < 0:
            raise TaskError(f"--task-replicate {replicate}: must be >= 0 (a replicate number: 0, 1, ...)")
        data = {**data, "replicate": replicate}
        where = f"{where} with --task-replicate {replicate}"
    return _validated(data, where)


def _validated(data: dict, where: str) -> TaskSpec:
    def fail(msg):
        raise TaskError(f"{where}: {msg}")

    def integer(key, lo, hi=None):
        v = data[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            fail(f"{key}: must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v!r}")
        return v

    out = dict(data)
    if not isinstance(data["name"], str) or not data["name"].strip():
        fail(f"name: must be a non-empty string, got {data['name']!r}")
    if "seed" in data:
        out["seed"] = integer("seed", 0)
    if "n_eval" in data:
        out["n_eval"] = integer("n_eval", 1)
    for key in ("a_digits", "b_digits"):
        if key not in data:
            continue
        v = data[key]
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v, v]
        if (not isinstance(v, list) or len(v) != 2 or any(not isinstance(d, int) or isinstance(d, bool) for d in v)
                or not 1 <= v[0] <= v[1] <= MAX_DIGITS):
            fail(f"{key}: must be [MIN, MAX] digit counts with 1 <= MIN <= MAX <= {MAX_DIGITS} (or one integer), "
                 f"got {data[key]!r}")
        out[key] = tuple(v)
    if "operations" in data:
        ops = data["operations"]
        if (not isinstance(ops, list) or not ops or any(o not in OPERATIONS for o in ops)
                or len(set(ops)) != len(ops)):
            fail(f"operations: must be a non-empty list of distinct operations from {', '.join(OPERATIONS)}, "
                 f"got {ops!r}")
        out["operations"] = tuple(ops)
    if "prompt_template" in data:
        t = data["prompt_template"]
        if not isinstance(t, str):
            fail(f"prompt_template: must be a string, got {t!r}")
        try:
            names = [n for _, n, _, _ in string.Formatter().parse(t) if n is not None]
        except ValueError as err:
            fail(f"prompt_template: {err} in {t!r}")
        if sorted(names) != sorted(_PLACEHOLDERS):
            fail(f"prompt_template: must use each of {{a}}, {{op}}, {{b}} exactly once and nothing else, got {t!r}")
    if data.get("replicate") is not None:
        out["replicate"] = integer("replicate", 0)
    if data.get("replicate_eval") is not None:
        out["replicate_eval"] = integer("replicate_eval", 1)
    if "format_reward" in data:
        v = data["format_reward"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            fail(f"format_reward: must be a number in [0, 1) (0: off), got {v!r}")
        out["format_reward"] = float(v)
    spec = TaskSpec(**out)
    if spec.replicate is not None and (spec.replicate + 1) * _per_replicate(spec) > spec.n_eval:
        fail(f"replicate: {spec.replicate} needs {(spec.replicate + 1) * _per_replicate(spec)} held-out problems "
             f"({_per_replicate(spec)} per replicate) but n_eval is {spec.n_eval}; raise n_eval or lower replicate_eval")
    if spec.problem_space() < 2 * spec.n_eval:
        fail(f"n_eval: {spec.n_eval} held-out problems leave too few for training: the digit ranges and operations "
             f"give {spec.problem_space()} problems; use n_eval <= {spec.problem_space() // 2} or wider ranges")
    return spec


# ================================================================================================
# Problems
# ================================================================================================


def _operand(rng: random.Random, digits: tuple[int, int]) -> int:
    d = rng.randint(*digits)
    return rng.randint(0, 9) if d == 1 else rng.randint(10 ** (d - 1), 10**d - 1)


def _draw(spec: TaskSpec, key: str) -> tuple[int, str, int]:
    rng = random.Random(key)
    a = _operand(rng, spec.a_digits)
    b = _operand(rng, spec.b_digits)
    return a, rng.choice(spec.operations), b


def _problem(spec: TaskSpec, a: int, op: str, b: int) -> Problem:
    return Problem(spec.prompt_template.format(a=a, op=op, b=b), str(OPERATIONS[op](a, b)))


_HELD_OUT: dict[TaskSpec, frozenset] = {}


def _held_out(spec: TaskSpec) -> tuple[list[tuple[int, str, int]], frozenset]:
    if spec.problem_space() < 2 * spec.n_eval:
        raise ValueError(f"TaskSpec {spec.name!r}: n_eval {spec.n_eval} exceeds half of its {spec.problem_space()} "
                         "problems (load_task refuses such a file)")
    draws, seen, k = [], set(), 0
    while len(draws) < spec.n_eval:
        t = _draw(spec, f"{spec.seed}/eval/{k}")
        k += 1
        if t not in seen:
            seen.add(t)
            draws.append(t)
    return draws, frozenset(seen)


def _held_out_set(spec: TaskSpec) -> frozenset:
    if spec not in _HELD_OUT:
        _HELD_OUT[spec] = _held_out(spec)[1]
    return _HELD_OUT[spec]


def _training_draw(spec: TaskSpec, stream: str) -> tuple[int, str, int]:
    held = _held_out_set(spec)
    attempt = 0
    while True:
        t = _draw(spec, f"{stream}/{attempt}")
        if t not in held:
            return t
        attempt += 1


def _per_replicate(spec: TaskSpec) -> int:
    return spec.replicate_eval or max(1, spec.n_eval // 4)


def eval_problems(spec: TaskSpec) -> list[Problem]:
    """The held-out problems a run evaluates on, never drawn for training: the whole fixed set
    (``spec.n_eval`` distinct problems), or a replicate's own disjoint share of it."""
    draws = _held_out(spec)[0]
    if spec.replicate is not None:
        k = _per_replicate(spec)
        order = list(range(len(draws)))
        random.Random(f"{spec.seed}/replicate-eval-order").shuffle(order)
        picked = order[spec.replicate * k:(spec.replicate + 1) * k]
        if len(picked) < k:
            raise ValueError(f"TaskSpec {spec.name!r}: replicate {spec.replicate} needs "
                             f"{(spec.replicate + 1) * k} held-out problems, n_eval is {spec.n_eval}")
        draws = [draws[i] for i in picked]
    return [_problem(spec, *t) for t in draws]


def train_problems(spec: TaskSpec, iteration: int, n: int, *, rank_offset: int = 0) -> list[Problem]:
    """Problems ``rank_offset .. rank_offset + n - 1`` of training ``iteration`` (a pure function of
    ``(spec.seed, iteration, index)``; none is a held-out problem)."""
    if iteration < 0 or n < 0 or rank_offset < 0:
        raise ValueError(f"train_problems: iteration, n and rank_offset must be >= 0, got {iteration}, {n}, "
                         f"{rank_offset}")
    stream = f"{spec.seed}/train" if spec.replicate is None else f"{spec.seed}/rep{spec.replicate}/train"
    return [_problem(spec, *_training_draw(spec, f"{stream}/{iteration}/{i}"))
            for i in range(rank_offset, rank_offset + n)]


def sft_examples(spec: TaskSpec, n: int) -> list[str]:
    """``n`` starting-policy documents ``prompt + answer`` (the end marker is the end-of-document id that
    ``launch/preprocess_data.py --append-eod`` appends); from their own stream, none held out."""
    out = []
    for i in range(n):
        p = _problem(spec, *_training_draw(spec, f"{spec.seed}/sft/{i}"))
        out.append(p.prompt + p.answer)
    return out


# ================================================================================================
# Answers and rewards
# ================================================================================================


def extract_answer(response: str) -> str | None:
    """The response's integer answer as written (whitespace around it stripped), or None if the
    response is not exactly one integer ``-?[0-9]+`` (empty, trailing text, a second problem)."""
    text = response.strip()
    return text if _INTEGER.fullmatch(text) else None


def reward(problem: Problem, response: str, spec: TaskSpec) -> float:
    """1.0 for the exact canonical answer; ``spec.format_reward`` for another well-formed integer; else 0.0."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answer == problem.answer else spec.format_reward

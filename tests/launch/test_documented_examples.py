"""Every documented example is true: each command, precision spec and per-layer rule shown in README.md,
docs/*.md and every launcher's ``--help`` text (with its module docstring) goes through the parser and
validation of the program that would take it, without training.

- ``launch/pretrain.py`` (also under ``torchrun``, and ``launch/slurm/pretrain.sbatch``'s arguments and
  flags after a bare ``--``): ``pretrain.arguments.parse_run_config`` -- parse, validate, freeze;
  ``launch/rl.py``: ``pretrain.rl.arguments.parse_rl_args``.
- every other launcher: its own ``main(argv)`` up to the end of its argparse parsing (a flag it does not
  take, a bad choice or a missing argument fails here), stopped before it does any work.
- ``SELECTOR=VALUE`` rules (``precision.policy.Rule.parse``), ``GEMM=RECIPE`` specs
  (``precision.policy.parse_precision``) and ``START:P,...`` schedules, wherever they appear as code.

A pretraining command whose only problem is an input an earlier documented step writes (a checkpoint,
a tokenizer, a dataset prefix) counts as valid when the error names that path (or ``--load``) and the
path is absent. A template -- ``...`` or an upper-case placeholder such as ``CKPT`` or ``PRESET`` --
is grammar, not an example: a template command has its placeholders filled with a dummy path and
goes through its launcher's argparse parser only; a template spec or rule is skipped
(``test_the_examples_are_found`` bounds how many).
Rollout specs and rules (``linear=``, ``kv=``) go through ``model.rollout_plan``'s parsers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from model.rollout_plan import _rule_value as _rollout_rule_value  # --rollout-precision-rule's parser
from model.rollout_plan import parse_rollout
from precision.policy import Rule, parse_precision
from precision.schedule import PrecisionSchedule

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LAUNCHERS = sorted(p.stem for p in (REPO / "launch").glob("*.py") if not p.stem.startswith("_"))
TO_PRETRAIN = ("launch/pretrain.py", "launch/slurm/pretrain.sbatch")
SELECTOR = r"(?:first:\d+|last:\d+|layers:\d+-\d+|kind:\w+|decoder\.[\w.*?\[\]]+|output_layer)"
RULE_RE = re.compile(rf"^{SELECTOR}=\S+$")
SPEC_RE = re.compile(r"^(?:base|fprop|dgrad|wgrad)=\S+$")
SCHEDULE_RE = re.compile(r"^\d+:\w[\w=+@/(),.:-]*$")


class _Parsed(Exception):
    """Raised instead of returning from ``parse_args``: the launcher parsed its flags; stop it there."""


def _help_text(name: str) -> tuple[str, str]:
    """The launcher's module docstring and ``python launch/NAME.py --help``'s output."""
    module = importlib.import_module(f"launch.{name}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        _main(module)(["--help"])
    return module.__doc__ or "", out.getvalue()


def _main(module):
    main = getattr(module, "main", None)
    if main is None:  # pretrain.py / rl.py import their main from the package
        raise AttributeError(module.__name__)
    return main


def _sources() -> list[tuple[str, str, bool]]:
    """``(where, text, has_code_blocks)`` of every document and every launcher's docstring and help
    (argparse's indented help is prose: only its quoted and flag values are examples)."""
    out = [(str(p.relative_to(REPO)), p.read_text(), True) for p in DOCS]
    makefile = (REPO / "Makefile").read_text().replace("$(VENV)/bin/", "").replace("$(PY) ", "python ")
    makefile = makefile.replace("\t", "    ")
    out.append(("Makefile", makefile, True))  # make pretrain: the README's set-up command
    for name in LAUNCHERS:
        doc, help_text = _help_text(name)
        out += [(f"launch/{name}.py", doc, True), (f"launch/{name}.py --help", help_text, False)]
    return out


def _code_lines(text: str) -> list[str]:
    """Lines of fenced blocks and indented docstring examples, continuations joined, comments cut."""
    blocks = re.findall(r"```[\w-]*\n(.*?)```", text, re.DOTALL)
    blocks += re.findall(r"((?:^ {4,}\S.*\n)+)", text, re.MULTILINE)
    out = []
    for block in blocks:
        for line in re.sub(r"\\\\?\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"'([^'\n]+)'", text)


def _commands(text: str) -> list[str]:
    return [line for line in _code_lines(text) if re.search(r"(?:^|\s)launch/\w+(?:/\w+)*\.(?:py|sbatch)\b", line)]


PLACEHOLDER = re.compile(r"\.\.\.|(?<![\w$-])[A-Z][A-Z_]*(?![\w=])")


def _placeholder(text: str) -> bool:
    """``...`` or an upper-case word that is not a value some pretrain flag takes (``WSD``)."""
    from pretrain.arguments import build_parser

    choices = {str(c) for a in build_parser()._actions for c in (a.choices or ())}
    return any(m.group(0) not in choices for m in PLACEHOLDER.finditer(text.replace("OMP_NUM_THREADS", "")))


def _examples():
    """``(where, kind, text)`` of every command, rule, spec and schedule documented."""
    seen, out = set(), []
    for where, text, has_code in _sources():
        for cmd in _commands(text) if has_code else ():
            key = ("command", cmd)
            if key not in seen:
                seen.add(key)
                out.append((where, "template" if _placeholder(cmd)
                            else "command", cmd))
        values = (_code_lines(text) if has_code else []) + _inline_code(text)
        for flag, value in re.findall(r"--(precision-rule|precision|precision-schedule)[ =]'?([^'\s`]+)", text):
            values.append(value)
        for value in values:
            value = value.strip().strip("'\"")
            if "=" in value and " " not in value:
                kind = "rule" if RULE_RE.match(value) else "spec" if SPEC_RE.match(value) else None
            elif SCHEDULE_RE.match(value) and "," in value:
                kind = "schedule"
            else:
                kind = None
            if kind and _placeholder(value):
                kind = "template"
            elif kind and re.search(r"(?:^|[=,])(?:linear|kv)=", value.split("=", 1)[1] if kind == "rule" else value):
                kind = f"rollout_{kind}"
            if kind and (kind, value) not in seen:
                seen.add((kind, value))
                out.append((where, kind, value))
    return out


EXAMPLES = _examples()


INPUT_FLAGS = ("--precision", "--load", "--data-path", "--tokenizer-model", "--pretrained-checkpoint", "--finetune",
               "--config")


def _absent_input(message: str, argv: list[str]) -> bool:
    """Whether ``message`` refuses an input of ``argv`` that does not exist here (one an earlier
    documented step makes): it names the absent path, or ``--load`` when that is the absent one."""
    for i, flag in enumerate(argv[:-1]):  # every occurrence: a sweep's runs each name their own input
        if flag in INPUT_FLAGS:
            path = argv[i + 1]
            if not Path(path).exists() and not (REPO / path).exists() and (path in message or flag in message):
                return True
    return False


def _validate(parse, argv: list[str], world: int, cuda: bool = False) -> None:
    from pretrain.arguments import ConfigError

    try:
        parse(argv, world, cuda)
    except ConfigError as e:
        if not _absent_input(str(e), argv):
            raise


def _check_pretrain(argv: list[str], world: int, cuda: bool = False) -> None:
    from pretrain.arguments import parse_run_config

    _validate(parse_run_config, argv, world, cuda)


def _check_rl(argv: list[str], world: int) -> None:
    from pretrain.rl.arguments import parse_rl_args

    _validate(parse_rl_args, argv, world)


def _check_launcher(name: str, argv: list[str], monkeypatch, elided: bool = False) -> None:
    """Run launcher ``name``'s main up to the end of its argparse parsing."""
    def parsed(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        raise _Parsed(ns)

    err = io.StringIO()
    with monkeypatch.context() as patch, contextlib.redirect_stderr(err), pytest.raises((_Parsed, SystemExit)) as e:
        patch.setattr(argparse.ArgumentParser, "parse_args", parsed)
        _main(importlib.import_module(f"launch.{name}"))(argv)
    if elided and "the following arguments are required" in err.getvalue():
        return None  # the template elides them ('...')
    assert e.type is _Parsed, f"launch/{name}.py refused {shlex.join(argv)}: {err.getvalue().strip()}"


def _fill(cmd: str) -> str:
    """A template command with its placeholders filled: ``...`` and ``[ ]`` dropped, each upper-case
    placeholder word a dummy path."""
    cmd = re.sub(r"(?<!\S)\.\.\.(?!\S)", " ", cmd).replace("[", " ").replace("]", " ")
    return PLACEHOLDER.sub(lambda m: m.group(0) if not _placeholder(m.group(0))
                           else "1" if m.group(0) == "N" else "runs/placeholder",
                           cmd.replace("OMP_NUM_THREADS", "\0")).replace("\0", "OMP_NUM_THREADS")


def _check_sweep(own: list[str], extra: list[str]) -> None:
    from pretrain.sweep.runner import SweepError, validate_runs
    from pretrain.sweep.spec import expand_runs, load_sweep

    sweep = load_sweep(own[0])
    runs = expand_runs(sweep, own[0])
    try:
        validate_runs(REPO / "runs" / "documented", runs, int(sweep.get("nproc-per-node", 1)), extra)
    except SweepError as e:
        if not _absent_input(str(e), [t for r in runs for t in r.flags]):
            raise


def _check_command(cmd: str, monkeypatch, template: bool = False) -> None:
    tokens = shlex.split(cmd.replace("$OUT", "out"))
    script = next(t for t in tokens if re.match(r"launch/\w+(?:/\w+)*\.(?:py|sbatch)$", t))
    before, args = tokens[: tokens.index(script)], tokens[tokens.index(script) + 1 :]
    world = next((int(t.split("=")[1]) for t in before if t.startswith("--nproc-per-node=")), None)
    if world is None and "--nproc-per-node" in before:
        world = int(before[before.index("--nproc-per-node") + 1])
    cuda = False
    if tokens[0] == "sbatch":  # -N nodes of 8 GPUs each (launch/slurm/pretrain.sbatch: one rank per GPU)
        nodes = int(before[before.index("-N") + 1]) if "-N" in before else 1
        world, cuda = nodes * 8, True
    world = world or 1
    own, passthrough = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    if "--help" in own or "-h" in own:  # every launcher's --help is read above (_help_text)
        return None
    if template:  # parsing only: a template's required values are placeholders
        from pretrain.arguments import build_parser
        from pretrain.rl.arguments import build_rl_parser

        if script in TO_PRETRAIN or script == "launch/rl.py":
            (build_rl_parser() if script == "launch/rl.py" else build_parser()).parse_args(own)
            return None
    if script in TO_PRETRAIN:
        return _check_pretrain(own, world, cuda)
    if not script.endswith(".py") or not (REPO / script).is_file():
        assert (REPO / script).is_file(), f"{cmd}: {script} does not exist"
        return None
    name = Path(script).stem
    if name == "rl":
        return _check_rl(own, world)
    _check_launcher(name, args, monkeypatch, elided=template)
    if name == "sweep" and not template:  # every run of the sweep file through its script's validation
        _check_sweep(own, passthrough)
    if passthrough and name in ("sweep", "bench_pretrain", "gradient_error", "scale_target"):
        from pretrain.arguments import build_parser

        build_parser().parse_args(passthrough)  # pretrain.py's flags (the others come from elsewhere)


@pytest.mark.parametrize("where,kind,text", EXAMPLES, ids=[f"{k}:{t[:60]}" for _, k, t in EXAMPLES])
def test_documented_example_is_valid(where, kind, text, monkeypatch):
    try:
        if kind == "command":
            _check_command(text, monkeypatch)
        elif kind == "template" and re.search(r"launch/\w", text):
            _check_command(_fill(text), monkeypatch, template=True)
        elif kind == "rule":
            Rule.parse(text)
        elif kind == "spec":
            parse_precision(text)
        elif kind == "schedule":
            PrecisionSchedule.parse(text)
        elif kind == "rollout_spec":
            parse_rollout(text)
        elif kind == "rollout_rule":
            _rollout_rule_value(text)
        else:
            pytest.skip(f"a template, not an example: {text}")
    except AssertionError:
        raise
    except Exception as e:  # one line naming where the example is
        pytest.fail(f"{where}: {text!r}: {e.__class__.__name__}: {e}")


def test_the_examples_are_found():
    kinds = [k for _, k, _ in EXAMPLES]
    skipped = [t for _, k, t in EXAMPLES if k == "template" and not re.search(r"launch/\w", t)]
    assert len(skipped) <= 5, skipped
    assert kinds.count("command") >= 20 and kinds.count("rule") >= 5 and kinds.count("spec") >= 5
    texts = {t for _, _, t in EXAMPLES}
    for documented in ("kind:mlp=wgrad=mxfp4+had16", "dgrad=fp8_e5m2@fp8_e4m3", "wgrad=mxfp4/sr@mxfp4",
                       "fprop=hif8+delayed(max,64)"):
        assert documented in texts

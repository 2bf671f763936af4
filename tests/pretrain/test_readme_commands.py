"""The README's commands work as written on a fresh machine: the environment they need is named right
after the quick start, every script a command runs exists, and every flag it passes is one that
script takes (``launch/pretrain.py``'s and ``launch/rl.py``'s from their parsers; flags after a bare ``--`` and the arguments
of ``launch/slurm/pretrain.sbatch`` go to ``pretrain.py``; other scripts by their argparse source).
Running the long, GPU and SLURM commands is left to their own tests."""

from __future__ import annotations

import re
import shlex

from pretrain.arguments import build_parser

from ._launch import REPO

TEXT = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])  # README + docs/
PRETRAIN_FLAGS = {o for a in build_parser()._actions for o in a.option_strings}
TO_PRETRAIN = ("launch/pretrain.py", "launch/slurm/pretrain.sbatch")


def _rl_flags() -> set[str]:
    """``launch/rl.py``'s flags: pretraining's parser plus the RL group (``pretrain.rl.arguments``)."""
    from pretrain.rl.arguments import build_rl_parser

    return {o for a in build_rl_parser()._actions for o in a.option_strings}


def commands() -> list[str]:
    """Every command line of the README's ``bash`` blocks (continuations joined, comments cut)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", TEXT, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and t != "--"]


def test_the_environment_is_named_right_after_the_quick_start():
    quick_start = TEXT.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in quick_start


def test_every_readme_command_runs_an_existing_script_with_flags_it_takes():
    makefile = (REPO / "Makefile").read_text()
    checked = 0
    for cmd in commands():
        tokens = shlex.split(cmd)
        if tokens[0] == "make":
            assert re.search(rf"^{tokens[1]}:", makefile, re.MULTILINE), cmd
            continue
        scripts = [t for t in tokens if t.startswith("launch/")]
        if not scripts:
            continue
        script = scripts[0]
        assert (REPO / script).is_file(), cmd
        args = tokens[tokens.index(script) + 1 :]
        passthrough = args[args.index("--") + 1 :] if "--" in args else []
        own = args[: args.index("--")] if "--" in args else args
        if script in TO_PRETRAIN:
            unknown = set(flags(own)) - PRETRAIN_FLAGS
        elif script == "launch/rl.py":
            unknown = set(flags(own)) - _rl_flags()
        else:
            source = (REPO / script).read_text()
            unknown = {f for f in flags(own) if f'"{f}"' not in source}
        unknown |= set(flags(passthrough)) - PRETRAIN_FLAGS
        assert not unknown, f"{cmd}: {sorted(unknown)}"
        checked += 1
    assert checked >= 12  # the README's pretraining, data, sweep, QAT, conversion and benchmark commands

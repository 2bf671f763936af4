"""``--config FILE``: a whole run's flags in one YAML or JSON file, or a checkpoint's ``run_config.json``.

    # run.yaml: every key a flag's name, with '_' or '-'
    model_size: tiny
    train-iters: 100
    precision: wgrad_hadamard
    precision_rule: [first:1=bf16, last:1=bf16]   # a repeatable flag: a list
    sequence_parallel: true                        # a switch: true gives it, false leaves it off
    bf16: false                                    # --bf16 / --no-bf16

    python launch/pretrain.py --config run.yaml --lr 1e-3    # the command line overrides the file

:func:`config_argv` turns the file into command-line tokens parsed by the same parser as the command
line (so every value meets the flag's type, choices and one-line errors), placed before the command
line's own; a flag given on the command line replaces the file's value (a repeatable flag's whole
list too). Precedence: defaults < ``--model-size`` file < ``--config`` file < command line.

A checkpoint's ``iter_*/run_config.json`` (``{"args": ..., "model_config": ..., "tokenizer": ...}``)
loads the same way: its ``args`` are the run's validated flags, so ``--config
ckpt/iter_0000100/run_config.json`` reproduces the run from the checkpoint alone. A
``--tokenizer-model`` that no longer exists becomes the tokenizer copy inside the checkpoint. Values
the run derived are given back as explicit flags (``--global-batch-size``, ``--lr-decay-iters``, ``--ffn-hidden-size``,
and ``--bf16`` / ``--num-workers`` as the device of that run resolved them); the one value that is
no flag, ``pretrained_vocab_size`` (read again from ``--pretrained-checkpoint``), is skipped. Paths
(``--save``, ``--load``, ``--tensorboard-dir``, ``--data-path``) come back as saved: give your own
on the command line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from dataclasses import dataclass

import yaml

from pretrain.config.fields import arg

FLAG = "--config"
SKIPPED_SAVED = ("pretrained_vocab_size",)
"""Keys of a checkpoint's ``run_config.json`` that are derived values, not flags: skipped."""


@dataclass(frozen=True)
class ConfigFileArgs:
    """The ``--config`` flag (group "run configuration file"); read while parsing, never saved."""

    config: str | None = arg(
        "--config", metavar="FILE",
        help="a YAML/JSON file of flags (every key a flag name, with '_' or '-'; lists for repeatable flags, "
        "true/false for switches), or a checkpoint's iter_*/run_config.json to reproduce its run; flags on "
        "the command line override the file")
    """The file whose flags come before the command line's."""


class ConfigFileError(ValueError):
    """A bad ``--config`` file; one line naming the file and the key."""


def read_config_file(path: str) -> tuple[dict, bool]:
    """``(flags mapping, whether it is a checkpoint's run_config.json)`` of ``path``."""
    if not os.path.isfile(path):
        raise ConfigFileError(f"{FLAG}: no such file: {path} (a YAML/JSON mapping of flag names to values, or a "
                              "checkpoint's iter_*/run_config.json)")
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise ConfigFileError(f"{FLAG}: {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'} "
                              f"({first})") from None
    if data is None:
        return {}, False
    if not isinstance(data, dict):
        raise ConfigFileError(f"{FLAG}: {path} must be a mapping of flag names to values (e.g. train_iters: 100)")
    if isinstance(data.get("args"), dict) and "model_config" in data:  # a checkpoint's run_config.json
        args = {k: v for k, v in data["args"].items() if k not in SKIPPED_SAVED}
        tok, saved = data.get("tokenizer"), args.get("tokenizer_model")
        copy = tok and os.path.join(os.path.dirname(os.path.abspath(path)), tok["path"])
        if saved and not os.path.exists(saved) and copy and os.path.exists(copy):
            args["tokenizer_model"] = copy  # the run's tokenizer file is gone: the checkpoint's copy
        return args, True
    return data, False


def _keys(parser: argparse.ArgumentParser) -> dict[str, list[tuple[argparse.Action, str]]]:
    """Key (a long flag without ``--``, or a dest, with ``_`` for ``-``) -> its actions and their flags."""
    out: dict[str, list] = {}
    for a in parser._actions:
        longs = [o for o in a.option_strings if o.startswith("--")]
        if not longs or a.dest in ("help", "config"):
            continue
        for o in longs:
            if isinstance(a, argparse.BooleanOptionalAction) and o.startswith("--no-"):
                continue
            out.setdefault(o[2:].replace("-", "_"), []).append((a, o))
        out.setdefault(a.dest, [])
        if (a, longs[0]) not in out[a.dest]:
            out[a.dest].append((a, longs[0]))
    return out


def _text(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _tokens(key: str, value, actions: list[tuple[argparse.Action, str]], parser, where: str) -> list[str]:
    """The command-line tokens giving ``key: value``."""
    if value is None:
        return []  # the flag's default
    action, flag = actions[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {key}: {value!r}; give true or false ({flag} / --no-{flag[2:]})")
        return [flag] if value else [f"--no-{flag[2:]}"]
    if action.nargs == 0:  # store_true / store_false / store_const, possibly several on one dest
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {key}: {value!r}; give true or false (the switch {flag})")
        if key.replace("-", "_") != action.dest:  # a switch by its own name (disable_bias_linear): true gives it
            return [flag] if value else []
        for a in parser._actions:  # the dest's value: the switch on that dest that stores it
            if a.dest == action.dest and a.nargs == 0 and a.const == value:
                return [next(o for o in a.option_strings if o.startswith("--"))]
        if value == parser.get_default(action.dest):
            return []
        raise ConfigFileError(f"{where}: {key}: {value!r}: no switch of {flag} sets it")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(action, argparse._AppendAction):
        return [t for v in values for t in (flag, _text(v))]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [flag, *map(_text, values)] if values else []
    if isinstance(value, (list, tuple, dict)):
        raise ConfigFileError(f"{where}: {key}: {value!r}; {flag} takes one value")
    return [flag, _text(value)]


def config_argv(parser: argparse.ArgumentParser, path: str, skip: set[str] = frozenset()) -> tuple[list[str], set[str]]:
    """The command-line tokens of the ``--config`` file ``path`` and the dests they set, leaving out the
    dests in ``skip`` (those the command line gives). :class:`ConfigFileError` (one line) for an
    unreadable file or an unknown key (naming the nearest valid one)."""
    data, _ = read_config_file(path)
    keys = _keys(parser)
    where = f"{FLAG} {path}"
    argv, dests = [], set()
    for raw, value in data.items():
        key = str(raw).replace("-", "_")
        if key == "config":
            raise ConfigFileError(f"{where}: config: a config file cannot name another one")
        if key not in keys:
            style = (lambda k: k.replace("_", "-")) if "-" in str(raw) else (lambda k: k)
            near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
            hint = f"did you mean {style(near[0])}?" if near else "keys are flag names (train_iters or train-iters)"
            raise ConfigFileError(f"{where}: unknown key {raw!r}; {hint}")
        actions = keys[key]
        dest = actions[0][0].dest
        if dest in skip:
            continue
        argv += _tokens(str(raw), value, actions, parser, where)
        dests.add(dest)
    return argv, dests

"""A config field that is also a command-line flag; argparse groups generated from config classes.

    @dataclass(frozen=True)
    class TrainingConfig:
        lr: float = arg("--lr", type=float, default=3e-4)
        \"\"\"Peak learning rate, reached at the end of the warm-up.\"\"\"

    add_group(parser, "training", TrainingConfig)      # one add_argument per field, in field order
    cfg = from_namespace(TrainingConfig, args)          # the validated values, frozen

The field's name is the flag's ``dest``; its metadata holds the flag names, the argparse keywords
and the help text (what ``--help`` prints; the docstring under the field is for readers of the code
and may say more). ``help`` and ``choices`` may be callables, evaluated when the parser is built
(e.g. the model-size files present, the format registry's names). ``also`` adds further flags on the
same ``dest`` (``--disable-bias-linear`` storing ``False`` into ``add_bias_linear``). A list default
(``append`` / ``nargs``) is a tuple in the frozen config.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

_NO_DEFAULT = object()


def arg(*flags: str, default: Any = None, help: Any = None, also: tuple = (), **kwargs) -> Any:
    """A dataclass field whose value comes from the flag(s) ``flags`` (argparse keywords ``kwargs``)."""
    frozen_default = tuple(default) if isinstance(default, list) else default
    return dataclasses.field(default=frozen_default,
                             metadata={"flags": flags, "default": default, "help": help, "also": also, "kwargs": kwargs})


def value(default: Any = _NO_DEFAULT, saved: bool = True) -> Any:
    """A dataclass field that no flag sets (a value derived while parsing or validating); ``saved=False``:
    left out of :func:`to_flat_dict` (what checkpoints save), as the flags it derives from are saved."""
    metadata = {"flags": ()} if saved else {"flags": (), "saved": False}
    if default is _NO_DEFAULT:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _resolve(x):
    return x() if callable(x) else x


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flags")]


def add_group(parser: argparse.ArgumentParser, title: str, *classes) -> argparse._ArgumentGroup:
    """An argument group ``title`` with one ``add_argument`` per flag field of ``classes``, in order."""
    group = parser.add_argument_group(title)
    for cls in classes:
        for f in flag_fields(cls):
            md = f.metadata
            kwargs = {k: _resolve(v) if k == "choices" else v for k, v in md["kwargs"].items()}
            if md["help"] is not None:
                kwargs["help"] = _resolve(md["help"])
            if md["default"] is not None:
                kwargs["default"] = list(md["default"]) if isinstance(md["default"], list) else md["default"]
            group.add_argument(*md["flags"], **kwargs)
            for flags, extra in md["also"]:
                group.add_argument(*flags, dest=f.name, **extra)
    return group


def flag_name(name: str) -> str:
    """``hidden_size`` -> ``--hidden-size`` (the flag a field's value came from)."""
    return "--" + name.replace("_", "-")


def from_namespace(cls, ns, **overrides):
    """``cls`` from the attributes of a (validated) argparse Namespace with its fields' names; lists
    become tuples. A flag field the Namespace lacks (a parser of another program) takes its default."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            continue
        if hasattr(ns, f.name):
            v = getattr(ns, f.name)
            values[f.name] = tuple(v) if isinstance(v, list) else v
        elif f.default is dataclasses.MISSING:
            raise AttributeError(f"{cls.__name__}.{f.name}: not in the parsed arguments")
    return cls(**values, **overrides)


def to_flat_dict(cfg) -> dict:
    """A config's fields as one flat ``{dest: value}`` (tuples back to lists: the Namespace's form)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if not f.metadata.get("saved", True):  # derived from the fields that are saved
            continue
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.update(to_flat_dict(v))
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out

"""Local lm-eval tasks from ``configs/eval/*.yaml``, runnable offline.

Each YAML there is an ordinary lm-eval task config (e.g. ``local_python_mc``: 58 multiple-choice
questions on which standard-library module provides what, answered by comparing the
log-likelihoods of the four choices). Its ``dataset_kwargs.data_files`` paths are relative to the
repository root; ``task_config`` makes them absolute so the task runs from any directory.

    resolve_tasks(["local_python_mc", "hellaswag"])
    # -> ([{...local_python_mc config...}, "hellaswag"], needs_builtin=True)

Built-in lm-eval tasks (hellaswag, arc_easy, ...) download their data on first use and need the
network (or a populated HF datasets cache); local tasks never do.
"""

from __future__ import annotations

import glob
import os

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO_ROOT, "configs", "eval")


def _configs() -> dict[str, str]:
    """{task name: yaml path} for every task config in ``configs/eval``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml"))):
        with open(path) as f:
            name = (yaml.safe_load(f) or {}).get("task")
        if name:
            out[name] = path
    return out


def local_task_names() -> list[str]:
    return list(_configs())


def task_config(name: str) -> dict:
    """The lm-eval config dict of local task ``name``, data file paths made absolute."""
    path = _configs().get(name)
    if path is None:
        raise ValueError(f"--tasks: {name!r} is not a local task (local: {', '.join(local_task_names())})")
    with open(path) as f:
        cfg = yaml.safe_load(f)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        files = {split: _abs(p) for split, p in files.items()}
    elif files is not None:
        files = [_abs(p) for p in files] if isinstance(files, list) else _abs(files)
    if files is not None:
        cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": files}
    return cfg


def _abs(path: str) -> str:
    full = path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"local task data file missing: {full}")
    return full


def resolve_tasks(names: list[str]) -> tuple[list[str | dict], bool]:
    """lm-eval task specs for ``names`` (config dicts for local tasks, names otherwise), and
    whether any built-in lm-eval task is needed (building its index takes seconds)."""
    local = set(local_task_names())
    specs: list[str | dict] = [task_config(n) if n in local else n for n in names]
    return specs, any(isinstance(s, str) for s in specs)


def task_manager(needs_builtin: bool):
    """An lm-eval ``TaskManager`` indexing built-in tasks only when needed."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=needs_builtin)

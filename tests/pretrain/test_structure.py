"""The shape of the orchestration code: no import circles through pretrain/, launch/ or model/, modules
short enough to read in one sitting, and RL flags that are config fields (a new one is one edit).

The import graph is read from the source (every ``import`` / ``from ... import`` of a project module,
at the top of a module or inside a function), not from ``sys.modules``, so an import hidden in a
function still counts.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("precision", "kernels", "model", "pretrain", "launch")
OURS = ("model", "pretrain", "launch")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges[m] |= {t for n in names if n.split(".")[0] in PACKAGES and (t := resolve(n)) not in (None, m)}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in edges:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_no_import_circle_runs_through_pretrain_launch_or_model():
    cycles = [c for c in _cycles(_graph(_modules())) if any(m.split(".")[0] in OURS for m in c)]
    assert cycles == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_modules_are_short_enough_to_read_in_one_sitting():
    long = {str(p.relative_to(REPO)): n for m, p in _modules().items() if m.split(".")[0] in OURS
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_rl_flag_is_an_rl_config_field_in_its_own_group():
    """``launch/rl.py``'s "reinforcement learning" group is generated from ``RLConfig``: a flag is a field
    (one edit), and the frozen config saves every RL flag under its dest."""
    from pretrain.rl.arguments import RLConfig, build_rl_parser

    parser = build_rl_parser()
    group = next(g for g in parser._action_groups if g.title == "reinforcement learning")
    dests = {a.dest for a in group._group_actions}
    flag_fields = {f.name for f in dataclasses.fields(RLConfig) if f.metadata.get("flags")}
    assert dests == flag_fields and len(dests) > 20
    assert set(RLConfig().to_dict()) == flag_fields  # derived values are not saved: their flags are
    titles = [g.title for g in parser._action_groups]
    assert titles[-1] == "reinforcement learning" and "precision" in titles

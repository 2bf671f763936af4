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


def _graph(mods: dict[str, Path], packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
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
                # ``from pkg import sub`` of a submodule imports pkg.sub (a name defined in pkg: pkg itself)
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names]
            else:
                continue
            edges[m] |= {t for n in names if n.split(".")[0] in packages and (t := resolve(n)) not in (None, m)}
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


def test_no_import_circle_in_the_project():
    assert _cycles(_graph(_modules())) == []


def test_the_graph_reads_a_submodule_import_as_an_edge_to_the_submodule(tmp_path):
    mods = {"p": tmp_path / "p.py", "p.sub": tmp_path / "sub.py", "p.other": tmp_path / "other.py"}
    mods["p"].write_text("from p.sub import f\n")
    mods["p.sub"].write_text("from p import other\n\ndef f():\n    from p import g\n")
    mods["p.other"].write_text("")
    edges = _graph(mods, packages=("p",))
    assert edges == {"p": {"p.sub"}, "p.sub": {"p.other", "p"}, "p.other": set()}
    assert _cycles(edges) == [["p", "p.sub"]]  # the function-local import of a name in p closes one


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


LAUNCHER_LINES = 150


def test_each_launcher_parses_calls_the_package_and_prints():
    """``launch/*.py`` hold no logic of their own: each at most 150 lines (benchmarks may be longer)."""
    long = {p.name for p in sorted((REPO / "launch").glob("*.py"))
            if not p.name.startswith("bench_") and len(p.read_text().splitlines()) > LAUNCHER_LINES}
    assert long == set()


# Where a parsed Namespace becomes frozen configs; nothing after parsing reads one.
PARSERS = ("pretrain.arguments", "pretrain.rl.arguments", "pretrain.config")


def test_only_the_parsers_freeze_a_namespace():
    """0 Namespace adapters: ``from_namespace`` is called by the parsers only, and ``RunConfig`` has no
    ``of`` that would take a Namespace after parsing."""
    from pretrain.config import RunConfig

    callers = set()
    for m, path in _modules().items():
        if m.split(".")[0] not in OURS or m.startswith(PARSERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == "from_namespace":
                    callers.add(m)
    assert callers == set() and not hasattr(RunConfig, "of")


def _follow_recipe(recipe, g, a, b) -> list[str]:
    """The files, in order, of the frames that hold ``recipe`` or one of its operand formats in their
    locals, from ``kernels.operand.gemm_operands`` on, over one emulated ``kernels.gemm`` call; the
    file a frame returns to counts again (consecutive repeats collapsed)."""
    from kernels.gemm import gemm
    from precision.state import LayerQuantState

    held = {id(recipe), id(recipe.a), id(recipe.b)}
    stack, files, started = [], [], [False]

    def visit(path: str) -> None:
        if not files or files[-1] != path:
            files.append(path)

    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call":
            started[0] = started[0] or (code.co_name == "gemm_operands" and code.co_filename.endswith("operand.py"))
            if started[0] and code.co_filename != "<string>" and any(id(v) in held for v in frame.f_locals.values()):
                stack.append(frame)
                visit(code.co_filename)
                return tracer
            return None
        if event == "return" and stack and frame is stack[-1]:
            stack.pop()
            if stack:
                visit(stack[-1].f_code.co_filename)
        return tracer

    sys.settrace(tracer)
    try:
        gemm(g, a, b, recipe, "emulated", state=LayerQuantState(seed=0, name="layer"))
    finally:
        sys.settrace(None)
    return files


def test_following_a_recipe_returns_to_a_file_it_left_at_most_10_times(monkeypatch):
    """One emulated GEMM of each preset's most involved GEMMs (NVFP4's 2-D weights, MXFP4 under a
    Hadamard, FP8): the recipe goes down the operand pipeline without wandering back and forth. The
    fused quantizers run their eager expression (the same frames; no compile time in a smoke test)."""
    import torch

    from kernels import fused
    from precision import presets
    from precision.recipe import Gemm

    monkeypatch.setattr(fused, "compile_available", lambda: False)
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen) for s in ((32, 64), (48, 64), (32, 48)))
    operands = {Gemm.FPROP: (x, w), Gemm.DGRAD: (dy, w), Gemm.WGRAD: (dy, x)}
    for preset in ("wgrad_hadamard", "nvfp4", "fp8"):
        lp = presets.get(preset)
        for g, (a, b) in operands.items():
            files = _follow_recipe({Gemm.FPROP: lp.fprop, Gemm.DGRAD: lp.dgrad, Gemm.WGRAD: lp.wgrad}[g], g, a, b)
            returns = sum(f in files[:i] for i, f in enumerate(files))
            assert files and files[0].endswith("operand.py") and returns <= 10, (preset, g, files)

"""The sweep library's layout: ``pretrain.sweep``'s modules stay small, import one way (never from
``launch``, and within the package cli -> report -> plots / results / runner -> spec -> claims -> results), and ``launch/sweep.py``
is a thin entry point whose names are the library's own objects."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "pretrain" / "sweep"
# which of the package's modules each module may import
ALLOWED = {"claims": {"results"}, "spec": {"claims"}, "runner": {"spec"}, "results": set(), "plots": set(),
           "report": {"claims", "plots", "results", "runner", "spec"},
           "cli": {"report", "results", "runner", "spec"}, "__init__": set()}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_each_module_is_small_and_imports_one_way(name):
    path = PKG / f"{name}.py"
    assert path.is_file(), path
    assert len(path.read_text().splitlines()) <= 600
    imports = _imports(path)
    assert not {m for m in imports if m == "launch" or m.startswith("launch.")}, imports
    inner = {m.split(".")[2] for m in imports if m.startswith("pretrain.sweep.")}
    assert inner <= ALLOWED[name], (name, inner)


def test_the_entry_point_is_thin_and_reexports_the_library(monkeypatch):
    from pretrain.sweep import plots, report, results, runner, spec

    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import sweep

    assert len((ROOT / "launch" / "sweep.py").read_text().splitlines()) <= 250
    for mod in (spec, runner, results, report, plots):
        for name in mod.__all__:
            if name in sweep.__all__:
                assert getattr(sweep, name) is getattr(mod, name), name
    assert sweep.collect.__module__ == "pretrain.sweep.report"
    assert sweep.Run is spec.Run and sweep.SweepError is spec.SweepError

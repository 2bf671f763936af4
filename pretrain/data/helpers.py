"""megatron-core's compiled dataset helpers (``megatron.core.datasets.helpers_cpp``).

GPTDataset builds its sample index with this C++ extension. The megatron-core 0.16 wheels on PyPI
ship it prebuilt (``helpers_cpp.cpython-3XX-<platform>.so``), so normally there is nothing to do.
An install without it (a source build, an unusual platform) has no Makefile to run either —
``megatron.core.datasets.utils.compile_helpers()`` calls ``make`` on a directory without one — so
we compile ``helpers.cpp`` ourselves with the system C++ compiler and pybind11 into a cache
directory and register the result under megatron's module name. The compile runs once, under a
file lock, so concurrent ranks do not race.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

_MODULE = "megatron.core.datasets.helpers_cpp"


def ensure_dataset_helpers(build_dir: str | None = None) -> str:
    """Make ``megatron.core.datasets.helpers_cpp`` importable; returns the extension's path.

    Compiles into ``build_dir`` when the installed megatron-core lacks the prebuilt extension.
    """
    try:
        from megatron.core.datasets import helpers_cpp

        return helpers_cpp.__file__
    except ImportError as err:
        reason = str(err)
    if build_dir is None:
        raise RuntimeError(
            f"megatron-core's dataset helpers do not import ({reason}); give a build_dir to compile them"
        )
    return compile_dataset_helpers(build_dir)


def compile_dataset_helpers(build_dir: str) -> str:
    """Compile megatron's ``helpers.cpp`` into ``build_dir`` (once) and register it as ``helpers_cpp``."""
    import megatron.core.datasets as mcd

    source = os.path.join(os.path.dirname(mcd.__file__), "helpers.cpp")
    target = os.path.join(build_dir, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, ".compile.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(target):
            _compile(source, target)
    spec = importlib.util.spec_from_file_location(_MODULE, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_MODULE] = module
    mcd.helpers_cpp = module
    return target


def _compile(source: str, target: str) -> None:
    try:
        import pybind11
    except ImportError:
        raise RuntimeError(
            "megatron-core's dataset helpers are not prebuilt here and pybind11 is missing: "
            "`pip install pybind11` (and have a C++ compiler), or install a megatron-core wheel for this platform"
        ) from None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError(
            "megatron-core's dataset helpers are not prebuilt here and no C++ compiler (c++/g++) is on PATH"
        )
    tmp = f"{target}.tmp{os.getpid()}"
    cmd = [
        compiler, "-O3", "-shared", "-std=c++17", "-fPIC",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        source, "-o", tmp,
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling megatron's helpers.cpp failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    os.replace(tmp, target)

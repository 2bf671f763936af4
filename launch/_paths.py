"""The repository root first on ``sys.path``, for a launcher run as a script.

``python launch/sweep.py ...`` (and ``torchrun launch/pretrain.py ...``, which starts
``python launch/pretrain.py``) puts the script's folder, ``launch/``, at ``sys.path[0]``. There
``launch/pretrain.py`` shadows the ``pretrain`` package: ``import pretrain`` would find the launcher,
not the package. So every launcher, run as a script, first imports this module -- found because
``launch/`` is ``sys.path[0]`` -- which puts the repository root at the front of ``sys.path``, ahead
of ``launch/``: the repository's packages (``pretrain``, ``precision``, ``kernels``, ``model``) are
found whether or not they are installed, the launchers stay importable by their bare names
(``import sweep``) from behind it, and the users' commands stay as they are.

Each launcher does it in the same two lines, before its first import from the repository::

    if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
        import _paths  # noqa: F401

Imported as a module of the ``launch`` package (``from launch.generate import main``,
``launch.sweep`` from ``launch/search_plan.py``), a launcher has a ``__package__`` and the
repository root is already on ``sys.path``: nothing is changed.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

if not sys.path or not sys.path[0] or os.path.realpath(sys.path[0]) != ROOT:
    sys.path.insert(0, ROOT)

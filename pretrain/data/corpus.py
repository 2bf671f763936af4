"""The built-in corpus: the Python standard library's own sources, one document per ``.py`` file.

It needs no network and no download: every interpreter ships it. What goes in, deterministically
for a given interpreter:

- every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, except directories named in
  ``SKIP_DIRS`` (test suites, ``site-packages``, byte-code caches, and ``encodings``, whose codec
  modules are mostly generated character tables) and files that are not valid UTF-8;
- files are taken in the order of ``sha1(relative path)``; a file that would push the total past
  the size cap is left out, so a small cap still gets a spread of modules;
- a file goes to validation when ``sha1("valid:" + relative path)`` maps below ``valid_fraction``
  (at least one file always does), to train otherwise. The split is by file, so the two are
  disjoint, and a file keeps its split when the cap changes.

Python 3.11's standard library gives about 10.7 MB of text (about 3.3 M tokens with the default
4096-token vocabulary); the default cap takes all of it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings"})
DEFAULT_MAX_MB = 32.0
DEFAULT_VALID_FRACTION = 0.02


@dataclass(frozen=True)
class Document:
    path: str  # relative to the standard library root, "/"-separated
    text: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _unit_hash(key: str) -> float:
    """A deterministic value in [0, 1) for ``key``."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2.0**64


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the candidate ``.py`` files, sorted."""
    root = root or stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if name.endswith(".py"):
                paths.append(name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/"))
    return sorted(paths)


def stdlib_corpus(
    max_mb: float = DEFAULT_MAX_MB,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    root: str | None = None,
) -> tuple[list[Document], list[Document]]:
    """The (train, valid) documents of the built-in corpus, each list sorted by path."""
    if max_mb <= 0:
        raise ValueError(f"default corpus: max_mb must be > 0, got {max_mb}")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"default corpus: valid_fraction must be in (0, 1), got {valid_fraction}")
    root = root or stdlib_root()
    budget = int(max_mb * 1e6)
    taken: list[Document] = []
    for rel in sorted(stdlib_files(root), key=lambda p: hashlib.sha1(p.encode()).digest()):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        if len(raw) > budget or not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        taken.append(Document(rel, text))
        budget -= len(raw)
    if len(taken) < 2:
        raise ValueError(f"default corpus: max_mb={max_mb} holds {len(taken)} file(s) of {root}; need >= 2")

    valid_score = {d.path: _unit_hash("valid:" + d.path) for d in taken}
    valid_paths = {p for p, u in valid_score.items() if u < valid_fraction}
    if not valid_paths:
        valid_paths = {min(valid_score, key=valid_score.get)}
    if len(valid_paths) == len(taken):
        valid_paths.discard(max(valid_paths, key=valid_score.get))
    train = sorted((d for d in taken if d.path not in valid_paths), key=lambda d: d.path)
    valid = sorted((d for d in taken if d.path in valid_paths), key=lambda d: d.path)
    return train, valid

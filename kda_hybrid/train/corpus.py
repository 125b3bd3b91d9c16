"""The training text every machine with Python has, and the only text the project trains on besides what a teacher
generates (the data rule of docs/records/smollm2/README.md): the standard library's own sources (test suites, encodings'
generated tables and installed packages left out) and the documentation topics of `pydoc_data`. A file is held out
for validation by the hash of its path, so the split does not depend on which files exist.

    from kda_hybrid.train.corpus import corpus_files, is_validation, read_text, stdlib_root

    root = stdlib_root()
    train = [f for f in corpus_files(root) if not is_validation(f.relative_to(root).as_posix())]

Not a module a checkpoint carries: nothing in the modeling code imports it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Test suites are two thirds of the stdlib by size and mostly boilerplate (idlelib and lib2to3 carry their own);
# encodings/ is 1.4 MB of generated charmap tables.
SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
VAL_PERCENT = 2  # files whose path hash falls in the first 2% are held out (about 12 files, 200 KB for 3.11)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, pattern: str = "**/*.py") -> list[Path]:
    files = (f for f in root.glob(pattern) if f.is_file() and not SKIP_PARTS & set(f.relative_to(root).parts))
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def is_validation(rel_path: str) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # a handful of stdlib files are latin-1 test fixtures; not worth learning
        return None


PYDOC_TOPICS = "pydoc_data/topics.py"


def pydoc_documents() -> list[tuple[str, str]]:
    """(name, text) of every topic of the documentation text Python ships (pydoc_data.topics: the reference
    manual's sections behind help('TOPIC')), in sorted order."""
    from pydoc_data.topics import topics

    return [(f"pydoc_data/topics/{key}", text) for key, text in sorted(topics.items()) if text.strip()]

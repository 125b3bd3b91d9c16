"""Import paths of the previous release that moved, kept importable for one more release.

`import kda_hybrid.trainer` (or `from kda_hybrid.trainer import train`) still works: it warns once with a
DeprecationWarning naming the new path, and the module it gives forwards every attribute to the new module(s), so
patching or reading a name there reads the real one. Remove an entry (and, when the table is empty, this module)
in the release after the one that announced the move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module path -> the module(s) that now hold its names, searched in order
MOVED: dict[str, tuple[str, ...]] = {
    "kda_hybrid.long_context": ("kda_hybrid.inference.long_context",),
    "kda_hybrid.training": ("kda_hybrid.train.data",),
    "kda_hybrid.trainer": ("kda_hybrid.train.loop",),
    "kda_hybrid.shapes": ("kda_hybrid.bench.shapes",),
    "kda_hybrid.benchmarking": ("kda_hybrid.bench.report", "kda_hybrid.bench.native"),
    "kda_hybrid.model_card_kda_hybrid": ("kda_hybrid.checkpoint_kda_hybrid",),
    "kda_hybrid.kda_stages": ("kda_hybrid.kda_triton_twins",),
}


def _user_stacklevel() -> int:
    """The warnings.warn stacklevel of the line that wrote the import (an import statement, or a call of
    importlib.import_module), so that the default filters show the warning in a user's own code. warnings itself
    skips the frozen import machinery's frames when it counts; every other frame counts."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen importlib") or name == __file__
                or frame.f_globals.get("__name__") == "importlib"):
            return level
        level += not name.startswith("<frozen importlib")
        frame = frame.f_back
    return 1


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, targets: tuple[str, ...]):
        self.targets = targets

    def create_module(self, spec):
        return None  # a plain new module, filled in by exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        new = " and ".join(self.targets)
        warnings.warn(f"{module.__name__} moved to {new}; import it from there (the old path goes in the next "
                      "release)", DeprecationWarning, stacklevel=_user_stacklevel())
        modules = [importlib.import_module(t) for t in self.targets]

        def __getattr__(name: str):
            for m in modules:
                if hasattr(m, name):
                    return getattr(m, name)
            raise AttributeError(f"module {module.__name__!r} (moved to {new}) has no attribute {name!r}")

        def __dir__():
            return sorted({n for m in modules for n in dir(m)})

        module.__getattr__ = __getattr__
        module.__dir__ = __dir__
        if all(hasattr(m, "__all__") for m in modules):
            module.__all__ = [n for m in modules for n in m.__all__]


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds only the old paths in MOVED, after every regular finder has failed to."""

    def find_spec(self, fullname, path=None, target=None):
        targets = MOVED.get(fullname)
        if targets is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(targets))


def install() -> None:
    """Append the finder to sys.meta_path once (kda_hybrid/__init__.py calls this)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

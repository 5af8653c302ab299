"""course_utils: the package behind the course notebooks.

Every number a notebook shows is computed here (memory, comm, plan) or measured by a run
started here (launch, train). One concept per module; each public function names the
notebook that introduces it. Import cost is kept low: submodules are loaded on first use.
"""

from __future__ import annotations

import importlib
import pkgutil

__version__ = "0.1.0"

#: Every module and subpackage of the package, read from its folder (so a new room needs no entry here).
_SUBMODULES = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'course_utils' has no attribute {name!r}")

"""course_utils: the package behind the course notebooks.

Every number a notebook shows is computed here (memory, comm, plan) or measured by a run
started here (launch, train). One concept per module; each public function names the
notebook that introduces it. Import cost is kept low: submodules are loaded on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = {
    "errors",
    "units",
    "strategies",
    "memory",
    "comm",
    "plan",
    "launch",
    "dist",
    "models",
    "data",
    "instrument",
    "loop",
    "train",
    "ddp",
    "zero",
    "fsdp",
    "checkpoint",
    "checkpoint_files",
    "checkpoint_state",
    "failures",
    "recovery",
    "background",
    "namespaces",
    "stepper",
    "widgets",
    "plots",
    "predict",
    "rehearse",
    "bench",
    "examples",
    "labs",
    "compat",
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'course_utils' has no attribute {name!r}")

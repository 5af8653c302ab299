"""Input checks the command line runs before anything starts (introduced in notebook 00).

Each check raises ``CourseInputError`` with one sentence that names the flag and the fix;
``course_utils.cli`` turns it into one line on stderr and exit status 2. They run in the
process that parses the arguments, before a worker starts: an error raised inside a worker
reaches the user as a launch failure, after the cost of a launch.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from .errors import CourseInputError

#: The largest whole number a flag may take: torch and the arithmetic work in 64-bit integers.
INT64_MAX = 2**63 - 1


def flag(dest: str) -> str:
    """``bucket_cap_mb`` -> ``--bucket-cap-mb``: the flag an argparse destination came from (notebook 00)."""
    return "--" + dest.replace("_", "-")


def check_numbers(args) -> None:
    """Every number parsed from the command line is finite and fits in 64 bits (notebook 00).

    argparse's ``type=float`` accepts ``nan`` and ``inf``, and ``type=int`` any number of digits;
    no flag of the course means either.
    """
    for dest, value in sorted(vars(args).items()):
        if dest.startswith("_") or isinstance(value, bool):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise CourseInputError(f"{flag(dest)} must be a finite number, got {v}")
            if isinstance(v, int) and not -INT64_MAX <= v <= INT64_MAX:
                raise CourseInputError(
                    f"{flag(dest)} is too large ({len(str(abs(v)))} digits); "
                    f"it must fit in 64 bits (at most {INT64_MAX})"
                )


def finite_result(name: str, value: float) -> float:
    """Refuse a result that overflowed to inf (or nan): the inputs were beyond what the formula can hold (notebook 01)."""
    if not math.isfinite(value):
        raise CourseInputError(f"{name} overflows ({value}); use smaller numbers")
    return value


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_dir(name: str, path) -> Path:
    """A folder that exists or can be created, and can be written to (notebook 06)."""
    p = Path(path)
    if str(path).strip() == "":
        raise CourseInputError(f"{name} is empty; give a folder, e.g. runs/demo")
    if p.exists() and not p.is_dir():
        raise CourseInputError(f"{name} {path} is a file, not a folder; give a folder (it is created if missing)")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise CourseInputError(f"{name} {path}: {base} is a file, so the folder cannot be created; give another path")
    try:  # try it: permission bits say nothing for root, nor on a read-only filesystem
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=base))
    except OSError as exc:
        raise CourseInputError(
            f"{name} {path}: cannot write in {base} ({exc.strerror}); give a folder you can write to"
        ) from None
    return p


def writable_file(name: str, path) -> Path:
    """A file path whose folder exists (or can be created) and is writable, and that is not a folder (notebook 02)."""
    p = Path(path)
    if str(path).strip() == "" or p.is_dir():
        raise CourseInputError(
            f"{name} {path!r} is {'a folder' if p.is_dir() else 'empty'}; give a file path, e.g. weights.pt"
        )
    writable_dir(name, p.parent if str(p.parent) else ".")
    if p.exists() and not os.access(p, os.W_OK):
        raise CourseInputError(f"{name} {path}: the file exists and is not writable; give another path")
    return p


def not_empty(name: str, text) -> None:
    """A text flag that was given must say something: ``--params ''`` is a typo, not the default (notebook 05b)."""
    if text is not None and not str(text).strip():
        raise CourseInputError(f"{name} is empty; give a value or leave the flag out")


#: The largest parameter count the calculators accept: a billion billion, far beyond any model;
#: beyond it the tables' bytes no longer print (1e40 parameters broke the formatting).
MAX_PARAMS = 1e18


def params_count(name: str, text) -> float:
    """``units.parse_count``, bounded by ``MAX_PARAMS`` (notebook 01)."""
    from .units import parse_count

    value = parse_count(text, name=name)
    if value > MAX_PARAMS:
        raise CourseInputError(
            f"{name}: {text} parameters is beyond what the tables can show; use at most {MAX_PARAMS:.0e}"
        )
    return value

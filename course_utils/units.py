"""Counts and byte units, kept apart and labelled (introduced in notebook 01).

The ZeRO paper reports memory in GB = 10^9 bytes; PyTorch's memory statistics and GPU
spec sheets often mean GiB = 2^30 bytes. The course never mixes them: every formatted
number carries its unit.
"""

from __future__ import annotations

import math
import re
import statistics

from .errors import CourseInputError

GB = 10**9
GiB = 2**30
MB = 10**6
MiB = 2**20

_COUNT_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_BYTE_SUFFIX = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


def parse_count(text: str | float | int, *, name: str = "value") -> float:
    """Parse a parameter count such as ``7.5B``, ``350M``, ``1T``, ``70e9`` (notebook 01).

    Suffixes: K = 10^3, M = 10^6, B (or G) = 10^9, T = 10^12. Raises CourseInputError,
    naming ``name``, for anything else or for a count that is not positive.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]?)", str(text).strip())
        suffix = m.group(2).upper() if m else None
        if not m or suffix not in _COUNT_SUFFIX:
            raise CourseInputError(
                f"{name}: cannot read {text!r}; write a number with an optional K, M, B or T "
                "suffix, for example 7.5B, 350M, 1T or 7.5e9"
            )
        value = float(m.group(1)) * _COUNT_SUFFIX[suffix]
    if not math.isfinite(value) or value <= 0:
        raise CourseInputError(f"{name}: must be a positive number, got {text!r}")
    return value


def parse_bytes(text: str | float | int, *, name: str = "value", default_unit: str = "GB") -> float:
    """Parse a memory size such as ``80GB``, ``141 GB``, ``24GiB`` or ``32`` (notebook 01).

    A bare number is read in ``default_unit``. GB means 10^9 bytes, GiB 2^30 bytes.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text) * _BYTE_SUFFIX[default_unit.upper()]
    else:
        m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", str(text).strip())
        unit = (m.group(2).upper() or default_unit.upper()) if m else None
        if not m or unit not in _BYTE_SUFFIX:
            raise CourseInputError(
                f"{name}: cannot read {text!r}; write a size such as 80GB (10^9 bytes) or 24GiB (2^30 bytes)"
            )
        value = float(m.group(1)) * _BYTE_SUFFIX[unit]
    if not math.isfinite(value) or value <= 0:
        raise CourseInputError(f"{name}: must be a positive size, got {text!r}")
    return value


def fmt_bytes(n: float, unit: str = "GB", digits: int = 2) -> str:
    """Format a byte count in one named unit, e.g. ``fmt_bytes(31.4e9) == '31.40 GB'`` (notebook 01)."""
    scale = _BYTE_SUFFIX[unit.upper()]
    return f"{n / scale:.{digits}f} {unit}"


def fmt_count(n: float) -> str:
    """Format a parameter count the way papers do: 7.5B, 350M, 1T (notebook 01)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:g}{suffix}"
    return f"{n:g}"


def fmt_sig3(x: float) -> str:
    """Three significant figures, never scientific notation: 4,798 and 0.616, not 4.8e+03 (notebook 05's planner)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fmt_size(n: float, digits: int = 3) -> str:
    """A byte count in the largest decimal unit that keeps it at 1 or more, ``digits`` significant digits:
    ``fmt_size(8.48e12) == '8.48 TB'``, ``fmt_size(31.4e9) == '31.4 GB'`` (the readouts of notebook 01's widgets).

    Never scientific notation: a readout showed "8.48e+03 GB" before this existed.
    """
    units = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
    for i, (unit, scale) in enumerate(units):
        if abs(n) >= scale:
            text = f"{n / scale:.{digits}g}"
            if "e" in text or abs(float(text)) >= 1000:  # 999.96 GB rounds to 1000: say 1 TB; past 999 TB group digits
                if i:
                    return f"{n / units[i - 1][1]:.{digits}g} {units[i - 1][0]}"
                return f"{n / scale:,.0f} {unit}"
            return f"{text} {unit}"
    return f"{n:,.0f} bytes"


def spread(values) -> dict:
    """``{"min", "median", "max", "n"}`` of a list of numbers (README, Benchmarks; notebook 05's all-gather timings).

    Here, with the bytes, rather than beside the observers: the planner's host fit and ``make bench`` need it
    without importing torch."""
    values = [float(v) for v in values]
    if not values:
        raise CourseInputError("no values to summarise: the runs it needs did not happen")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}

"""The one exception type for bad input (introduced in notebook 00).

A `CourseInputError` always says what was wrong and what to do instead. The command line
turns it into one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations


class CourseInputError(ValueError):
    """Bad input to a course function, the CLI or a notebook parameter (notebook 00)."""


def require(condition: bool, message: str) -> None:
    """Raise `CourseInputError(message)` unless `condition` holds (notebook 00)."""
    if not condition:
        raise CourseInputError(message)

"""Exercises for notebooks 01 to 06: the student builds the mechanism, real ranks check it.

``check(notebook, name, fn)``, ``show_hint(notebook, name, n)``, ``load_solution(notebook, name)``;
one module per notebook (``nb01`` ... ``nb06``) registers that notebook's exercises, ``core`` holds
the checking machinery, ``solutions`` the reference solutions (installed with the package), and
``grading`` grades a class, each notebook sealed (``seal``; ``python -m course_utils exercises --grade``).
"""

from .core import Outcome, check, exercises, get, load_solution, passed, show_hint

__all__ = ["Outcome", "check", "exercises", "get", "load_solution", "passed", "show_hint"]

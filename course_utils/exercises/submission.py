"""A student's notebook read as data, before anything in it runs (issue 29; the grader is ``grading``).

Which course notebook it is, whose it is, which cells are the student's (every code cell but the notebook's own
lecture: the cells whose ids ``NN-...`` the course gave them), the lecture's imports (run first, so the student's
functions see the names they saw in the notebook), and what each exercise's name is bound to in the student's
cells: a ``def``, a call of ``load_solution``, an assignment, an import, nothing. Nothing here executes the
notebook: cells are parsed (IPython's text transform, then ``ast``), never run.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CourseInputError
from . import core

MAX_NOTEBOOK_BYTES = 64 << 20


class NotGradable(Exception):
    """The file is not something the grader can grade (not a notebook, not a course notebook)."""


# ---------------------------------------------------------------------------------------------
# Reading a submission (as data; nothing in it runs here)
# ---------------------------------------------------------------------------------------------


@dataclass
class Submission:
    path: Path
    raw: bytes
    notebook: str
    student: str
    cells: list  # (position, id, source) of every code cell, in order
    metadata: dict


def _python(source: str) -> str:
    """A cell's source as plain Python (IPython's own text transform: magics become calls; nothing runs)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _parse(source: str):
    try:
        return ast.parse(_python(source))
    except (SyntaxError, ValueError, RecursionError):
        return None


def which_notebook(cells: list, path: Path) -> str | None:
    """The course notebook this is: from its exercise cells' ids, its check calls, or its file name."""
    for pattern in (r"(\d\d)-ex-", r"(\d\d)-"):
        found = [m.group(1) for _, cid, _ in cells if (m := re.match(pattern, cid or ""))]
        found = [nb for nb in found if nb in core.NOTEBOOKS]
        if found:
            return max(set(found), key=found.count)
    calls = [m.group(1) for _, _, src in cells for m in re.finditer(core.CHECK_CALL, src)]
    if calls:
        return max(set(calls), key=calls.count)
    m = re.match(r"(\d\d)[_-]", path.name)
    return m.group(1) if m and m.group(1) in core.NOTEBOOKS else None


def read_submission(path, *, notebook: str | None = None, names: str = "file") -> Submission:
    """Read a student's notebook as data: its cells, which course notebook it is, the student's name."""
    import nbformat

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise NotGradable(f"cannot read {path} ({exc.strerror})") from None
    if size > MAX_NOTEBOOK_BYTES:
        raise NotGradable(f"{path.name} is {size / 2**20:.0f} MiB; a notebook over 64 MiB is not graded")
    raw = path.read_bytes()
    try:
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
    except Exception as exc:
        raise NotGradable(f"{path.name} is not a readable notebook ({type(exc).__name__})") from None
    cells = [
        (i + 1, str(c.get("id", "")), c.source if isinstance(c.source, str) else "".join(c.source))
        for i, c in enumerate(nb.cells)
        if c.get("cell_type") == "code"
    ]
    nb_id = core._nb(notebook) if notebook else which_notebook(cells, path)
    if nb_id is None:
        raise NotGradable(
            f"{path.name} is not a course notebook with exercises (no exercise cells, no check calls, no NN_ "
            "in its name); give --notebook NN if it is one"
        )
    return Submission(path, raw, nb_id, student_name(path, dict(nb.metadata), names), cells, dict(nb.metadata))


def student_name(path: Path, metadata: dict, names: str) -> str:
    """The student's name: the file's name (default), or ``names="metadata:KEY"`` (a dotted key of the
    notebook's metadata, e.g. ``course.student``), falling back to the file's name when it is missing."""
    if names.startswith("metadata:"):
        value = metadata
        for part in names.split(":", 1)[1].split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and value.strip():
            return value.strip()[:100]
    return path.stem


@dataclass
class Binding:
    """What the student's cells bind an exercise's name to (the last binding wins, as when they run)."""

    kind: str = ""  # "def", "assign", "import" or "" (not bound in any cell the grader can read)
    cell: int = 0
    node: object = None
    solution_cell: int = 0  # a cell that calls load_solution for this exercise (0: none)


def student_cells(sub: Submission) -> tuple[list, list[str]]:
    """The cells the grader runs (the student's: every code cell but the lecture's) and the lecture cells'
    imports (run first, so the student's functions see the names they saw in the notebook)."""
    lecture = re.compile(rf"{sub.notebook}-(?!ex-)")
    run, imports = [], []
    for position, cid, source in sub.cells:
        if not lecture.match(cid):
            run.append((position, source))
            continue
        tree = _parse(source)
        for node in tree.body if tree else []:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(ast.unparse(node))
    return run, imports


def bindings(cells: list, exercises: list) -> dict[str, Binding]:
    """For each exercise, what the cells bind its name to, and whether one calls ``load_solution`` for it."""
    out = {ex.name: Binding() for ex in exercises}
    wanted = {(ex.notebook, ex.name) for ex in exercises}
    for position, source in cells:
        tree = _parse(source)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called(node.func) == "load_solution" and len(node.args) >= 2:
                args = [a.value if isinstance(a, ast.Constant) else None for a in node.args[:2]]
                key = (str(args[0]).zfill(2), args[1])
                if key in wanted:
                    out[key[1]].solution_cell = position
        for node in tree.body:
            for name, kind in _binds(node):
                if name in out:
                    out[name].kind, out[name].cell, out[name].node = kind, position, node
    return out


def _called(func) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _binds(node) -> list[tuple[str, str]]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(node.name, "def")]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [((a.asname or a.name).split(".")[0], "import") for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    names = []
    for t in targets:
        for n in ast.walk(t) if t is not None else ():
            if isinstance(n, ast.Name):
                names.append((n.id, "assign"))
    return names


def _shape(node) -> str:
    """A function's code with its docstring and name left out: what "the same source" compares."""
    node = ast.parse(ast.unparse(node)).body[0]
    node.name = "_"
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        node.body = body[1:] or [ast.Pass()]
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def same_as_reference(ex, binding: Binding) -> bool:
    """True when the student's ``def`` is the reference solution's, up to its docstring, comments and layout."""
    import inspect
    import textwrap

    if binding.kind != "def":
        return False
    try:
        reference = ast.parse(textwrap.dedent(inspect.getsource(core.solution(ex.notebook, ex.name)))).body[0]
    except (CourseInputError, OSError, TypeError):
        return False
    return _shape(binding.node) == _shape(reference)

"""Append (or refresh) the "Exercises" section at the end of notebooks 01-06 from the registry.

Each exercise's task, stub and check cell come from its ``Exercise`` record in
``course_utils/exercises/nbNN.py`` (one fact, one place): run this after editing a record::

    python -m tools.exercise_cells            # every notebook with exercises
    python -m tools.exercise_cells 02         # one notebook

Only cells whose id starts with ``NN-ex-`` are replaced; the rest of the notebook is untouched.
A module's ``AFTER_CHECK`` ({exercise name: [(kind, source, slide), ...]}) adds cells right after that
exercise's check and hints: what the student should read only once the check has run. The answer to the
task's Predict goes in the record's ``after_pass`` instead: the check shows it under a pass, never before.
Slides: the task is a slide, the stub and the check stay out of the deck (the task, not the solution).
The teacher's notes (how to run the exercises with a class, what each check compares) are written as
notes cells and moved into cell metadata by ``tools/editions.py`` (the student's notebook holds none).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from course_utils.exercises import core
from tools import editions

ROOT = Path(__file__).resolve().parent.parent


def _cell(kind: str, cid: str, source: str, slide: str | None = None) -> dict:
    cell = {"cell_type": kind, "id": cid, "metadata": {}, "source": source.strip("\n")}
    if slide:
        cell["metadata"]["slideshow"] = {"slide_type": slide}
    if kind == "code":
        cell["execution_count"] = None
        cell["outputs"] = []
    return cell


def section(nb: str) -> list[dict]:
    """The cells of notebook ``nb``'s Exercises section."""
    module = importlib.import_module(f"course_utils.exercises.nb{nb}")
    exs = core.exercises(nb)
    n = [0]

    def cid() -> str:
        n[0] += 1
        return f"{nb}-ex-{n[0]:02d}"

    # The slide: the heading, one line and the list; how checks and hints work goes in its speaker notes
    # (issue 23: a slide carries the point). The notes cell's id is outside the numbering, so adding it
    # renumbered nothing.
    cells = [
        _cell(
            "markdown",
            cid(),
            "## Exercises: build it yourself\n\n"
            + "Each exercise gives a task, a stub to fill in and a check cell that compares your code with "
            "the course's reference.\n\n" + "\n".join(f"- **{nb}.{ex.name}**: {ex.title}" for ex in exs),
            "slide",
        ),
        _cell(
            "markdown",
            f"{nb}-ex-notes",
            "Before anyone writes code, ask the room for the answer each task asks to predict: the check "
            "compares the code with the reference, the prediction is theirs to compare. A check answers in a "
            "few seconds; until a stub is filled in it says *not done*.",
            "notes",
        ),
        _cell(
            "code",
            cid(),
            "from course_utils.exercises import check, load_solution, show_hint  # noqa: F401 (yours to call)",
        ),
    ]
    for kind, source, slide in getattr(module, "EXTRA_CELLS", ()):
        cells.append(_cell(kind, cid(), source, slide))
    for i, ex in enumerate(exs, 1):
        cells += [
            _cell("markdown", cid(), f"### Exercise {nb}.{i}: {ex.title}\n\n{ex.task}", "slide"),
            _cell("code", cid(), ex.stub, "skip"),
            _cell("code", cid(), f'check("{nb}", "{ex.name}", {ex.name})', "skip"),
            _cell(
                "code",
                cid(),
                f"# Stuck? Uncomment one line at a time.\n"
                f"# show_hint({nb!r}, {ex.name!r}, 1)\n"
                f"# {ex.name} = load_solution({nb!r}, {ex.name!r})",
                "skip",
            ),
            _cell("markdown", cid(), f"What the check compares: {ex.checks}.", "notes"),
        ]
        # what a student reads once the check ran (the module's AFTER_CHECK); ids outside the numbering
        for j, (kind, source, slide) in enumerate(getattr(module, "AFTER_CHECK", {}).get(ex.name, ()), 1):
            cells.append(_cell(kind, f"{nb}-ex-{ex.name}-after-{j}", source, slide))
    editions.convert(section := {"cells": cells})  # notes cells into the metadata of the cell before them
    return section["cells"]


def notebook_path(nb: str) -> Path:
    return next((ROOT / "notebooks").glob(f"{nb}_*.ipynb"))


def write(nb: str) -> Path:
    path = notebook_path(nb)
    data = json.loads(path.read_text())
    data["cells"] = [c for c in data["cells"] if not str(c.get("id", "")).startswith(f"{nb}-ex-")] + section(nb)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv or [nb for nb in core.NOTEBOOKS if core.exercises(nb)]
    for nb in chosen:
        print(f"wrote {write(nb).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

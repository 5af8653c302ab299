"""Execute every notebook with papermill, with its CI parameters (a second configuration): `make test-configs`.

`make test` runs every notebook once, with its defaults, through nbval (the student's edition, as a
student runs it); here each notebook runs with the `ci_parameters` stored in its metadata (for example
another world size) as the teacher's edition the build runs (tools/editions.py: each computed speaker
note filled in after its cell), so both configurations and both editions are exercised. The run then
checks both editions: every slide of the deck has notes a teacher can glance at, filled in from this
run; the student's outputs hold no teacher text; no prediction shows what its cells compute.
Executed copies go to build/test-notebooks/, never notebooks/.

This run builds the live widgets (``COURSE_HEADLESS`` unset in the kernel, as in JupyterLab or
Colab), so a widget that raises for the values a notebook passes fails CI; the nbval run covers the
headless path. It costs no extra run: the widgets are built in the kernel with no browser attached.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from tools import build_course as bc  # noqa: E402
from tools import editions as ed  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _ci_parameters(path):
    return json.loads(path.read_text())["metadata"].get("course", {}).get("ci_parameters", {})


@pytest.mark.notebook
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if _ci_parameters(p)], ids=lambda p: p.name)
def test_notebook_runs_with_ci_parameters(path, monkeypatch):
    monkeypatch.delenv("COURSE_HEADLESS", raising=False)  # live widgets: ipywidgets objects, not static PNGs
    out = ROOT / "build" / "test-notebooks" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    bc.run_teacher_edition(
        path, out, parameters=_ci_parameters(path), cwd=str(ROOT / "notebooks"), execution_timeout=300
    )
    executed = json.loads(out.read_text())
    errors = [
        o
        for c in executed["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
    # the views were live: every notebook that builds one holds a widget view or an instant view (its
    # self-contained HTML with no static image beside it), no static stand-in
    sources = "".join("".join(c["source"]) for c in executed["cells"] if c["cell_type"] == "code")
    if "widgets.memory_chart(" in sources or "widgets.planner(" in sources or "widgets.zero3_stepper(" in sources:
        views = [
            o
            for c in executed["cells"]
            if c["cell_type"] == "code"
            for o in c.get("outputs", [])
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
            or (
                "data-course-instant=" in "".join(o.get("data", {}).get("text/html", ""))
                and "image/png" not in o["data"]
            )
        ]
        assert views, f"{path.name}: no live widget was built (COURSE_HEADLESS leaked into the kernel?)"

    _check_both_editions(path, executed)


def _check_both_editions(path, executed):
    """The deck's notes, as this run filled them in, and the student's side of the run's outputs."""
    filled = ed.filled_notes(executed)
    problems = []
    for number, cells in enumerate(bc.slides_of(executed), 1):
        said = [ed.cell_notes(c, filled) for c in cells]
        notes = "\n\n".join(s["notes"] for s in said if s["notes"].strip())
        if number > 1 and len(notes) < bc.NOTES_MIN_CHARS:
            problems.append(f"slide {number}: no speaker notes in this run ({notes[:60]!r})")
        if ed.words(notes) > bc.NOTES_MAX_WORDS:
            problems.append(f"slide {number}: {ed.words(notes)} words of notes once filled in")
    student = {**executed, "cells": [c for c in executed["cells"] if not ed.is_injected(c)]}
    problems += [f"cell {t['cell']} tells the teacher: {t['text'][:80]!r}" for t in ed.teacher_text(student)]
    problems += [f"prediction {s['cell']}: {'; '.join(s['reasons'])}" for s in ed.spoiled_predictions(student)]
    assert not problems, f"{path.name} with its CI parameters:\n" + "\n".join(problems)

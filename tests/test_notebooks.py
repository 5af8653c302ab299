"""Execute every notebook with papermill, with its CI parameters (a second configuration).

`make test` also runs every notebook with its defaults through nbval; here each notebook runs
with the `ci_parameters` stored in its metadata (for example another world size), so both
configurations are exercised. Executed copies go to build/test-notebooks/, never notebooks/.

This run builds the live widgets (``COURSE_HEADLESS`` unset in the kernel, as in JupyterLab or
Colab), so a widget that raises for the values a notebook passes fails CI; the nbval run covers the
headless path. It costs no extra run: the widgets are built in the kernel with no browser attached.
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _ci_parameters(path):
    return json.loads(path.read_text())["metadata"].get("course", {}).get("ci_parameters", {})


@pytest.mark.notebook
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if _ci_parameters(p)], ids=lambda p: p.name)
def test_notebook_runs_with_ci_parameters(path, monkeypatch):
    import papermill

    monkeypatch.delenv("COURSE_HEADLESS", raising=False)  # live widgets: ipywidgets objects, not static PNGs
    out = ROOT / "build" / "test-notebooks" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(path),
        str(out),
        parameters=_ci_parameters(path),
        cwd=str(ROOT / "notebooks"),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=300,
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

"""Write course notebooks from Python: the cell conventions in one place (for authors, not students).

Every notebook of the course has the same frame:

1. a title cell with the one-line promise, the "Open in Colab" badge, prerequisites and run time;
2. the papermill ``parameters`` cell (the first code cell), commented knob by knob;
3. a set-up cell that installs ``course_utils`` when the kernel is Colab (and does nothing elsewhere);
4. sections; cells that belong in the slide deck carry ``slideshow.slide_type``.

Usage (from an authoring script)::

    from tools.nbbuild import md, code, frame, save
    cells = frame("01", "The 16-byte bill", promise=..., needs=..., minutes=1, parameters='''...''')
    cells += [md("## ...", slide="slide"), code("...")]
    save(cells, "notebooks/01_memory_bill.ipynb", ci_parameters={"steps": 2})
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import nbformat

from tools import colab  # the badge and the set-up cell, generated from pyproject.toml (one place)


def _src(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def md(text: str, slide: str | None = "slide", notes: bool = False):
    """A markdown cell; ``slide`` is reveal.js's slide_type ("slide", "subslide", "fragment", "skip", "notes", or None)."""
    cell = nbformat.v4.new_markdown_cell(_src(text))
    if notes:
        slide = "notes"
    if slide:
        cell.metadata["slideshow"] = {"slide_type": slide}
    return cell


def code(text: str, slide: str | None = None, tags=()):
    """A code cell; ``slide`` puts it (and its output) in the deck."""
    cell = nbformat.v4.new_code_cell(_src(text))
    if slide:
        cell.metadata["slideshow"] = {"slide_type": slide}
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def frame(number: str, title: str, *, promise: str, needs: str, minutes: float, parameters: str,
          filename: str) -> list:
    """Title cell, parameters cell, Colab set-up cell: the start of every notebook."""
    meta = colab.metadata()
    badge = colab.badge(meta, filename)
    head = md(f"""
        # {number} · {title}

        **{promise}**

        {badge}

        *You need:* {needs} · *Runs in:* about {minutes:g} min on a 2-core laptop CPU (no GPU needed).
        """, slide="slide")
    params = code(parameters, tags=("parameters",))
    setup = code(colab.setup_source(meta), slide="skip")
    return [head, params, setup]


def save(cells: list, path: str | Path, *, ci_parameters: dict | None = None) -> Path:
    """Write a stripped notebook (no outputs, no execution counts) with the course metadata.

    ``ci_parameters`` are the papermill parameters `make test` runs the notebook with, in
    addition to its defaults (for example a different world size).
    """
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["course"] = {"ci_parameters": ci_parameters or {}}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{Path(path).stem[:2]}-{i:03d}"  # stable ids: clean diffs when a notebook is rewritten
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(nbformat.from_dict(nb), indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    path.write_text(text)
    nbformat.validate(nbformat.read(path, as_version=4))
    return path

"""Build the course: execute every notebook headless, then export slide decks.

    python tools/build_course.py execute   # notebooks/*.ipynb -> build/notebooks/*.ipynb (papermill)
    python tools/build_course.py slides    # build/notebooks/*.ipynb -> slides/*.slides.html (nbconvert)

Used by `make course`. Executed notebooks never go back into notebooks/.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
BUILD = ROOT / "build" / "notebooks"
SLIDES = ROOT / "slides"


def execute() -> int:
    import papermill

    os.environ["COURSE_HEADLESS"] = "1"
    BUILD.mkdir(parents=True, exist_ok=True)
    total = time.monotonic()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        start = time.monotonic()
        print(f"    {path.name} ...", end="", flush=True)
        papermill.execute_notebook(str(path), str(BUILD / path.name), cwd=str(NOTEBOOKS),
                                   kernel_name="python3", progress_bar=False)
        print(f" {time.monotonic() - start:.1f} s", flush=True)
    print(f"    all notebooks: {time.monotonic() - total:.1f} s")
    return 0


def slides() -> int:
    import nbformat
    from nbconvert import SlidesExporter

    SLIDES.mkdir(exist_ok=True)
    executed = sorted(BUILD.glob("*.ipynb"))
    if not executed:
        print("no executed notebooks in build/notebooks/; run `make notebooks` first", file=sys.stderr)
        return 2
    exporter = SlidesExporter()
    for path in executed:
        body, _ = exporter.from_notebook_node(nbformat.read(path, as_version=4))
        out = SLIDES / f"{path.stem}.slides.html"
        out.write_text(body)
        print(f"    {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    commands = {"execute": execute, "slides": slides}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit("usage: python tools/build_course.py (execute | slides)")
    sys.exit(commands[sys.argv[1]]())

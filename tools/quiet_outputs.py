"""The quiet-output check: no warning text, temporary path or launcher frame in what a notebook shows.

A student reads a cell's output for its answer; a ``FutureWarning`` from both ranks, a
``/tmp/course-run-...`` folder or two frames of launcher plumbing above it only hide that answer
(issue 28, COURSE_STYLE "Outputs a student reads"). The one path allowed is the launcher's closing pointer
to the logs, on the last line of its error, below the answer (``LOG_POINTER``). ``noise(outputs)`` lists what one cell's outputs
hold of that; it reads outputs in nbformat's shape (``stream``, ``display_data``, ``execute_result``,
``error``), so it serves an executed ``.ipynb`` as well as a running test.

It runs inside the notebook phase of ``make test`` at no extra cost: the repository's ``conftest.py``
loads this module as a pytest plugin, and ``pytest_runtest_call`` below looks at the outputs nbval has
just collected for each cell (``IPyNbCell.test_outputs``) and fails that cell with what it found, so
no notebook is executed twice. nbval sees every output a cell produced, including a display a later
message updated or cleared; the launcher's live status line is such a display, so progress lines are
not judged here (they are the launcher's to keep out of finished outputs).

A cell may show noise on purpose (a notebook that teaches what a warning says): tag it
``shows-noise`` and say why in the cell.

    python -m tools.quiet_outputs build/notebooks/*.ipynb    # the same check on executed notebooks
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

#: The tag a cell carries when its output shows noise on purpose.
ALLOW_TAG = "shows-noise"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: Warning text: Python's ``SomethingWarning: message`` (and the source line ``warnings.warn(`` it
#: prints under it), torch's C++ ``[W1201 16:05:56.123 file.cpp:12] Warning: ...`` and logging's ``WARNING:``.
WARNING = re.compile(r"\b[A-Z]\w*Warning: |^\s*warnings\.warn\(|^\[W\d{4} |^\[W [^\]]*\]|^WARNING\b", re.M)


def temp_roots() -> list[str]:
    """Folders whose paths are temporary on this machine (longest first)."""
    roots = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/private/tmp", "/private/var/folders", "/dev/shm"}
    if os.environ.get("TMPDIR"):
        roots.add(os.environ["TMPDIR"].rstrip("/"))
    return sorted((r for r in roots if r), key=len, reverse=True)


def _temp_path() -> re.Pattern:
    alternatives = "|".join(re.escape(r) for r in temp_roots())
    return re.compile(r"(?<![\w.~-])(?:" + alternatives + r")/[^\s\"'<>:,)]*")


#: The one place a temporary path may stand: the launcher's closing pointer to the logs, on the last line of an
#: error it raised (``course_utils._report``: "(every rank's output and full traceback: PATH)"), below the
#: answer the student reads, where it says where to look next.
LOG_POINTER = re.compile(r"^\(every rank's output[^:()]*: (?P<path>\S+)\)$")


#: The checkout the notebooks run from: a clone may itself live under /tmp, and a frame of the course's own code
#: (``.../course_utils/examples.py``) is the student's to read, not a temporary path.
COURSE_ROOT = str(Path(__file__).resolve().parent.parent)


def _in_the_course(path: str) -> bool:
    return path == COURSE_ROOT or path.startswith(COURSE_ROOT + os.sep)


def _closing_pointer(text: str, start: int) -> bool:
    """True when the match at ``start`` is the launcher's logs pointer and nothing but blank lines follows it."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", start)
    line_end = len(text) if line_end < 0 else line_end
    return bool(LOG_POINTER.match(text[line_start:line_end].strip())) and not text[line_end:].strip()


#: A frame of a traceback, as Python prints it (``File "path", line N``) and as IPython does (``File path:N``).
FRAME = re.compile(r"File \"?(?P<path>[^\"\n:]+\.py)\"?(?:, line |:)\d+")

#: Frames of the machinery that starts and watches workers: what a student's traceback must not start
#: with. One place: the launcher's owners extend it when the plumbing moves.
LAUNCHER_FRAMES = (
    "/torch/distributed/elastic/",
    "/torch/distributed/launcher/",
    "/torch/distributed/run.py",
    "/multiprocessing/",
    "/cloudpickle/",
    "/course_utils/_agent.py",
    "/course_utils/launch.py",
    "/course_utils/worker.py",
)


def _texts(output: dict) -> list[str]:
    """The text a reader sees in one output (stream text, a traceback, text-like display data)."""
    kind = output.get("output_type")

    def joined(value) -> str:
        return "".join(value) if isinstance(value, list) else str(value or "")

    if kind == "stream":
        return [joined(output.get("text"))]
    if kind == "error":
        return ["\n".join(output.get("traceback") or []), f"{output.get('ename', '')}: {output.get('evalue', '')}"]
    data = output.get("data") or {}
    return [joined(data[m]) for m in ("text/plain", "text/markdown", "text/html", "text/latex") if m in data]


def noise(outputs: list) -> list[str]:
    """What one cell's outputs show that a student should not have to read past: one line per finding,
    naming the kind (warning, temporary path, launcher frame) and quoting it."""
    found: list[str] = []
    temp = _temp_path()

    def add(line: str) -> None:
        if line not in found:
            found.append(line)

    for output in outputs:
        texts = _texts(output)
        if (
            output.get("output_type") in ("display_data", "execute_result")
            and texts
            and not any(t.strip() for t in texts)
        ):
            add(f"empty display: {sorted(output.get('data') or {})} with nothing to read (a cleared progress line?)")
        for text in texts:
            text = _ANSI.sub("", text)
            for m in WARNING.finditer(text):
                line = text[text.rfind("\n", 0, m.start()) + 1 :].split("\n", 1)[0].strip()
                add(f"warning: {line[:160]}")
            for m in temp.finditer(text):
                if not _closing_pointer(text, m.start()) and not _in_the_course(m.group(0)):
                    add(f"temporary path: {m.group(0)[:160]}")
            for m in FRAME.finditer(text):
                path = m.group("path").replace("\\", "/")
                if any(part in path for part in LAUNCHER_FRAMES):
                    add(f"launcher frame: {path}")
    return found


def notebook_noise(path: Path) -> list[str]:
    """Findings of every code cell of an executed notebook, each prefixed with the cell's number and id."""
    nb = json.loads(Path(path).read_text())
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code" or ALLOW_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        out += [f"cell {i} ({cell.get('id', '?')}): {line}" for line in noise(cell.get("outputs", []))]
    return out


# ---------------------------------------------------------------------------------------------
# The pytest plugin: every cell nbval runs is checked right after it ran
# ---------------------------------------------------------------------------------------------


def _is_nbval_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item, "test_outputs")


try:
    import pytest
except ImportError:  # the command line below needs no pytest
    pytest = None

if pytest is not None:

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        result = yield
        if _is_nbval_cell(item) and ALLOW_TAG not in (getattr(item, "cell", {}) or {}).get("metadata", {}).get(
            "tags", []
        ):
            found = noise(item.test_outputs or [])
            if found:
                raise AssertionError(
                    "this cell's output holds what a student should not have to read past "
                    "(tools/quiet_outputs.py):\n  " + "\n  ".join(found)
                )
        return result


def main(argv=None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m tools.quiet_outputs EXECUTED.ipynb ...", file=sys.stderr)
        return 2
    failed = 0
    for path in paths:
        found = notebook_noise(path)
        failed += bool(found)
        for line in found:
            print(f"{path.name}: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the course: execute every notebook headless, then export slide decks.

    python tools/build_course.py execute [NN ...]      notebooks/*.ipynb -> build/notebooks/ (papermill, headless)
    python tools/build_course.py slides [NN ...]       build/notebooks/*.ipynb -> build/slides/NN_name.slides.html
    python tools/build_course.py publish               build/slides/*.slides.html -> slides/ (committed, for teachers)
    python tools/build_course.py vendor                re-fetch reveal.js and KaTeX from npm into slides/
    python tools/build_course.py docs-shot [NN_name]   build/screenshots/NN_name.png -> docs/deck.png (README)

`make course` runs `execute` then `slides`; `make slides` re-exports the decks from build/ alone.
NN picks notebooks by prefix ("01", "05b") or full name; none means every notebook.
Executed notebooks never go back into notebooks/, and built decks never go into slides/ by themselves:
a run's timings, process ids and temporary folders differ on every machine, so `make course` leaves a
fresh clone's `git status` clean; `make publish-slides` (`publish`) is the teacher's deliberate step
that refreshes the committed decks. Every deck has the build machine's paths scrubbed (``scrub_paths``).

How a notebook becomes a deck (slides/README.md says the same for teachers):

- Only cells that carry ``slideshow`` metadata go into the deck; cells without it (the parameters,
  imports, asserting cells, the notebook's own prose) stay in the notebook. ``skip`` drops a cell.
- Speaker notes are the teacher's edition (tools/editions.py): ``metadata.course.notes`` of each cell of
  a slide (computed ones filled in by the run: ``execute`` runs ``editions.teacher_notebook``), then the
  slide's More part: the notes' ``more`` and the notebook's own prose of that slide. A student's
  notebook holds none of it.
- ``deck_lint`` checks every slide a teacher will present (``make test`` runs it on every notebook):
  speaker notes of 120 characters to ``NOTES_MAX_WORDS`` words, at most ``SLIDE_PROSE_CHARS`` of prose,
  a heading, no dangling colon, maths in $...$.
- A code cell in the deck shows its outputs. Its source is shown too (small) when it is at most
  ``SHORT_CODE_LINES`` lines and displays no result (a slide whose point is a chart or a table shows it,
  not the call), or when tagged ``slide-code``; ``slide-no-code`` hides a short one. A cell tagged
  ``slide-text-in-notes`` keeps only its pictures on the slide; its printed text and tables go to the
  slide's speaker notes, under More (detail beside a chart, or reading matter longer than a slide).
- Each slide is fitted to the 1280 x 720 canvas when the deck opens (deck_template/deck.js): charts
  take the height the slide leaves free; a slide that overflows shrinks its text a little (85 %),
  then moves its trailing prose, in order, into its speaker notes (never a cell's first paragraph,
  a heading, a table, code, an output or a "Predict" question), then shrinks further (not below 70 %).
  Width too: a table or displayed formula wider than the slide gets smaller type (down to 14 px), and
  scrolls sideways in its own box only if it is still too wide.
- Widget views, stderr (warnings) and JavaScript outputs are left out; an instant view (the HTML
  output marked ``data-course-instant``, course_utils.instant) is kept as it is, live in the deck, and
  the static image beside it dropped; a notebook with an error output is refused. Remote images (the
  Colab badge) become plain links, so a deck loads nothing from the network: reveal.js and KaTeX are
  vendored under slides/.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
BUILD = ROOT / "build" / "notebooks"
SCREENSHOTS = ROOT / "build" / "screenshots"
SLIDES = ROOT / "slides"
BUILD_SLIDES = ROOT / "build" / "slides"
TEMPLATE_DIR = Path(__file__).resolve().parent / "deck_template"

#: Kernels talk to the build over Unix sockets, not TCP: nothing listens on a port, and ipykernel has
#: no reason to print its "Kernel is running over TCP without encryption" warning once per notebook.
if str(ROOT) not in sys.path:  # run as a script, this folder is on sys.path, not the repository
    sys.path.insert(0, str(ROOT))
from tools import editions  # noqa: E402
from tools.kernels import IPCKernelManager as IPC_KERNEL_MANAGER  # noqa: E402

#: Code cells this short show their source on the slide (the call that drew the chart).
SHORT_CODE_LINES = 3
SHOW_CODE_TAG, HIDE_CODE_TAG = "slide-code", "slide-no-code"
#: A cell whose printed text and tables are detail beside its picture, or reading matter too long for a
#: slide: the slide keeps its pictures, and the text goes to the slide's speaker notes, under More.
TEXT_TO_NOTES_TAG = "slide-text-in-notes"

#: What the decks load, from the npm registry (`vendor` re-fetches exactly these files).
VENDOR = {
    "reveal.js": (
        "6.0.2",
        ["LICENSE", "dist/reveal.js", "dist/reveal.css", "dist/theme/white.css", "dist/plugin/notes.js"],
    ),
    "katex": (
        "0.19.1",
        ["LICENSE", "dist/katex.min.js", "dist/katex.min.css", "dist/contrib/auto-render.min.js", "dist/fonts/*.woff2"],
    ),
}
#: Where each vendored file lands under slides/ (KaTeX's dist/ prefix is dropped).
VENDOR_DIRS = {"reveal.js": ("", "reveal.js"), "katex": ("dist/", "katex")}

DECK_SUFFIX = ".slides.html"


# ---------------------------------------------------------------------------------------------
# Which notebooks
# ---------------------------------------------------------------------------------------------


def select(paths, names) -> list[Path]:
    """The paths whose stem starts with one of ``names`` (all of them when ``names`` is empty)."""
    paths = sorted(paths)
    if not names:
        return paths
    chosen = [p for p in paths if any(p.stem == n or p.stem.split("_")[0] == n for n in names)]
    missing = [n for n in names if not any(p.stem == n or p.stem.split("_")[0] == n for p in paths)]
    if missing:
        raise SystemExit(f"no notebook named {', '.join(missing)} (have: {', '.join(p.stem for p in paths)})")
    return chosen


def written_once_engine():
    """papermill's nbclient engine, writing the executed notebook once (at the end, or where it stopped).

    papermill writes the whole notebook, validated by nbformat, at every cell's start and end: about 240
    writes of up to 1 MB for notebook 06, whose build went from 64.3 s and 94 CPU s to 58.4 s and 86 CPU s
    without them (``/usr/bin/time``), time no student spends in JupyterLab. Registered as ``"course-once"``.
    """
    from papermill.engines import NBClientEngine, NotebookExecutionManager, papermill_engines

    class WrittenOnce(NotebookExecutionManager):
        final = False

        def save(self, **kwargs):
            if self.final:
                super().save(**kwargs)
            else:
                self.last_save_time = self.now()

        def cell_exception(self, cell, cell_index=None, **kwargs):
            self.final = True  # a failing cell stops the run: the copy shows where
            return super().cell_exception(cell, cell_index, **kwargs)

        def notebook_complete(self, **kwargs):
            self.final = True
            return super().notebook_complete(**kwargs)

    class Engine(NBClientEngine):
        @classmethod
        def execute_notebook(cls, nb, kernel_name, output_path=None, progress_bar=True, log_output=False,
                             autosave_cell_every=30, **kwargs):  # fmt: skip
            nb_man = WrittenOnce(nb, output_path=output_path, progress_bar=progress_bar, log_output=log_output,
                                 autosave_cell_every=autosave_cell_every)  # fmt: skip
            nb_man.notebook_start()
            try:
                cls.execute_managed_notebook(nb_man, kernel_name, log_output=log_output, **kwargs)
            finally:
                nb_man.cleanup_pbar()
                nb_man.notebook_complete()
            return nb_man.nb

    papermill_engines.register("course-once", Engine)
    return "course-once"


def run_teacher_edition(path: Path, out: Path, **papermill_args):
    """Execute notebook ``path`` as the teacher's edition (``editions.teacher_notebook``) into ``out``.

    papermill runs a file, not the notebook object: given an object it records the whole notebook as its
    ``input_path`` metadata (and serialises it at every cell's save), so the edition goes through a
    temporary file, and the executed copy then names the real notebook it came from.
    """
    import nbformat
    import papermill

    with tempfile.TemporaryDirectory(prefix="course-edition-") as tmp:
        teacher = Path(tmp) / path.name
        nbformat.write(editions.teacher_notebook(nbformat.read(path, as_version=4)), teacher)
        try:
            papermill.execute_notebook(
                str(teacher),
                str(out),
                kernel_name="python3",
                progress_bar=False,
                log_output=False,
                engine_name=written_once_engine(),
                **papermill_args,
            )
        finally:
            if out.exists():  # also after a failure: the executed copy shows where it stopped
                executed = nbformat.read(out, as_version=4)
                executed.metadata.get("papermill", {})["input_path"] = str(path)
                for cell in executed.cells:  # a finished launch's progress line: an empty bundle, drawn as nothing
                    if "outputs" in cell:  # live, but a reader of the saved copy sees a blank line
                        cell.outputs = [o for o in cell.outputs if o.output_type != "display_data" or o.get("data")]
                nbformat.write(executed, out)


def execute(names=()) -> int:
    """Run notebooks with papermill into build/notebooks/; a failing notebook is reported, the rest still run.

    What runs is the teacher's edition (``editions.teacher_notebook``): the notebook, plus after each cell
    with computed speaker notes a cell that fills them in from the run; the deck reads them from there.
    """
    import papermill

    os.environ["COURSE_HEADLESS"] = "1"
    BUILD.mkdir(parents=True, exist_ok=True)
    total, failed = time.monotonic(), []
    for path in select(NOTEBOOKS.glob("*.ipynb"), names):
        start = time.monotonic()
        print(f"    {path.name} ...", end="", flush=True)
        try:
            run_teacher_edition(path, BUILD / path.name, cwd=NOTEBOOKS, kernel_manager_class=IPC_KERNEL_MANAGER)
        except papermill.PapermillExecutionError as err:
            failed.append(path.name)
            print(f" FAILED in cell {err.exec_count}: {err.ename}: {err.evalue}", flush=True)
            continue
        print(f" {time.monotonic() - start:.1f} s", flush=True)
    print(f"    all notebooks: {time.monotonic() - total:.1f} s")
    if failed:
        print(
            f"    failed: {', '.join(failed)} (the executed copies in build/notebooks/ show the error)", file=sys.stderr
        )
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# From notebook cells to deck cells
# ---------------------------------------------------------------------------------------------


def slide_type(cell) -> str | None:
    """The cell's reveal.js slide type, or None when it carries no ``slideshow`` metadata."""
    return (cell.get("metadata", {}).get("slideshow") or {}).get("slide_type")


def _is_injected(cell) -> bool:
    """A cell a build added: papermill's parameters or error banner, or a cell that fills in computed notes."""
    return editions.is_injected(cell)


def fingerprint(nb) -> str:
    """A hash of what a deck is made from: every cell's type, source, slide type, tags and speaker notes.

    The same for a stripped notebook and its executed copy (outputs, papermill's bookkeeping and the
    cells that fill in computed notes do not count), so a deck can say which version of its notebook it shows.
    """
    cells = [
        [
            c["cell_type"],
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"],
            slide_type(c),
            sorted(c.get("metadata", {}).get("tags", [])),
        ]
        + ([editions.notes_of(c)] if editions.notes_of(c) else [])
        for c in nb["cells"]
        if not _is_injected(c)
    ]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()[:16]


_WIDGET = "application/vnd.jupyter.widget-view+json"
#: The mark of an instant view (course_utils.instant.MARKER): self-contained HTML a deck keeps as it is.
_INSTANT = "data-course-instant="
_DROPPED_MIME = (_WIDGET, "application/javascript", "application/vnd.jupyter.widget-state+json")


#: A launch's live status line (course_utils.launch._Progress): a clock for the room watching the run,
#: noise on a slide shown later (it would show that run's step counters, not the result).
_PROGRESS_LINE = re.compile(r"^\[\s*\d+\.\ds\] rank 0: ")


def deck_outputs(outputs: list) -> list:
    """Outputs as a deck shows them: no stderr, no launch progress lines, no widget views or JavaScript."""
    kept = []
    for out in outputs:
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            continue
        plain = out.get("data", {}).get("text/plain", "")
        if (
            out.get("output_type") == "display_data"
            and set(out.get("data", {})) == {"text/plain"}
            and _PROGRESS_LINE.match("".join(plain) if isinstance(plain, list) else plain)
        ):
            continue
        if out.get("output_type") in ("display_data", "execute_result"):
            out = copy.deepcopy(out)
            data = out["data"]
            had_widget = _WIDGET in data
            for mime in _DROPPED_MIME:
                data.pop(mime, None)
            if _INSTANT in "".join(data.get("text/html", "")):  # course_utils.instant: live in the deck too
                data.pop("image/png", None)  # (its static image is for readers that run no script)
            if had_widget:
                data.pop("text/plain", None)  # the repr of a widget object, e.g. "VBox(children=...)"
            if not data:
                continue
        kept.append(out)
    return kept


def _is_image(out) -> bool:
    return any(m.startswith("image/") for m in out.get("data", {}))


_REMOTE_IMAGE = re.compile(r"!\[([^\]]*)\]\((https?://[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_NOTEBOOK_LINK = re.compile(r"\]\((\d\d[a-z]?_[a-z0-9_]+)\.ipynb\)")


def _notes_text(outputs: list) -> str:
    """The speaker notes a code cell marked ``notes`` printed or displayed (markdown preferred)."""
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            parts.append("".join(out.get("text", "")))
        elif out.get("output_type") in ("display_data", "execute_result"):
            data = out.get("data", {})
            text = data.get("text/markdown") or data.get("text/plain") or ""
            parts.append("".join(text) if isinstance(text, list) else text)
    return "\n\n".join(p.strip() for p in parts if p.strip())


def _deck_markdown(source: str) -> str:
    """Markdown for the deck: remote images become their alt text (a link stays a link);
    links to another notebook point at its deck."""
    source = _REMOTE_IMAGE.sub(lambda m: m.group(1), source)
    return _NOTEBOOK_LINK.sub(lambda m: f"]({m.group(1)}{DECK_SUFFIX})", source)


def _markdown_cell(source: str, kind: str, cell_id: str):
    import nbformat

    cell = nbformat.v4.new_markdown_cell(source, id=cell_id)  # a fixed id: the same deck every build
    cell.metadata["slideshow"] = {"slide_type": kind}
    return cell


def _shows_a_result(outputs: list) -> bool:
    """Outputs that are the slide's point (a chart, a widget, a table or other displayed markdown): the slide
    shows them, not the call that made them."""
    return any(
        m.startswith("image/")
        or m in (_WIDGET, "application/vnd.jupyter.widget-state+json", "text/markdown", "text/html")
        for o in outputs
        if o.get("output_type") in ("display_data", "execute_result")
        for m in o.get("data", {})
    )


def _text_outputs(outputs: list) -> tuple[list, str]:
    """(the picture outputs, the rest as markdown for the speaker notes) of a cell tagged ``slide-text-in-notes``."""
    kept, text = [], []
    for out in outputs:
        data = out.get("data", {})
        if any(m.startswith("image/") or m == _WIDGET for m in data):
            kept.append(out)
        elif out.get("output_type") == "stream":
            text.append("```\n" + "".join(out.get("text", "")).rstrip() + "\n```")
        elif "text/markdown" in data:
            text.append(
                "".join(data["text/markdown"]) if isinstance(data["text/markdown"], list) else data["text/markdown"]
            )
        elif "text/plain" in data:
            text.append("```\n" + "".join(data["text/plain"]).rstrip() + "\n```")
    return kept, "\n\n".join(text)


def deck_notebook(nb, name: str):
    """The notebook a deck is exported from: the slide cells of ``nb``, ready for reveal.js.

    Speaker notes come from the cells' metadata (``editions``): each cell's notes follow it on its slide
    (a cell outside the deck gives its notes to the slide it sits in), computed ones as the run filled them
    in; each slide ends with its More part: the notes' longer material, then the notebook's own prose of
    that slide (markdown cells without slide metadata), so the teacher has every sentence once.
    Returns (notebook, warnings). ``name`` is the notebook's stem, for the title slide's notes.
    Raises ValueError when the notebook holds an error output, computed notes it was not run to fill
    in, or no slide cells.
    """
    import nbformat

    nb = copy.deepcopy(nb)
    filled = editions.filled_notes(nb)
    cells, warnings, more, prose = [], [], [], []

    def end_of_slide():
        if more or prose:
            text = "\n\n".join(more)
            if prose:
                text += ("\n\n" if text else "") + "*In the notebook:*\n\n" + "\n\n".join(prose)
            cells.append(_markdown_cell("**More**\n\n" + text, "notes", f"more-{len(cells)}"))
            more.clear()
            prose.clear()

    for index, cell in enumerate(nb.cells):
        if _is_injected(cell):
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            raise ValueError(
                f"{name}: the cell run as In [{cell.get('execution_count')}] raised "
                f"{errors[0].get('ename')}; fix the notebook and run `make notebooks` again"
            )
        kind = slide_type(cell)
        if kind in ("slide", "subslide") and cell.cell_type != "raw":
            end_of_slide()
        try:
            said = editions.cell_notes(cell, filled)
        except KeyError:
            raise ValueError(
                f"{name}: the computed speaker notes of cell {cell.get('id')} were not filled in (the notebook "
                "was not run as the teacher's edition): run `make notebooks`"
            ) from None
        shown, detail = _cell_for_deck(cell, kind, index, name, warnings)
        cells.extend(shown)
        if detail:
            more.append(detail)
        if said["notes"].strip():
            cells.append(_markdown_cell(_deck_markdown(said["notes"]), "notes", f"notes-{cell.get('id', index)}"))
        if said["more"].strip():
            more.append(_deck_markdown(said["more"]))
        if kind is None and cell.cell_type == "markdown":
            prose.append(_deck_markdown(cell.source))
    end_of_slide()
    if not any(slide_type(c) not in ("notes",) for c in cells):
        raise ValueError(f"{name}: no cell carries slideshow metadata, so there is no deck to export")
    title = _title(nb)
    cells.insert(
        1 if cells else 0,
        _markdown_cell(
            f"Deck of `notebooks/{name}.ipynb`, executed headless; every number on these slides was computed "
            "by that run. Keys: S speaker view (these notes), F full screen, Esc overview, B blank screen. "
            "After presenting, run the notebook live: `make lab`, or the Colab badge.",
            "notes",
            "deck-keys",
        ),
    )
    out = nbformat.v4.new_notebook()
    out.cells = cells
    out.metadata = copy.deepcopy(nb.metadata)
    out.metadata.pop("widgets", None)  # no widget state: the deck needs no widget JavaScript
    out.metadata["title"] = title
    return out, warnings


def _cell_for_deck(cell, kind, index: int, name: str, warnings: list) -> tuple[list, str]:
    """What one notebook cell puts on its slide ([] or [the cell as the deck shows it]), and the text it sends
    to the slide's speaker notes instead (a cell tagged ``slide-text-in-notes``)."""
    if kind is None:
        if cell.cell_type == "code" and any(_is_image(o) for o in cell.get("outputs", [])):
            warnings.append(
                f"{name}: cell {index} draws a chart but has no slideshow metadata, so the "
                "deck leaves it out (give it slide='subslide', or 'skip' to silence this)"
            )
        return [], ""
    if kind == "skip" or cell.cell_type == "raw":
        return [], ""
    if cell.cell_type == "markdown":
        text = _deck_markdown(cell.source)
        if kind == "notes":  # the old form: a notes cell (tools/editions.py convert moves it into metadata)
            return [_markdown_cell(text, "notes", cell.get("id", f"c{index}"))], ""
        cell.source = text
        return [cell], ""
    if kind == "notes":  # the old form: notes computed by the run, its printed or displayed text
        said = _notes_text(cell.get("outputs", []))
        return ([_markdown_cell(said, "notes", cell.get("id", f"c{index}"))] if said else []), ""
    result = _shows_a_result(cell.get("outputs", []))
    cell.outputs = deck_outputs(cell.get("outputs", []))
    tags = set(cell.metadata.get("tags", []))
    detail = ""
    if TEXT_TO_NOTES_TAG in tags:
        cell.outputs, detail = _text_outputs(cell.outputs)
    lines = len(cell.source.strip().splitlines())
    show = SHOW_CODE_TAG in tags or (lines <= SHORT_CODE_LINES and HIDE_CODE_TAG not in tags and not result)
    if not show:
        cell.metadata["transient"] = {"remove_source": True}
        if not cell.outputs and kind not in ("slide", "subslide"):
            return [], detail  # nothing left to show (a cell that starts a slide stays: the count of slides is fixed)
    return [cell], detail


#: What a slide may carry (issue 23): the headline, the chart or table, a line or two of text and the
#: prediction question. Prose beyond this goes into the notebook's own prose (a markdown cell with no
#: slide metadata, which the deck gives to the teacher under More) or the teacher's notes.
SLIDE_PROSE_CHARS = 450
#: The shortest speaker notes a teacher can speak from: the point, a question for the class, a number.
NOTES_MIN_CHARS = 120
#: The most a teacher can take in at a glance while speaking (issue 28): the rest goes into More.
NOTES_MAX_WORDS = editions.NOTES_MAX_WORDS
#: The most rows a table on one slide can have and still be read at 90% of its size (issue 28: 03's
#: summary, 12 rows, was shown at 75%); a longer table is split over two slides.
TABLE_MAX_ROWS = 10
#: A call that draws a picture: on a slide, the picture is the point, not the call (issue 28).
_DRAWS = re.compile(r"\b(plots\.show|widgets\.\w+|R\.\w+_figure)\s*\(")
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)
_CODE_SPAN = re.compile(r"```.*?```|`[^`\n]*`", re.S)
#: Maths written by hand where KaTeX would typeset it: a caret power (10^12), a subscript (N_d), a
#: Greek letter or a superscript/root sign outside $...$.
_RAW_MATH = re.compile(r"\w\^[\w({]|(?<![\w\\])[A-Za-z]_[A-Za-z0-9{]|[ΨΦαβγδσμΣ²³√∑]")


def _visible_prose(source: str) -> str:
    """The prose of a markdown cell as a slide shows it: no headings, tables, code, maths, links' targets."""
    text = _CODE_SPAN.sub(" ", source)
    text = _MATH.sub("x", text)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("#", "|", "<", "[![")) and ln.strip()]
    text = " ".join(lines)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"[*_>\[\]]|\s+", lambda m: " " if m.group().isspace() else "", text).strip()


def slides_of(nb) -> list[list]:
    """The deck's slides as lists of the notebook cells that belong to them: the cells it shows, and the
    cells outside the deck that sit between them (their notes and prose belong to that slide)."""
    return [c for c in editions.slides(nb["cells"]) if any(_in_deck(x) for x in c)]


def _in_deck(cell) -> bool:
    return slide_type(cell) not in (None, "skip", "notes") and cell["cell_type"] != "raw"


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def deck_lint(nb, name: str) -> list[str]:
    """What a teacher would trip over in the deck of ``nb``, one line per slide (issues 23 and 28).

    Every slide needs speaker notes (``metadata.course.notes`` of one of its cells, computed or not:
    tools/editions.py), at least ``NOTES_MIN_CHARS`` and at most ``NOTES_MAX_WORDS`` words (the rest goes
    into ``more``); carries at most ``SLIDE_PROSE_CHARS`` of prose and tables of at most ``TABLE_MAX_ROWS``
    rows; shows no call that draws a picture; has a heading (the title slide aside); does not end on a colon
    that introduces nothing; and writes its maths for KaTeX ($16\\Psi/N_d$), not by hand (16Ψ/Nd, 10^12).
    The notebook holds no notes cells (teacher text a student would read), and every computed note reads
    only names its notebook defines before it. What needs the run or a browser (label sizes, a table
    printed by a cell, notes once filled in) is checked by test_notebooks.py and test_browser.py.
    """
    problems = []
    old = [c.get("id") for c in nb["cells"] if editions.is_notes_cell(c)]
    if old:
        problems.append(
            f"{name}: {len(old)} notes cell(s) in the student's notebook ({', '.join(map(str, old[:5]))}): "
            f"`python tools/editions.py convert {name}` moves them into the metadata of the cell they follow"
        )
    problems += [f"{name}: {p}" for p in editions.template_problems(nb)]
    for number, cells in enumerate(slides_of(nb), 1):
        shown = [c for c in cells if _in_deck(c)]
        notes = [editions.notes_of(c).get("notes", "") for c in cells]
        notes += [_source(c) for c in cells if editions.is_notes_cell(c)]
        markdown = [_source(c) for c in shown if c["cell_type"] == "markdown"]
        heading = next((m.group(1) for s in markdown for m in [re.search(r"^#+\s+(.+)$", s, re.M)] if m), None)
        where = f"{name} slide {number} ({(heading or 'no heading')[:50]})"
        said = sum(len(n.strip()) for n in notes)
        if number > 1 and said < NOTES_MIN_CHARS:
            problems.append(
                f"{where}: speaker notes missing or under {NOTES_MIN_CHARS} characters; give one of its cells "
                "`course.notes` in its metadata: the point, a question for the class, the number to remember"
            )
        spoken = sum(editions.words(n) for n in notes)
        if spoken > NOTES_MAX_WORDS:
            problems.append(
                f"{where}: {spoken} words of speaker notes (at most {NOTES_MAX_WORDS}, what a teacher takes in at "
                "a glance); keep the point, the question and the number, and move the rest into `course.more`"
            )
        prose = sum(len(_visible_prose(s)) for s in markdown)
        if prose > SLIDE_PROSE_CHARS:
            problems.append(
                f"{where}: {prose} characters of prose on the slide (at most {SLIDE_PROSE_CHARS}); keep the point "
                "on the slide and move the rest into the notebook's prose (a markdown cell with no slide metadata)"
            )
        if number > 1 and heading is None:
            problems.append(f"{where}: no heading; start the slide with a markdown heading that states its point")
        if shown and shown[-1]["cell_type"] == "markdown" and _visible_prose(_source(shown[-1])).rstrip().endswith(":"):
            problems.append(f"{where}: ends on a colon that introduces nothing on the slide")
        for s in markdown:
            raw = _RAW_MATH.search(_MATH.sub(" ", _CODE_SPAN.sub(" ", s)))
            if raw:
                problems.append(f"{where}: maths written by hand ({raw.group()!r}); write it in $...$ for KaTeX")
                break
        for s in markdown:
            rows = [
                ln for ln in s.splitlines() if ln.lstrip().startswith("|") and not re.match(r"\s*\|[\s|:-]+\|\s*$", ln)
            ]
            if len(rows) - 1 > TABLE_MAX_ROWS:
                problems.append(
                    f"{where}: a table of {len(rows) - 1} rows (at most {TABLE_MAX_ROWS} on a slide, read at 90% of "
                    "its size or more); split it over two slides"
                )
        for c in shown:
            if (
                c["cell_type"] == "code"
                and SHOW_CODE_TAG in c.get("metadata", {}).get("tags", [])
                and _DRAWS.search(_source(c))
            ):
                problems.append(
                    f"{where}: cell {c.get('id')} shows the call that draws a picture (tag {SHOW_CODE_TAG}); the "
                    "slide's point is the picture: drop the tag"
                )
    return problems


def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if m:
                return re.sub(r"[*_`]", "", m.group(1)).strip()
    return "Course deck"


def expected_slides(nb) -> int:
    """How many slides (reveal.js sections) the deck of ``nb`` has: counted from slide metadata."""
    cells = [
        c
        for c in nb["cells"]
        if slide_type(c) not in (None, "skip", "notes") and c["cell_type"] != "raw" and not _is_injected(c)
    ]
    return sum(1 for i, c in enumerate(cells) if i == 0 or slide_type(c) in ("slide", "subslide"))


# ---------------------------------------------------------------------------------------------
# The deck: nbconvert with the course template, then an offline check
# ---------------------------------------------------------------------------------------------


class _Resources(HTMLParser):
    """Every URL a page would load by itself: scripts, stylesheets, images, frames, media, CSS url()/@import."""

    LOADS = {
        "script": "src",
        "img": "src",
        "iframe": "src",
        "embed": "src",
        "source": "src",
        "video": "src",
        "audio": "src",
        "object": "data",
    }

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.urls, self._in_style = [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if (
            tag == "link"
            and "stylesheet" in (attrs.get("rel") or "")
            or tag == "link"
            and attrs.get("rel") in ("preload", "modulepreload", "icon")
        ):
            self.urls.append(("link", attrs.get("href") or ""))
        elif tag in self.LOADS and attrs.get(self.LOADS[tag]):
            self.urls.append((tag, attrs[self.LOADS[tag]]))
        if attrs.get("style"):
            self.urls += [("style", u) for u in css_urls(attrs["style"])]
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.urls += [("style", u) for u in css_urls(data)]


def css_urls(css: str) -> list[str]:
    """URLs a stylesheet loads: url(...) and @import."""
    found = re.findall(r"url\(\s*['\"]?([^'\")]+)['\"]?\s*\)", css)
    found += re.findall(r"@import\s+['\"]([^'\"]+)['\"]", css)
    return found


def loaded_urls(html: str) -> list[tuple[str, str]]:
    """(tag, url) for everything ``html`` loads when opened (not links a reader may click)."""
    parser = _Resources()
    parser.feed(html)
    return parser.urls


def remote_loads(html: str) -> list[str]:
    """Every URL ``html`` would fetch from the network: empty for a deck that opens offline."""
    return [f"<{tag}> {url}" for tag, url in loaded_urls(html) if re.match(r"(https?:)?//", url.strip(), re.I)]


_TMP_SUFFIX = re.compile(r"((?<![\w$])TMPDIR/[A-Za-z0-9._-]*?[-_.])[a-z0-9_]{8}(?![A-Za-z0-9_])")


def scrub_paths(text: str, root: Path = ROOT) -> str:
    """``text`` without the build machine's paths: the repository's absolute path becomes relative, a home
    folder ``~``, the temporary folder ``TMPDIR`` (with tempfile's random 8-character suffixes as XXXXXXXX;
    no ``$``, which KaTeX would read as maths).

    A published deck showed a traceback through the build machine's checkout, its virtual environment and
    the run's temporary folders; none of that means anything to the room, and it names the machine.
    """
    import tempfile

    text = text.replace(str(root) + "/", "").replace(str(root), ".")
    text = re.sub(r"(?<![\w.~-])(?:/home|/Users)/[^/\s\"'<>]+(?=/)", "~", text)
    text = re.sub(r"(?<![\w.~-])/root(?=/)", "~", text)
    for tmp in sorted({tempfile.gettempdir(), "/tmp", "/var/tmp", "/private/tmp"}, key=len, reverse=True):
        text = re.sub(r"(?<![\w.~-])" + re.escape(tmp) + r"(?=/)", "TMPDIR", text)
    return _TMP_SUFFIX.sub(r"\1XXXXXXXX", text)


def export_deck(executed: Path, source: Path | None = None) -> tuple[str, list[str]]:
    """(HTML of the deck, warnings) for one executed notebook."""
    import nbformat
    from nbconvert import SlidesExporter

    nb = nbformat.read(executed, as_version=4)
    name = executed.stem
    deck, warnings = deck_notebook(nb, name)
    if source is not None and fingerprint(nbformat.read(source, as_version=4)) != fingerprint(nb):
        raise ValueError(
            f"{executed.relative_to(ROOT) if executed.is_relative_to(ROOT) else executed} was run "
            f"from another version of notebooks/{source.name}: run `make notebooks` first"
        )
    charts = sum(1 for c in deck.cells if c.cell_type == "code" for o in c.outputs if _is_image(o))
    exporter = SlidesExporter(
        extra_template_basedirs=[str(TEMPLATE_DIR.parent)],
        template_name=TEMPLATE_DIR.name,
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )
    resources = {
        "course": {
            "notebook": f"notebooks/{name}.ipynb",
            "fingerprint": fingerprint(nb),
            "title": _title(nb),
            "slides": expected_slides(nb),
            "charts": charts,
            "css": (TEMPLATE_DIR / "deck.css").read_text(),
            "js": (TEMPLATE_DIR / "deck.js").read_text(),
        }
    }
    html, _ = exporter.from_notebook_node(deck, resources=resources)
    html = scrub_paths(html)
    remote = remote_loads(html)
    if remote:
        raise ValueError(f"{name}: the deck would load from the network: {remote[:3]}")
    return html, warnings


def _vendored(dest: Path) -> None:
    """Put the vendored reveal.js and KaTeX beside decks written outside slides/ (decks load them by relative path)."""
    for _, target in VENDOR_DIRS.values():
        shutil.copytree(SLIDES / target, dest / target, dirs_exist_ok=True)


def slides(names=(), out: Path = BUILD_SLIDES) -> int:
    """Export a deck per executed notebook into ``out`` (build/slides/; `publish` copies them to slides/)."""
    out.mkdir(parents=True, exist_ok=True)
    _vendored(out)
    executed = select(BUILD.glob("*.ipynb"), names) if BUILD.is_dir() else []
    if not executed:
        print("no executed notebooks in build/notebooks/; run `make notebooks` first", file=sys.stderr)
        return 2
    missing = [p.stem for p in NOTEBOOKS.glob("*.ipynb") if not (BUILD / p.name).exists()]
    if missing and not names:
        print(f"    note: not executed yet, so no deck: {', '.join(sorted(missing))}", file=sys.stderr)
    failed = []
    for path in executed:
        source = NOTEBOOKS / path.name
        if not source.exists():
            print(f"    skip {path.name}: no notebooks/{path.name} any more", file=sys.stderr)
            continue
        try:
            html, warnings = export_deck(path, source)
        except ValueError as err:
            failed.append(path.stem)
            print(f"    no deck for {path.stem}: {err}", file=sys.stderr)
            continue
        deck = out / f"{path.stem}{DECK_SUFFIX}"
        deck.write_text(html)
        for line in warnings:
            print(f"    warning: {line}", file=sys.stderr)
        print(f"    {deck.relative_to(ROOT) if deck.is_relative_to(ROOT) else deck} ({len(html) // 1024} KiB)")
    orphans = [
        d.name
        for d in out.glob(f"*{DECK_SUFFIX}")
        if not (NOTEBOOKS / (d.name[: -len(DECK_SUFFIX)] + ".ipynb")).exists()
    ]
    if orphans:
        print(f"    warning: decks without a notebook (delete them): {', '.join(orphans)}", file=sys.stderr)
    return 1 if failed else 0


def _deck_fingerprint(html: str) -> str | None:
    """The fingerprint a deck records (its course-fingerprint meta tag; attributes in any order)."""
    for tag in re.findall(r"<meta\b[^>]*>", html):
        attrs = dict(re.findall(r'(\w[\w-]*)="([^"]*)"', tag))
        if attrs.get("name") == "course-fingerprint":
            return attrs.get("content")
    return None


def publish(build: Path = BUILD_SLIDES, dest: Path = SLIDES) -> int:
    """Copy the built decks into the committed slides/ (`make publish-slides`), only when every notebook has a
    deck built from its current version; decks whose notebook is gone are removed from slides/."""
    notebooks = {p.stem: p for p in NOTEBOOKS.glob("*.ipynb")}
    import nbformat

    problems = []
    for stem, source in sorted(notebooks.items()):
        deck = build / f"{stem}{DECK_SUFFIX}"
        if not deck.exists():
            problems.append(f"{stem}: no deck in {deck.parent.name}/")
        elif _deck_fingerprint(deck.read_text()) != fingerprint(nbformat.read(source, as_version=4)):
            problems.append(f"{stem}: its built deck shows another version of the notebook")
    if problems:
        print("not published: " + "; ".join(problems) + " (run `make course` first)", file=sys.stderr)
        return 1
    for stem in sorted(notebooks):
        shutil.copyfile(build / f"{stem}{DECK_SUFFIX}", dest / f"{stem}{DECK_SUFFIX}")
    for old in dest.glob(f"*{DECK_SUFFIX}"):
        if old.name[: -len(DECK_SUFFIX)] not in notebooks:
            old.unlink()
            print(f"    removed {old.name} (no notebook)")
    print(f"    published {len(notebooks)} decks into slides/: review `git diff --stat slides/`, then commit them")
    return 0


# ---------------------------------------------------------------------------------------------
# Vendored JavaScript and the README screenshot
# ---------------------------------------------------------------------------------------------


def vendor() -> int:
    """Fetch the pinned reveal.js and KaTeX packages with `npm pack` and copy the files decks load."""
    import fnmatch

    if shutil.which("npm") is None:
        print("vendor needs npm (Node.js) to fetch the packages from the npm registry", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        for package, (version, patterns) in VENDOR.items():
            subprocess.run(
                ["npm", "pack", "--silent", f"{package}@{version}"], cwd=tmp, check=True, stdout=subprocess.DEVNULL
            )
            tarball = Path(tmp) / f"{package}-{version}.tgz"
            strip, target = VENDOR_DIRS[package]
            dest = SLIDES / target
            if dest.exists():
                shutil.rmtree(dest)
            with tarfile.open(tarball) as tar:
                for member in tar.getmembers():
                    rel = member.name.removeprefix("package/")
                    if member.isfile() and any(fnmatch.fnmatch(rel, p) for p in patterns):
                        out = dest / rel.removeprefix(strip)
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_bytes(tar.extractfile(member).read())
            size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
            print(f"    slides/{target}/: {package} {version}, {size // 1024} KiB")
    return 0


def docs_shot(names=()) -> int:
    """Copy one deck screenshot (written by tests/test_browser.py) to docs/deck.png for the README."""
    name = names[0] if names else "01_memory_bill"
    shot = SCREENSHOTS / f"{name}.png"
    if not shot.exists():
        print(
            f"no {shot.relative_to(ROOT)}: run the browser tests first "
            "(.venv/bin/python -m pytest tests/test_browser.py -k deck)",
            file=sys.stderr,
        )
        return 2
    (ROOT / "docs").mkdir(exist_ok=True)
    shutil.copyfile(shot, ROOT / "docs" / "deck.png")
    print(f"    {shot.relative_to(ROOT)} -> docs/deck.png")
    return 0


if __name__ == "__main__":
    commands = {"execute": execute, "slides": slides, "publish": publish, "vendor": vendor, "docs-shot": docs_shot}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit("usage: python tools/build_course.py (execute | slides | publish | vendor | docs-shot) [NN ...]")
    command, args = commands[sys.argv[1]], sys.argv[2:]
    sys.exit(command() if command in (vendor, publish) else command(args))

"""The slide decks: one per notebook, up to date, opening with no network; and the rules that turn
a notebook into a deck (tools/build_course.py), checked on a small notebook made here.

The browser checks (slides counted and charts drawn in chromium) are in test_browser.py.
"""

from __future__ import annotations

import base64
import json
import re
import sys

import nbformat
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from tools import build_course as bc  # noqa: E402
from tools import editions as ed  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DECKS = sorted((ROOT / "slides").glob(f"*{bc.DECK_SUFFIX}"))
REBUILD = "run `make course`, then `make publish-slides`, and commit slides/"
# A 1 x 1 PNG: enough for nbconvert to embed an image output.
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"
    )
).decode()


def _deck_name(deck):
    return deck.name[: -len(bc.DECK_SUFFIX)]


def _meta(html: str, name: str) -> str:
    for tag in re.findall(r"<meta\b[^>]*>", html):
        attrs = dict(re.findall(r'(\w[\w-]*)="([^"]*)"', tag))
        if attrs.get("name") == name:
            return attrs["content"]
    raise AssertionError(f"the deck has no {name} meta tag: {REBUILD}")


def _leaf_sections(html: str) -> int:
    """Slides of a deck: <section>s that hold no other <section>."""
    body = re.sub(r"<aside class=\"notes.*?</aside>", "", html, flags=re.S)
    tags = re.findall(r"<(/?)section\b", body)
    leaves, has_child = 0, []
    for closing in tags:
        if not closing:
            if has_child:
                has_child[-1] = True
            has_child.append(False)
        else:
            leaves += 0 if has_child.pop() else 1
    return leaves


# ---------------------------------------------------------------------------------------------
# The committed decks
# ---------------------------------------------------------------------------------------------


def test_every_notebook_has_a_deck_and_every_deck_a_notebook():
    notebooks = {p.stem for p in NOTEBOOKS}
    decks = {_deck_name(d) for d in DECKS}
    assert not notebooks - decks, f"notebooks without a deck: {sorted(notebooks - decks)}; {REBUILD}"
    assert not decks - notebooks, f"decks without a notebook: {sorted(decks - notebooks)}; delete them"


@pytest.mark.parametrize("deck", DECKS, ids=_deck_name)
def test_deck_shows_the_current_notebook(deck):
    source = ROOT / "notebooks" / f"{_deck_name(deck)}.ipynb"
    if not source.exists():
        pytest.fail(f"{deck.name} has no notebook (see the test above)")
    html = deck.read_text()
    nb = nbformat.read(source, as_version=4)
    assert _meta(html, "course-fingerprint") == bc.fingerprint(nb), (
        f"{deck.name} was exported from another version of {source.name}: {REBUILD}"
    )
    slides = bc.expected_slides(nb)
    assert int(_meta(html, "course-slides")) == slides == _leaf_sections(html)
    assert slides >= 3, f"{deck.name}: {slides} slides is not a talk"
    title = re.search(r"<h1[^>]*>(.*?)<", html, re.S).group(1).strip()
    assert title == bc._title(nb), "the first slide is the notebook's title"
    charts = len(re.findall(r'<img\b[^>]*\bsrc="data:image/', html))
    assert int(_meta(html, "course-charts")) == charts


@pytest.mark.parametrize("deck", DECKS, ids=_deck_name)
def test_deck_loads_nothing_from_the_network(deck):
    html = deck.read_text()
    assert bc.remote_loads(html) == []
    # the same, said plainly: no script or stylesheet tag points at http(s):// or a protocol-relative URL
    tags = re.findall(r"<(?:script|link)\b[^>]*>", html, re.I)
    assert not [t for t in tags if re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", t, re.I)]


@pytest.mark.parametrize("deck", DECKS, ids=_deck_name)
def test_deck_finds_its_local_files(deck):
    local = [url for _, url in bc.loaded_urls(deck.read_text()) if not url.startswith(("data:", "#"))]
    assert {"reveal.js/dist/reveal.js", "reveal.js/dist/plugin/notes.js", "katex/katex.min.js"} <= set(local)
    missing = [url for url in local if not (deck.parent / url).is_file()]
    assert not missing, f"{deck.name} loads files that are not in slides/: {missing}"


#: What a build machine's path looks like: the checkout, a home folder, the temporary folder.
MACHINE_PATH = re.compile(r"(?<![\w.~-])(/home/|/Users/|/root/|/tmp/|/var/folders/|/private/var/)")
#: An absolute path into a checkout, wherever it was: /somewhere/course_utils/..., /somewhere/.venv/...
CHECKOUT_PATH = re.compile(r"(?<![\w.~:/-])(/[\w.-]+)+/(course_utils|\.venv|notebooks)/")


@pytest.mark.parametrize("deck", DECKS, ids=_deck_name)
def test_deck_shows_no_machine_paths(deck):
    html = deck.read_text()
    assert str(ROOT) not in html
    hits = list(MACHINE_PATH.finditer(html)) + list(CHECKOUT_PATH.finditer(html))
    found = sorted({html[m.start() : m.start() + 60].split('"')[0].split("\n")[0] for m in hits})
    assert not found, f"{deck.name} shows the build machine's paths {found[:3]}: {REBUILD}"


def test_vendored_files_are_complete_and_offline():
    for package, (_version, patterns) in bc.VENDOR.items():
        strip, target = bc.VENDOR_DIRS[package]
        for pattern in patterns:
            found = list((ROOT / "slides" / target).glob(pattern.removeprefix(strip)))
            assert found, (
                f"slides/{target}/{pattern.removeprefix(strip)} is missing: python tools/build_course.py vendor"
            )
    for css in (ROOT / "slides").rglob("*.css"):
        remote = [u for u in bc.css_urls(css.read_text()) if re.match(r"(https?:)?//", u)]
        assert not remote, f"{css.relative_to(ROOT)} loads {remote}"
    assert "speaker" in (ROOT / "slides" / "reveal.js" / "dist" / "plugin" / "notes.js").read_text().lower()


# ---------------------------------------------------------------------------------------------
# From notebook to deck, on a notebook made here
# ---------------------------------------------------------------------------------------------


def _md(text, kind="slide"):
    cell = nbformat.v4.new_markdown_cell(text)
    if kind:
        cell.metadata["slideshow"] = {"slide_type": kind}
    return cell


def _code(text, outputs=(), kind=None, tags=()):
    cell = nbformat.v4.new_code_cell(text)
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    if kind:
        cell.metadata["slideshow"] = {"slide_type": kind}
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _stdout(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def _image(text="the readout"):
    return {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG, "text/plain": text}}


def _notes(cell, notes="", more="", computed=False):
    cell.metadata["course"] = {k: v for k, v in (("notes", notes), ("more", more), ("computed", computed)) if v}
    return cell


def _filled(nb, cell_id, notes, more=""):
    """Put the text the build's filler cell displays after running (tools/editions.py) into ``nb``."""
    filler = next(c for c in nb.cells if c.get("id") == f"{cell_id}-filled")
    data = {"cell": cell_id, "notes": notes} | ({"more": more} if more else {})
    filler.outputs = [
        nbformat.from_dict({"output_type": "display_data", "metadata": {}, "data": {ed.NOTES_MIME: data}})
    ]


@pytest.fixture
def executed():
    """A small executed notebook (the teacher's edition the build runs) with one of each kind of cell."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.cells = [
        _md(
            "# 99 · A test deck\n\n**One promise.**\n\n[![Open In Colab](https://colab.research.google.com/"
            "assets/colab-badge.svg)](https://colab.research.google.com/x/99_test.ipynb)"
        ),
        _code("steps = 2", [], tags=("parameters",)),
        _code("import sys  # Colab set-up", [], kind="skip"),
        _notes(
            _md("## With $N$ ranks\n\nThe sum is $N(N+1)/2$; next: [notebook 02](02_next.ipynb)."),
            notes="Say this aloud, do not show it.",
            more="The long story, for when there is time.",
        ),
        _md("The notebook's own explanation, under the slide.", kind=None),
        _notes(
            _code("result = 3\nassert result == 3", [_stdout("checked\n")]),
            notes="The number to remember: **{result * 14} bytes**.",
            computed=True,
        ),
        _code(
            "chart()",
            [
                {
                    "output_type": "display_data",
                    "metadata": {},
                    "data": {"text/plain": "[  4.1s] rank 0: done (at 6/6 loss=5.2) | rank 1: done"},
                },
                _image(),
                _stdout("drawn\n"),
                {"output_type": "stream", "name": "stderr", "text": "a FutureWarning\n"},
                {
                    "output_type": "display_data",
                    "metadata": {},
                    "data": {
                        "application/vnd.jupyter.widget-view+json": {"model_id": "x"},
                        "text/plain": "VBox(children=...)",
                    },
                },
            ],
            kind="subslide",
        ),
        _code("a = 1\nb = 2\nc = 3\nd = 4\nprint('long cell')", [_stdout("long cell\n")], kind="fragment"),
        _code(
            "a = 1\nb = 2\nc = 3\nd = 4\nprint('shown')",
            [_stdout("shown\n")],
            kind="subslide",
            tags=(bc.SHOW_CODE_TAG,),
        ),
        _code("hidden_call()", [_stdout("short but hidden\n")], kind="-", tags=(bc.HIDE_CODE_TAG,)),
        _code("short_call()", [_stdout("short and shown\n")], kind="-"),
        _code("unmarked_chart()", [_image("not in the deck")]),
        _md("## Summary\n\n| a | b |\n|---|---|\n| 1 | 2 |"),
    ]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"t-{i:03d}"
    nb = ed.teacher_notebook(nb)
    _filled(nb, "t-005", "The number to remember: **42 bytes**.")
    return nb


def test_deck_keeps_slide_cells_only(executed):
    deck, warnings = bc.deck_notebook(executed, "99_test")
    sources = [c.source for c in deck.cells]
    assert not any("steps = 2" in s or "Colab set-up" in s or "assert result" in s or "filled in" in s for s in sources)
    kinds = [bc.slide_type(c) for c in deck.cells]
    assert kinds.count("notes") == 4  # two cells' notes, the slide's More, the deck's own keys note
    assert "The number to remember: **42 bytes**." in sources  # computed: the run's filled-in text
    assert "Say this aloud, do not show it." in sources
    more = next(s for s in sources if "The long story" in s)
    assert more.startswith("**More**") and "*In the notebook:*" in more and "under the slide" in more
    assert len(warnings) == 1 and "unmarked" not in warnings[0] and "chart" in warnings[0]
    assert "widgets" not in deck.metadata
    assert deck.metadata["title"] == "99 · A test deck"


def test_notes_follow_their_slide(executed):
    """Each cell's notes sit on its slide: the main notes after the cell, the More part at the slide's end."""
    deck, _ = bc.deck_notebook(executed, "99_test")
    order = [(bc.slide_type(c), c.source.split("\n")[0][:20]) for c in deck.cells]
    at = [i for i, (k, _) in enumerate(order) if k == "subslide"][0]  # the chart's slide starts here
    before = [src for k, src in order[:at] if k == "notes"]
    assert before[-1].startswith("**More**") and any(s.startswith("Say this") for s in before)
    assert any(s.startswith("The number") for s in before), "notes of a cell outside the deck reach its slide"


def test_computed_notes_must_have_been_filled_in(executed):
    for cell in executed.cells:
        if ed.INJECTED_TAG in cell.metadata.get("tags", []):
            cell.outputs = []
    with pytest.raises(ValueError, match="make notebooks"):
        bc.deck_notebook(executed, "99_test")


def test_fingerprint_follows_the_notes(executed):
    before = bc.fingerprint(executed)
    executed.cells[3].metadata["course"]["notes"] += " And one more thing."
    assert bc.fingerprint(executed) != before, "a deck whose notes changed is stale"


def test_deck_outputs_leave_out_widgets_and_warnings(executed):
    deck, _ = bc.deck_notebook(executed, "99_test")
    chart = next(c for c in deck.cells if c.cell_type == "code" and c.source == "chart()")
    kinds = [(o.output_type, sorted(o.get("data", {}))) for o in chart.outputs]
    assert kinds == [("display_data", ["image/png", "text/plain"]), ("stream", [])]
    assert chart.outputs[1].name == "stdout"


def test_deck_shows_short_code_and_hides_long_code(executed):
    """A short cell shows its source, small; a long one, one tagged slide-no-code, and any cell that draws a
    picture (the point is the picture, not the call) show only their outputs, unless tagged slide-code."""
    deck, _ = bc.deck_notebook(executed, "99_test")
    hidden = {c.source.splitlines()[-1] for c in deck.cells if c.get("metadata", {}).get("transient")}
    shown = {c.source.splitlines()[-1] for c in deck.cells if c.cell_type == "code"} - hidden
    assert hidden == {"print('long cell')", "hidden_call()", "chart()"}
    assert shown == {"print('shown')", "short_call()"}


def test_deck_markdown_loads_nothing_remote_and_links_decks(executed):
    deck, _ = bc.deck_notebook(executed, "99_test")
    title, section = deck.cells[0].source, deck.cells[2].source  # [1]: the deck's keys note
    assert (
        "colab-badge.svg" not in title and "[Open In Colab](https://colab.research.google.com/x/99_test.ipynb)" in title
    )
    assert "(02_next.slides.html)" in section


def test_deck_refuses_a_notebook_with_an_error(executed):
    executed.cells[5].outputs.append(
        nbformat.from_dict({"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []})
    )
    with pytest.raises(ValueError, match="AssertionError"):
        bc.deck_notebook(executed, "99_test")


def test_exported_deck(executed, tmp_path):
    path = tmp_path / "99_test.ipynb"
    nbformat.write(executed, path)
    html, _ = bc.export_deck(path)
    assert bc.remote_loads(html) == []
    assert _leaf_sections(html) == bc.expected_slides(executed) == int(_meta(html, "course-slides")) == 5
    assert int(_meta(html, "course-charts")) == 1 and 'alt="the readout"' in html
    assert html.count('<aside class="notes">') == 4 and "Say this aloud" in html and "42 bytes" in html
    assert "{result * 14}" not in html and "filled in from this run" not in html
    assert "'long cell'" not in html and "long cell" in html  # source hidden, output shown
    assert "'shown'" in html  # source shown: tagged slide-code
    assert "$N(N+1)/2$" in html  # KaTeX typesets it when the deck opens
    assert "FutureWarning" not in html and "VBox(children" not in html and "widget-state" not in html
    assert _meta(html, "course-fingerprint") == bc.fingerprint(executed)
    again, _ = bc.export_deck(path)
    assert again == html, "the same notebook gives the same deck, byte for byte (clean diffs)"


def test_a_stale_executed_notebook_is_refused(executed, tmp_path):
    path, source = tmp_path / "99_test.ipynb", tmp_path / "source.ipynb"
    nbformat.write(executed, path)
    executed.cells[3].source += " Edited after the run."
    nbformat.write(executed, source)
    with pytest.raises(ValueError, match="make notebooks"):
        bc.export_deck(path, source)


def test_fingerprint_ignores_outputs_and_papermill(executed):
    stripped = nbformat.from_dict(json.loads(json.dumps(executed)))
    for cell in stripped.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    banner = _md("An Exception was encountered", kind=None)
    banner.metadata["tags"] = ["papermill-error-cell-tag"]
    executed.cells.insert(0, banner)
    assert bc.fingerprint(stripped) == bc.fingerprint(executed)
    stripped.cells[0].source += "!"
    assert bc.fingerprint(stripped) != bc.fingerprint(executed)


@pytest.mark.parametrize(
    "snippet",
    [
        '<script src="https://unpkg.com/reveal.js/dist/reveal.js"></script>',
        '<link rel="stylesheet" href="//cdn.example.org/theme.css">',
        '<style>@import "https://fonts.googleapis.com/css?family=Lato";</style>',
        '<img src="http://example.org/badge.svg">',
        '<div style="background: url(https://example.org/x.png)"></div>',
    ],
)
def test_remote_loads_are_found(snippet):
    assert bc.remote_loads(f"<html><body>{snippet}</body></html>")


def test_links_are_not_loads():
    assert bc.remote_loads('<a href="https://colab.research.google.com/x">Open in Colab</a>') == []


# ---------------------------------------------------------------------------------------------
# Where decks go: build/slides/ on every build, slides/ only when published; machine paths scrubbed
# ---------------------------------------------------------------------------------------------


def test_export_scrubs_machine_paths(executed, tmp_path):
    import tempfile

    tmp = tempfile.gettempdir()
    executed.cells[5].outputs = [
        nbformat.from_dict(
            _stdout(
                f'File "{ROOT}/course_utils/examples.py", line 12\n'
                f"  {ROOT}/.venv/lib/python3.11/site-packages/torch/x.py\n"
                f"logs kept in {tmp}/course-run-1aiyrz7w/logs and /home/alice/runs/a.log and /root/.cache/x\n"
            )
        )
    ]
    executed.cells[5].metadata["slideshow"] = {"slide_type": "subslide"}
    path = tmp_path / "99_test.ipynb"
    nbformat.write(executed, path)
    html, _ = bc.export_deck(path)
    assert str(ROOT) not in html and not MACHINE_PATH.search(html) and not CHECKOUT_PATH.search(html)
    assert f"{tmp}/" not in html and "1aiyrz7w" not in html
    # what the room needs stays: the file within the course, the folder's name and role
    assert 'File "course_utils/examples.py", line 12' in html
    assert "TMPDIR/course-run-XXXXXXXX/logs" in html and "~/runs/a.log" in html and "~/.cache/x" in html
    assert "reveal.js/dist/reveal.js" in html  # relative paths are untouched


def test_build_writes_build_slides_and_publish_refreshes_slides(executed, tmp_path, monkeypatch):
    notebooks, build, built, published = (tmp_path / d for d in ("notebooks", "build", "built", "published"))
    for d in (notebooks, build, published):
        d.mkdir()
    nbformat.write(executed, build / "99_test.ipynb")
    stripped = nbformat.from_dict(json.loads(json.dumps(executed)))
    for cell in stripped.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(stripped, notebooks / "99_test.ipynb")
    (published / f"00_gone{bc.DECK_SUFFIX}").write_text("<html></html>")
    monkeypatch.setattr(bc, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(bc, "BUILD", build)

    assert bc.slides(out=built) == 0
    deck = built / f"99_test{bc.DECK_SUFFIX}"
    assert deck.is_file() and (built / "reveal.js" / "dist" / "reveal.js").is_file()  # opens from build/ too
    assert (built / "katex" / "katex.min.js").is_file()
    assert not (published / f"99_test{bc.DECK_SUFFIX}").exists(), "a build never writes the published decks"

    assert bc.publish(build=built, dest=published) == 0
    assert (published / f"99_test{bc.DECK_SUFFIX}").read_text() == deck.read_text()
    assert not (published / f"00_gone{bc.DECK_SUFFIX}").exists()  # its notebook is gone

    stripped.cells[3].source += " Edited after the build."
    nbformat.write(stripped, notebooks / "99_test.ipynb")
    assert bc.publish(build=built, dest=published) == 1  # a deck of an older version is not published


def test_built_decks_are_ignored_by_git():
    """`make course` writes only ignored paths, so a fresh clone's `git status` stays clean after it."""
    import subprocess

    assert bc.BUILD_SLIDES == ROOT / "build" / "slides" and bc.BUILD == ROOT / "build" / "notebooks"
    for path in ("build/slides/01_memory_bill.slides.html", "build/notebooks/01_memory_bill.ipynb"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert done.returncode == 0, f"{path} is not ignored by git"


# ---------------------------------------------------------------------------------------------
# What a teacher presents: every slide of every notebook passes the deck rules (issue 23)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_slide_can_be_presented(notebook):
    problems = bc.deck_lint(nbformat.read(notebook, as_version=4), notebook.stem)
    assert not problems, f"{len(problems)} slide(s) to fix:\n" + "\n".join(problems)


def test_deck_lint_finds_what_a_teacher_trips_over():
    nb = nbformat.v4.new_notebook()
    long = "A sentence that says a little more than it should. " * 12
    spoken = "The point is X; ask the class what happens at 4 ranks; the number to remember is 2 bytes. "
    nb.cells = [
        _md("# 99 · Title"),
        _notes(_md("## One point\n\nShort and clear.", kind="slide"), notes=spoken * 2, more=spoken * 20),
        _md("## Too long\n\n" + long, kind="slide"),
        _notes(_code("x = 2", []), notes="Notes long enough to speak from, with the point and a question. " * 2),
        _code("chart()", [], kind="subslide"),
        _md("## Dangling\n\nThe result is:", kind="slide"),
        _notes(_code("y = x + 1", []), notes="The run says {x} and then {y:,}; " * 6, computed=True),
        _md("## Maths by hand\n\nEach rank keeps 16Ψ/Nd bytes, or $16\\Psi/N_d$ written well.", kind="slide"),
        _notes(_md("Under the slide.", kind=None), notes="Too short."),
        _notes(_md("## Talks too much", kind="slide"), notes=spoken * 8),
        _notes(_md("## Reads what nobody defined", kind="slide"), notes="{z:.1f} and {x} " * 9, computed=True),
        _md("Left in the old form, a teacher's note the student would read.", kind="notes"),
    ]
    problems = bc.deck_lint(nb, "99_test")
    assert len(bc.slides_of(nb)) == 8
    assert any("slide 3" in p and "characters of prose" in p for p in problems)
    assert any("slide 4" in p and "notes missing" in p for p in problems)
    assert any("slide 4" in p and "no heading" in p for p in problems)
    assert any("slide 5" in p and "colon" in p for p in problems)
    assert not any("slide 5" in p and "notes" in p for p in problems), "computed notes count, a field as a word"
    assert any("slide 6" in p and "'Ψ'" in p for p in problems)
    assert any("slide 6" in p and "notes missing" in p for p in problems)
    assert any("slide 7" in p and "words of speaker notes" in p for p in problems)
    assert not any("slide 2" in p for p in problems), "More may be long: only the notes are glanced at"
    assert not any("slide 1 " in p for p in problems)
    assert any("reads z" in p for p in problems) and not any("reads x" in p for p in problems)
    assert any("1 notes cell(s) in the student's notebook" in p for p in problems)


def test_deck_lint_finds_long_tables_and_shown_picture_calls():
    nb = nbformat.v4.new_notebook()
    spoken = "The point, a question for the room and the number to remember, said in a sentence or two. " * 2
    rows = "\n".join(["| a | b |", "|---|---|"] + [f"| {i} | {i * 2} |" for i in range(11)])
    nb.cells = [
        _md("# 99 · Title"),
        _notes(_md("## Eleven rows\n\n" + rows, kind="slide"), notes=spoken),
        _notes(_md("## Ten rows\n\n" + "\n".join(rows.splitlines()[:-1]), kind="slide"), notes=spoken),
        _notes(
            _code("plots.show(plots.memory_chart_figure(view))", [], kind="slide", tags=(bc.SHOW_CODE_TAG,)),
            notes=spoken,
        ),
        _notes(_code("print(view)", [], kind="slide", tags=(bc.SHOW_CODE_TAG,)), notes=spoken),
    ]
    problems = bc.deck_lint(nb, "99_test")
    assert any("slide 2" in p and "table of 11 rows" in p for p in problems)
    assert not any("slide 3" in p for p in problems), "ten rows fit"
    assert any("slide 4" in p and "draws a picture" in p for p in problems)
    assert not any("slide 5" in p and "picture" in p for p in problems), "code that draws nothing may be shown"


def test_charts_say_their_smallest_text_and_draw_none_under_14_px():
    """plots.png raises any text a figure asks for below MIN_TEXT_PX, and StaticFigure records the smallest
    text it drew, which the decks use to show every chart large enough for it (issue 28)."""
    from course_utils import plots

    fig = plots.new_figure(7.5, 4.5)
    ax = fig.subplots()
    ax.plot([1, 2, 3], label="a line")
    ax.legend(fontsize=6)
    ax.set_xticks([0, 1, 2], ["a", "b", "c"], fontsize=5)
    assert plots.min_text_px(fig) < 9  # what the figure asked for
    chart = plots.StaticFigure(fig)
    assert plots.MIN_TEXT_PX == 14 and chart.size["course_min_text_px"] >= plots.MIN_TEXT_PX
    assert min(t.get_fontsize() for t in ax.get_xticklabels()) * fig.dpi / 72 >= plots.MIN_TEXT_PX
    assert chart.size["width"] == 750 and chart.size["height"] == 450  # the CSS size the deck scales from


def _timeline(buckets=8):
    return {
        "ready": [{"bucket": b, "t_ms": 10.0 + 18 * b, "param": f"p{b}"} for b in range(buckets)],
        "all_reduce": [{"bucket": b, "start_ms": 15.0 + 18 * b, "end_ms": 40.0 + 20 * b} for b in range(buckets)],
        "forward_ms": 60.0,
        "backward_end_ms": 170.0,
        "synced_ms": 190.0,
    }


@pytest.mark.parametrize(
    "draw",
    [
        lambda plots: plots.ddp_timelines_figure([_timeline(), _timeline()]),
        lambda plots: plots.zero3_schedule_frames(
            [__import__("course_utils.stepper").stepper.stage3_schedule(4)[i] for i in (2, -1)]
        ),
    ],
    ids=["ddp_timelines_two_ranks", "stage3_two_moments"],
)
def test_stacked_charts_fit_a_slide_with_readable_labels(draw):
    """The two charts that stacked panels (notebook 02's DDP timelines, notebook 03's stage-3 moments)
    fit a 1280 x 720 slide under a heading at their own size, where their labels are 14 px or more."""
    from course_utils import plots

    chart = plots.StaticFigure(draw(plots))
    assert chart.size["course_min_text_px"] >= plots.MIN_TEXT_PX
    assert chart.size["width"] <= 1270 and chart.size["height"] <= 640, chart.size

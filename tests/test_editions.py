"""Two editions from one source (issue 28): the student's notebook holds no teacher text and spoils no
prediction; the teacher's notes live in cell metadata, reach the deck, and are converted from the old
form (notes cells) by a script that changes nothing the second time.

The executed side (every slide's notes filled in from a real run, predictions against what the cells
print) is in test_notebooks.py, which runs every notebook as the teacher's edition.
"""

from __future__ import annotations

import copy
import json
import sys

import nbformat
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from tools import build_course as bc  # noqa: E402
from tools import editions as ed  # noqa: E402
from tools.editions import dumps  # noqa: E402
from tools.editions import stored_form as canonical

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _cell(kind, source, slide=None, cid=None):
    cell = {"cell_type": kind, "id": cid or f"c{abs(hash(source)) % 10**8}", "metadata": {}, "source": source}
    if slide:
        cell["metadata"]["slideshow"] = {"slide_type": slide}
    if kind == "code":
        cell |= {"outputs": [], "execution_count": None}
    return cell


def _old_form():
    """A notebook as the course wrote them before issue 28: notes cells after the cells they speak about."""
    cells = [
        _cell("markdown", "# 99 · Old form", "slide", "t-0"),
        _cell("code", "n = 4\nrows = [1, 2, 3]", None, "t-1"),
        _cell(
            "markdown",
            "Ask the room for the sum {before} the click.\n\n<!-- more -->\n\nThe long story.",
            "notes",
            "t-2",
        ),
        _cell(
            "code",
            "from IPython.display import Markdown, display\n\n"
            "total = sum(rows)\n"
            "a, b = rows[0], rows[-1]\n"
            'display(Markdown(f"**Remember:** {total} from {a} to {b}; " + "braces {kept}" + f" and {n:,} ranks"))',
            "notes",
            "t-3",
        ),
        _cell("markdown", "## Second\n\nText.", "slide", "t-4"),
        _cell("code", "big = True", None, "t-5"),
        _cell("code", 'if big:\n    display(Markdown(f"Only when big: {[r * 2 for r in rows]}"))', "notes", "t-6"),
        _cell("code", "print('not a notes shape')", "notes", "t-7"),
    ]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_convert_moves_each_notes_cell_into_the_cell_before_it():
    nb = _old_form()
    said = ed.convert(nb)
    ids = [c["id"] for c in nb["cells"]]
    assert ids == ["t-0", "t-1", "t-4", "t-5", "t-7"], "notes cells gone, the one of unknown shape left"
    assert any("t-7" in s and "LEFT" in s for s in said)
    meta = nb["cells"][1]["metadata"]["course"]
    # the static note's braces are escaped once it shares a cell with a computed one: one template language
    assert meta["notes"] == (
        "Ask the room for the sum {{before}} the click.\n\n"
        "**Remember:** {sum(rows)} from {rows[0]} to {rows[-1]}; braces {{kept}} and {n:,} ranks"
    )
    assert meta["more"] == "The long story." and meta["computed"] is True and "when" not in meta
    assert nb["cells"][3]["metadata"]["course"] == {
        "notes": "Only when big: {[r * 2 for r in rows]}",
        "computed": True,
        "when": "big",
    }
    assert ed.template_problems(nb) == []
    again = copy.deepcopy(nb)
    assert [s for s in ed.convert(again) if "LEFT" not in s] == [] and again == nb, "converting twice changes nothing"


def test_expand_then_convert_gives_the_same_notebook():
    nb = _old_form()
    ed.convert(nb)
    once = json.dumps(nb, sort_keys=True)
    added = ed.expand(nb)
    assert added == 2 and not any("course" in c["metadata"] for c in nb["cells"])
    ed.convert(nb)
    assert json.dumps(nb, sort_keys=True) == once


def test_long_notes_move_their_last_paragraphs_into_more():
    nb = {
        "cells": [
            _cell("markdown", "# 99", "slide", "t-0"),
            _cell("markdown", "## A slide", "slide", "t-1"),
            _cell(
                "markdown", "First paragraph, the point. " * 10 + "\n\n" + "Second, the detail. " * 30, "notes", "t-2"
            ),
        ]
    }
    said = ed.convert(nb)
    meta = nb["cells"][1]["metadata"]["course"]
    assert meta["notes"].startswith("First") and meta["more"].startswith("Second") and "notes" in meta
    assert any("slide 2" in s and "More" in s for s in said)
    assert ed.words(meta["notes"]) <= ed.NOTES_MAX_WORDS


def test_words_count_a_field_and_a_formula_as_one():
    assert ed.words("{psi:,} parameters hold $16\\Psi$ bytes, {{literal}} braces") == 7
    assert ed.words("**Point:** the `launch` call; 2 + 2 = 4.") == 7


def test_template_problems_name_what_is_missing():
    nb = {"cells": [_cell("code", "x = 1\nfor i in range(3):\n    y = i", None, "a")]}
    nb["cells"][0]["metadata"]["course"] = {"notes": "{x} {y} {z} {[q for q in (x, y)]}", "computed": True}
    problems = ed.template_problems(nb)
    assert len(problems) == 1 and "reads z," in problems[0] + "," and "q" not in problems[0]
    nb["cells"][0]["metadata"]["course"] = {"notes": "{x", "computed": True}
    assert "not a valid f-string" in ed.template_problems(nb)[0]
    nb["cells"][0]["metadata"]["course"] = {"notes": "{x}", "when": "x > 0"}
    assert "`when` needs `computed: true`" in ed.template_problems(nb)[0]


def test_the_teachers_edition_fills_notes_in_after_their_cell(monkeypatch):
    """The filler cell the build runs after a computed cell formats its template in the kernel's namespace
    (backslashes stay text, as the notes' maths needs), and an unmet ``when`` fills in nothing."""
    import IPython.display

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 3", id="a"), nbformat.v4.new_code_cell("y = 0", id="b")]
    nb.cells[0].metadata["course"] = {"notes": "$\\Psi$ = {x * 14:,} bytes", "more": "{x!r}", "computed": True}
    nb.cells[1].metadata["course"] = {"notes": "never {1 / y}", "computed": True, "when": "y"}
    teacher = ed.teacher_notebook(nb)
    assert [c.id for c in teacher.cells] == ["a", "a-filled", "b", "b-filled"] and len(nb.cells) == 2
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    namespace = {}
    for cell in teacher.cells:
        exec(cell.source, namespace)  # noqa: S102 (the build's own cells, as a kernel runs them)
        if ed.INJECTED_TAG in cell.metadata.get("tags", []):
            cell.outputs = [nbformat.from_dict({"output_type": "display_data", "metadata": {}, "data": shown[-1]})]
    filled = ed.filled_notes(teacher)
    assert filled == {"a": {"notes": "$\\Psi$ = 42 bytes", "more": "3"}, "b": {"notes": "", "more": ""}}
    assert bc.fingerprint(teacher) == bc.fingerprint(nb), "the filler cells are not part of the notebook"


# ---------------------------------------------------------------------------------------------
# What the checks of the student's edition find
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Ask the room for the four numbers before the click.",
        "**Point:** sharding moves bytes.",
        "Take a show of hands: more, or less?",
        "The next slide says why.",
        "Read the printed line aloud.",
        "Ask: why keep a second copy? (A small update can round away.)",
        "The number to remember: 12 elements.",
        "Walk through the three methods with the room.",
    ],
)
def test_teacher_sentences_are_found(text):
    nb = {"cells": [_cell("markdown", "## A slide\n\n" + text, "slide")]}
    assert ed.teacher_text(nb), text


@pytest.mark.parametrize(
    "text",
    [
        "Stage 1 fits with room to spare.",
        "The c10d rendezvous hands out the ranks.",
        "Documentation uses the FSDP1 class, `FullyShardedDataParallel`.",
        "Ask FSDP2 itself: one real-size training step.",
        "If the release is not published yet, ask your teacher for the link.",
    ],
)
def test_student_sentences_are_not_taken_for_teacher_text(text):
    nb = {"cells": [_cell("markdown", "## A slide\n\n" + text, "slide")]}
    assert not ed.teacher_text(nb), text


def test_a_notes_cell_is_teacher_text_whatever_it_says():
    nb = {"cells": [_cell("markdown", "Plain words.", "notes"), _cell("code", 'display(Markdown(f"{x} GB"))', "notes")]}
    found = ed.teacher_text(nb)
    assert [f["kind"] for f in found] == ["notes cell", "notes cell"] and found[0]["words"] == 2


def _spoiled(*cells):
    return ed.spoiled_predictions({"cells": list(cells)})


def _run(source, printed):
    cell = _cell("code", source)
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": printed}]
    return cell


def test_a_prediction_answered_after_its_cell_is_not_spoiled():
    prompt = _cell("markdown", "## Sums\n\n**Predict, then run.** With $N$ ranks, what does each hold? (Hint: add.)")
    heading = _cell("markdown", "### What does every rank hold?", "subslide")
    answer = _cell("markdown", "Every rank holds 10.")
    assert _spoiled(prompt, heading, _run("total = sum(range(1, n + 1))", "total 10\n"), answer) == []


@pytest.mark.parametrize(
    "between, printed, reason",
    [
        ([_cell("markdown", "### Every rank holds ten", "subslide")], "10\n", "heading between"),
        ([_cell("markdown", "The answer is ten: 1 + 2 + 3 + 4.")], "10\n", "prose between"),
        ([_cell("markdown", "Ask for the sum.", "notes")], "10\n", "teacher notes between"),
        ([], "total 1,600 bytes\n", "shows what its cells compute: 1600"),
    ],
)
def test_spoiled_predictions_are_found(between, printed, reason):
    prompt = _cell("markdown", "*Predict:* the sum over 4 ranks? It is near 1{,}600.")
    found = _spoiled(prompt, *between, _run("total = sum(r + 1 for r in range(4))", printed))
    assert found and any(reason in r for r in found[0]["reasons"]), found


def test_a_prompt_that_answers_itself_is_found():
    prompt = _cell("markdown", "*Predict:* what does rank 1 hold? (Rank 0's values.)")
    assert "answers itself" in _spoiled(prompt, _run("x = 1", "rank 1 holds 1\n"))[0]["reasons"][0]


def test_givens_in_a_prompt_are_not_results():
    """A number the code or the text before already holds (an input, not a result) is no spoiler."""
    before = _cell("markdown", "GPT-2 has $h = 1{,}600$.")
    prompt = _cell("markdown", "*Predict:* with $h = 1{,}600$ and $b = 32$, how many GB? Stage 3 on 64 GPUs?")
    cell = _run("h, b = 1600, 32\nprint(bill(h, b, nd=64))", "h = 1600, b = 32: 60.4 GB on 64 GPUs\n")
    assert _spoiled(before, prompt, cell) == []


# ---------------------------------------------------------------------------------------------
# The course's notebooks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_converted(path):
    """Every notebook is in the two-editions form: converting it (nb_canonical does) changes nothing."""
    text = path.read_text(encoding="utf-8")
    said = []
    assert dumps(canonical(json.loads(text), said)) == text and not said, (
        f"{path.name}: {said[:3]}; run `.venv/bin/python tools/nb_canonical.py {path.relative_to(ROOT)}`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_edition_has_no_teacher_text(path):
    found = ed.teacher_text(json.loads(path.read_text()))
    assert not found, (
        f"{path.name}: teacher text a student reads (move it into the cell's `course.notes`): "
        + "; ".join(f"cell {f['cell']}: {f['text'][:90]!r}" for f in found[:5])
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_edition_spoils_no_prediction(path):
    found = ed.spoiled_predictions(json.loads(path.read_text()))
    assert not found, f"{path.name}: predictions answered before their cell runs: " + "; ".join(
        f"cell {s['cell']}: {s['reasons'][0]}" for s in found[:5]
    )


def test_every_notebook_has_predictions():
    """The checks above are about something: each notebook asks the student to predict."""
    for path in NOTEBOOKS:
        assert len(ed.predictions(json.loads(path.read_text()))) >= 3, path.name

"""The notebooks' exercises (course_utils.exercises, notebooks 01-06).

Every check passes on the reference solutions, says "not done" on the untouched stubs (without
launching anything), and fails with its message in the exercise's terms on a known wrong
answer. The distributed checks of solutions and mistakes share one launch.
"""

import json
import linecache

import pytest
from mistakes import ALSO_RIGHT, MISTAKES

from course_utils import cli
from course_utils.errors import CourseInputError
from course_utils.exercises import core
from tools import exercise_cells


def test_every_notebook_has_at_least_two_exercises():
    exs = core.exercises()
    assert len(exs) >= 14
    for nb in core.NOTEBOOKS:
        assert len(core.exercises(nb)) >= 2, nb
    for ex in exs:
        assert len(ex.hints) >= 2 and ex.task and ex.checks
        assert (ex.judge is None) != (ex.on_rank is None and ex.verdict is None), ex.key
        assert (ex.notebook, ex.name) in MISTAKES, f"{ex.key} has no known wrong answer"


def test_notebook_sections_are_the_records():
    """The Exercises cells of each notebook are what tools/exercise_cells.py writes from the records."""
    for nb in core.NOTEBOOKS:
        data = json.loads(exercise_cells.notebook_path(nb).read_text())
        cells = [c for c in data["cells"] if c["id"].startswith(f"{nb}-ex-")]
        assert cells == exercise_cells.section(nb), f"notebook {nb}: run python -m tools.exercise_cells {nb}"
        assert data["cells"][-len(cells) :] == cells  # the section ends the notebook
        tasks = [c for c in cells if c["source"].startswith("### Exercise")]
        assert all(c["metadata"]["slideshow"]["slide_type"] == "slide" for c in tasks)
        stubs = [c for c in cells if c["cell_type"] == "code" and "NotImplementedError" in c["source"]]
        assert all(c["metadata"]["slideshow"]["slide_type"] == "skip" for c in stubs)


def test_stubs_are_not_done_without_launching(monkeypatch):
    import course_utils.launch as launch_module

    def no_launch(*args, **kwargs):
        raise AssertionError("a stub must be recognised without starting processes")

    monkeypatch.setattr(launch_module, "launch", no_launch)
    outcomes = core.run_all("stubs")
    assert [o.status for o in outcomes] == [core.NOT_DONE] * len(outcomes)
    assert all(f"show_hint({o.notebook!r}, {o.name!r}, 1)" in o.message for o in outcomes)


def test_solutions_pass_and_known_mistakes_fail_with_their_message():
    pairs, expected = [], []
    for ex in core.exercises():
        pairs.append((ex, core.solution(ex.notebook, ex.name)))
        expected.append((core.PASSED, None))
        for fn, words in MISTAKES[(ex.notebook, ex.name)]:
            pairs.append((ex, fn))
            expected.append((core.FAILED, words))
        for fn in ALSO_RIGHT.get((ex.notebook, ex.name), ()):
            pairs.append((ex, fn))
            expected.append((core.PASSED, None))
    outcomes = core.check_many(pairs)
    for (ex, fn), outcome, (status, words) in zip(pairs, outcomes, expected):
        assert outcome.status == status, (ex.key, fn.__name__, outcome.message)
        if ex.after_pass:  # the Predict's answer: shown under a pass, never under a wrong answer
            assert (ex.after_pass.split("\n")[0][:60] in outcome.shown()) == (status == core.PASSED), ex.key
        if words:
            assert words in outcome.message, (ex.key, fn.__name__, outcome.message)
            assert "Traceback" not in outcome.message and "\n" not in outcome.message


def test_after_pass_text_is_shown_on_a_pass_only():
    """Exercise 01.1's answer prose (its record's ``after_pass``) reaches the notebook only under a passing
    check: not under a wrong answer, an error or an untouched stub (no launch: the outcomes are built
    the way ``_verdict`` builds them)."""
    from IPython.lib.pretty import pretty

    ex = core.get("01", "zero_state_bytes")
    first = ex.after_pass.split("\n")[0][:60]
    assert first.startswith("Why no rank holds exactly 8Ψ/Nd")
    failed = core._verdict(ex, {0: {"wrong": "you returned 0"}, 1: {"value": {"bytes": 0}}})
    errored = core._verdict(ex, {0: {"error": "your code raised KeyError"}})
    not_done = core._verdict(ex, {0: {"not_done": True}})
    for o in (failed, errored, not_done):
        assert not o.passed and not o.after_pass
        assert first not in pretty(o) and first not in o.shown() and "Why no rank" not in str(o)
    passed = core._outcome(ex, core.PASSED, "matches the course's reference on 4 real ranks")
    assert pretty(passed).startswith(str(passed)) and first in pretty(passed)
    assert "\n" not in str(passed) and passed.to_dict()["message"] == passed.message  # grading reads one line


def test_the_bf16_predict_is_answered_from_the_measurement_on_a_pass_only():
    """Exercise 01.3 asks whether bf16 halves a block's activations: a pass shows the reference's bytes, both
    dtypes, their ratio and the tensors kept in fp32 (read from the graph); a wrong answer shows none of it."""
    import torch

    from course_utils import memory
    from course_utils.exercises import nb01

    measured = {(d, b): memory.measure_activation_bytes(nb01._OneBlock(blk), x) for blk, x, d, b in nb01.block_cases()}
    fp32, bf16 = measured[torch.float32, 2]["total"], measured[torch.bfloat16, 2]["total"]
    kept = sum(t.untyped_storage().nbytes() for _, t in nb01._kept_in_fp32(measured[torch.bfloat16, 2]["loss"]))
    assert bf16 - kept == (fp32 - kept) // 2  # all but the fp32-kept tensors halve, to the byte
    right, wrong = core.check_many(
        [(core.get("01", "block_activation_bytes"), core.solution("01", "block_activation_bytes"))]
        + [(core.get("01", "block_activation_bytes"), fn) for fn, _ in MISTAKES[("01", "block_activation_bytes")][:1]]
    )
    reading = f"{fp32:,} bytes saved in fp32, {bf16:,} in bf16, {bf16 / fp32:.3f}"
    shown = " ".join(right.shown().split())  # shown() wraps its paragraphs at 100 characters
    assert right.passed and reading in shown and f"still saves {kept:,} bytes in fp32" in shown
    assert not wrong.passed and "bytes saved in fp32" not in wrong.shown()


def test_after_check_replays_wait_for_a_pass():
    """The after-check cells that replay an answer (01.1, 05.2) ask ``passed`` first: false before any check,
    false after a wrong answer, true once the solution passes, false again after a later wrong answer."""
    from course_utils.exercises import passed

    core._PASSED.discard("05.exposed_comm")
    assert not passed("05", "exposed_comm")
    assert not core.check("05", "exposed_comm", lambda *a: (0.0, 0.0)).passed
    assert not passed("05", "exposed_comm")
    assert core.check("05", "exposed_comm", core.solution("05", "exposed_comm")).passed
    assert passed("05", "exposed_comm") and not passed("01", "zero_state_bytes")
    core.check("05", "exposed_comm", lambda *a: (0.0, 0.0))
    assert not passed("05", "exposed_comm")


def _cell_function(source: str, name: str, cell: int):
    """Define ``name`` the way a notebook cell does: module ``__main__``, source kept in linecache
    (how the not-done detection reads a stub), sent to the workers by value by ``launch``."""
    filename = f"<ipython-input-{cell}>"  # IPython registers each cell's source under such a name
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(core.CELL_GLOBALS, namespace)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def test_a_function_written_in_a_cell_is_checked_on_real_ranks():
    """A function with no module (as a notebook cell defines it) travels to the workers by value."""
    fn = _cell_function(
        "def averaging_hook(grad):\n    g = grad.clone()\n    dist.all_reduce(g)\n"
        "    return g / dist.get_world_size()\n",
        "averaging_hook",
        1,
    )
    broken = _cell_function("def averaging_hook(grad):\n    return grad.undefined_thing\n", "averaging_hook", 2)
    stub = _cell_function(core.get("02", "averaging_hook").stub, "averaging_hook", 3)
    assert fn.__module__ == "__main__"
    ex = core.get("02", "averaging_hook")
    ok, bad, not_done = core.check_many([(ex, fn), (ex, broken), (ex, stub)])
    assert ok.status == core.PASSED, ok.message
    # a student's exception is one line that names it, not a traceback wall
    assert bad.status == core.FAILED and "AttributeError" in bad.message and "\n" not in bad.message
    assert not_done.status == core.NOT_DONE and core.is_stub(stub)


def test_hints_open_one_at_a_time_and_solutions_load(capsys):
    text = core.hint_text("02", "averaging_hook", 1)
    assert text.startswith("Hint 1 of 3") and "show_hint('02', 'averaging_hook', 2)" in text
    assert "the last hint" in core.hint_text("02", "averaging_hook", 3)
    with pytest.raises(CourseInputError):
        core.hint_text("02", "averaging_hook", 4)
    for past in (4, 0, "2"):  # asking past the last hint (or for no hint) prints one line, not a traceback
        core.show_hint("02", "averaging_hook", past)
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "has hints 1 to 3" in out[0] and "load_solution('02', 'averaging_hook')" in out[0]
    fn = core.load_solution("01", "smallest_nd")
    assert "def smallest_nd" in capsys.readouterr().out
    assert core.check("01", "smallest_nd", fn).passed
    with pytest.raises(CourseInputError):
        core.get("07", "anything")
    with pytest.raises(CourseInputError):
        core.get("02", "no_such_exercise")


def test_cli_lists_every_exercise_and_rejects_bad_input(capsys):
    assert cli.main(["exercises", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(r["notebook"], r["name"]) for r in listing] == [(e.notebook, e.name) for e in core.exercises()]
    assert cli.main(["exercises", "--grade", "no-such.ipynb"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no notebook" in err
    for flags, words in (
        (["--memory", "100MiB"], "--memory below 512 MiB"),
        (["--pids", "8"], "--pids below 64"),
        (["--time", "0"], "--time must be"),
        (["--disk", "lots"], "--disk: cannot read"),
        (["--jobs", "0"], "--jobs must be 1 or more"),
        (["--names", "email"], "--names takes"),
    ):
        assert cli.main(["exercises", "--grade", ".", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, (flags, err)

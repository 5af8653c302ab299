"""The checking machinery behind every notebook's "Exercises" section (notebooks 01 to 06).

An ``Exercise`` is one record: its task (markdown), the stub the student fills in, its hints,
and how it is checked. A check runs the student's function the way the course runs its own:
in this process for arithmetic, on real ranks through ``course_utils.launch.launch`` for
anything distributed, and compares the result with the course's reference (the same functions
the notebook's lecture cells call). The answer is one ``Outcome``: passed, failed with one
sentence in the exercise's terms, or not done (the stub is untouched). A check never raises on
a wrong answer, so a notebook with untouched stubs still runs from top to bottom.

Notebook side::

    from course_utils.exercises import check, show_hint, load_solution
    check("02", "averaging_hook", averaging_hook)     # prints passed / failed: why / not done
    show_hint("02", "averaging_hook", 1)              # hints open one at a time
    averaging_hook = load_solution("02", "averaging_hook")   # prints the reference, defines it

Teacher side: ``python -m course_utils exercises --json | --run solutions | --run stubs |
--grade NOTEBOOKS...`` (``command``); grading a class, sealed, is ``grading``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import CourseInputError

NOTEBOOKS = ("01", "02", "03", "04", "05", "06")
#: What an untouched stub raises; any NotImplementedError counts as "not done".
STUB_MARKER = "NotImplementedError"
PASSED, FAILED, NOT_DONE = "passed", "failed", "not done"
#: Only the grader says these: the reference solution was used; the notebook could not be graded.
REFERENCE, UNGRADED = "reference used", "could not be graded"
#: Held while a check launches the course's own code for a reference (``nb04.measured_layouts``,
#: ``nb06.uninterrupted``): a grader judges several notebooks at once, from threads, and one launch at a time
#: keeps the launcher's agent server to one caller.
REFERENCE_LAUNCH = threading.Lock()
#: A check cell: ``check("NN", "name", ...)``.
CHECK_CALL = r"""check\(\s*["'](\d\d)["']\s*,\s*["'](\w+)["']"""


class Wrong(Exception):
    """Raised inside a check with the one sentence a student sees (notebooks 01-06)."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: what the student reads, writes and is checked on (notebooks 01-06).

    Either ``judge(fn)`` runs in this process and raises ``Wrong("...")`` on a wrong answer, or
    (distributed exercises, ``nproc`` > 0) ``on_rank(fn, info)`` runs on every rank of a launch
    and returns plain data, and ``verdict(results_by_rank)`` raises ``Wrong`` on a wrong answer (it may
    return a reading to report beside the pass).

    The contract that lets a teacher trust a grade (``grading``): the student's code runs where ``fn``
    is called, and everything there can be changed by it. So ``on_rank`` only reports what the
    student's code produced (tensors, numbers) and what was measured around it, and ``verdict``
    computes every reference itself (from the course's functions, or a cached launch of the course's
    own code) and decides: it runs in the grader's process, where no student code ever runs. A
    ``judge`` calls ``fn`` and compares its return values; the grader hands it a stand-in that runs
    the student's function in the seal and returns plain data. Plain data only, both ways: numbers,
    strings, lists, tuples, dicts and tensors.
    """

    notebook: str
    name: str
    title: str
    checks: str  # what the check compares, in one sentence
    task: str  # the markdown the student reads
    stub: str  # the code cell the student fills in (defines ``name``)
    hints: tuple[str, ...]
    judge: Callable | None = None
    on_rank: Callable | None = None
    verdict: Callable | None = None
    nproc: int = 0
    timeout_s: float = 60.0
    after_pass: str = ""  # shown under a passing check only, never before the student's answer passes

    @property
    def key(self) -> str:
        return f"{self.notebook}.{self.name}"

    def describe(self) -> dict:
        return {
            "notebook": self.notebook,
            "name": self.name,
            "title": self.title,
            "checks": self.checks,
            "distributed": bool(self.nproc),
            "nproc": self.nproc,
            "hints": len(self.hints),
        }


@dataclass
class Outcome:
    """A check's answer: ``status`` is "passed", "failed" or "not done"; ``message`` one sentence."""

    notebook: str
    name: str
    status: str
    message: str = ""
    after_pass: str = ""  # the exercise's ``after_pass``, kept on a pass only

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def shown(self) -> str:
        """What the notebook shows: the one-line answer, then on a pass the exercise's ``after_pass`` text."""
        if not (self.passed and self.after_pass):
            return str(self)
        paragraphs = [textwrap.fill(line, 100) for line in self.after_pass.split("\n")]
        return "\n\n".join([str(self), *paragraphs])

    def to_dict(self) -> dict:
        return {"notebook": self.notebook, "name": self.name, "status": self.status, "message": self.message}

    def __str__(self) -> str:
        mark = {PASSED: "PASSED", FAILED: "NOT YET", NOT_DONE: "NOT DONE"}.get(self.status, self.status.upper())
        return f"[{mark}] exercise {self.notebook}.{self.name}" + (f": {self.message}" if self.message else "")

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the sentence, not a dataclass dump
        p.text(self.shown())


REGISTRY: dict[tuple[str, str], Exercise] = {}
#: The exercises whose check has passed in this process (a kernel): their after-check cells show their replay.
_PASSED: set[str] = set()


def register(ex: Exercise) -> Exercise:
    """Add an exercise to the registry (each ``nbNN`` module registers its own at import)."""
    REGISTRY[(ex.notebook, ex.name)] = ex
    return ex


def _load(notebooks=NOTEBOOKS) -> None:
    """Import the exercise modules of these notebooks (each registers its exercises); a notebook's
    check imports only its own, so the section adds nothing heavy to the notebook's run."""
    for nb in notebooks:
        try:
            importlib.import_module(f"course_utils.exercises.nb{nb}")
        except ModuleNotFoundError as exc:  # a notebook without exercises yet
            if exc.name != f"course_utils.exercises.nb{nb}":
                raise


def exercises(notebook: str | None = None) -> list[Exercise]:
    """Every exercise, in notebook order (or one notebook's) (notebooks 01-06)."""
    _load(NOTEBOOKS if notebook is None else (_nb(notebook),))
    out = [ex for ex in REGISTRY.values() if notebook is None or ex.notebook == _nb(notebook)]
    return sorted(out, key=lambda ex: NOTEBOOKS.index(ex.notebook))


def _nb(notebook) -> str:
    text = str(notebook).zfill(2)
    if text not in NOTEBOOKS:
        raise CourseInputError(f"notebook {notebook!r} has no exercises; choose one of {', '.join(NOTEBOOKS)}")
    return text


def get(notebook, name: str) -> Exercise:
    """The exercise ``name`` of ``notebook`` ("02" or 2), or a CourseInputError that lists the names."""
    nb = _nb(notebook)
    _load((nb,))
    ex = REGISTRY.get((nb, name))
    if ex is None:
        names = ", ".join(n for (b, n) in REGISTRY if b == nb)
        raise CourseInputError(f"notebook {nb} has no exercise {name!r}; its exercises are: {names}")
    return ex


# ---------------------------------------------------------------------------------------------
# Not done, and how a student's error reads
# ---------------------------------------------------------------------------------------------


def is_stub(fn) -> bool:
    """True when ``fn`` is an untouched stub: its body (after a docstring) starts by raising
    NotImplementedError (notebooks 01-06). Found from the source, so nothing is launched for it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        code = getattr(fn, "__code__", None)  # no source (exec'd): a tiny body that names the marker
        return code is not None and STUB_MARKER in code.co_names and len(code.co_code) < 40
    node = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))), None)
    if node is None:
        return False
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if isinstance(node, ast.ClassDef):  # a class stub: its first method decides
        method = next((s for s in body if isinstance(s, ast.FunctionDef)), None)
        body = (
            []
            if method is None
            else [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        )
    first = body[0] if body else None
    if not isinstance(first, ast.Raise) or first.exc is None:
        return False
    target = first.exc.func if isinstance(first.exc, ast.Call) else first.exc
    return isinstance(target, ast.Name) and target.id == STUB_MARKER


def student_error(exc: BaseException) -> str:
    """One line for an exception raised by the student's code: its type, message and where."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [
        f
        for f in frames
        if "course_utils" not in f.filename.replace("\\", "/").split("/site-packages/")[-1] or "<" in f.filename
    ]
    where = f" (line {mine[-1].lineno}: {mine[-1].line.strip()})" if mine and mine[-1].line else ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"your code raised {type(exc).__name__}{': ' + text if text else ''}{where}"


def _outcome(ex: Exercise, status: str, message: str = "") -> Outcome:
    return Outcome(ex.notebook, ex.name, status, message, ex.after_pass if status == PASSED else "")


def _not_done(ex: Exercise) -> Outcome:
    return _outcome(
        ex,
        NOT_DONE,
        f"the stub is untouched: fill in {ex.name} above, then run this cell again "
        f"(hints: show_hint({ex.notebook!r}, {ex.name!r}, 1))",
    )


# ---------------------------------------------------------------------------------------------
# Running on real ranks: the student's function travels with the launch (by value when it was
# written in a notebook cell: ``launch`` serialises its arguments with cloudpickle)
# ---------------------------------------------------------------------------------------------

#: Names a stub may use without importing them (what ``run_stub`` defines it with).
CELL_GLOBALS = (
    "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
    "import torch.distributed as dist\n"
)


def run_on_ranks(jobs: list) -> list:
    """Worker: run each ``(notebook, name, fn)`` job's ``on_rank`` on this rank, in order.

    A job whose student code raises returns ``{"error": one line}``; the other jobs still run.
    """
    from .. import dist as cdist

    out = []
    with cdist.session() as info:
        for notebook, name, fn in jobs:
            ex = get(notebook, name)
            try:
                out.append({"value": ex.on_rank(fn, info)})
            except NotImplementedError:
                out.append({"not_done": True})
            except Wrong as exc:
                out.append({"wrong": str(exc)})
            except Exception as exc:  # the student's code: one line, never a traceback wall
                out.append({"error": student_error(exc)})
    return out


# ---------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------


def _judge_local(ex: Exercise, fn) -> Outcome:
    try:
        said = ex.judge(fn)  # a judge may measure the Predict's answer: shown under a pass, before after_pass
    except NotImplementedError:
        return _not_done(ex)
    except Wrong as exc:
        return _outcome(ex, FAILED, str(exc))
    except Exception as exc:
        return _outcome(ex, FAILED, student_error(exc))
    outcome = _outcome(ex, PASSED, "matches the course's reference")
    outcome.after_pass = "\n".join(text for text in (said, outcome.after_pass) if text)
    return outcome


@contextmanager
def _one_intra_op_thread():
    """Compute a verdict's reference on one intra-op thread, then restore the caller's setting.

    Measured (tests/test_exercises.py's solutions test, 2 cores): after the checks' launches, the first
    Adam reference that ``nb03.reference_steps`` computed in this process on torch's 2 intra-op threads came
    out different in the first half of its 118,528 elements in 6 of 10 processes (relative 1.4e-5; a second
    computation in the same process was right); on one thread in 0 of 14. Not traced into ATen; the ranks,
    which run on one thread each, always agreed with the one-thread reference.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _verdict(ex: Exercise, per_rank: dict) -> Outcome:
    for rank in sorted(per_rank):
        r = per_rank[rank]
        if r.get("not_done"):
            return _not_done(ex)
        if "wrong" in r:
            return _outcome(ex, FAILED, f"rank {rank}: {r['wrong']}")
        if "error" in r:
            return _outcome(ex, FAILED, f"on rank {rank}, {r['error']}")
    try:
        with _one_intra_op_thread():
            said = ex.verdict({rank: r["value"] for rank, r in per_rank.items()})  # a verdict may report a reading
    except Wrong as exc:
        return _outcome(ex, FAILED, str(exc))
    return _outcome(
        ex, PASSED, f"matches the course's reference on {len(per_rank)} real ranks" + (f"; {said}" if said else "")
    )


def check_many(pairs: list) -> list[Outcome]:
    """Check several ``(exercise, fn)`` pairs; the distributed ones share one launch per world size.

    Each launch costs about a second, so the tests and ``--run`` batch their checks here.
    """
    from ..launch import LaunchError, launch

    results: dict[int, Outcome] = {}
    batches: dict[int, list] = {}
    for i, (ex, fn) in enumerate(pairs):
        if fn is None or is_stub(fn):
            results[i] = _not_done(ex)
        elif ex.nproc:
            batches.setdefault(ex.nproc, []).append(i)
        else:
            results[i] = _judge_local(ex, fn)
    for nproc, idxs in batches.items():
        jobs = [(pairs[i][0].notebook, pairs[i][0].name, pairs[i][1]) for i in idxs]
        timeout = sum(pairs[i][0].timeout_s for i in idxs)
        try:
            # gloo on CPU everywhere: the checks build their tensors on the CPU, and a check is about
            # correctness and bytes, which the CPU shows exactly (NCCL needs every tensor on a GPU).
            run = launch(run_on_ranks, nproc=nproc, args=(jobs,), timeout_s=timeout, progress=False, backend="gloo")
        except LaunchError as exc:
            for i in idxs:
                results[i] = _outcome(pairs[i][0], FAILED, ranks_failed(str(exc).strip().splitlines()[0]))
            continue
        for j, i in enumerate(idxs):
            results[i] = _verdict(pairs[i][0], {rank: values[j] for rank, values in run.items()})
    for i, (ex, _) in enumerate(pairs):
        (_PASSED.add if results[i].passed else _PASSED.discard)(ex.key)
    return [results[i] for i in range(len(pairs))]


def passed(notebook, name: str) -> bool:
    """Whether the last check of exercise ``name`` in this kernel passed (notebooks 01 and 05).

    An after-check cell that replays the exercise's answer asks this first, so the answer shows only
    once the student's own code (or the loaded solution) has passed the check.
    """
    return get(notebook, name).key in _PASSED


def ranks_failed(first_line: str) -> str:
    """What a distributed check says when its launch did not return (a hang, a crash of a rank)."""
    return (
        f"the ranks did not finish together ({first_line}); a collective that some ranks call and others do "
        "not waits forever: call the same collectives, in the same order, on every rank"
    )


def check(notebook, name: str, fn) -> Outcome:
    """Check the student's ``fn`` for exercise ``name`` of ``notebook`` and print the answer (notebooks 01-06).

    Never raises on a wrong or unfinished answer: it returns (and the notebook shows) an
    ``Outcome``, so a notebook with untouched stubs still runs to the end.
    """
    return check_many([(get(notebook, name), fn)])[0]


# ---------------------------------------------------------------------------------------------
# Hints and solutions
# ---------------------------------------------------------------------------------------------


def hint_text(notebook, name: str, n: int) -> str:
    """Hint ``n`` (1-based) of an exercise, with how many there are."""
    ex = get(notebook, name)
    if not isinstance(n, int) or not 1 <= n <= len(ex.hints):
        raise CourseInputError(f"exercise {ex.key} has hints 1 to {len(ex.hints)}; ask for one of those")
    more = f" (next: show_hint({ex.notebook!r}, {ex.name!r}, {n + 1}))" if n < len(ex.hints) else " (the last hint)"
    return f"Hint {n} of {len(ex.hints)}{more}: {ex.hints[n - 1]}"


def show_hint(notebook, name: str, n: int = 1) -> None:
    """Print hint ``n`` of an exercise; the hints open one at a time (notebooks 01-06).

    Asking past the last hint (or for hint 0) prints one line saying which hints there are, never a traceback.
    """
    ex = get(notebook, name)
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= len(ex.hints):
        print(hint_text(notebook, name, n))
    else:
        print(
            f"Exercise {ex.key} has hints 1 to {len(ex.hints)}; there is no hint {n!r}. Still stuck? "
            f"load_solution({ex.notebook!r}, {ex.name!r}) shows the reference solution."
        )


def solution(notebook, name: str):
    """The reference solution of an exercise, from ``course_utils.exercises.solutions.nbNN``."""
    ex = get(notebook, name)
    try:
        module = importlib.import_module(f"{__package__}.solutions.nb{ex.notebook}")
    except ModuleNotFoundError:
        raise CourseInputError(
            f"the reference solutions are not available here (no solutions/nb{ex.notebook}.py next to "
            f"{Path(__file__).name}): a notebook being graded runs without them"
        ) from None
    return getattr(module, ex.name)


def load_solution(notebook, name: str, *, quiet: bool = False):
    """Give up on an exercise: print the reference solution, define it in the caller, return it (notebooks 01-06)."""
    fn = solution(notebook, name)
    if not quiet:
        print(inspect.getsource(fn))
    caller = sys._getframe(1).f_globals
    if caller.get("__name__") == "__main__":
        caller[name] = fn
    return fn


def run_stub(ex: Exercise):
    """The stub's function, defined from the exercise's stub source (what the notebook cell holds)."""
    namespace: dict = {}
    exec(compile(CELL_GLOBALS + ex.stub, f"<stub {ex.key}>", "exec"), namespace)
    return namespace[ex.name]


# ---------------------------------------------------------------------------------------------
# For teachers and CI: run every check on the solutions or the stubs (grading a class: ``grading``)
# ---------------------------------------------------------------------------------------------


def run_all(which: str) -> list[Outcome]:
    """Every exercise's check on the reference solutions ("solutions") or the untouched stubs ("stubs")."""
    if which not in ("solutions", "stubs"):
        raise CourseInputError(f"--run takes 'solutions' or 'stubs', got {which!r}")
    pairs = [(ex, solution(ex.notebook, ex.name) if which == "solutions" else run_stub(ex)) for ex in exercises()]
    return check_many(pairs)

"""Grading a class a teacher can trust (issue 29): each notebook sealed, every exercise judged outside the seal.

``grade_class(paths)`` grades many notebooks side by side; ``grade_notebook(path)`` grades one. For each:

1. **Read it as data** (``submission``, here, outside the seal): which course notebook it is, the exercises that
   notebook has (the course's own list, ``core.exercises``, never the submission's), which cells are the
   student's (every code cell but the lecture: the grade is about the exercises, and the lecture takes a minute
   to run), and what each exercise's name is bound to in them.
2. **Run the student's cells in a seal** (``seal.Seal``): no network beyond loopback, an unprivileged user, a
   filesystem of its own, limits on time, memory, processes and disk. The reference solutions are not in it.
3. **Judge here, with the course's code as installed**: an in-process check (``judge``) runs in this process
   and calls the student's function through ``calls.Call``, which sends the arguments into the seal, runs the
   function there in a child of the student's process and brings back what it returned as plain data
   (``calls.decode`` builds numbers, strings, containers and tensors from JSON and runs nothing the student
   wrote). A distributed check runs its ``on_rank`` on real ranks inside the seal; its observations come back
   as plain data and its ``verdict`` runs here.
   Nothing the student's code can read or write decides an outcome: it can only change what its own function
   returns, and a lie told through the pipe is only a wrong answer.

Outcomes: passed, failed (why), not done, reference used (``load_solution`` called for it, or a source equal to
the reference's), could not be graded (why: the notebook hung, crashed, ran out of memory, filled its disk,
forked without end, or is not a course notebook).
"""

from __future__ import annotations

import csv
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import CourseInputError
from . import core
from .calls import Call, CallDied, CallTimedOut, StudentRaised, decode
from .seal import Capabilities, Limits, Seal, SealEnded, probe
from .submission import Binding, NotGradable, bindings, read_submission, same_as_reference, student_cells

#: Extra seconds a distributed check may take beyond its exercises' own timeouts (its launch starting).
LAUNCH_GRACE_S = 40.0
OUTCOMES = (core.PASSED, core.FAILED, core.NOT_DONE, core.REFERENCE, core.UNGRADED)
COLUMNS = ("student", "file", "notebook", "exercise", "outcome", "message", "seconds")


# ---------------------------------------------------------------------------------------------
# One notebook
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    student: str
    file: str
    notebook: str
    exercise: str
    outcome: str
    message: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class NotebookGrade:
    student: str
    file: str
    notebook: str
    rows: list[Row] = field(default_factory=list)
    graded: bool = True
    reason: str = ""
    wall_s: float = 0.0
    cpu_s: float | None = None
    memory_peak: int | None = None
    cell_errors: list = field(default_factory=list)
    log_tail: str = ""
    killed_after: int = 0  # processes the grader had to kill after its seal ended (0: its PID namespace did)
    started_at: float = 0.0  # time.time() when its seal started and ended
    ended_at: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d


class Cores:
    """CPU cores for launches: a distributed check holds as many as it has ranks while it runs, so notebooks
    graded side by side never put more ranks on the machine than it has cores (their collectives would
    starve each other, and a slow check can look like a hung one)."""

    def __init__(self, n: int):
        self.total = self.free = max(1, int(n))
        self.cond = threading.Condition()

    @contextmanager
    def hold(self, k: int):
        k = min(max(1, k), self.total)
        with self.cond:
            self.cond.wait_for(lambda: self.free >= k)
            self.free -= k
        try:
            yield
        finally:
            with self.cond:
                self.free += k
                self.cond.notify_all()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def grade_notebook(
    path,
    *,
    limits: Limits | None = None,
    notebook: str | None = None,
    names: str = "file",
    slot: int = 0,
    cores: Cores | None = None,
    caps: Capabilities | None = None,
) -> NotebookGrade:
    """Grade one student's notebook (see the module's docstring); never raises for what the notebook does."""
    path, limits = Path(path), limits or Limits()
    try:
        sub = read_submission(path, notebook=notebook, names=names)
    except NotGradable as exc:
        grade = NotebookGrade(path.stem, path.name, notebook or "", graded=False, reason=str(exc))
        grade.rows = [Row(path.stem, path.name, notebook or "", "(notebook)", core.UNGRADED, str(exc), 0.0)]
        return grade
    exs = core.exercises(sub.notebook)
    grade = NotebookGrade(sub.student, path.name, sub.notebook)
    cells, imports = student_cells(sub)
    bound = bindings(cells, exs)
    outcomes: dict[str, tuple[str, str, float]] = {}
    for ex in exs:  # decided from the source alone: the reference was used
        b = bound[ex.name]
        if b.solution_cell:
            outcomes[ex.name] = (core.REFERENCE, f"load_solution was called for it (cell {b.solution_cell})", 0.0)
        elif same_as_reference(ex, b):
            outcomes[ex.name] = (core.REFERENCE, f"its source is the reference solution's (cell {b.cell})", 0.0)
    cores = cores or Cores(usable_cores())
    grade.started_at = time.time()
    try:
        seal = Seal({sub.path.name: sub.raw}, limits, slot=slot, caps=caps)
    except OSError as exc:
        grade.graded, grade.reason = False, f"the seal could not be built ({exc})"
        grade.rows = [Row(sub.student, path.name, sub.notebook, ex.key, core.UNGRADED, grade.reason, 0.0) for ex in exs]
        return grade
    end = None
    try:
        todo = [ex for ex in exs if ex.name not in outcomes]
        ran = seal.ask(
            {
                "op": "cells",
                "cells": cells,
                "imports": imports,
                "names": [ex.name for ex in todo],
                "warm": any(ex.nproc for ex in todo),
            },
            limits.wall_s,
        )
        grade.cell_errors = [c for c in ran.get("cells", []) if isinstance(c, dict) and c.get("error")][:50]
        stopped = _stopped_early(seal, ran, limits)
        if stopped:
            raise SealEnded(seal.close(kind=stopped))
        names_info = ran.get("names") if isinstance(ran.get("names"), dict) else {}
        batches: dict[int, list] = {}
        for ex in todo:
            info = names_info.get(ex.name) if isinstance(names_info.get(ex.name), dict) else {}
            early = _not_checked(ex, info, bound[ex.name])
            if early:
                outcomes[ex.name] = (*early, 0.0)
            elif ex.nproc:
                batches.setdefault(ex.nproc, []).append(ex)
            else:
                start = time.monotonic()
                status, message = _judge_here(seal, ex)
                outcomes[ex.name] = (status, message, time.monotonic() - start)
        for nproc, batch in batches.items():
            start = time.monotonic()
            with cores.hold(nproc):
                results = _on_ranks(seal, nproc, batch)
            took = time.monotonic() - start
            for ex, (status, message) in zip(batch, results):
                outcomes[ex.name] = (status, message, took)
        try:
            seal.ask({"op": "bye"}, 5.0)
        except (SealEnded, TimeoutError):
            pass
    except SealEnded as exc:
        end = exc.end
    finally:
        end = seal.close() if end is None else end
    grade.wall_s, grade.cpu_s, grade.memory_peak, grade.log_tail = end.wall_s, end.cpu_s, end.memory_peak, end.log_tail
    grade.ended_at, grade.killed_after = time.time(), end.killed_after
    if len(outcomes) < len(exs):
        grade.graded, grade.reason = False, end.reason
    for ex in exs:
        status, message, took = outcomes.get(ex.name, (core.UNGRADED, end.reason, 0.0))
        note = _note(bound[ex.name], status)
        grade.rows.append(Row(sub.student, path.name, sub.notebook, ex.key, status, message + note, round(took, 2)))
    return grade


def _stopped_early(seal: Seal, ran: dict, limits: Limits) -> str | None:
    """After the cells: a fork bomb or a full disk leaves nothing fair to check with."""
    stats = seal.stats()
    if stats.get("pids_hits"):
        return "processes"
    if stats.get("oom_kills"):
        return "memory"
    disk = ran.get("disk") if isinstance(ran.get("disk"), dict) and seal.caps.namespaces else {}  # its own tmpfs
    if isinstance(disk.get("used"), int) and disk["used"] >= 0.98 * limits.disk_bytes:
        return "disk"
    if "cells" not in ran:
        return "crashed"
    return None


def _not_checked(ex, info: dict, binding: Binding) -> tuple[str, str] | None:
    """An exercise decided before any check runs: not defined, an untouched stub, not a function."""
    if not info.get("defined"):
        where = "its stub cell is not in the notebook" if not binding.kind else f"cell {binding.cell} did not define it"
        return core.NOT_DONE, f"{ex.name} is not defined: {where}"
    if not info.get("callable"):
        return core.FAILED, f"{ex.name} is a {str(info.get('type'))[:40]}, not a function"
    if info.get("stub"):
        return core.NOT_DONE, "the stub is as given (it still raises NotImplementedError)"
    return None


def _note(binding: Binding, status: str) -> str:
    if status not in (core.PASSED, core.FAILED) or binding.kind == "def":
        return ""
    if binding.kind:
        return f" (note: bound by an {binding.kind} in cell {binding.cell}, not a def: read it)"
    return " (note: defined by code the grader cannot read, e.g. exec: read it)"


def _judge_here(seal: Seal, ex) -> tuple[str, str]:
    """An in-process check, run here; the student's function is called inside the seal."""
    call = Call(seal, ex.name, time.monotonic() + ex.timeout_s)
    try:
        try:
            ex.judge(call)
        finally:
            seal.ask({"op": "done"}, 30.0)  # its worker, and whatever the worker started, end here
    except NotImplementedError:
        return core.NOT_DONE, "it raises NotImplementedError (not finished)"
    except CallTimedOut:
        return core.FAILED, f"it did not return within {ex.timeout_s:g} s (an endless loop?) and was stopped"
    except CallDied as exc:
        oom = seal.stats().get("oom_kills")
        why = "it used more memory than the limit" if oom else str(exc)
        return core.FAILED, f"its process died while it ran ({why})"
    except core.Wrong as exc:
        return core.FAILED, str(exc)
    except StudentRaised as exc:
        return core.FAILED, exc.line
    except SealEnded:
        raise
    except Exception as exc:  # the check could not use the answer (a wrong type, a wrong shape)
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return core.FAILED, f"the check could not use what it returned ({type(exc).__name__}: {text})"
    return core.PASSED, "matches the course's reference"


def _on_ranks(seal: Seal, nproc: int, batch: list) -> list[tuple[str, str]]:
    """Distributed checks: on_rank on real ranks inside the seal, the verdicts here."""
    timeout = sum(ex.timeout_s for ex in batch)
    request = {"op": "ranks", "nproc": nproc, "jobs": [[ex.notebook, ex.name] for ex in batch], "timeout_s": timeout}
    try:
        answer = seal.ask(request, timeout + LAUNCH_GRACE_S)
    except TimeoutError:  # the launch ends itself at its timeout: no answer means the process itself is stuck
        raise SealEnded(seal.close(kind="stuck")) from None
    if "launch_error" in answer:
        message = core.ranks_failed(str(answer["launch_error"])[:300])
        return [(core.FAILED, message)] * len(batch)
    per_rank = answer.get("per_rank")
    out = []
    for j, ex in enumerate(batch):
        try:
            values = {int(rank): decode(v)[j] for rank, v in per_rank.items()}
            if sorted(values) != list(range(nproc)):
                raise ValueError("not one result per rank")
            o = core._verdict(ex, values)
            out.append((o.status, o.message))
        except Exception as exc:
            out.append((core.FAILED, f"the ranks' results were not what the check measures ({type(exc).__name__})"))
    return out


# ---------------------------------------------------------------------------------------------
# A class
# ---------------------------------------------------------------------------------------------


def notebooks_in(paths) -> list[Path]:
    """Every notebook named: files as given, folders' ``*.ipynb`` (sorted, checkpoints left out)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.glob("*.ipynb") if q.is_file())
        elif p.exists():
            out.append(p)
        else:
            raise CourseInputError(f"no notebook at {p}; give the path of a student's .ipynb or of a folder of them")
    if not out:
        raise CourseInputError(f"no .ipynb files in {', '.join(map(str, paths))}; give notebooks or their folder")
    return out


def grade_class(
    paths,
    *,
    limits: Limits | None = None,
    jobs: int | None = None,
    notebook: str | None = None,
    names: str = "file",
    progress=None,
) -> list[NotebookGrade]:
    """Grade every notebook in ``paths`` (files or folders), ``jobs`` side by side (default: the cores here).

    Launches share the cores (``Cores``); each notebook runs in a seal of its own, as a user of its own.
    ``progress(grade)`` is called as each notebook finishes.
    """
    files, limits = notebooks_in(paths), limits or Limits()
    jobs = max(1, min(jobs or usable_cores(), len(files)))
    cores, caps = Cores(usable_cores()), probe()
    slots = list(range(jobs))
    lock = threading.Lock()

    def one(path: Path) -> NotebookGrade:
        with lock:
            slot = slots.pop()
        try:
            grade = grade_notebook(
                path, limits=limits, notebook=notebook, names=names, slot=slot, cores=cores, caps=caps
            )
        finally:
            with lock:
                slots.append(slot)
        if progress:
            progress(grade)
        return grade

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        grades = list(pool.map(one, files))
    named = [g.student for g in grades]
    for g in grades:  # two files, one name (from metadata): each is told apart by its file
        if named.count(g.student) > 1:
            g.student = f"{g.student} ({g.file})"
            for r in g.rows:
                r.student = g.student
    return grades


def rows(grades: list[NotebookGrade]) -> list[Row]:
    return [r for g in grades for r in g.rows]


def write_tables(grades: list[NotebookGrade], out_dir, *, limits: Limits, caps: Capabilities) -> tuple[Path, Path]:
    """``grades.csv`` (one row per student and exercise) and ``grades.json`` (the same, with each notebook's
    seal: time, CPU seconds, memory, why it stopped) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "grades.csv", out / "grades.json"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for r in rows(grades):
            writer.writerow([getattr(r, c) for c in COLUMNS])
    document = {
        "graded_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "limits": asdict(limits),
        "seal_missing": caps.missing(),
        "notebooks": [g.to_dict() for g in grades],
    }
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    return csv_path, json_path


def summary_text(grades: list[NotebookGrade]) -> str:
    """One line per student: how many exercises passed, and what else."""
    width = max([len("student")] + [len(g.student) for g in grades])
    lines = [f"{'student':<{width}}  nb  passed  failed  not done  reference  ungraded  seconds"]
    for g in grades:
        n = {s: sum(r.outcome == s for r in g.rows) for s in OUTCOMES}
        lines.append(
            f"{g.student:<{width}}  {g.notebook or '--':<2}  {n[core.PASSED]:>3}/{len(g.rows):<2}  {n[core.FAILED]:>6}  "
            f"{n[core.NOT_DONE]:>8}  {n[core.REFERENCE]:>9}  {n[core.UNGRADED]:>8}  {g.wall_s:>7.1f}"
            + ("" if g.graded else f"  could not be graded: {g.reason}")
        )
    return "\n".join(lines)

"""What a launch says: the live status line, the results, and the error when a run fails (private; notebook 00).

Everything here reads the run's folder, which the workers and the agent fill: ``rank<r>.json``
(progress), ``result-rank<r>.pkl`` (each rank's return value), ``stack-<name>.txt`` (Python stacks
dumped on SIGUSR1, or on SIGINT before a rank dies of it), ``cause-rank<r>.txt`` (the one line a
user needs when a worker failed on their input) and ``result.pkl`` (the agent's outcome). Nothing
here starts or stops a process (``course_utils._procs`` does).

Outputs meant to be read stay clean: the status line is cleared when the run ends, and an error
says the logs' folder (a temporary path) once, at its end.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path


class LaunchError(RuntimeError):
    """A launch did not return results (notebook 00).

    ``.log_dir``: the folder of every rank's output, or None. In a notebook it is a scratch folder
    removed when the kernel stops, so a saved notebook should print the attribute's name, not its value.
    """

    log_dir: str | None = None


class WorkerFailed(LaunchError):
    """A worker raised or died; ``.rank`` names it and the message holds its traceback (notebook 00).

    ``.input_error`` is the one line to show alone when the worker failed on the user's input (a
    ``CourseInputError`` raised in a worker, a full disk), else None.
    """

    def __init__(
        self, message: str, rank: int | None = None, exitcode: int | None = None, input_error: str | None = None
    ):
        super().__init__(message)
        self.rank, self.exitcode, self.input_error = rank, exitcode, input_error


class LaunchTimeout(LaunchError):
    """The run outlived its timeout (a hang: usually a collective waiting for a missing rank)."""


class Progress:
    """One status line per run, updated in place: in a notebook a display handle, else stderr.

    While the run lasts each rank shows its last reported step (``starting`` before the first).
    When it ends the line is cleared in a notebook (a progress line is not an answer), and in a
    terminal each rank's ending is printed once: ``done``, ``failed`` or ``killed``.
    """

    def __init__(self, folder: Path, nproc: int, enabled: bool):
        self.folder, self.nproc, self.enabled = folder, nproc, enabled
        self.handle, self.last = None, ""

    def line(self, elapsed: float, final: dict[int, str] | None = None) -> str:
        parts = []
        for r in range(self.nproc):
            try:
                p = json.loads((self.folder / f"rank{r}.json").read_text())
                extra = " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in p.items()
                    if k not in ("rank", "step", "total", "pid")
                )
                state = f"{p['step']}/{p['total']}" + (f" {extra}" if extra else "")
            except (OSError, ValueError, KeyError):
                state = "starting"
            if final is not None:
                state = final.get(r, "killed") + ("" if state == "starting" else f" (at {state})")
            parts.append(f"rank {r}: {state}")
        return f"[{elapsed:5.1f}s] " + " | ".join(parts)

    def quiet_s(self) -> float | None:
        """Seconds since any rank last reported progress; None if none ever did."""
        times = [f.stat().st_mtime for f in self.folder.glob("rank*.json")]
        return max(0.0, time.time() - max(times)) if times else None

    def update(self, elapsed: float, final: dict[int, str] | None = None) -> None:
        if not self.enabled or (elapsed < 2.0 and final is None):
            return
        if "ipykernel" in sys.modules:
            self._in_notebook(elapsed, final)
        elif final is not None and sys.stderr.isatty():
            print(self.line(elapsed, final), file=sys.stderr)

    def _in_notebook(self, elapsed: float, final) -> None:
        from IPython.display import display

        if final is not None:  # the run is over: its answer (or error) is what the cell shows
            if (
                self.handle is not None
            ):  # an empty bundle: an empty "text/plain" would be stored and drawn as a blank box
                self.handle.update({}, raw=True)
            return
        text = self.line(elapsed)
        if text == self.last:
            return
        self.last = text
        if self.handle is None:
            self.handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": text}, raw=True)


# ---------------------------------------------------------------- results


def result_files(folder: Path) -> dict[int, Path]:
    return {int(f.name[len("result-rank") : -len(".pkl")]): f for f in folder.glob("result-rank*.pkl")}


def read_results(folder: Path, nproc: int) -> dict[int, object] | None:
    """Every rank's return value, if all ``nproc`` ranks of the same (latest) attempt left one."""
    found = {}
    for rank, path in result_files(folder).items():
        try:
            with open(path, "rb") as fh:
                found[rank] = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
    if sorted(found) != list(range(nproc)) or len({attempt for attempt, _ in found.values()}) != 1:
        return None
    return {rank: value for rank, (_, value) in found.items()}


def log_launch(target: str, nproc: int, wall_s: float, cold: bool, finished: bool, backend: str) -> None:
    """One JSON line per launch appended to $COURSE_LAUNCH_LOG, when set (``python -m course_utils bench``
    counts a notebook's launches with it, the GPU check which of them ran on NCCL; ``cold``: this
    launch started the agent server)."""
    path = os.environ.get("COURSE_LAUNCH_LOG")
    if path:
        row = {"target": target, "nproc": nproc, "wall_s": wall_s, "cold": cold, "finished": finished}
        with open(path, "a") as fh:
            fh.write(json.dumps({**row, "backend": backend}) + "\n")


# ---------------------------------------------------------------- where each rank was


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Python's and torch's own folders: frames there are not where a worker's code was."""
    torch_dir = str(Path(importlib.import_module("torch").__file__).parent)
    return tuple({os.path.dirname(os.__file__), os.path.dirname(importlib.__file__), torch_dir})


def _stack_sizes(folder: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in folder.glob("stack-*.txt")}


def ask_for_stacks(pgid: int, folder: Path, wait_s: float = 0.5) -> dict[str, int]:
    """SIGUSR1 to the run's whole group: every worker and the agent append their Python stacks."""
    before = _stack_sizes(folder)
    try:
        os.killpg(pgid, signal.SIGUSR1)
    except ProcessLookupError:
        return before
    time.sleep(wait_s)
    return before


def _last_dump(text: str) -> list[list[tuple[str, int, str]]]:
    """The threads of the last faulthandler dump in ``text``: per thread, frames most recent first."""
    threads, current = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = []
            threads.append(current)
        elif line.strip().startswith('File "') and current is not None:
            rest = line.strip()[len('File "') :]
            path, _, tail = rest.partition('", line ')
            number, _, func = tail.partition(" in ")
            try:
                current.append((path, int(number), func.strip()))
            except ValueError:
                pass
    return threads


def _where(frames: list[tuple[str, int, str]]) -> str:
    """Where a worker was: the innermost frame of the course's or the user's code, and what it had called."""
    import linecache

    for i, (path, number, func) in enumerate(frames):
        if (
            path.startswith("<")
            or path.startswith(_library_dirs())
            or ("site-packages" in path and "course_utils" not in path)
        ):
            continue
        if func == "_ask_peers_where_they_are":
            return "raised: its collective timed out (its traceback is above)"
        if func == "run_the_function" and i == 0:  # no Python frame below the call: the function had returned
            return STUCK_AFTER_RETURN
        if path.endswith((os.path.join("course_utils", "_agent.py"), os.path.join("course_utils", "worker.py"))):
            continue
        source = linecache.getline(path, number).strip()
        called = [f for _, _, f in frames[:i] if f not in ("wrapper", "_fn", "inner")]
        waiting = f"in {called[-1]}, called from " if called else "in "
        return f"{waiting}{func} ({Path(path).name} line {number}: {source})" if source else f"{waiting}{func}"
    if any(f == "_wrap" for _, _, f in frames[:3]):
        return "returned"
    return _innermost(frames)


def _innermost(frames: list[tuple[str, int, str]], depth: int = 3) -> str:
    """The last few calls of a stack, innermost first: ``poll (api.py 785) < _monitor_workers < _invoke_run``."""
    return " < ".join(f"{f} ({Path(p).name} {n})" if i == 0 else f for i, (p, n, f) in enumerate(frames[:depth]))


def _is_entry(path: str, func: str) -> bool:
    """The bottom frame of a launch's main thread: the agent's ``_child`` or a worker's ``run_in_worker``."""
    return (path.endswith("_agent.py") and func == "_child") or (path.endswith("worker.py") and func == "run_in_worker")


NO_STACK = "no stack (the process had not started, or was stuck outside Python)"
STUCK_AFTER_RETURN = (
    "stuck after its function returned, in native code while the function's variables were freed "
    "(a destructor that never returned), before its result was saved"
)


def where_ranks_were(folder: Path, nproc: int, since: dict[str, int] | None = None) -> dict:
    """Per rank, where its main thread was at the last stack dump (and the agent's), from the run's folder."""
    out = {}
    for name in [f"rank{r}" for r in range(nproc)] + ["agent"]:
        path = folder / f"stack-{name}.txt"
        threads = []
        if path.exists():
            with open(path, errors="replace") as fh:
                fh.seek((since or {}).get(path.name, 0))
                threads = _last_dump(fh.read())
        if not threads:
            out[name] = NO_STACK
            continue
        if name != "agent" and result_files(folder).get(int(name[4:])) is not None:
            out[name] = "returned its result"
            continue
        main = next((t for t in threads if any(_is_entry(p, f) for p, _, f in t)), threads[-1])
        out[name] = _innermost(main, 4) if name == "agent" else _where(main)
    return out


# ---------------------------------------------------------------- the errors


def input_error(folder: Path, rank: int | None) -> str | None:
    """The one line a worker left when it failed on the user's input (``_agent._note_the_cause``), or None."""
    notes = {int(f.name[len("cause-rank") : -len(".txt")]): f for f in folder.glob("cause-rank*.txt")}
    for path in ([notes[rank]] if rank in notes else []) + sorted(notes.values()):
        text = path.read_text().strip()
        if text:
            return text
    return None


def failure_error(outcome: dict, folder: Path, nproc: int, max_restarts: int, log_dir: Path) -> WorkerFailed:
    """The ``WorkerFailed`` of a run that ended without every result: the rank, what it raised, where ranks were.

    The cause's traceback starts at the user's or the course's own frame (``_agent.trim_traceback``);
    the full output of every rank stays in ``log_dir``, said once, at the end.
    """
    rank = outcome.get("rank")
    head = f"rank {rank} failed" if rank is not None else "the launch failed"
    if outcome.get("exitcode") is not None:
        head += f" (exit code {outcome['exitcode']})"
    if max_restarts:
        head += f" (the group was restarted up to {max_restarts} time(s) first)"
    where = where_ranks_were(folder, nproc)
    seen = {int(r[4:]): w for r, w in where.items() if w != NO_STACK and r != "agent"}
    note = ""
    if seen and any(w.startswith("raised: its collective") for w in seen.values()):
        # a collective timed out and its rank asked everyone where they were
        absent = [r for r, w in seen.items() if not w.startswith(("raised", "returned"))]
        note = "\nWhere each rank was when the collective timed out:\n" + "\n".join(
            f"  rank {r}: {w}" for r, w in seen.items()
        )
        if absent:
            head = f"rank {rank} timed out in a collective that rank(s) {', '.join(map(str, absent))} never reached"
    elif rank in seen and (outcome.get("exitcode") or 0) < 0:  # ended by a signal: it dumped its stack first
        note = f"\nrank {rank} was {seen[rank]} when the signal came."
    cause = input_error(folder, rank)
    message = outcome.get("message") or "no result from any rank"
    error = WorkerFailed(
        f"{head}: {cause}\n{message}{note}\n(every rank's output and full traceback: {log_dir})"
        if cause
        else f"{head}\n{message}{note}\n(every rank's output and full traceback: {log_dir})",
        rank=rank,
        exitcode=outcome.get("exitcode"),
        input_error=cause,
    )
    error.log_dir = str(log_dir)
    return error


def timeout_error(ranks: dict, agent: str, quiet: float | None, timeout_s: float, grace_s: float, last: str, log_dir):
    """The ``LaunchTimeout`` of a run stopped at its timeout: where each process was, and why it was slow or stuck."""
    lines = "\n".join(f"  rank {r}: {w}" for r, w in ranks.items()) + f"\n  agent: {agent}"
    if all(w == "returned its result" for w in ranks.values()):
        why = (
            "Every rank had returned its result, but torch's elastic agent did not collect the results: "
            "this is the launcher's fault, not your code's; run the cell again"
        )
    elif quiet is not None and quiet < timeout_s:
        why = (
            f"The workers were still making progress ({quiet:.0f} s before the end): the run is not hung, only "
            "longer than timeout_s, which also bounds the whole run; pass a larger timeout_s (or fewer steps)"
        )
    elif any(w == STUCK_AFTER_RETURN for w in ranks.values()):
        stuck = [r for r, w in ranks.items() if w == STUCK_AFTER_RETURN]
        why = (
            f"Rank(s) {', '.join(map(str, stuck))} returned from the function but never finished: no collective "
            "was waiting, a C++ destructor was (a process group freed while a thread of its own needed the GIL "
            "is the known case, see course_utils.dist.shutdown)"
        )
    else:
        waiting = [r for r, w in ranks.items() if w != "returned its result"]
        why = (
            f"Rank(s) {', '.join(map(str, waiting))} did not finish: look above for the rank that never reached "
            "the collective the others wait in"
        )
    error = LaunchTimeout(
        f"the run did not finish within {timeout_s:g} s (+{grace_s:g} s grace) and every process was "
        f"stopped. {why}.\nWhere each process was:\n{lines}\nLast progress: {last}\n"
        f"(every rank's output: {log_dir})"
    )
    error.log_dir = str(log_dir)
    return error

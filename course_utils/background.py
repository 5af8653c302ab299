"""One call of a module-level function in a process of its own, while the caller goes on (notebook 05b).

Not a distributed launch (no process group, no ranks: ``course_utils.launch`` is for that), but
held to the same rule: whatever ends the call (its result, a timeout, an interrupt, the kernel's
exit), the process is gone afterwards.
"""

from __future__ import annotations

import atexit
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import scratch
from ._procs import kill_group, server_env
from ._report import LaunchError, LaunchTimeout
from .errors import CourseInputError
from .worker import target_of

#: What the background process runs: import the function by name, call it, pickle what came of it.
_BACKGROUND_MAIN = """
import importlib, os, pickle, sys, time
module, _, qualname = sys.argv[1].partition(":")
fn = importlib.import_module(module)
with open(sys.argv[2] + ".imported.tmp", "w") as f:
    f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process of this machine
os.replace(sys.argv[2] + ".imported.tmp", sys.argv[2] + ".imported")
for part in qualname.split("."):
    fn = getattr(fn, part)
args, kwargs = pickle.load(sys.stdin.buffer)
try:
    out = (True, fn(*args, **kwargs))
except Exception as exc:
    out = (False, exc)
with open(sys.argv[2], "wb") as f:
    try:
        pickle.dump(out, f)
    except Exception:
        pickle.dump((False, RuntimeError(repr(out[1]))), f)
"""


class Background:
    """One call of a module-level function in a fresh process, while the caller goes on (notebook 05b).

    ``result(timeout_s)`` waits for it and returns its value (or raises its exception); either way
    the process is gone afterwards. A timeout, an interrupt or the kernel's exit ends the process
    (it runs in its own session, ended as a group), so nothing is left running. Notebook 05b
    rehearses its 70B this way on the machine's second core while the first runs the sections
    before it. Not a distributed launch: no process group, no ranks (``launch`` is for that).
    """

    def __init__(self, fn, *args, **kwargs):
        target = target_of(fn)
        if target is None:
            raise CourseInputError(
                "Background runs a module-level function of an importable module (it is "
                "imported by name in the new process); move the function into a module"
            )
        self._folder = scratch.folder("course-background-")
        self._result = self._folder / "result.pkl"
        self._started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BACKGROUND_MAIN, target, str(self._result)],
            stdin=subprocess.PIPE,
            env=server_env(),
            start_new_session=True,
        )
        atexit.register(self.cancel)
        self._proc.stdin.write(pickle.dumps((args, kwargs)))
        self._proc.stdin.close()

    def cold_start_s(self, timeout_s: float = 120.0) -> float:
        """Seconds from the start of this process to the end of its imports (the function's module, torch
        with it): what a *cold* worker pays before its first line of work, as torchrun's spawned workers do
        at every restart. Waits for the imports to end (notebook 06 sets it beside a warm restart)."""
        stamp, deadline = Path(f"{self._result}.imported"), time.monotonic() + timeout_s
        while not stamp.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise LaunchError("the background process ended or stalled before its imports finished")
            time.sleep(0.05)
        return float(stamp.read_text()) - self._started

    def result(self, timeout_s: float = 600.0):
        """The function's return value; waits at most ``timeout_s`` seconds, then ends the process and raises."""
        try:
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise LaunchTimeout(
                    f"the background run did not finish in {timeout_s:g} s and was stopped; give "
                    "it a longer timeout_s, or run it in the foreground to see where it is"
                ) from None
            if not self._result.exists():
                raise LaunchError(
                    f"the background process ended (exit code {self._proc.returncode}) without a "
                    "result; run the same call in the foreground to see why"
                )
            ok, value = pickle.loads(self._result.read_bytes())
            if not ok:
                raise value
            return value
        finally:
            self.cancel()

    def cancel(self) -> None:
        """End the process now (nothing if it has finished) and remove its folder."""
        if self._proc.poll() is None:
            kill_group(self._proc.pid)
            self._proc.wait()
        shutil.rmtree(self._folder, ignore_errors=True)
        atexit.unregister(self.cancel)

"""The course's temporary folders, and how none outlives the process that made it (notebook 00; issue 34).

A notebook makes folders as it runs (checkpoints: 43 MB for notebook 06; a background call; a hang's
files; the logs of a launch that failed). ``folder(prefix)`` puts each under one root of the calling
process, ``<tmp>/course-scratch-<pid>-<start time>-*``, which goes with the process:

- at a normal exit, by ``atexit``;
- where the process was killed (SIGKILL, and a notebook kernel stopped by Jupyter or nbval is killed
  so), through the launcher's agent server, which sees its kernel go (its stdin closes:
  ``_agent.serve``) and leaves a small process (``bury_later``) to remove the folders once the runs end;
- and, whatever else, by the next course process that makes a folder: ``sweep`` removes every root
  whose process is gone (the start time tells a reused pid from its first owner).

Runs a student starts from a shell keep their own folders where they say (``--checkpoint-dir``), and a
failed launch from the command line keeps its logs for the user to read (``launch``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "course-scratch-"
_root: tuple[int, Path] | None = None  # (the pid that made it, the folder): a forked child makes its own


def _stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks since boot) of a process (Linux); ("", "0") where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return "", "0"


def _owner_alive(name: str) -> bool:
    try:
        pid_text, start = name[len(PREFIX) :].split("-")[:2]
        pid = int(pid_text)
    except ValueError:  # not a name of ours
        return True
    return _alive(pid) and start in ("0", _stat(pid)[1])  # the start time tells a reused pid from the owner


def sweep(where: str | None = None) -> list[str]:
    """Remove every scratch root whose process is gone; return their names (notebook 00)."""
    where = where or tempfile.gettempdir()
    gone = []
    try:
        names = os.listdir(where)
    except OSError:
        return gone
    for name in names:
        if name.startswith(PREFIX) and not _owner_alive(name):
            shutil.rmtree(os.path.join(where, name), ignore_errors=True)
            gone.append(name)
    return gone


def root() -> Path:
    """This process's scratch root, made (after a ``sweep``) on first use and removed at exit (notebook 00)."""
    global _root
    pid = os.getpid()
    if _root is None or _root[0] != pid or not _root[1].is_dir():
        sweep()
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-{_stat(pid)[1]}-"))
        atexit.register(shutil.rmtree, path, True)
        _root = (pid, path)
    return _root[1]


def folder(prefix: str) -> Path:
    """A fresh folder under this process's scratch root: gone when the process is (notebook 00)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root()))


def bury_later(parent: int, groups: list[int]) -> None:
    """``bury`` in a small process of its own (no torch, none of the caller's environment), started now.

    The launcher's agent server calls this when its kernel was killed, and exits at once (its agents
    end when it does); the small process waits for them, then sweeps.
    """
    import subprocess
    import sys

    code = "import sys; from course_utils.scratch import bury; bury(int(sys.argv[1]), [int(g) for g in sys.argv[2:]])"
    subprocess.Popen(
        [sys.executable, "-c", code, str(parent), *map(str, groups)],
        env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def bury(parent: int, groups: list[int]) -> None:
    """A launcher's agent server whose caller was killed: once its runs have ended, sweep (notebook 00).

    A killed kernel (SIGKILL: what Jupyter and nbval do to stop one) runs no ``atexit``. Its agent
    server (``_agent.serve``) sees its stdin close, stops the runs' process groups (``groups``) and
    starts this (``bury_later``): it waits for them to end (they may still write into their folders for
    a moment; at most 10 s), then for the kernel to be gone (a dying process closes its files before it
    has exited), then removes every scratch root whose process is gone.
    """
    import time

    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(group_alive(g) for g in groups):
        time.sleep(0.02)
    deadline = time.monotonic() + 1.0
    while _alive(parent) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _alive(parent):
        sweep()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _stat(pid)[0] not in ("Z", "X")  # a zombie has exited: only its exit code is left


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` lives (the launcher's ``_procs`` uses it too)."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):  # PermissionError: a recycled id owned by someone else
        return False

"""The seal a student's notebook runs in when a teacher grades it (issue 29; the grader is ``grading``).

Everything a student wrote runs inside it, and nothing that runs inside it decides a grade: the grader, outside,
asks the sealed process for what the student's functions return and judges that itself (see ``grading``).

With root (a teacher's server, CI), on Linux, each notebook gets:

- **its own namespaces** (``unshare --mount --net --pid --ipc --uts``): a network with only loopback up (the
  exercises' ranks still meet on 127.0.0.1; nothing else answers, not even the host's loopback or its abstract
  sockets), System V IPC of its own, and a PID namespace whose first process is the seal's own init
  (``_sealinit``);
- **a filesystem of its own**: a fresh root holding the system's and Python's folders read-only, a fresh
  ``/proc``, and ``/tmp``, the only writable place, where ``/tmp/work`` holds the copy of the notebook. The
  teacher's files, the class's other notebooks and the course's reference solutions are not in it;
- **an unprivileged user** of its own (one uid per seal running at the same time) with no new privileges;
- **limits** (``Limits``): wall time for the whole notebook, memory and processes (cgroups), disk (the size of
  the tmpfs that holds ``/tmp``; what is written there also counts as memory);
- **an end for every process it started**. Two mechanisms, each for what it does best: the PID namespace is the
  guarantee (when its init exits the kernel kills everything left in it, double-forked, setsid'd or stopped),
  and the cgroup is the meter (memory and process limits, out-of-memory kills, CPU seconds), which a PID
  namespace cannot give. After the end the grader checks the cgroup is empty and kills what it finds there.

Without root, or without ``unshare``, the seal keeps what an ordinary user can have and ``Capabilities.missing``
says what is lost: the student's code runs as the teacher's user, in a fresh folder, with a scrubbed
environment, per-process memory and file-size limits, and the wall-time limit; it can read what the teacher can
read and reach the network, and a process that leaves the session can outlive the seal.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import CourseInputError
from .cgroups import Cgroups, v1_dirs, v2_dir

GiB = 1 << 30
MiB = 1 << 20
#: First uid of the seals' users; seal ``slot`` runs as ``UID_BASE + slot`` (a uid with no account here).
UID_BASE = 61000
#: The most bytes one answer of the sealed process may take (a function that returns a huge object is stopped).
MAX_ANSWER_BYTES = 256 * MiB
INIT = Path(__file__).with_name("_sealinit.py")
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")


@dataclass(frozen=True)
class Limits:
    """What one student's notebook may use (issue 29). Each has a flag of ``exercises --grade``.

    The defaults fit an honest notebook many times over: its exercises take 10-30 s and under 1.5 GiB here
    (the student's process, the launcher's agent and 2 ranks, each a Python with torch).
    """

    wall_s: float = 300.0  # the whole notebook: its cells and every check
    memory_bytes: int = 4 * GiB  # every process of the seal together
    pids: int = 512  # processes and threads together (torch starts a few threads per process)
    disk_bytes: int = 1 * GiB  # what it can write (its /tmp)

    def describe(self) -> str:
        return (
            f"{self.wall_s:g} s, {self.memory_bytes / GiB:g} GiB of memory, {self.pids} processes and threads, "
            f"{self.disk_bytes / GiB:g} GiB of disk"
        )


# ---------------------------------------------------------------------------------------------
# What this machine allows
# ---------------------------------------------------------------------------------------------


@dataclass
class Capabilities:
    """What the seal can use here; ``missing()`` names what is lost without it."""

    root: bool
    unshare: str | None
    cgroup: str | None  # "v1" or "v2": memory and process limits, CPU seconds
    linux: bool = sys.platform.startswith("linux")
    notes: list[str] = field(default_factory=list)

    @property
    def namespaces(self) -> bool:
        return self.linux and self.root and self.unshare is not None

    def missing(self) -> list[str]:
        out = []
        if not self.namespaces:
            why = "not root" if not self.root else "no usable unshare" if self.linux else "not Linux"
            out += [
                f"a user of its own ({why}: the student's code runs as you and can read what you can read)",
                f"a network namespace ({why}: the student's code can reach the network)",
                f"a filesystem of its own ({why}: only a fresh working folder)",
                f"a PID namespace ({why}: a process that leaves the session can outlive the seal)",
            ]
        if self.cgroup is None:
            out += [
                "memory and process limits in total (no writable cgroup: memory is limited per process, "
                "processes not at all)",
            ]
        return out + self.notes


NAMESPACES = ("--mount", "--net", "--pid", "--ipc", "--uts")


@functools.cache
def _unshare_works(unshare: str) -> str:
    """ "" when ``unshare`` can make the seal's namespaces here (a container may forbid it), else why not."""
    try:
        out = subprocess.run([unshare, *NAMESPACES, "--fork", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if out.returncode == 0 else (out.stderr.strip().splitlines() or ["it failed"])[-1]


def probe() -> Capabilities:
    """What the seal can use on this machine (reads /proc, and tries unshare once per process)."""
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    caps = Capabilities(root=root, unshare=shutil.which("unshare"), cgroup=None)
    if caps.linux and root and caps.unshare:
        why = _unshare_works(caps.unshare)
        if why:
            caps.unshare = None
            caps.notes.append(f"unshare cannot make namespaces here ({why[:200]})")
    if caps.linux and root:
        if {"memory", "pids"} <= set(v1_dirs()):
            caps.cgroup = "v1"
        elif v2_dir() is not None:
            caps.cgroup = "v2"
    return caps


# ---------------------------------------------------------------------------------------------
# The sealed process
# ---------------------------------------------------------------------------------------------


class SealEnded(RuntimeError):
    """The sealed process ended (or was ended) before it answered; ``.end`` says why."""

    def __init__(self, end: SealEnd):
        super().__init__(end.reason)
        self.end = end


@dataclass
class SealEnd:
    """How a seal ended, in the teacher's words (``reason``), with what was measured."""

    reason: str = ""
    kind: str = "ended"  # ended | time | memory | processes | disk | crashed | setup
    wall_s: float = 0.0
    cpu_s: float | None = None
    memory_peak: int | None = None
    disk_used: int | None = None
    killed_after: int = 0  # processes the grader had to kill after the end (0: the PID namespace ended them all)
    cgroups_left: list = field(default_factory=list)  # cgroups that could not be removed (should be none)
    log_tail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _paths_to_bind(course_dir: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Folders the student's process needs (read-only) and the root's symlinks (/bin -> usr/bin)."""
    binds, links = [], []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            binds.append(d)
    wanted = [sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable)), str(course_dir)]
    wanted += [p for p in sys.path if p and p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    for p in wanted:
        real = os.path.realpath(p)
        if os.path.isdir(real):
            binds.append(real)
    binds = sorted(set(binds), key=len)
    kept: list[str] = []
    for b in binds:  # a folder inside one already bound comes with it
        if not any(b == k or b.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(b)
    return kept, links


def answer_env(fds: tuple[int, int], home: str, tmp: str) -> dict:
    """The sealed process's whole environment: none of the teacher's variables."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmp,
        "USER": "student",
        "LOGNAME": "student",
        "LANG": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "COURSE_HEADLESS": "1",
        "COURSE_WARM_UP": "0",
        "OMP_NUM_THREADS": "1",  # ranks of several notebooks share the cores: one thread each
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "COURSE_SEAL_FDS": f"{fds[0]},{fds[1]}",
    }


class Seal:
    """One sealed process running ``python -m course_utils.exercises.answers`` for one notebook.

    ``Seal(files, limits, slot=i)`` starts it; ``ask(request, timeout_s)`` sends one JSON request and returns the
    JSON answer (raising ``SealEnded`` if the process ended or ran out of time); ``close()`` ends every process
    of the seal and returns a ``SealEnd``. The answers are the student's process talking: treat them as data.
    """

    def __init__(self, files: dict[str, bytes], limits: Limits, *, slot: int = 0, caps: Capabilities | None = None):
        import base64

        import course_utils

        self.limits, self.caps = limits, caps or probe()
        self.started = time.monotonic()
        self.deadline = self.started + limits.wall_s
        self._end: SealEnd | None = None
        self._log = bytearray()
        self._cgroups = None
        course_dir = Path(course_utils.__file__).resolve().parent
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        self._buffer = b""
        argv = [sys.executable, "-m", "course_utils.exercises.answers"]
        if self.caps.namespaces:
            self.uid = _free_uid(slot)
            report_r, report_w = os.pipe()
            lifeline_r, self._lifeline_w = os.pipe()
            self._report_r = report_r
            self._root = tempfile.mkdtemp(prefix="course-seal-")
            os.chmod(self._root, 0o755)
            if self.caps.cgroup:
                self._cgroups = Cgroups(self.caps.cgroup, os.path.basename(self._root), limits)
            binds, links = _paths_to_bind(course_dir)
            solutions = course_dir / "exercises" / "solutions"
            config = {
                "root": self._root,
                "uid": self.uid,
                "gid": self.uid,
                "disk_bytes": limits.disk_bytes,
                "nproc": limits.pids + 64,  # a backstop: the cgroup's limit comes first, and is counted
                "wall_s": limits.wall_s + 5.0,  # the grader ends it first; this is the init's own backstop
                "binds": binds,
                "links": links,
                "hide": [str(solutions)] if solutions.is_dir() else [],
                "cgroups": self._cgroups.procs_files() if self._cgroups else [],
                "files": {name: base64.b64encode(data).decode() for name, data in files.items()},
                "argv": argv,
                "env": answer_env((req_r, resp_w), "/tmp/home", "/tmp"),
                "report_fd": report_w,
                "lifeline_fd": lifeline_r,
            }
            command = [self.caps.unshare, *NAMESPACES, "--fork", "--kill-child"]
            command += [sys.executable, "-I", "-S", str(INIT)]
            fds = (req_r, resp_w, report_w, lifeline_r)
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=fds,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
            )
            self._proc.stdin.write(json.dumps(config).encode())
            self._proc.stdin.close()
            for fd in fds:
                os.close(fd)
        else:
            self._report_r = self._lifeline_w = None
            self._root = tempfile.mkdtemp(prefix="course-seal-")
            work, home = Path(self._root) / "work", Path(self._root) / "home"
            work.mkdir()
            home.mkdir()
            for name, data in files.items():
                (work / name).write_bytes(data)
            self._proc = subprocess.Popen(
                argv,
                cwd=work,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(req_r, resp_w),
                start_new_session=True,
                env=answer_env((req_r, resp_w), str(home), self._root),
            )
            os.close(req_r)
            os.close(resp_w)
            _limit_process(self._proc.pid, limits)
        threading.Thread(target=self._drain, daemon=True).start()

    # -- talking to it ------------------------------------------------------------------------

    def _drain(self) -> None:
        """Keep the last 64 KB of what the student's processes print (the pipe must never fill)."""
        out = self._proc.stdout
        while True:
            chunk = out.read1(65536) if hasattr(out, "read1") else out.read(65536)
            if not chunk:
                return
            self._log += chunk
            del self._log[: max(0, len(self._log) - 65536)]

    def stats(self) -> dict:
        """The cgroup's readings now (out-of-memory kills, hits of the process limit, memory, CPU seconds)."""
        return self._cgroups.stats() if self._cgroups is not None and self._end is None else {}

    def log_tail(self, n: int = 4000) -> str:
        return bytes(self._log[-n:]).decode(errors="replace")

    def ask(self, request: dict, timeout_s: float) -> dict:
        """Send one request; return the answer (a dict), within ``timeout_s`` and the seal's wall time."""
        if self._end is not None:
            raise SealEnded(self._end)
        tag = secrets.token_hex(8)  # an answer counts only with the tag of its request: lines written ahead are noise
        try:
            os.write(self._req_w, json.dumps(dict(request, id=tag)).encode() + b"\n")
        except (BrokenPipeError, OSError):
            raise SealEnded(self.close()) from None
        limit = min(time.monotonic() + timeout_s, self.deadline)
        while True:
            answer = self._line(limit, timeout_s)
            if not isinstance(answer, dict):
                continue
            if answer.pop("id", None) == tag:
                return answer

    def _line(self, limit: float, timeout_s: float):
        """The next line of the student's process, decoded (None when it is not JSON)."""
        while b"\n" not in self._buffer:
            left = limit - time.monotonic()
            if left <= 0:
                if time.monotonic() >= self.deadline:
                    raise SealEnded(self.close(kind="time"))
                raise TimeoutError(f"no answer within {timeout_s:g} s")
            ready, _, _ = select.select([self._resp_r], [], [], min(left, 0.5))
            if not ready:
                if self._proc.poll() is not None:
                    raise SealEnded(self.close())
                if self.stats().get("pids_hits"):  # a fork bomb: nothing it runs after this is fair to judge
                    raise SealEnded(self.close(kind="processes"))
                continue
            chunk = os.read(self._resp_r, 1 << 20)
            if not chunk:
                raise SealEnded(self.close())
            self._buffer += chunk
            if len(self._buffer) > MAX_ANSWER_BYTES:
                raise SealEnded(self.close(kind="answer"))
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return None

    # -- ending it ----------------------------------------------------------------------------

    def close(self, kind: str | None = None) -> SealEnd:
        """End every process of the seal (idempotent) and say how it ended."""
        if self._end is not None:
            return self._end
        end = SealEnd(wall_s=time.monotonic() - self.started)
        report = {}
        if self._lifeline_w is not None:
            os.close(self._lifeline_w)  # the init ends every process of the namespace
            self._lifeline_w = None
        else:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        if self._report_r is not None:
            raw = b""
            while chunk := os.read(self._report_r, 65536):
                raw += chunk
            os.close(self._report_r)
            self._report_r = None
            try:
                report = json.loads(raw) if raw else {}
            except ValueError:
                report = {}
        stats = {}
        if self._cgroups is not None:
            end.killed_after = self._cgroups.empty()
            stats = self._cgroups.stats()
            end.cgroups_left = self._cgroups.remove()
        for fd in (self._req_w, self._resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._root, ignore_errors=True)
        end.cpu_s, end.memory_peak = stats.get("cpu_s"), stats.get("memory_peak")
        end.disk_used = report.get("disk_used")
        end.log_tail = self.log_tail()
        end.kind, end.reason = _why(kind, report, stats, self.limits, end)
        self._end = end
        return end


def size_text(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def _why(kind: str | None, report: dict, stats: dict, limits: Limits, end: SealEnd) -> tuple[str, str]:
    """The end's kind and its reason, in the teacher's words (what the cgroup and the init saw come first)."""
    disk = report.get("disk_used") or 0
    if report.get("error"):
        return "setup", f"the seal could not be built ({report['error']})"
    if stats.get("oom_kills") or kind == "memory":
        return "memory", f"it used more than the memory limit ({size_text(limits.memory_bytes)}) and was killed"
    if stats.get("pids_hits") or kind == "processes":
        return "processes", f"it forked without end: it reached the process limit ({limits.pids} processes and threads)"
    if kind == "time" or report.get("stopped") == "time":
        return "time", f"it ran past the time limit ({limits.wall_s:g} s for the whole notebook)"
    if kind == "disk" or (disk and disk >= 0.98 * limits.disk_bytes):
        return "disk", f"it filled its disk ({size_text(limits.disk_bytes)})"
    if kind == "answer":
        return "crashed", f"a function returned more than {MAX_ANSWER_BYTES // MiB} MiB"
    if "signal" in report:
        name = signal.Signals(report["signal"]).name if report["signal"] in signal.valid_signals() else "?"
        return "crashed", f"the student's process crashed (killed by {name})"
    if report.get("exit") not in (None, 0):
        return "crashed", f"the student's process exited (status {report['exit']}) before the checks were done"
    if kind in ("crashed", "stuck"):
        return "crashed", "the student's process stopped answering (a cell broke it)"
    if not report and end.log_tail.strip():  # it never started: unshare or Python said why
        return "setup", f"the seal did not start ({end.log_tail.strip().splitlines()[-1][:200]})"
    return kind or "ended", "it ended"


def _free_uid(slot: int) -> int:
    uid = UID_BASE + slot
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1000


def _limit_process(pid: int, limits: Limits) -> None:
    """Without cgroups: what one process (and what it starts) may use, set from outside."""
    import resource

    for res, value in ((resource.RLIMIT_FSIZE, limits.disk_bytes), (resource.RLIMIT_DATA, limits.memory_bytes)):
        try:
            resource.prlimit(pid, res, (value, value))
        except (OSError, ValueError, AttributeError):
            pass


def check_limits(limits: Limits) -> Limits:
    """Refuse limits that cannot work, with what to give instead."""
    if not limits.wall_s > 0:
        raise CourseInputError(f"--time must be a number of seconds above 0, got {limits.wall_s!r}")
    if limits.memory_bytes < 512 * MiB:
        raise CourseInputError("--memory below 512 MiB cannot run torch; give at least 1GiB (e.g. --memory 4GiB)")
    if limits.pids < 64:
        raise CourseInputError("--pids below 64 cannot start the ranks and their threads; give at least 128")
    if limits.disk_bytes < 16 * MiB:
        raise CourseInputError("--disk below 16 MiB leaves no room for the notebook; give at least 256MiB")
    return limits

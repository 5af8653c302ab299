"""The cgroups of a grading seal (issue 29; ``seal``): the limits on memory and processes, and the meter.

cgroup v1 (one cgroup per controller: memory, pids, cpuacct) and v2 (one cgroup), each made under the cgroup the
grader itself is in. What they give the seal that a PID namespace cannot: a limit on all its processes' memory
together and on how many processes and threads it runs, the count of out-of-memory kills and of refused forks,
the peak of memory, and CPU seconds.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, type, super options) of every mount."""
    out = []
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            parts, rparts = left.split(), right.split()
            out.append((parts[4], rparts[0], rparts[-1] if len(rparts) > 2 else ""))
    except OSError:
        pass
    return out


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per controller ("" for the v2 hierarchy)."""
    out = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except OSError:
        pass
    return out


def v1_dirs() -> dict[str, Path]:
    """cgroup v1: the writable folder under which this process may create cgroups, per controller."""
    own = _own_cgroups()
    out = {}
    for point, kind, opts in _mounts():
        if kind != "cgroup":
            continue
        for c in ("memory", "pids", "cpuacct"):
            if c in opts.split(",") and c not in out:
                base = Path(point) / own.get(c, "/").lstrip("/")
                if os.access(base, os.W_OK):
                    out[c] = base
    return out


def v2_dir() -> Path | None:
    """cgroup v2: a folder where children get the memory and pids controllers, or None."""
    own = _own_cgroups().get("")
    for point, kind, _ in _mounts():
        if kind != "cgroup2" or own is None:
            continue
        base = Path(point) / own.lstrip("/")
        try:
            have = (base / "cgroup.controllers").read_text().split()
            if {"memory", "pids"} <= set(have) and os.access(base, os.W_OK):
                enabled = (base / "cgroup.subtree_control").read_text().split()
                if not {"memory", "pids"} <= set(enabled):
                    (base / "cgroup.subtree_control").write_text("+memory +pids" + (" +cpu" if "cpu" in have else ""))
                return base
        except OSError:  # a cgroup holding processes cannot enable controllers for children
            continue
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _field(text: str, key: str) -> int:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


class Cgroups:
    """One seal's cgroups (v1: one per controller; v2: one), with its limits set."""

    def __init__(self, kind: str, name: str, limits):
        self.kind, self.dirs = kind, {}
        if kind == "v1":
            for c, base in v1_dirs().items():
                self.dirs[c] = base / name
                self.dirs[c].mkdir()
            mem = self.dirs["memory"]
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():
                try:  # no swap beyond the limit either (where swap accounting is on)
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
                except OSError:
                    pass
            (self.dirs["pids"] / "pids.max").write_text(str(limits.pids))
        else:
            path = v2_dir() / name
            path.mkdir()
            self.dirs = {"memory": path, "pids": path, "cpu": path}
            (path / "memory.max").write_text(str(limits.memory_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
            (path / "pids.max").write_text(str(limits.pids))

    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def stats(self) -> dict:
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        if self.kind == "v1":
            cpu = self.dirs.get("cpuacct")
            return {
                "memory_peak": int(_read(mem / "memory.max_usage_in_bytes").strip() or 0),
                "oom_kills": _field(_read(mem / "memory.oom_control"), "oom_kill"),
                "memory_hits": int(_read(mem / "memory.failcnt").strip() or 0),
                "pids_hits": _field(_read(pids / "pids.events"), "max"),
                "cpu_s": int(_read(cpu / "cpuacct.usage").strip() or 0) / 1e9 if cpu else None,
            }
        events = _read(mem / "memory.events")
        return {
            "memory_peak": int(_read(mem / "memory.peak").strip() or 0),
            "oom_kills": _field(events, "oom_kill"),
            "memory_hits": _field(events, "max"),
            "pids_hits": _field(_read(pids / "pids.events"), "max"),
            "cpu_s": _field(_read(mem / "cpu.stat"), "usage_usec") / 1e6,
        }

    def procs(self) -> set[int]:
        return {int(p) for f in self.procs_files() for p in _read(Path(f)).split()}

    def empty(self, stall_s: float = 15.0, wait_s: float = 120.0) -> int:
        """Wait until no process is left in the cgroup, and return how many had to be killed to get there.

        The PID namespace's processes are already killed when this runs, but they leave the cgroup only once
        they are gone, which takes a while: hundreds of them on a loaded machine left at a few per second in a
        test run at load 23. So the wait lasts as long as processes keep leaving; what is still there after
        ``stall_s`` with none leaving (or after ``wait_s`` in all) gets SIGKILL: 0 means the PID namespace
        ended every process.
        """
        start = last_progress = time.monotonic()
        killed, fewest = set(), None
        while pids := self.procs():
            now = time.monotonic()
            if fewest is None or len(pids) < fewest:
                fewest, last_progress = len(pids), now
            if now - start > wait_s + stall_s:
                break
            if now - last_progress > stall_s or now - start > wait_s:
                if self.kind == "v2" and (self.dirs["pids"] / "cgroup.kill").exists():
                    (self.dirs["pids"] / "cgroup.kill").write_text("1")
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.add(pid)
                    except ProcessLookupError:
                        pass
            time.sleep(0.05)
        return len(killed)

    def remove(self, wait_s: float = 10.0) -> list[str]:
        """Remove the cgroups; return those that could not be (a process still leaving, after ``wait_s``)."""
        left = []
        for d in set(self.dirs.values()):
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(str(d))
                        break
                    time.sleep(0.05)
        return left

"""Which sockets a command's processes listen on beyond loopback (issue 34: nothing listens beyond the machine).

``watch(argv)`` runs a command with a marker in its environment, which every process it starts
inherits (agents, workers, torchrun, kernels, servers), and samples /proc while it runs: for every
process carrying the marker, the TCP sockets it listens on and the UDP sockets it has bound, read
from the socket tables of that process's own network namespace. A socket counts when it is in this
machine's own network namespace and its address is not loopback: a socket inside one of
``course_utils.cluster``'s namespaces is reachable only from the cluster's own private subnet.
``watching_this_process()`` samples the same way, for the processes a run made inside the test starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

_LOOPBACK6 = ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def _is_loopback(hex_address: str, v6: bool) -> bool:
    host = hex_address.split(":")[0]
    return host in _LOOPBACK6 if v6 else host.endswith("7F")  # 127.x.x.x, little-endian


def _readable(hex_address: str, v6: bool) -> str:
    host, port = hex_address.split(":")
    if v6:
        return f"[{host}]:{int(port, 16)}"
    return ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"


def _marked(marker: str, older: set | None = None) -> list[int]:
    """Pids whose environment holds ``marker``. ``older``: pids that ran before the command started and have
    been listed at every sample since (updated here), so cannot be its processes: their environment is not
    read again (a sample read every process's, ~5 ms of CPU per 50 ms on a busy machine). A pid is reused
    only after the kernel's counter wraps (pid_max), never within the 50 ms between two samples."""
    listed = set(filter(str.isdigit, os.listdir("/proc")))
    if older is not None:
        older &= listed  # one that vanished may come back as another process: read it then
    pids = []
    for pid in listed - (older or set()):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of ``pid``'s open sockets. A descriptor closed between the listing and its reading is
    skipped alone (it was skipping the whole process for that sample: a false negative)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def sockets_beyond_loopback(pids) -> set[tuple[str, str, str]]:
    """``(command, protocol, address)`` of every socket one of ``pids`` holds open beyond loopback, now."""
    host_ns = os.readlink("/proc/self/ns/net")
    found = set()
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != host_ns:
                continue  # a cluster node's namespace: its own private network
            inodes = _socket_inodes(pid)
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            for table in ("tcp", "tcp6", "udp", "udp6"):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    # TCP: LISTEN (0A). UDP: bound and unconnected (no remote address). A connected UDP socket
                    # takes datagrams from its one peer only; glibc's resolver opens one, on the host's own
                    # address, for each DNS query (torch elastic's socket.getfqdn() makes one): most likely what
                    # test_ft saw once, port 52269 of eth0, in a run whose servers all listened on loopback
                    connected = fields[2].split(":")[1] != "0000"
                    listening = (table.startswith("udp") and not connected) or fields[3] == "0A"
                    v6 = table.endswith("6")
                    if fields[9] in inodes and listening and not _is_loopback(fields[1], v6):
                        found.add((command, table, _readable(fields[1], v6)))
        except OSError:
            continue
    return found


def watch(argv, *, timeout_s: float = 300, env=None, cwd=None, until=None, shell=False):
    """Run ``argv`` to its end (or until ``until(proc)`` is true: then it is stopped), sampling every 50 ms.

    The command's output goes to a file, ``proc.output_path`` (``until`` may read it); returns
    ``(sockets beyond loopback seen at any sample, the finished process)`` with ``proc.output`` set.
    """
    import tempfile

    marker = f"COURSE_SOCKET_PROBE={uuid.uuid4().hex}"
    key, value = marker.split("=")
    out = tempfile.NamedTemporaryFile(prefix="course-listening-", suffix=".log", delete=False)
    older = set(filter(str.isdigit, os.listdir("/proc")))
    proc = subprocess.Popen(
        argv,
        env={**(env or os.environ), key: value},
        cwd=cwd,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        shell=shell,
    )
    out.close()
    proc.output_path = Path(out.name)
    seen, deadline = set(), time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= sockets_beyond_loopback(_marked(marker, older))
            if until is not None and until(proc):
                seen |= sockets_beyond_loopback(_marked(marker, older))
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.output = proc.output_path.read_text(errors="replace")
        proc.output_path.unlink()
    return seen, proc


@contextlib.contextmanager
def watching_this_process():
    """Sample, every 50 ms while the block runs, the sockets of every process this one has started (its
    descendants, read from /proc): for a run made in this process (``ft_run``, which forks from ``launch``'s
    agent server, so a marker in ``os.environ`` would not reach every process). Yields the set it fills."""
    seen, done = set(), threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            seen.update(sockets_beyond_loopback(_descendants(os.getpid())))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()

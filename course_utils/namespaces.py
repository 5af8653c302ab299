"""Several "nodes" on one Linux machine, joined by a real, rate-limited network link (notebooks 05 and 06).

Every other run of the course puts all its ranks on one host, talking over loopback. Here each
node is a network namespace (its own network stack and address), and the nodes are wired as a
star: each node's one cable (a veth pair) goes into a switch (a Linux bridge, in a namespace of
its own). A star and not a chain of direct cables because a replacement node (notebook 06) then
plugs in like any other, and N > 2 needs nothing new. ``tc`` shapes both ends of every cable:
``tbf`` for the rate (each node sends and receives at most RATE, a full-duplex network card),
``netem`` for a delay where the kernel has it (many container kernels do not; the report says
which was used). What runs on the nodes is ``course_utils.cluster``'s.

Addresses are the cluster's own (``SUBNET``, inside namespaces that have no other interface):
nothing is sent anywhere else. Nothing a cluster creates outlives it, however its process ends:

- on success, failure, timeout and interrupt, ``close`` kills every process in every namespace,
  deletes the namespaces (their cables and qdiscs go with them) and the cluster's folder;
- a guardian process, started before anything else in a session of its own, does the same the
  moment the creating process is gone (SIGKILL included: it watches a pipe from it);
- names carry the course prefix and the creating process's id, so ``remove_leftovers`` (run by
  every new cluster, by ``python -m course_utils cluster --clean`` and by ``make test``) removes
  whatever a run whose creator is dead left, should the guardian have died with it.

Linux and root only (network namespaces and ``tc`` need them); ``missing()`` says in one
sentence what this machine lacks.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import CourseInputError

#: Every namespace the course creates starts with this; then the creating process's id.
PREFIX = "course-"
#: The cluster's own private /24; node i is SUBNET.(11 + i) (two digits keep string order = node order).
SUBNET = "10.213.0"
#: The node's network card, inside its namespace.
IFACE = "eth0"
#: Nodes per cluster, replacements included: addresses .11 to .19 stay two digits, so their string order
#: (by which c10d ranks the nodes, through --local-addr) is the nodes' order.
MAX_NODES = 9


class ClusterUnavailable(CourseInputError):
    """This machine cannot build the cluster; the message says what is missing (notebook 05)."""


@dataclass(frozen=True)
class Link:
    """A cable's shape (notebook 05): ``rate`` in tc's words ("100mbit") or None, ``delay`` ("5ms") or None."""

    rate: str | None = None
    delay: str | None = None

    @property
    def bytes_per_s(self) -> float | None:
        """The rate in bytes per second (tc's units are decimal: 1mbit = 10^6 bit/s), None if unlimited."""
        if self.rate is None:
            return None
        number, unit = re.fullmatch(r"([0-9.]+)(kbit|mbit|gbit)", self.rate).groups()
        return float(number) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[unit] / 8

    def describe(self) -> str:
        """ "100mbit", "unlimited" or "100mbit, 5ms delay": the link in words."""
        return (self.rate or "unlimited") + (f", {self.delay} delay" if self.delay else "")


def parse_link(text: str | Link | None) -> Link:
    """``"unlimited"``, ``"100mbit"``, ``"1gbit"`` or ``"100mbit,5ms"`` -> ``Link`` (notebook 05)."""
    if isinstance(text, Link):
        return text
    text = (text or "unlimited").strip().lower().replace(" ", "")
    rate, _, delay = text.partition(",")
    if rate not in ("unlimited", "none", "") and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)", rate):
        raise CourseInputError(
            f"--link {text!r}: give a rate like 100mbit or 1gbit (or unlimited), optionally a delay: 100mbit,5ms"
        )
    if rate not in ("unlimited", "none", "") and not float(re.match(r"[0-9.]+", rate).group()) > 0:
        raise CourseInputError(f"--link {text!r}: a rate of 0 carries nothing; give a rate like 100mbit (or unlimited)")
    if delay and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(us|ms|s)", delay):
        raise CourseInputError(f"--link {text!r}: the delay after the comma must look like 5ms")
    return Link(None if rate in ("unlimited", "none", "") else rate, delay or None)


# ------------------------------------------------------------------ what the machine must offer


def _is_root() -> bool:
    return os.geteuid() == 0


def _which(tool: str) -> str | None:
    return shutil.which(tool)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def missing() -> str | None:
    """One sentence saying what this machine lacks for a cluster, or None when it has it all (notebook 05)."""
    if not sys.platform.startswith("linux"):
        return f"the cluster needs Linux network namespaces, and this is {sys.platform}"
    if not _is_root():
        return "the cluster needs root (network namespaces and tc); run it as root, e.g. with sudo"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("taskset", "util-linux")):
        if _which(tool) is None:
            return f"the cluster needs the `{tool}` command, which is not installed (package {package})"
    probe = f"{PREFIX}{os.getpid()}-probe-{secrets.token_hex(3)}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return (
            "this machine forbids new network namespaces (a container without CAP_SYS_ADMIN?): " + made.stderr.strip()
        )
    _run("ip", "netns", "delete", probe, check=False)
    return None


def require() -> None:
    """Raise ``ClusterUnavailable`` with ``missing()``'s sentence if the cluster cannot be built (notebook 05)."""
    reason = missing()
    if reason:
        raise ClusterUnavailable(reason)


# ------------------------------------------------------------------ namespaces and their processes


def course_namespaces() -> list[str]:
    """Names of every network namespace the course created and did not remove yet (notebook 05)."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def namespace_pids(ns: str) -> list[int]:
    """Processes living in namespace ``ns`` (``ip netns pids``; notebook 05)."""
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_namespace(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` until none is left. torchrun's workers run in sessions of
    their own and can outlive their agent, so a process group is not enough: the namespace is."""
    deadline = time.monotonic() + timeout_s
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _run("ip", "netns", "delete", ns, check=False)  # its cables and their qdiscs go with it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _creator(name: str) -> int | None:
    """The id of the process that created a course namespace or folder, from its name."""
    found = re.match(r"course-(?:cluster-)?(\d+)-", name)
    return int(found.group(1)) if found else None


def remove_leftovers() -> list[str]:
    """Remove what course clusters whose creating process is gone left behind (notebook 05).

    Their namespaces (and every process in them; cables and qdiscs go with the namespaces) and their
    folders (``course-cluster-<pid>-*`` in the temporary folder). A cluster's guardian normally does
    this the moment its creator dies; this is for when the guardian died too. What belongs to a run
    that is still alive is left alone. Returns the names removed.
    """
    removed = []
    for ns in course_namespaces():
        pid = _creator(ns)
        if pid is not None and not _alive(pid):
            _remove_namespace(ns)
            removed.append(ns)
    for folder in Path(tempfile.gettempdir()).glob("course-cluster-*"):
        pid = _creator(folder.name)
        if pid is not None and not _alive(pid) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def clean_command() -> int:
    """``python -m course_utils cluster --clean``: remove what killed cluster runs left; say what (notebook 05)."""
    if not sys.platform.startswith("linux") or not _is_root():
        print("nothing to clean here: clusters are built by root on Linux only")
        return 0
    removed = remove_leftovers()
    print("\n".join(f"removed {name}" for name in removed) if removed else "nothing left by a cluster run")
    return 0


_GUARD = """
import os, select, shutil, signal, sys
from course_utils.namespaces import _remove_namespace, course_namespaces
run, folder, creator = sys.argv[1], sys.argv[2], os.getppid()
stop = []
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda *a: stop.append(1))  # a signal to the guardian ends the wait, never the clean-up
while not stop and os.getppid() == creator:  # the creator exits, however: its pipe closes or we are re-parented
    try:
        if select.select([0], [], [], 0.5)[0] and not os.read(0, 4096):
            break
    except InterruptedError:
        pass
for ns in course_namespaces():
    if ns.startswith(run):
        _remove_namespace(ns)
shutil.rmtree(folder, ignore_errors=True)
"""


class _Guardian:
    """A small process that removes a cluster's namespaces and folder when its creator is gone (SIGKILL too).

    It runs in a session of its own (a signal to the creator's process group does not reach it) and
    waits on a pipe only the creator holds: the pipe closes when the creator exits, however it exits.
    """

    def __init__(self, run: str, folder: Path):
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _GUARD, run, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def release(self) -> None:
        """The creator cleaned up itself: let the guardian check once more and leave."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


@dataclass
class Node:
    """One "machine": a namespace, its address, and the port of its cable on the switch (notebook 05)."""

    index: int
    ns: str
    addr: str
    port: str


class Cluster:
    """``with Cluster(nodes=2, link="100mbit") as c:`` N namespaces on a switch, torn down on exit (notebook 05).

    ``c.start(node, argv)`` runs a command inside a node (its own session, output to a log);
    ``c.lose(node)`` kills every process of a node and unplugs it (notebook 06);
    ``c.add_node()`` plugs in a new one; ``c.set_link(...)`` reshapes every cable.
    """

    def __init__(self, nodes: int = 2, link: str | Link | None = "unlimited"):
        if not isinstance(nodes, int) or isinstance(nodes, bool) or not 2 <= nodes <= MAX_NODES:
            raise CourseInputError(f"nodes must be a whole number from 2 to {MAX_NODES}, got {nodes!r}")
        self.size, self.link = nodes, parse_link(link)
        self.run = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.run}-sw"
        self.nodes: list[Node] = []
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.netem = False
        self.log_dir: Path | None = None
        self._guardian: _Guardian | None = None
        self._count = 0

    def __enter__(self) -> Cluster:
        require()
        remove_leftovers()
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"course-cluster-{os.getpid()}-"))
        self._guardian = _Guardian(self.run, self.log_dir)  # before any namespace exists
        try:
            self._make_namespace(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            if self.link.delay:
                self.netem = self._has_netem()
                if not self.netem:
                    raise ClusterUnavailable(
                        f"this kernel has no netem qdisc, so a delay ({self.link.delay}) cannot be set; "
                        "give the link a rate only (e.g. --link 100mbit)"
                    )
            for _ in range(self.size):
                self.add_node()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _has_netem(self) -> bool:
        """Whether this kernel has netem: try it on the switch namespace's loopback."""
        ok = (
            _run(
                "ip",
                "netns",
                "exec",
                self.switch,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
                check=False,
            ).returncode
            == 0
        )
        _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return ok

    def add_node(self) -> Node:
        """Plug a new node into the switch: namespace, cable, address, shaped link (notebooks 05, 06)."""
        i = self._count
        if i >= MAX_NODES:
            raise CourseInputError(f"at most {MAX_NODES} nodes (replacements included) per cluster")
        self._count += 1
        node = Node(i, f"{self.run}-n{i}", f"{SUBNET}.{11 + i}", f"n{i}")
        self._make_namespace(node.ns)
        # The cable is created with both ends already inside their namespaces: nothing of it ever
        # exists in the host's own namespace, so two clusters at once cannot collide on a name.
        _run(
            "ip",
            "link",
            "add",
            "name",
            IFACE,
            "netns",
            node.ns,
            "type",
            "veth",
            "peer",
            "name",
            node.port,
            "netns",
            self.switch,
        )
        _run("ip", "-n", self.switch, "link", "set", node.port, "master", "br0", "up")
        _run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", IFACE)
        _run("ip", "-n", node.ns, "link", "set", IFACE, "up")
        self.nodes.append(node)
        self._shape(node)
        return node

    def set_link(self, link: str | Link | None) -> None:
        """Reshape every cable (rate, delay) without restarting anything (notebook 05)."""
        link = parse_link(link)
        if link.delay and not self._has_netem():
            raise ClusterUnavailable(
                f"this kernel has no netem qdisc, so a delay ({link.delay}) cannot be set; give the link a rate only"
            )
        self.link, self.netem = link, bool(link.delay)
        for node in self.nodes:
            self._shape(node)

    def _shape(self, node: Node) -> None:
        """Both ends of a node's cable: what it sends (its card) and what the switch sends it."""
        rate, delay = self.link.rate, self.link.delay
        for ns, dev in ((node.ns, IFACE), (self.switch, node.port)):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
            _run(*tc, "del", "dev", dev, "root", check=False)
            if delay:
                _run(*tc, "add", "dev", dev, "root", "netem", "delay", delay, *(["rate", rate] if rate else []))
            elif rate:
                # a bucket of 5 ms at the rate (at least 64 KiB, which tc needs at low rates), queue up to 50 ms
                burst = max(64 * 1024, int(self.link.bytes_per_s / 200))
                _run(*tc, "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms")

    def free_port(self, node: Node) -> int:
        """A port nothing listens on in ``node`` (the OS picks it: bind to port 0 there)."""
        out = _run(
            "ip",
            "netns",
            "exec",
            node.ns,
            sys.executable,
            "-c",
            "import socket; s = socket.socket(); s.bind(('" + node.addr + "', 0)); print(s.getsockname()[1])",
        )
        return int(out.stdout)

    def cores(self, node: Node) -> set[int]:
        """The host cores a node runs on: its own share (real machines do not lend each other cores),
        so a node's ranks size their thread pools from its share (``dist.usable_cores``)."""
        host = sorted(os.sched_getaffinity(0))
        slot = self.nodes.index(node) % self.size
        return {c for i, c in enumerate(host) if i % self.size == slot} or set(host)  # fewer cores than nodes: share

    def start(self, node: Node, argv: list[str], env: dict | None = None, name: str | None = None) -> subprocess.Popen:
        """Run ``argv`` inside ``node`` in a session of its own; output goes to ``self.log_dir/<name>.log``."""
        log = open(self.log_dir / f"{name or node.ns}.log", "ab")
        tmp = self.log_dir / "tmp"  # torchrun's own log folders (torchelastic_*) and any temporary file: removed
        tmp.mkdir(exist_ok=True)  # with the cluster, not left in /tmp (633 torchelastic_ folders were)
        full_env = {**os.environ, **(env or {}), "TMPDIR": str(tmp)}
        cores = ",".join(map(str, sorted(self.cores(node))))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", node.ns, "taskset", "-c", cores, *argv],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def lose(self, node: Node) -> None:
        """The whole node is gone: every process in it (agent and workers) killed at once, its cable unplugged (notebook 06)."""
        _kill_namespace(node.ns)
        _run("ip", "netns", "delete", node.ns, check=False)
        self.namespaces.remove(node.ns)
        self.nodes.remove(node)

    def close(self) -> None:
        """Kill every process of every node, then delete the namespaces (cables and qdiscs go with them)
        and the nodes' logs (read them before: a failed run's error message quotes their tails)."""
        for ns in reversed(self.namespaces):
            _remove_namespace(ns)
        self.namespaces.clear()
        for proc in self.procs:
            if proc.poll() is None:  # an `ip netns exec` that never got its namespace
                proc.kill()
            proc.wait()
        if self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self._guardian is not None:
            self._guardian.release()
            self._guardian = None

    def scratch(self, name: str) -> Path:
        """A folder of this cluster's, shared by its nodes (one filesystem) and removed with it."""
        folder = self.log_dir / name
        folder.mkdir()
        return folder

    def describe_link(self) -> dict:
        """``{"rate", "delay", "netem"}`` of the cables: what was really set."""
        return {**asdict(self.link), "netem": self.netem}

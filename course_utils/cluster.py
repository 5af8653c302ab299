"""Several "nodes" on one Linux machine, joined by a real, rate-limited network link (notebooks 05 and 06).

Every other run of the course puts all its ranks on one host, talking over loopback. Here each
node is a network namespace (its own network stack and address), and the nodes are wired as a
star: each node's one cable (a veth pair) goes into a switch (a Linux bridge, in a namespace of
its own). A star and not a chain of direct cables because a replacement node (notebook 06) then
plugs in like any other, and N > 2 needs nothing new. ``tc`` shapes both ends of every cable:
``tbf`` for the rate (each node sends and receives at most RATE, a full-duplex network card),
``netem`` for a delay where the kernel has it (many container kernels do not; the report says
which was used).

Then ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint <node 0>:<port>``
runs inside every namespace (``ip netns exec``), exactly the line one would type on each machine
of a real cluster. torch ignores ``--node-rank`` with the c10d rendezvous (it assigns node ranks
itself, in the order of ``--local-addr``), so that is what orders the nodes here.

Addresses are the cluster's own (``SUBNET``, inside namespaces that have no other interface):
nothing is sent anywhere else. Everything a run creates (processes, namespaces, cables, qdiscs:
the last two live and die with the namespaces) is removed on success, failure, timeout and
interrupt, and the names carry the course prefix and the creating process's id, so two runs at
once never collide and the leftovers of a killed run are recognised and removed by the next.

Linux and root only (network namespaces and ``tc`` need them); ``missing()`` says in one
sentence what this machine lacks.
"""

from __future__ import annotations

import json
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


def remove_leftovers() -> list[str]:
    """Remove the namespaces (and their processes) of course runs whose creating process is gone (notebook 05).

    A run killed with SIGKILL cannot clean up after itself; the next run does. Namespaces of a
    run that is still alive are left alone. Returns the names removed.
    """
    removed = []
    for ns in course_namespaces():
        found = re.match(re.escape(PREFIX) + r"(\d+)-", ns)
        if found and not _alive(int(found.group(1))):
            _remove_namespace(ns)
            removed.append(ns)
    return removed


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
        self._count = 0

    def __enter__(self) -> Cluster:
        require()
        remove_leftovers()
        self.log_dir = Path(tempfile.mkdtemp(prefix="course-cluster-"))
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
        full_env = {**os.environ, **(env or {})}
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

    def describe_link(self) -> dict:
        """``{"rate", "delay", "netem"}`` of the cables: what was really set."""
        return {**asdict(self.link), "netem": self.netem}


# ------------------------------------------------------------------ torchrun across the nodes


def torchrun_argv(
    cluster: Cluster,
    node: Node,
    endpoint: str,
    *,
    nproc_per_node: int,
    module_argv: list[str],
    max_restarts: int = 0,
    rdzv_id: str,
) -> list[str]:
    """The torchrun line of one node, as one would type it on that machine (notebook 05)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(cluster.size),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--local-addr",
        node.addr,
        "--max-restarts",
        str(max_restarts),
        # node 0 hosts the rendezvous store (torch's guess compares host names, which all namespaces
        # share); a dead node is declared dead after 2 missed 1 s heartbeats (the default waits 15 s)
        "--rdzv-conf",
        f"is_host={int(node.addr == endpoint.rpartition(':')[0])},join_timeout=60,"
        "keep_alive_interval=1,keep_alive_max_attempt=2",
        "--monitor-interval",
        "0.1",
        *module_argv,
    ]


def _node_env(timeout_s: float, progress_dir: str | None) -> dict:
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env = {
        "GLOO_SOCKET_IFNAME": IFACE,  # gloo talks over the node's card, not loopback
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a fresh store per restart (pytorch/pytorch#135712)
        "COURSE_TIMEOUT_S": str(timeout_s),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p),
    }
    if progress_dir:
        env["COURSE_PROGRESS_DIR"] = progress_dir
    return env


def _report_from_logs(cluster: Cluster) -> dict | None:
    """Rank 0's JSON report line, from whichever node's log holds it."""
    for log in sorted(cluster.log_dir.glob("*.log")):
        for line in reversed(log.read_text(errors="replace").splitlines()):
            start = line.find("{")
            if start >= 0 and '"losses"' in line:
                try:
                    return json.loads(line[start:])
                except json.JSONDecodeError:
                    continue
    return None


def _tail(cluster: Cluster, lines: int = 15) -> str:
    parts = []
    for log in sorted(cluster.log_dir.glob("*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(text))
    return "\n".join(parts)


def _wait(procs: list[subprocess.Popen], deadline: float, cluster: Cluster, on_tick=None) -> None:
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(
                "the cluster run did not finish in time; every process was stopped. Last output:\n" + _tail(cluster)
            )
        if on_tick:
            on_tick()
        time.sleep(0.02)
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise RuntimeError(
            f"torchrun exited with status {bad[0]} on a node; every process was stopped. "
            "Last output:\n" + _tail(cluster)
        )


def _start_job(
    cluster: Cluster, module_argv: list[str], *, nproc_per_node: int, max_restarts: int, env: dict
) -> tuple[list[subprocess.Popen], callable]:
    """Start torchrun on every node; return the processes and ``argv_of(node)`` (for replacements)."""
    head = cluster.nodes[0]
    endpoint = f"{head.addr}:{cluster.free_port(head)}"

    def argv_of(node):
        return torchrun_argv(
            cluster,
            node,
            endpoint,
            nproc_per_node=nproc_per_node,
            module_argv=module_argv,
            max_restarts=max_restarts,
            rdzv_id=cluster.run,
        )

    return [cluster.start(node, argv_of(node), env) for node in cluster.nodes], argv_of


def _steps_done(progress: str) -> int | None:
    done = []
    for f in Path(progress).glob("rank*.json"):
        try:
            done.append(json.loads(f.read_text())["step"])
        except (OSError, ValueError, KeyError):
            pass
    return max(done) if done else None


def train_on_cluster(
    cfg=None,
    *,
    nodes: int = 2,
    nproc_per_node: int = 2,
    link="unlimited",
    timeout_s: float = 120.0,
    lose_node_after: int | None = None,
    **overrides,
) -> dict:
    """Train with ``course_utils.train`` under torchrun on ``nodes`` namespaces; return its report (notebook 05).

    The report is ``train``'s (losses, ``weights_sha256``, bytes held, traffic, ``step_time_s``,
    ``cross_node_bytes_per_step``) plus ``link`` (what ``tc`` really set), ``nodes``,
    ``nproc_per_node``, ``wall_s`` and ``commands`` (each node's torchrun line).

    ``lose_node_after=S`` (notebook 06): as soon as a rank reports step S done (its checkpoint, if
    S is a checkpoint step, is then complete), every process of the last node is killed at once and
    its cable unplugged, as when a machine dies. The survivors' agents go back to the rendezvous
    and wait; a replacement node is plugged in and started with the very same torchrun line (what
    a job manager does), and the group restarts from the newest complete checkpoint. Needs
    ``checkpoint_dir`` and ``max_restarts >= 1``. The report adds ``lost_after_step``.
    """
    from .train import TrainConfig, train_flags

    cfg = TrainConfig(**{**asdict(cfg or TrainConfig()), **overrides})
    cfg.nproc, cfg.node_size = nodes * nproc_per_node, nproc_per_node
    cfg.validate()
    if lose_node_after is not None and not (cfg.checkpoint_dir and cfg.max_restarts >= 1):
        raise CourseInputError(
            "losing a node needs checkpoint_dir and max_restarts >= 1 (the survivors restart "
            "from the newest complete checkpoint)"
        )
    start = time.monotonic()
    progress = tempfile.mkdtemp(prefix="course-cluster-progress-")
    try:
        with Cluster(nodes, link) as cluster:
            procs, argv_of = _start_job(
                cluster,
                ["-m", "course_utils.train", *train_flags(cfg), "--json"],
                nproc_per_node=nproc_per_node,
                max_restarts=cfg.max_restarts,
                env=_node_env(cfg.timeout_s, progress),
            )
            lost = []

            def lose_when_due():
                if lose_node_after is None or lost or (_steps_done(progress) or 0) < lose_node_after:
                    return
                lost.append(_steps_done(progress))
                cluster.lose(cluster.nodes[-1])
                procs.pop()
                replacement = cluster.add_node()
                procs.append(cluster.start(replacement, argv_of(replacement), _node_env(cfg.timeout_s, progress)))

            _wait(procs, start + timeout_s, cluster, on_tick=lose_when_due)
            report = _report_from_logs(cluster)
            if report is None:
                raise RuntimeError("the run finished without rank 0's report. Last output:\n" + _tail(cluster))
            report.update(
                link=cluster.describe_link(),
                nodes=nodes,
                nproc_per_node=nproc_per_node,
                wall_s=time.monotonic() - start,
                commands=[" ".join(["torchrun", *argv_of(n)[3:]]) for n in cluster.nodes],
            )
            if lose_node_after is not None:
                report["lost_after_step"] = lost[0] if lost else None
    finally:
        shutil.rmtree(progress, ignore_errors=True)
    return report


#: What ``sweep_worker`` keeps of each run's report.
SWEEP_FIELDS = (
    "strategy",
    "world_size",
    "step_time_s",
    "cross_node_bytes_per_step",
    "comm_per_step",
    "weights_sha256",
    "losses",
)


def sweep_worker(config: dict, strategies: list, links: list, phase_dir: str | None = None) -> list | None:
    """Train every strategy on every link in ONE process group; rank 0 returns the rows (notebook 05).

    One job instead of one per run: starting a job (processes, torch import, rendezvous) costs
    seconds, each run here well under one. Before each link, rank 0 asks the controller for it
    (``phase_dir/want-<i>.json``) and waits for ``done-<i>``; with no ``phase_dir`` (one host,
    under ``launch``) the links are only labels. The same worker runs under ``launch`` and torchrun.
    """
    import torch.distributed as dist

    from . import dist as cdist
    from .train import TrainConfig, run_training

    rows = []
    with cdist.session() as info:
        for i, link in enumerate(links):
            if phase_dir and info.rank == 0:
                want, done = Path(phase_dir) / f"want-{i}.json", Path(phase_dir) / f"done-{i}"
                want.write_text(json.dumps({"link": link}))
                deadline = time.monotonic() + 60
                while not done.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the controller never set link {link!r}")
                    time.sleep(0.01)
            dist.barrier()
            for strategy in strategies:
                report = run_training(TrainConfig(**{**config, "strategy": strategy}), info)
                if info.rank == 0:
                    rows.append({"link": link, **{k: report[k] for k in SWEEP_FIELDS}})
    if phase_dir and info.rank == 0:  # results by file: one rank's long line could interleave with others'
        tmp = Path(phase_dir) / "result.json.tmp"
        tmp.write_text(json.dumps(rows))
        tmp.rename(Path(phase_dir) / "result.json")
    return rows if info.rank == 0 else None


def sweep_on_cluster(
    strategies, links, *, nodes: int = 2, nproc_per_node: int = 2, timeout_s: float = 120.0, **config
) -> dict:
    """Every strategy on every link, one torchrun job across ``nodes`` namespaces (notebook 05).

    The controller reshapes the cables between links (``Cluster.set_link``) while the job waits.
    Returns ``{"rows": [...], "links": {link: what tc set}, "wall_s", "commands"}``; each row holds
    ``link`` and ``SWEEP_FIELDS`` of one ``train`` report.
    """
    from .train import TrainConfig

    cfg = TrainConfig(**config)
    cfg.nproc, cfg.node_size = nodes * nproc_per_node, nproc_per_node
    for s in strategies:
        TrainConfig(**{**asdict(cfg), "strategy": s}).validate()
    parsed = [parse_link(x) for x in links]
    links = [p.describe() for p in parsed]
    start = time.monotonic()
    phases = tempfile.mkdtemp(prefix="course-cluster-phases-")
    try:
        with Cluster(nodes, parsed[0]) as cluster:
            args = json.dumps([asdict(cfg), list(strategies), links, phases])
            procs, argv_of = _start_job(
                cluster,
                ["-m", "course_utils.worker", "course_utils.cluster:sweep_worker", "--args", args],
                nproc_per_node=nproc_per_node,
                max_restarts=0,
                env=_node_env(cfg.timeout_s, None),
            )
            shaped = {}

            def serve_links():
                for i, link in enumerate(links):
                    if link not in shaped and (Path(phases) / f"want-{i}.json").exists():
                        cluster.set_link(parsed[i])
                        shaped[link] = cluster.describe_link()
                        (Path(phases) / f"done-{i}").touch()

            _wait(procs, start + timeout_s, cluster, on_tick=serve_links)
            result = Path(phases) / "result.json"
            if not result.exists():
                raise RuntimeError("the sweep finished without rank 0's rows. Last output:\n" + _tail(cluster))
            out = {
                "rows": json.loads(result.read_text()),
                "links": shaped,
                "wall_s": time.monotonic() - start,
                "commands": [" ".join(["torchrun", *argv_of(n)[3:]]) for n in cluster.nodes],
            }
    finally:
        shutil.rmtree(phases, ignore_errors=True)
    return out


def links_vs_planner(
    strategies=("ddp", "full_shard", "hybrid_shard"),
    links=("unlimited", "1gbit", "100mbit"),
    *,
    nodes: int = 2,
    nproc_per_node: int = 2,
    timeout_s: float = 120.0,
    **config,
) -> dict:
    """Each strategy on each link, measured, beside the planner's prediction for that link (notebook 05).

    Where the cluster can be built, ``sweep_on_cluster``. Where it cannot (``missing()`` says why),
    the same worker on one host under ``launch``, link "loopback": the same mesh, the cross-node
    bytes counted the same way (ranks in "nodes" of ``nproc_per_node``), no step time over a link.

    Each row gains ``planned_cross_node_bytes`` and ``link_bytes`` (``plan.network_step``, fp32
    values), and ``planned_step_time_s``: the step measured on the unlimited link plus the planner's
    seconds on this link. ``crossover[other]``: ``bandwidth`` (bytes/s) where HSDP and ``other``
    take equally long (``plan.crossover_bandwidth``; None: never) and ``hsdp_faster``: "below" or
    "above" it, "always" or "never"; ``text``: that in words.
    """
    from . import plan
    from .models import build_model, param_count
    from .strategies import get as strategy
    from .train import TrainConfig

    cfg = TrainConfig(**config, nproc=nodes * nproc_per_node, node_size=nproc_per_node)
    if cfg.precision != "fp32":
        raise CourseInputError("links_vs_planner compares fp32 runs with the planner; use precision='fp32'")
    why_not = missing()
    if why_not is None:
        out = sweep_on_cluster(
            strategies, links, nodes=nodes, nproc_per_node=nproc_per_node, timeout_s=timeout_s, **config
        )
    else:
        from .launch import launch

        rows = launch(
            sweep_worker,
            nproc=cfg.nproc,
            args=(asdict(cfg), list(strategies), ["loopback"]),
            timeout_s=timeout_s,
            echo=False,
            progress=False,
        )[0]
        out = {"rows": rows, "links": {}, "commands": []}
    psi = param_count(build_model(cfg.model))
    base = {r["strategy"]: r["step_time_s"] for r in out["rows"] if r["link"] == "unlimited"}
    for r in out["rows"]:
        rate = None if r["link"] == "loopback" else parse_link(r["link"]).bytes_per_s
        machines = plan.Cluster(gpus_per_node=nproc_per_node, nodes=nodes, inter_bw=rate or 1e12)
        net = plan.network_step(strategy(r["strategy"]), psi, machines, bytes_per_value=4)
        r["planned_cross_node_bytes"] = net["cross_node_bytes"]
        r["link_bytes"] = net["network_s"] * machines.inter_bw  # what the busiest cable carries per step
        r["planned_step_time_s"] = (
            None if r["strategy"] not in base else base[r["strategy"]] + (net["network_s"] if rate else 0.0)
        )
    crossover = {}
    if "hybrid_shard" in base:
        link_bytes = {r["strategy"]: r["link_bytes"] for r in out["rows"]}
        for other in base:
            if other == "hybrid_shard":
                continue
            h, o = (base["hybrid_shard"], link_bytes["hybrid_shard"]), (base[other], link_bytes[other])
            bandwidth = plan.crossover_bandwidth(*h, *o)
            if bandwidth:
                wins = "below" if h[1] < o[1] else "above"
            else:
                wins = "always" if h[0] <= o[0] and h[1] <= o[1] else "never"
            where = {"below": "below", "above": "above"}.get(wins)
            text = (
                f"HSDP is faster than {other} {where} {bandwidth * 8 / 1e6:,.0f} Mbit/s"
                if where
                else f"HSDP is {'faster than' if wins == 'always' else 'never faster than'} {other} on every link"
            )
            crossover[other] = {"bandwidth": bandwidth, "hsdp_faster": wins, "text": text}
    return {**out, "why_not": why_not, "psi": psi, "crossover": crossover}


# ------------------------------------------------------------------ command line


def cluster_arguments(parser) -> None:
    """``train``'s flags, less ``--nproc`` and ``--node-size`` (the cluster's shape sets them), plus its own (notebook 05)."""
    from .train import train_arguments

    train_arguments(parser, one_machine=False)
    parser.set_defaults(strategy="hybrid_shard")  # the strategy a slow link between nodes is for
    parser.add_argument("--nodes", type=int, default=2, help='namespaces ("machines") on the switch')
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument(
        "--link",
        default="unlimited",
        help="each node's link: unlimited, 100mbit, 1gbit, or RATE,DELAY (delay needs netem)",
    )
    parser.add_argument("--wall-timeout-s", type=float, default=300.0, help="the whole run, then everything is stopped")


def cluster_command(args) -> int:
    """``python -m course_utils cluster ...`` (notebook 05)."""
    from .train import _config_from_args, print_report

    require()  # first: on a machine without the cluster, nothing else matters
    args.nproc, args.node_size = args.nodes * args.nproc_per_node, args.nproc_per_node
    cfg = _config_from_args(args)
    try:
        report = train_on_cluster(
            cfg, nodes=args.nodes, nproc_per_node=args.nproc_per_node, link=args.link, timeout_s=args.wall_timeout_s
        )
    except (RuntimeError, TimeoutError) as exc:  # a failed run, already torn down: say why, no traceback
        print(f"python -m course_utils cluster: {exc}", file=sys.stderr)
        return 1
    print_report(report, args.json)
    if not args.json:
        print(
            f"link {report['link']['rate'] or 'unlimited'}, delay {report['link']['delay'] or 'none'}; "
            f"{report['cross_node_bytes_per_step']:.0f} B per step from one rank to other nodes"
        )
    return 0

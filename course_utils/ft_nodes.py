"""Where a TorchFT replica group lives and listens: this machine's loopback, or a node of the cluster (notebook 06).

``course_utils.ft`` forks one process per replica group. On one machine each group listens on
127.0.0.1 only; on the cluster of ``course_utils.cluster`` (network namespaces joined by a rate-limited
link) the process for group r moves into node r's namespace right after the fork and listens on that
node's address only. What listens, per replica group, and how it is bound here:

- the group's own TCPStore (the Manager's store): a socket bound to the address first, handed to
  ``TCPStore(master_listen_fd=...)``, as ``course_utils._agent`` binds the launcher's stores (a TCPStore
  server binds every interface whatever host it is given);
- the rendezvous store of torchft's process group, which the groups of a quorum meet on: the same
  bound socket, and the address in the group's reconfigure handle says where it is (torchft writes
  ``socket.gethostname()`` there, which inside a namespace is not an address the other node reaches);
- torchft's manager server (Rust): ``Manager`` builds it with ``bind="[::]:PORT"`` and takes no bind
  address (torchft-nightly 2026.10.26, ``torchft/manager.py``), so the group's process replaces
  ``torchft.manager.ManagerServer`` with a function that passes the group's address instead;
- gloo's own sockets: on the interface named by ``GLOO_SOCKET_IFNAME`` (``lo``, or the node's ``eth0``);
- the lighthouse: torchft's ``LighthouseServer`` takes ``bind``; it gets the first node's address.

A place is a plain dict, so it travels to the forked process as it is:
``{"addr": "127.0.0.1", "iface": "lo", "ns": None, "cores": None}`` on loopback,
``{"addr": "10.213.0.11", "iface": "eth0", "ns": "course-...-n0", "cores": [0]}`` on a node.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from pathlib import Path

#: The loopback place: every process of a run on this machine, listening on 127.0.0.1 only.
LOOPBACK = {"addr": "127.0.0.1", "iface": "lo", "ns": None, "cores": None}
#: ``setns(2)``'s flag for a network namespace (linux/sched.h).
CLONE_NEWNET = 0x40000000


def node_places(cluster) -> list[dict]:
    """One place per node of a ``cluster.Cluster`` (notebook 06): its address, card, namespace and cores."""
    return [{"addr": n.addr, "iface": "eth0", "ns": n.ns, "cores": sorted(cluster.cores(n))} for n in cluster.nodes]


def enter(place: dict) -> None:
    """Move this (just forked, single-threaded) process into ``place``: its namespace and cores (notebook 06).

    ``setns`` changes the namespace of the calling thread; threads started afterwards (torch's, gloo's,
    torchft's Rust runtimes) inherit it, so it must come before anything opens a socket. Python 3.11
    has no ``os.setns``: libc's is called directly. Needs root (the cluster needs it anyway).
    """
    if place.get("ns"):
        fd = os.open(f"/run/netns/{place['ns']}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {place['ns']}: {os.strerror(err)}")
        finally:
            os.close(fd)
    if place.get("cores"):
        os.sched_setaffinity(0, place["cores"])
    os.environ["GLOO_SOCKET_IFNAME"] = place["iface"]


def bound_store(addr: str, timeout=None):
    """A TCPStore server listening on ``addr`` only, on a free port (notebook 06)."""
    import torch.distributed as tdist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    extra = {"timeout": timeout} if timeout is not None else {}
    return tdist.TCPStore(addr, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(), **extra)


def process_group(addr: str, timeout):
    """torchft's reconfigurable gloo group whose rendezvous store listens on ``addr`` only (notebook 06).

    The store is made before torchft asks for it (``ProcessGroup._rendezvous_store`` is where torchft
    keeps it), and the handle the lighthouse hands the other groups names ``addr``, not the host name.
    """
    import torchft

    class BoundProcessGroupGloo(torchft.ProcessGroupGloo):
        def get_reconfigure_handle(self) -> str:
            if self._rendezvous_store is None:
                self._rendezvous_store = bound_store(addr)
            handle = json.loads(super().get_reconfigure_handle())
            handle["store"] = f"{addr}:{self._rendezvous_store.port}"
            return json.dumps(handle)

    return BoundProcessGroupGloo(timeout=timeout)


def bind_manager_server(addr: str) -> None:
    """Make torchft's ``Manager`` start its manager server on ``addr`` instead of every interface (notebook 06).

    Call it in the replica group's own process, before building the ``Manager``. torchft gives
    ``ManagerServer`` ``bind="[::]:PORT"``; this keeps the port and replaces the host.
    """
    import torchft.manager as tm

    real = getattr(tm.ManagerServer, "course_real", tm.ManagerServer)

    def server_on_addr(*args, **kwargs):
        kwargs["bind"] = f"{addr}:{kwargs['bind'].rsplit(':', 1)[1]}"
        return real(*args, **kwargs)

    server_on_addr.course_real = real
    tm.ManagerServer = server_on_addr


def link_bytes(iface: str) -> tuple[int, int] | None:
    """``(received, sent)`` bytes so far on ``iface`` of this process's network namespace (notebook 06).

    Read from ``/proc/self/net/dev``, the kernel's counters of the interface: every frame that crossed
    it, headers included. On a cluster node the interface is the node's end of its cable (a veth), so
    these are the bytes that crossed the link. None if there is no such interface.
    """
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, numbers = line.partition(":")
        if name.strip() == iface:
            fields = numbers.split()
            return int(fields[0]), int(fields[8])
    return None


def listening_addresses(pids) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state owned by ``pids`` (notebook 06).

    Read from each process's own namespace (``/proc/PID/net/tcp`` and ``tcp6``), so a process inside a
    node's namespace is seen with the address it bound there.
    """
    found = set()
    for pid in pids:
        inodes = set()
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            tables = [(Path(f"/proc/{pid}/net/{t}").read_text(), t) for t in ("tcp", "tcp6")]
        except OSError:
            continue  # the process ended meanwhile
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        for text, table in tables:
            for line in text.splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    host, port = fields[1].split(":")
                    found.add((_address(host, table), int(port, 16)))
    return sorted(found)


def _address(hex_host: str, table: str) -> str:
    """The kernel's hex address (host byte order, 32-bit words) as text."""
    raw = bytes.fromhex(hex_host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if table == "tcp" else socket.AF_INET6, words)

"""torchrun across the nodes of a ``namespaces.Cluster``: the plumbing under ``cluster`` (notebooks 05 and 06).

Each node's torchrun line (``torchrun_argv``), its environment (``node_env``), starting the job on every node
(``start_job``), waiting for it with a time limit (``wait``), reading rank 0's report from the nodes' logs
(``report_from_logs``), the steps the ranks reported done (``steps_done``), and the shape checked before any
namespace exists (``check_shape``). ``cluster`` holds what the notebooks call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .errors import CourseInputError
from .namespaces import IFACE, Cluster, Node


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
    # node 0 hosts the rendezvous store (torch's guess compares host names, which all namespaces
    # share); a dead node is declared dead after 2 missed 1 s heartbeats (the default waits 15 s)
    conf = f"is_host={int(node.addr == endpoint.rpartition(':')[0])},join_timeout=60,"
    conf += "keep_alive_interval=1,keep_alive_max_attempt=2"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.size)]
    argv += ["--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    argv += ["--rdzv-id", rdzv_id, "--local-addr", node.addr, "--max-restarts", str(max_restarts)]
    return [*argv, "--rdzv-conf", conf, "--monitor-interval", "0.1", *module_argv]


def node_env(timeout_s: float, progress_dir: str | None) -> dict:
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


def report_from_logs(cluster: Cluster) -> dict | None:
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


def tail(cluster: Cluster, lines: int = 15) -> str:
    parts = []
    for log in sorted(cluster.log_dir.glob("*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(text))
    return "\n".join(parts)


def wait(procs: list[subprocess.Popen], deadline: float, cluster: Cluster, on_tick=None) -> None:
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(
                "the cluster run did not finish in time; every process was stopped. Last output:\n" + tail(cluster)
            )
        if on_tick:
            on_tick()
        time.sleep(0.02)
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise RuntimeError(
            f"torchrun exited with status {bad[0]} on a node; every process was stopped. Last output:\n" + tail(cluster)
        )


def start_job(
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


def steps_done(progress: str) -> int | None:
    done = []
    for f in Path(progress).glob("rank*.json"):
        try:
            done.append(json.loads(f.read_text())["step"])
        except (OSError, ValueError, KeyError):
            pass
    return max(done) if done else None


def check_shape(nodes: int, nproc_per_node: int, timeout_s: float) -> None:
    """The cluster's shape and time limit against their stated ranges, before any namespace exists."""
    from .validate import check_values, max_local_ranks

    check_values("cluster", {"nodes": nodes, "nproc_per_node": nproc_per_node, "wall_timeout_s": timeout_s})
    if nodes * nproc_per_node > max_local_ranks():
        raise CourseInputError(
            f"{nodes} nodes x {nproc_per_node} ranks is more than this machine can start ({max_local_ranks()})"
        )

"""The job manager of a TorchFT run: it forks the lighthouse and one process per replica group, and restarts a
group that dies (notebook 06).

``course_utils.ft.ft_run`` launches ``job_manager`` as one ``course_utils.launch`` worker. The groups
(``ft_groups.replica_main``) and the job manager talk through files in the run's folder: markers
(``ready-R``, ``done-R``, ``dead-R``, ``gone-R``, ``asking-R-A``, ``holding``) say who is where.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from . import ft_nodes
from .ft_config import FTConfig
from .ft_groups import _all_finished, replica_main

# ---------------------------------------------------------------- the job manager (a launch worker)


def _fork(log: Path, main, *args) -> int:
    """Fork a process that runs ``main(*args)`` with its output in ``log``; return its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's SIGTERM to the group ends it at once
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        main(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# How long the lighthouse waits for heartbeating stragglers to ask before it forms a quorum without them. torchft's
# default is 60000 ms (`torchft_lighthouse --help`), as long as the Manager's default quorum_timeout (60 s): short
# here so a notebook run with three or more groups does not wait a minute (notebook 06, sections 13-14)
JOIN_TIMEOUT_MS = 5000


def lighthouse_main(cfg: FTConfig, place: dict, run_dir: Path) -> None:
    """torchft's lighthouse on ``place``'s address, until the job manager ends it (notebook 06)."""
    ft_nodes.enter(place)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"{place['addr']}:0",
        min_replicas=1,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
    )
    # it advertises the machine's host name; it listens on the place's address only
    address = f"http://{place['addr']}:" + server.address().rsplit(":", 1)[1]
    (run_dir / "lighthouse.tmp").write_text(address)
    (run_dir / "lighthouse.tmp").rename(run_dir / "lighthouse")
    while True:
        signal.pause()  # the job manager's SIGTERM ends it


def _committed_without(run_dir: Path, cfg: FTConfig, replica: int) -> int:
    """Steps (DiLoCo: rounds) the other groups have committed with fewer than all R groups in the quorum."""
    steps = set()
    for path in run_dir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("committed") and row["replica"] != replica and row["participants"] < cfg.replicas:
                steps.add(row["step"])
    return len(steps)


def job_manager(config: dict, places: list, run_dir: str) -> dict:
    """Start the lighthouse and every replica group, restart a group that dies (once), wait for all (notebook 06).

    Runs as one ``launch`` worker, forked from the launcher's agent server with torch already
    imported, and forks the groups itself: starting or restarting a group costs a fork, not a
    fresh Python and torch import. A dead group is restarted once the survivors have committed
    ``restart_after`` steps without it (or have all finished). A group that fails other than as
    planned stops the run. Every pid goes to ``pids.txt``.
    """
    import torch._dynamo  # noqa: F401  (building any torch optimizer imports it: once, before the forks)
    import torchft  # noqa: F401
    import torchft.local_sgd  # noqa: F401
    from torchft.checkpointing.pg_transport import PGTransport  # noqa: F401

    cfg, run_dir = FTConfig(**config), Path(run_dir)
    pids = open(run_dir / "pids.txt", "a")
    pids.write(f"{os.getpid()}\n")

    def start(main, log, *args) -> int:
        pid = _fork(run_dir / log, main, *args)
        pids.write(f"{pid}\n")
        pids.flush()
        return pid

    lighthouse = start(lighthouse_main, "lighthouse.log", cfg, places[0], run_dir)
    deadline = time.monotonic() + 30
    while not (run_dir / "lighthouse").exists():
        if os.waitpid(lighthouse, os.WNOHANG)[0] or time.monotonic() > deadline:
            raise RuntimeError(f"the lighthouse did not start; its log: {run_dir / 'lighthouse.log'}")
        time.sleep(0.01)
    address = (run_dir / "lighthouse").read_text()

    def group(replica: int, attempt: int) -> int:
        args = (cfg, replica, attempt, places[replica % len(places)], address, run_dir)
        return start(replica_main, f"replica-{replica}-{attempt}.log", *args)

    running = {group(r, 0): (r, 0) for r in range(cfg.replicas)}
    jobs = {"exits": [], "restarts": [], "stopped": None, "listening": set()}
    try:
        _supervise(cfg, run_dir, running, jobs, group, lighthouse)
    finally:
        for pid, sig in [*((p, signal.SIGKILL) for p in running), (lighthouse, signal.SIGTERM)]:
            try:
                os.kill(pid, sig)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    jobs["listening"] = sorted(jobs["listening"])
    times = os.times()  # this process and every process it forked and reaped: the run's CPU seconds
    jobs["cpu_s"] = times.user + times.system + times.children_user + times.children_system
    if jobs["stopped"] and not cfg.hang:
        s = jobs["stopped"]
        raise RuntimeError(
            f"replica {s['replica']} failed (attempt {s['attempt']}, exit code {s['code']}): {s['error']}; "
            f"its log: {s['log']}"
        )
    return jobs


def _supervise(cfg: FTConfig, run_dir: Path, running: dict, jobs: dict, group, lighthouse: int) -> None:
    """Until every group has finished (or one failed as nobody planned): reap the groups that exit, restart a
    dead one when its time comes (``group(replica, attempt)`` forks it), sample what the run listens on."""
    dead, sampled = [], 0.0
    hung = {r for r, _ in cfg.planned("hang")}
    while running or dead:
        if time.monotonic() - sampled > 0.25:  # what every process of the run listens on, as it runs
            jobs["listening"].update(ft_nodes.listening_addresses([lighthouse, *running]))
            sampled = time.monotonic()
        pid, status = os.waitpid(-1, os.WNOHANG) if running else (0, 0)
        if pid in running:
            replica, attempt = running.pop(pid)
            if not _exited(cfg, run_dir, jobs, replica, attempt, os.waitstatus_to_exitcode(status), dead):
                return  # a failure nobody planned: the caller stops every group
        if hung and all((run_dir / f"done-{r}").exists() for r in range(cfg.replicas) if r not in hung):
            return  # the others finished without the hung group, which never will
        for replica in list(dead):
            if (
                _all_finished(run_dir, cfg)
                or (run_dir / "holding").exists()
                or _committed_without(run_dir, cfg, replica) >= cfg.restart_after
            ):
                running[group(replica, 1)] = (replica, 1)
                jobs["restarts"].append({"replica": replica, "t": time.time()})
                dead.remove(replica)
        time.sleep(0.02)


def _exited(cfg: FTConfig, run_dir: Path, jobs: dict, replica: int, attempt: int, code: int, dead: list) -> bool:
    """Note a group's exit; False when it failed as nobody planned (the run stops), else True (a planned death
    joins ``dead``, to be restarted, or is marked gone)."""
    jobs["exits"].append({"replica": replica, "attempt": attempt, "code": code, "t": time.time()})
    if code != 0 and (attempt > 0 or replica not in {r for r, _ in cfg.planned("kill")}):
        log = run_dir / f"replica-{replica}-{attempt}.log"
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        jobs["stopped"] = {
            "replica": replica,
            "attempt": attempt,
            "code": code,
            "error": lines[-1] if lines else "(no output)",
            "log": str(log),
            "t": time.time(),
        }
        return False
    if code != 0:  # the job manager's answer to a dead group: start it again, or let it go
        (run_dir / f"dead-{replica}").touch()  # the planned kill wrote it first (_Replica.die)
        # DiLoCo: a group restarted after the others finished has nobody to heal from
        if cfg.restart_after is None or (cfg.diloco and _all_finished(run_dir, cfg)):
            (run_dir / f"gone-{replica}").touch()
        else:
            dead.append(replica)
    return True
